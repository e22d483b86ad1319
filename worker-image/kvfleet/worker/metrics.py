"""The worker's Prometheus metrics: KV cache, requests, tokens, reports, and the GPU when there is one.

Names follow Prometheus conventions (base units, `_total` for counters) and carry the pool and pod
as labels set by the scrape config, not by the worker. Values are read at scrape time from the
engine and the agent (collector callbacks), so a scrape never sees a half-updated state.

Beside kvfleet's own names every worker exposes vLLM's (`vllm:*`), because the dashboards and the
KEDA / HPA rules people already run for vLLM read those. An engine that exports its own (vLLM's
Prometheus stat logger) hands them over as a collector and they are served as they are; for any
other engine `VLLMNames` emulates the common ones with vLLM 0.32's names, types, labels
(`model_name`, `engine`) and buckets, fed per request by `RequestMeter`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvfleet.worker.engines.capabilities import PrefixCacheStats
from kvfleet.worker.gpu import GPUProbe

# Window over which the tokens/s gauge averages generated tokens.
RATE_WINDOW_S = 10.0

# vLLM's label for the engine's index: one engine per worker, the first, as a one-engine vLLM says it.
VLLM_ENGINE_INDEX = "0"
# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py), copied: only the vLLM engine may import
# vllm, and a dashboard's histogram_quantile over a mixed pool wants the same boundaries everywhere.
VLLM_TIME_TO_FIRST_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                      7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_INTER_TOKEN_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                                      10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                  120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# The finish reasons the engines report (base.FinishReason): their series exist from the start, at 0,
# as vLLM creates one per reason up front.
VLLM_FINISH_REASONS = ("stop", "length", "abort")


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


class VLLMNames:
    """vLLM 0.32's common metrics (vllm/v1/metrics/loggers.py PrometheusStatLogger), for an engine
    that does not export its own: same names, types, label names and buckets, one engine ("0").

    Where the figures come from: running and waiting are the agent's (requests holding KV, requests
    queued), KV usage is used / capacity as a 0-1 fraction (vLLM's `_perc` is one too: "1 means 100
    percent usage"), the rest is timed per request by `RequestMeter` as vLLM's frontend times it.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, running: Callable[[], float],
                 waiting: Callable[[], float], kv_usage_ratio: Callable[[], float]) -> None:
        labels = ["model_name", "engine"]
        values = (model_name, VLLM_ENGINE_INDEX)
        # vLLM's gauges say multiprocess_mode="mostrecent"; that only matters under prometheus_client's
        # multiprocess mode, which a worker (one process serving /metrics) does not use.
        Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
              registry=registry).labels(*values).set_function(running)
        Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
              registry=registry).labels(*values).set_function(waiting)
        Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
              registry=registry).labels(*values).set_function(kv_usage_ratio)
        # prometheus_client adds `_total` to a counter's samples: these are vllm:prompt_tokens_total etc.
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=registry).labels(*values)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=registry).labels(*values)
        self._request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                        [*labels, "finished_reason"], registry=registry)
        for reason in VLLM_FINISH_REASONS:
            self._request_success.labels(*values, reason)
        self._values = values
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
            buckets=VLLM_TIME_TO_FIRST_TOKEN_BUCKETS_S, registry=registry).labels(*values)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels,
            buckets=VLLM_INTER_TOKEN_LATENCY_BUCKETS_S, registry=registry).labels(*values)
        self.time_per_output_token = Histogram(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            labels, buckets=VLLM_INTER_TOKEN_LATENCY_BUCKETS_S, registry=registry).labels(*values)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels,
            buckets=VLLM_REQUEST_LATENCY_BUCKETS_S, registry=registry).labels(*values)

    def finished(self, reason: str) -> None:
        self._request_success.labels(*self._values, reason).inc()


class RequestMeter:
    """One request's timing on this worker, for `VLLMNames` (does nothing when the engine exports its own).

    As vLLM's frontend does (vllm/v1/metrics/stats.py IterationStats): time to first token is from
    the request's arrival to the step that gave its first token, when its prompt tokens are counted
    too (a request aborted before its first token has none); each later step with tokens is one
    inter-token latency; at the end the time per output token is (last token - first token) / (tokens
    - 1), 0 for a single token, and the end-to-end latency is from arrival. A request handed over from
    another worker (`arrived_s` None) had its first token there: here it adds only its later steps,
    its tokens and its end.
    """

    def __init__(self, names: VLLMNames | None, arrived_s: float | None, num_prompt_tokens: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._names = names
        self._arrived_s = arrived_s
        self._num_prompt_tokens = num_prompt_tokens
        self._clock = clock
        self._first_s: float | None = None
        self._last_s: float | None = None
        self._num_generated = 0

    def tokens(self, num_tokens: int) -> None:
        """One engine step that gave this request `num_tokens` tokens (steps with none are not tokens)."""
        names = self._names
        if names is None or num_tokens == 0:
            return
        now = self._clock()
        names.generation_tokens.inc(num_tokens)
        if self._last_s is None:
            if self._arrived_s is not None:
                self._first_s = now
                names.time_to_first_token.observe(now - self._arrived_s)
                names.prompt_tokens.inc(self._num_prompt_tokens)
        else:
            names.inter_token_latency.observe(now - self._last_s)
        self._last_s = now
        self._num_generated += num_tokens

    def finished(self, reason: str) -> None:
        """The request ended on this worker (not handed over) with this finish reason."""
        names = self._names
        if names is None:
            return
        names.finished(reason)
        if self._arrived_s is None:
            return
        names.e2e_latency.observe(self._clock() - self._arrived_s)
        if self._first_s is not None and self._last_s is not None:
            decode_s = self._last_s - self._first_s
            names.time_per_output_token.observe(decode_s / (self._num_generated - 1) if self._num_generated > 1 else 0.0)


class WorkerMetrics:
    def __init__(self, kv_used_bytes: Callable[[], float], kv_capacity_bytes: Callable[[], float],
                 running: Callable[[], float], waiting: Callable[[], float], gpu: GPUProbe,
                 prefix_cache: Callable[[], PrefixCacheStats] | None = None, model_name: str = "",
                 engine_metrics: Collector | None = None) -> None:
        """`engine_metrics`: the engine's own Prometheus families (vLLM's), served as they are; without
        them the worker emulates vLLM's names (`VLLMNames`, labelled with `model_name`), never both, so
        no name is exported twice."""
        self.registry = CollectorRegistry()
        r = self.registry
        if engine_metrics is not None:
            r.register(engine_metrics)
            self.vllm_names: VLLMNames | None = None
        else:
            def kv_usage_ratio() -> float:
                capacity = kv_capacity_bytes()
                return kv_used_bytes() / capacity if capacity > 0 else 0.0

            self.vllm_names = VLLMNames(r, model_name, running, waiting, kv_usage_ratio)
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

    def request(self, arrived_s: float | None, num_prompt_tokens: int) -> RequestMeter:
        """The meter of one request's vLLM-named figures; `arrived_s` (time.monotonic) None for a
        request handed over from another worker."""
        return RequestMeter(self.vllm_names, arrived_s, num_prompt_tokens)
