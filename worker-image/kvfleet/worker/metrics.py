"""The worker's Prometheus metrics: KV cache, requests, tokens, reports, and the GPU when there is one.

Names follow Prometheus conventions (base units, `_total` for counters) and carry the pool and pod
as labels set by the scrape config, not by the worker. Values are read at scrape time from the
engine and the agent (collector callbacks), so a scrape never sees a half-updated state.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvfleet.worker.engines.capabilities import PrefixCacheStats
from kvfleet.worker.gpu import GPUProbe

# Window over which the tokens/s gauge averages generated tokens.
RATE_WINDOW_S = 10.0


class TokenRate:
    """Generated tokens per second over the last RATE_WINDOW_S seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()

    def add(self, tokens: int) -> None:
        self._events.append((self._clock(), tokens))

    def per_s(self) -> float:
        now = self._clock()
        while self._events and self._events[0][0] < now - RATE_WINDOW_S:
            self._events.popleft()
        return sum(n for _, n in self._events) / RATE_WINDOW_S


class PrefixCacheCollector(Collector):
    """The prefix cache's gauges, read at scrape time; a figure the engine does not report (None) is
    left out rather than exported as a number it never measured."""

    def __init__(self, stats: Callable[[], PrefixCacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, documentation, value in (
            ("kvfleet_worker_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache so far.", s.hit_tokens),
            ("kvfleet_worker_prefilled_tokens", "Tokens the engine prefilled so far (past cached prefixes).",
             s.prefilled_tokens),
            ("kvfleet_worker_prefix_cache_blocks", "KV blocks the prefix cache holds.", s.cached_blocks),
            ("kvfleet_worker_prefix_cache_evictable_blocks", "Cached KV blocks no running request reads.",
             s.evictable_blocks),
            # The host tier (elastic memory's CPU buffer): blocks kept there, and moves each way so far.
            ("kvfleet_worker_prefix_cache_host_blocks", "Cached KV blocks swapped out to host memory.", s.host_blocks),
            ("kvfleet_worker_prefix_cache_swap_outs", "Cached blocks swapped out to host memory so far.",
             s.num_swap_outs if s.host_blocks is not None else None),
            ("kvfleet_worker_prefix_cache_swap_ins", "Cached blocks swapped back in from host memory so far.",
             s.num_swap_ins if s.host_blocks is not None else None),
        ):
            if value is not None:
                yield GaugeMetricFamily(name, documentation, value=float(value))


class WorkerMetrics:
    def __init__(self, kv_used_bytes: Callable[[], float], kv_capacity_bytes: Callable[[], float],
                 running: Callable[[], float], waiting: Callable[[], float], gpu: GPUProbe,
                 prefix_cache: Callable[[], PrefixCacheStats] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rate = TokenRate()
        Gauge("kvfleet_worker_kv_used_bytes", "KV cache bytes held by requests (whole blocks).",
              registry=r).set_function(kv_used_bytes)
        Gauge("kvfleet_worker_kv_capacity_bytes", "KV cache bytes the engine allocated.",
              registry=r).set_function(kv_capacity_bytes)
        Gauge("kvfleet_worker_requests_running", "Requests holding KV cache.", registry=r).set_function(running)
        Gauge("kvfleet_worker_requests_waiting", "Requests queued for KV blocks or a batch slot.",
              registry=r).set_function(waiting)
        Gauge("kvfleet_worker_generation_tokens_per_second", f"Generated tokens per second over {RATE_WINDOW_S:.0f} s.",
              registry=r).set_function(self.rate.per_s)
        self.prompt_tokens = Counter("kvfleet_worker_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("kvfleet_worker_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("kvfleet_worker_requests", "Requests ended, by finish reason.", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("kvfleet_worker_rejected_requests", "Requests refused with a 4xx, by status.",
                                ["status"], registry=r)
        self.report_writes = Counter("kvfleet_worker_report_writes", "KV-load reports written to the Pod.", registry=r)
        if prefix_cache is not None:
            r.register(PrefixCacheCollector(prefix_cache))
        if gpu.available:
            used = Gauge("kvfleet_worker_gpu_memory_used_bytes", "GPU memory used (all processes).", ["gpu"], registry=r)
            total = Gauge("kvfleet_worker_gpu_memory_total_bytes", "GPU memory.", ["gpu"], registry=r)
            util = Gauge("kvfleet_worker_gpu_utilization_ratio", "GPU busy time over the driver's sample period.",
                         ["gpu"], registry=r)

            def refresh() -> float:
                for s in gpu.sample():
                    used.labels(str(s.index)).set(s.memory_used_bytes)
                    total.labels(str(s.index)).set(s.memory_total_bytes)
                    util.labels(str(s.index)).set(s.utilization_percent / 100)
                return 1.0

            self.refresh_gpu: Callable[[], float] | None = refresh
        else:
            self.refresh_gpu = None

    def generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)
        self.rate.add(tokens)
