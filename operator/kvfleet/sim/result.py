"""What one replay reports (`RunResult`): GPUs, KV, moves, pods and per-request delays, per epoch.

The replay (run.py) fills it in; the report (report.py), the benches and the demo read it. Every
figure the table, the JSON and the plots show is a property here, so they are computed one way.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvfleet.sim.bounds import SharedBound


def nearest_rank(values: Iterable[float], percent: float) -> float:
    """The nearest-rank percentile: the smallest value with at least `percent`% of values <= it.

    Exact (always one of the values, no interpolation), so reports can be checked by hand:
    rank = ceil(percent / 100 x n), 1-based; percent 0 gives the minimum, an empty list 0.
    """
    ordered = sorted(values)
    if not ordered:
        return 0.0
    if not 0 <= percent <= 100:
        raise ValueError("percent must be within [0, 100]")
    rank = max(1, math.ceil(percent * len(ordered) / 100))
    return ordered[rank - 1]


@dataclass
class RunResult:
    policy: str
    epoch_s: float
    times_s: list[float] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    kv_bytes: list[int] = field(default_factory=list)
    lower_bound: list[int] = field(default_factory=list)
    migrations_per_epoch: list[int] = field(default_factory=list)
    num_migrations: int = 0
    num_preemptions: int = 0
    num_kv_transfers: int = 0
    num_token_transfers: int = 0
    num_deferred: int = 0
    migrated_bytes: int = 0
    migration_time_s: float = 0.0
    num_capacity_violations: int = 0
    num_requests: int = 0
    num_spanning: int = 0
    max_moves_per_operation: int = 0
    num_item_moves: int = 0  # moves of placed items (a multi-item is one), the unit of Theorem 3
    num_moves_cancelled: int = 0
    capacity_bytes: int = 0
    scale_up_s: float = 0.0
    scale_down_delay_s: float = 0.0
    # (created, deleted) of every pod, in seconds: what the cloud bills.
    pod_lifetimes_s: list[tuple[float, float]] = field(default_factory=list)
    # Per finished request: time not spent prefilling or decoding, and decode time per output token.
    queue_delays_s: list[float] = field(default_factory=list)
    tpots_s: list[float] = field(default_factory=list)
    # Per finished request, from its arrival: to the end of its first decode step, and to its last token.
    ttfts_s: list[float] = field(default_factory=list)
    jcts_s: list[float] = field(default_factory=list)
    last_finish_s: float = 0.0  # when the last request wrote its last token (0 with none finished)
    num_over_capacity_requests: int = 0  # requests whose reservation ever passed C (they span GPUs)
    shared_bound: SharedBound = SharedBound()
    # False: every operation was scheduled on its own (MELL Fig. 13's baseline), see simulate().
    batching: bool = True
    # The prefix cache model (--prefix-cache), counted when each request is first placed.
    prefix_cache: bool = False
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens the GPU held (its leading hash blocks)
    prefix_host_hit_tokens: int = 0  # of those, tokens its worker's host tier held (copied back, not prefilled)
    # Summed over epochs: the running requests' prompt tokens, and of those the copies of hash blocks that
    # another running request holds on the same GPU (or anywhere in the pool): what an engine that
    # holds a shared block once would not hold (the replay counts every copy).
    running_prompt_tokens: int = 0
    shared_same_gpu_tokens: int = 0
    shared_pool_tokens: int = 0
    prefill_tokens_saved: int = 0  # what the prefill skipped: hits, less the 1 token always prefilled
    num_prefix_hits: int = 0  # requests with a hit
    num_prefix_evictions: int = 0  # hash blocks given up to running requests' KV

    @property
    def prefix_hit_ratio(self) -> float:
        """Hit prompt tokens / prompt tokens of the placed requests."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def shared_same_gpu_ratio(self) -> float:
        """Time-averaged share of running prompt KV that is a second copy of a block on the same GPU."""
        return self.shared_same_gpu_tokens / self.running_prompt_tokens if self.running_prompt_tokens else 0.0

    @property
    def shared_pool_ratio(self) -> float:
        """The same over the whole pool: what counting shared blocks once could save at best."""
        return self.shared_pool_tokens / self.running_prompt_tokens if self.running_prompt_tokens else 0.0

    @property
    def duration_s(self) -> float:
        return len(self.times_s) * self.epoch_s

    @property
    def peak_gpus(self) -> int:
        return max(self.gpus, default=0)

    @property
    def mean_gpus(self) -> float:
        return sum(self.gpus) / len(self.gpus) if self.gpus else 0.0

    @property
    def utilization(self) -> float:
        """Time-averaged share of the KV capacity of the GPUs in use that holds KV."""
        shares = [kv / (n * self.capacity_bytes) for kv, n in zip(self.kv_bytes, self.gpus) if n]
        return sum(shares) / len(shares) if shares else 0.0

    @property
    def migrations_per_s(self) -> float:
        return self.num_migrations / self.duration_s if self.duration_s else 0.0

    @property
    def lower_bound_peak(self) -> int:
        return max(self.lower_bound, default=0)

    @property
    def lower_bound_mean(self) -> float:
        return sum(self.lower_bound) / len(self.lower_bound) if self.lower_bound else 0.0

    @property
    def active_gpu_hours(self) -> float:
        """GPU-epochs the plans held (what `mean_gpus` averages), in hours."""
        return sum(self.gpus) * self.epoch_s / 3600.0

    @property
    def billed_gpu_hours(self) -> float:
        """Sum of pod lifetimes (one GPU per pod), in hours: what the cloud bills."""
        return sum(end - start for start, end in self.pod_lifetimes_s) / 3600.0

    @property
    def peak_pods(self) -> int:
        # A pod deleted at t and one created at t do not overlap: deletions sort first.
        edges = sorted([(s, 1) for s, _ in self.pod_lifetimes_s] + [(e, -1) for _, e in self.pod_lifetimes_s])
        live = peak = 0
        for _, delta in edges:
            live += delta
            peak = max(peak, live)
        return peak

    @property
    def queue_p50_s(self) -> float:
        return nearest_rank(self.queue_delays_s, 50)

    @property
    def queue_p99_s(self) -> float:
        return nearest_rank(self.queue_delays_s, 99)

    def ttft_s(self, percentile: int) -> float:
        """Arrival to the end of the first decode step, at a percentile of the finished requests."""
        return nearest_rank(self.ttfts_s, percentile)

    def jct_s(self, percentile: int) -> float:
        """Arrival to the last token (job completion time), at a percentile of the finished requests."""
        return nearest_rank(self.jcts_s, percentile)

    @property
    def tpot_p50_ms(self) -> float:
        return nearest_rank(self.tpots_s, 50) * 1000.0

    @property
    def tpot_p99_ms(self) -> float:
        return nearest_rank(self.tpots_s, 99) * 1000.0

    @property
    def own_bound_billed_gpu_hours(self) -> float:
        """This run's fluid bound as a cloud bills it: a lower bound on `billed_gpu_hours` for this run.

        A pod holding a GPU at an epoch end is let go at the next epoch end at the earliest and then
        lingers `scale_down_delay_s`, so through each epoch at least the most GPUs held at the epoch
        ends of the last floor(delay / epoch) + 1 epochs are billed, and those at least ceil(KV / C)
        (`lower_bound`). Summed over epochs: what even a perfect packer of this run's KV would be billed. It depends on the run
        (its KV depends on how fast its GPUs decode), so it is reported per policy.
        """
        # A GPU held at epoch end j is let go at j + 1 at the earliest and its pod billed until
        # delay later: it covers the whole epoch ending at i only if (i - j) x epoch <= delay.
        window = math.floor(self.scale_down_delay_s / self.epoch_s) + 1
        held: deque[tuple[int, int]] = deque()  # (epoch, bound), bounds decreasing: a sliding maximum
        total = 0
        for k, bound in enumerate(self.lower_bound):
            while held and held[-1][1] <= bound:
                held.pop()
            held.append((k, bound))
            if held[0][0] <= k - window:
                held.popleft()
            total += held[0][1]
        return total * self.epoch_s / 3600.0

    @property
    def mean_vs_own_bound(self) -> float:
        """mean GPUs / this run's own fluid bound (same epochs, so a ratio of means)."""
        return self.mean_gpus / self.lower_bound_mean if self.lower_bound_mean else 0.0

    @property
    def active_vs_shared_bound(self) -> float:
        """Active GPU-hours / the shared bound's GPU-hours: GPU-hours, as runs drain at different times."""
        bound = self.shared_bound.gpu_hours
        return self.active_gpu_hours / bound if bound else 0.0

    @property
    def billed_vs_shared_bound(self) -> float:
        bound = self.shared_bound.gpu_hours
        return self.billed_gpu_hours / bound if bound else 0.0
