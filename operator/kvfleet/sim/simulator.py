"""Discrete-event replay of a workload under one policy: how many GPUs, how full, how many migrations.

Time advances in scheduling epochs (MELL §IV: instances report at the start of each epoch, the
scheduler answers with a plan). Within an epoch each GPU decodes its batch at the speed of the
performance model below, so KV grows at a realistic rate and a fuller GPU decodes more slowly.

What the scheduler is told about a request is its KV *reservation*: the blocks it holds now plus
the blocks it can write before the next epoch at the fastest decode speed. That way a GPU that the
plan keeps within C stays within C until the next plan, without knowing any output length (MELL
Finding 2). Actual KV (without the look-ahead) is what utilization and the fluid lower bound use.

Performance model (per GPU type and batch size): a decode step reads the weights and the batch's
KV once, so step_s = (weight_bytes + kv_bytes) / (bandwidth x efficiency) + batch x per-sequence
overhead; prefill is compute-bound, 2 x params x tokens / (peak FLOPs x MFU). Migrations cost the
planner's choice (§V): a KV transfer takes bytes / link bandwidth, a token transfer a re-prefill.
A setup may instead run at a speed its workers measured (`profile_setup`, kvfleet.sim.profile): the
replay asks the same two questions, step and prefill time, and is otherwise the same.
Deterministic: no clock, no randomness (synthetic workloads take their seed outside).

What a cloud bills is a worker *pod*, from the moment it asks for its GPU until it is deleted, not
the GPUs a plan holds active: so the replay keeps a pod behind each active GPU, which takes
`scale_up_s` to become ready when new and lingers, billed and warm, `scale_down_delay_s` after the
plan lets its GPU go (the LLMPool's `autoscaling.scaleDownDelaySeconds`). Requests wait for their
pod; what they wait, and how fast they decode, is reported per request (queueing delay, TPOT).
Two bounds are reported: each run's own fluid bound (the KV that run held) and one shared by every
policy, computed from the workload alone (`shared_bound`).

With a `PrefixCacheSpec` (`--prefix-cache`) each worker also keeps the prompt blocks of the requests
that finished on its GPU (MemServe §4.1-4.2, kvfleet.sim.prefix_cache), in the KV memory its running
requests leave free, for as long as its pod lives (warm pods keep theirs): a request placed on a GPU
prefills only what that GPU does not hold of its prompt's leading hash blocks. The scheduler is not
told (placement stays cache-blind) and each running request still holds its whole prompt's KV:
counting a prefix two running requests share once would make a request's size depend on what runs
beside it, which the MELL core's per-request sizes cannot say.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvfleet.api.models import AutoscalingSpec
from kvfleet.api.speed import SpeedProfile
from kvfleet.mell.cluster import ClusterPolicy, SchedulerConfig
from kvfleet.mell.migration import Boundaries, plan_migrations
from kvfleet.mell.models import Arrive, Event, EventBatch, Finish, Grow, Location, Migration, Plan
from kvfleet.mell.models import tpot_load_cap as core_tpot_load_cap
from kvfleet.mell.policy import make_policy
from kvfleet.sim.hardware import BLOCK_SIZE_TOKENS, CapacityDerivation, GpuSpec, ModelShape, derive_capacity
from kvfleet.sim.prefix_cache import GpuPrefixCache, PrefixCacheSpec
from kvfleet.sim.profile import ProfileSpeed
from kvfleet.sim.traces import TraceRequest

# The §VIII-B links, for setups whose own are unknown (every hardware setup; a profile without them).
INTRA_NODE_BYTES_PER_S = 25e9  # PCIe 4.0 x16
INTER_NODE_BYTES_PER_S = 1.25e9  # 10 Gbps


@dataclass(frozen=True)
class BandwidthSpeed:
    """The datasheet speed model (module docstring): a decode step reads the weights and the batch's
    KV at a share of the GPU's bandwidth, a prefill is compute-bound at a share of its peak FLOPs."""

    model: ModelShape
    gpu: GpuSpec
    bandwidth_efficiency: float = 0.8
    per_sequence_overhead_s: float = 0.0002
    mfu: float = 0.5

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.gpu.mem_bandwidth_bytes_per_s * self.bandwidth_efficiency

    def step_s(self, batch: int, kv_bytes: int) -> float:
        return (self.model.weight_bytes + kv_bytes) / self.bandwidth_bytes_per_s + batch * self.per_sequence_overhead_s

    def prefill_s(self, tokens: int) -> float:
        return 2.0 * self.model.num_params * tokens / (self.gpu.peak_flops * self.mfu)

    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_s(1)


# Where a setup's speed comes from: the datasheet, or what workers measured (kvfleet.sim.profile).
SpeedModel = BandwidthSpeed | ProfileSpeed


@dataclass(frozen=True)
class Setup:
    """What a replay runs on: a worker's KV capacity C, its speed, and the links between workers.

    `make_setup` builds one from a model on a GPU type (C derived from them, kept in `capacity` for
    reports), `profile_setup` from a measured speed profile (C as the profile states it).
    """

    name: str
    speed: SpeedModel
    capacity_bytes: int
    kv_bytes_per_token: int
    capacity: CapacityDerivation | None = None  # how C was derived, for a hardware setup
    intra_node_bytes_per_s: float = INTRA_NODE_BYTES_PER_S
    inter_node_bytes_per_s: float = INTER_NODE_BYTES_PER_S

    def step_s(self, batch: int, kv_bytes: int) -> float:
        return self.speed.step_s(batch, kv_bytes)

    def prefill_s(self, tokens: int) -> float:
        return self.speed.prefill_s(tokens)

    def prefill_tokens_per_s(self) -> float:
        return self.speed.prefill_tokens_per_s()


def tpot_load_cap(setup: Setup, tpot_s: float) -> tuple[int, int]:
    """A TPOT objective as the default policy's load cap (SchedulerConfig.max_load_bytes and
    load_bytes_per_request) on this setup's speed model (`Setup.step_s`, the core's formula).

    The core's step is linear, (weights + kv) / bandwidth + batch x per-sequence; a measured profile
    is fitted to one, step = a + b x batch + c x kv (`ProfileSpeed.linear_decode`), read as bandwidth
    1 / c, weights a / c (rounded up, so the cap never allows a slower step) and per-sequence b (at
    least 0: a fit in which more requests step faster would loosen the cap on noise).
    """
    speed = setup.speed
    try:
        if isinstance(speed, BandwidthSpeed):
            return core_tpot_load_cap(tpot_s, speed.model.weight_bytes, speed.bandwidth_bytes_per_s,
                                      speed.per_sequence_overhead_s)
        fit = speed.linear_decode()
        if fit.per_kv_byte_s <= 0:
            raise ValueError(f"the speed profile's decode steps do not grow with KV (fitted {fit.per_kv_byte_s:.3g} "
                             "s per byte): no load keeps a TPOT objective")
        return core_tpot_load_cap(tpot_s, math.ceil(fit.intercept_s / fit.per_kv_byte_s), 1.0 / fit.per_kv_byte_s,
                                  max(fit.per_sequence_s, 0.0))
    except ValueError as err:
        raise ValueError(f"{setup.name}: {err}") from None


def make_setup(name: str, model: ModelShape, gpu: GpuSpec, activation_reserve_bytes: int | None = None) -> Setup:
    capacity = derive_capacity(model, gpu, activation_reserve_bytes)
    return Setup(name, BandwidthSpeed(model, gpu), capacity.capacity_bytes, model.kv_bytes_per_token, capacity)


def profile_setup(profile: SpeedProfile) -> Setup:
    """A setup that runs at a measured speed: `profile-<model>`, C and bytes per token as the profile
    states them, both links at its measured link speed where it has one."""
    link = profile.link_bytes_per_second
    return Setup(
        f"profile-{profile.model}", ProfileSpeed.from_profile(profile), profile.capacity_bytes,
        profile.kv_bytes_per_token,
        intra_node_bytes_per_s=INTRA_NODE_BYTES_PER_S if link is None else link,
        inter_node_bytes_per_s=INTER_NODE_BYTES_PER_S if link is None else link,
    )


# The LLMPool's default, so that a bare `simulate` bills what a default pool would.
DEFAULT_SCALE_DOWN_DELAY_S = float(AutoscalingSpec.model_fields["scale_down_delay_seconds"].default)


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


@dataclass(frozen=True)
class SharedBound:
    """The least KV any policy can hold for a workload: the same for every policy of a scenario.

    Every request is taken to be placed at the first epoch end after it arrives (the scheduler's
    first chance, for every policy), to hold its prompt from then, and to decode at an unloaded GPU's
    speed (`step_s(1, 0)` per token) from then or from its arrival plus its own prefill, whichever is
    later, holding its prompt and the tokens written so far (whole tokens). No policy places a request
    earlier or decodes it faster, so no policy holds less KV-time.
    `gpu_hours` (KV-seconds / C) bounds every policy's active and billed GPU-hours; `peak` (the
    largest ceil(KV / C) at an epoch end along that trajectory) is a reference, not a strict bound
    (a policy's requests run later, so its peak may fall at other times).
    """

    kv_byte_seconds: float = 0.0
    duration_s: float = 0.0
    capacity_bytes: int = 0
    peak: int = 0

    @property
    def gpu_hours(self) -> float:
        return self.kv_byte_seconds / self.capacity_bytes / 3600.0 if self.capacity_bytes else 0.0

    @property
    def mean(self) -> float:
        """GPUs on average over the workload's own span (until its last request would finish)."""
        return self.kv_byte_seconds / (self.capacity_bytes * self.duration_s) if self.duration_s else 0.0


def shared_bound(requests: Iterable[TraceRequest], setup: Setup, epoch_s: float,
                 prefix_cache: PrefixCacheSpec | None = None) -> SharedBound:
    """The workload-only bound (see `SharedBound`), in closed form per request.

    With a prefix cache, a request may find every block its `hash_ids` cover cached, so the bound
    prefills only the rest (at least 1 token, as a replay does): still no run decodes it sooner.

    A request with prompt P and output N is placed at ta, the first epoch end after its arrival, and
    holds P tokens until it starts decoding at t0 = max(ta, arrival + prefill(P)); it then writes one
    token every s = step_s(1, 0): during its j-th step (j = 0 .. N-1) it holds P + j tokens, so it
    holds bytes_per_token x (P x (t0 - ta) + s x (N x P + N x (N - 1) / 2)) byte-seconds, and
    releases its KV at t0 + N x s.
    """
    step = setup.step_s(1, 0)
    bpt = setup.kv_bytes_per_token
    kv_byte_seconds = 0.0
    end_s = 0.0
    at_epoch: dict[int, int] = {}  # KV bytes held at the end of epoch k (time k x epoch_s)
    for req in requests:
        n, p = req.output_tokens, req.prompt_tokens
        k = math.floor(req.arrival_s / epoch_s) + 1  # admitted at the end of the epoch it arrives in
        placed_s = k * epoch_s
        prefill_tokens = p if prefix_cache is None else max(1, p - req.hashed_tokens(prefix_cache.hash_block_tokens))
        t0 = max(placed_s, req.arrival_s + setup.prefill_s(prefill_tokens))
        t1 = t0 + n * step
        end_s = max(end_s, t1, placed_s)
        kv_byte_seconds += bpt * (p * (t0 - placed_s) + step * (n * p + n * (n - 1) / 2))
        while k * epoch_s < t1 or k * epoch_s == placed_s:
            written = max(0, min(n - 1, math.floor((k * epoch_s - t0) / step)))
            at_epoch[k] = at_epoch.get(k, 0) + (p + written) * bpt
            k += 1
    c = setup.capacity_bytes
    peak = max((math.ceil(kv / c) for kv in at_epoch.values()), default=0)
    duration_s = math.ceil(end_s / epoch_s) * epoch_s if end_s > 0 else 0.0
    return SharedBound(kv_byte_seconds, duration_s, c, peak)


def migration_boundaries(setup: Setup, epoch_s: float) -> Boundaries:
    """The §V boundaries of one epoch on `setup`: each link carries its bandwidth x epoch, each instance
    re-prefills a tenth of what it could in an epoch (the rest is its decode batch's)."""
    return Boundaries(
        intra_node_link_bytes=int(setup.intra_node_bytes_per_s * epoch_s),
        inter_node_link_bytes=int(setup.inter_node_bytes_per_s * epoch_s),
        instance_prefill_tokens=int(epoch_s * setup.prefill_tokens_per_s() * 0.1),
    )


def merge_plans(now_s: float, plans: list[Plan]) -> Plan:
    """One epoch's plans as one, in order (what the epoch did in all): moves, placements and GPU
    changes concatenated, the spans of the last plan (the state the epoch ends in)."""
    return Plan(
        now_s,
        tuple(x for p in plans for x in p.placements),
        tuple(x for p in plans for x in p.migrations),
        tuple(x for p in plans for x in p.preemptions),
        plans[-1].spans if plans else (),
        tuple(x for p in plans for x in p.activate_gpu_ids),
        tuple(x for p in plans for x in p.terminate_gpu_ids),
        tuple(x for p in plans for x in p.moves_per_operation),
        sum(p.num_moves_cancelled for p in plans),
    )


@dataclass
class _Live:
    """A request the replay is decoding: where it runs, how far it got, what the scheduler was told.

    `earliest_decode_s` (arrival + prefill) is when it could decode had nothing made it wait;
    `waited_s` adds up what did (the epoch, a pod starting, re-prefills), `decoding_s` the time it
    decoded: the queueing delay and the TPOT reported when it finishes.
    """

    req: TraceRequest
    gpu_id: str
    decode_from_s: float
    not_before_s: float = 0.0  # the start of the epoch it arrived in: no decode is owed before
    prefill_tokens: int = 0  # its prompt, less what the prefix cache held where it was first placed
    generated: float = 0.0
    reported_bytes: int = 0
    earliest_decode_s: float = 0.0
    last_decoded_s: float | None = None
    waited_s: float = 0.0
    decoding_s: float = 0.0


@dataclass
class _Pod:
    """A model worker pod: billed from `created_s` until deleted; `released_s` is set while warm."""

    created_s: float
    ready_s: float
    released_s: float | None = None
    # Historical KV is the worker's (its engine's GPU memory): it stays while the pod is warm, goes
    # on with it to the next GPU the plans ask for, and is lost when the pod is deleted.
    prefix_cache: GpuPrefixCache | None = None


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
    num_over_capacity_requests: int = 0  # requests whose reservation ever passed C (they span GPUs)
    shared_bound: SharedBound = SharedBound()
    # False: every operation was scheduled on its own (MELL Fig. 13's baseline), see simulate().
    batching: bool = True
    # The prefix cache model (--prefix-cache), counted when each request is first placed.
    prefix_cache: bool = False
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens the GPU held (its leading hash blocks)
    prefill_tokens_saved: int = 0  # what the prefill skipped: hits, less the 1 token always prefilled
    num_prefix_hits: int = 0  # requests with a hit
    num_prefix_evictions: int = 0  # hash blocks given up to running requests' KV

    @property
    def prefix_hit_ratio(self) -> float:
        """Hit prompt tokens / prompt tokens of the placed requests."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

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


def simulate(
    requests: list[TraceRequest],
    setup: Setup,
    policy_name: str,
    epoch_s: float = 1.0,
    config: SchedulerConfig | None = None,
    on_epoch: Callable[[int], None] | None = None,
    lookahead_epochs: float = 1.0,
    scale_up_s: float = 0.0,
    scale_down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S,
    batching: bool = True,
    prefix_cache: PrefixCacheSpec | None = None,
) -> RunResult:
    """Replay `requests` (sorted by arrival) under one policy.

    Each epoch runs the same steps in this order (the order is part of the results: events reach
    the scheduler as finishes, then growths, then arrivals): decode, report growth, admit arrivals,
    schedule, apply the plan, record the epoch. `scale_up_s` is how long a new worker pod takes to
    be ready (node and pod start); `scale_down_delay_s` how long an emptied one stays, warm and
    billed. With `scale_up_s=0` the replay is the one without pods: they only add the bill.
    `batching=False` schedules every operation on its own (`_Replay.schedule_unbatched`), the
    baseline of MELL's Fig. 13. `prefix_cache` turns on the per-GPU prefix cache model (module
    docstring); without it the replay is exactly the one before the model existed.
    """
    if epoch_s <= 0:
        raise ValueError("epoch_s must be positive")
    if scale_up_s < 0 or scale_down_delay_s < 0:
        raise ValueError("scale_up_s and scale_down_delay_s must be >= 0")
    cfg = config or SchedulerConfig(capacity_bytes=setup.capacity_bytes)
    bounds = migration_boundaries(setup, epoch_s)
    if cfg.intra_node_move_budget_bytes is None and cfg.inter_node_move_budget_bytes is None:
        # The policy plans within the §V boundaries the replay costs its moves against.
        cfg = replace(cfg, intra_node_move_budget_bytes=bounds.intra_node_link_bytes,
                      inter_node_move_budget_bytes=bounds.inter_node_link_bytes)
    replay = _Replay(requests, setup, make_policy(policy_name, cfg), epoch_s, lookahead_epochs, scale_up_s,
                     scale_down_delay_s, prefix_cache)
    replay.result.batching = batching
    now_s = 0.0
    epoch = 0
    while replay.has_work():
        epoch += 1
        start_s, now_s = now_s, epoch * epoch_s
        events = replay.decode_epoch(start_s, now_s)
        events += replay.report_growth()
        events += replay.admit_arrivals(now_s)
        if batching:
            plan = replay.policy.schedule(EventBatch(now_s, tuple(events)))
            replay.apply_plan(plan, now_s)
        else:
            plan = replay.schedule_unbatched(events, now_s)
        replay.record_epoch(plan, now_s)
        if on_epoch is not None:
            on_epoch(epoch)
    replay.close_pods(now_s)
    return replay.result


class _Replay:
    """The state of one `simulate` run between epochs, and the steps that advance it.

    A class rather than one long loop so that each step (decode, growth, arrivals, applying the
    plan, costing migrations, recording) can be read, and extended, on its own.
    """

    def __init__(
        self, requests: list[TraceRequest], setup: Setup, policy: ClusterPolicy, epoch_s: float, lookahead_epochs: float,
        scale_up_s: float, scale_down_delay_s: float, prefix_cache: PrefixCacheSpec | None = None,
    ) -> None:
        self.setup = setup
        self.policy = policy
        self.epoch_s = epoch_s
        self.capacity_bytes = setup.capacity_bytes
        self.kv_bytes_per_token = setup.kv_bytes_per_token
        self.block_bytes = BLOCK_SIZE_TOKENS * self.kv_bytes_per_token
        # Look-ahead: tokens a request can write in one epoch at the fastest step (batch 1, no KV).
        self.lookahead_tokens = math.ceil(lookahead_epochs * epoch_s / setup.step_s(1, 0))
        self.boundaries = migration_boundaries(setup, epoch_s)
        # Where each GPU the plans activated is, kept after the policy forgets a GPU it terminated.
        self.locations: dict[str, Location] = {}
        self.live: dict[str, _Live] = {}
        # Request ids per GPU, as an insertion-ordered set: the order fixes the order of Finish events.
        self.on_gpu: dict[str, dict[str, None]] = {}
        self.pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.next_arrival = 0
        self.result = RunResult(
            policy=policy.name, epoch_s=epoch_s, capacity_bytes=self.capacity_bytes, num_requests=len(requests),
            scale_up_s=scale_up_s, scale_down_delay_s=scale_down_delay_s,
            shared_bound=shared_bound(requests, setup, epoch_s, prefix_cache), prefix_cache=prefix_cache is not None,
        )
        self.scale_up_s = scale_up_s
        self.scale_down_delay_s = scale_down_delay_s
        self.pods: dict[str, _Pod] = {}  # the pod behind each GPU the plans hold
        self.warm: list[_Pod] = []  # released, not yet deleted, in the order they were released
        self.over_capacity: set[str] = set()
        self.prefix_spec = prefix_cache

    def has_work(self) -> bool:
        return self.next_arrival < len(self.pending) or bool(self.live)

    def reservation_bytes(self, tokens: float) -> int:
        """What the scheduler is told a request holds: its blocks after one look-ahead of decoding."""
        blocks = math.ceil((tokens + self.lookahead_tokens) / BLOCK_SIZE_TOKENS)
        return blocks * self.block_bytes

    def decode_epoch(self, start_s: float, now_s: float) -> list[Event]:
        """Decode every GPU's batch from `start_s` to `now_s` at the speed the batch allows; finish the done.

        The step time of a GPU is fixed for the epoch by its KV at the start of the epoch.
        """
        events: list[Event] = []
        for rids in self.on_gpu.values():
            if not rids:
                continue
            members = [self.live[r] for r in rids]
            kv = sum(int(m.req.prompt_tokens + m.generated) * self.kv_bytes_per_token for m in members)
            step = self.setup.step_s(len(members), kv)
            for m in members:
                begin_s = max(start_s, m.decode_from_s)
                busy_s = now_s - begin_s
                before = m.generated
                if busy_s > 0:
                    m.generated += busy_s / step
                    # Time since it last decoded (or could first decode) is waiting: exactly 0 when
                    # it decoded through the previous epoch, since this epoch begins where it ended.
                    m.waited_s += begin_s - (m.earliest_decode_s if m.last_decoded_s is None else m.last_decoded_s)
                    m.last_decoded_s = now_s
                if m.generated >= m.req.output_tokens:
                    events.append(Finish(m.req.request_id))
                    self._record_finish(m, before, step, busy_s)
                elif busy_s > 0:
                    m.decoding_s += busy_s
        # In the order they finished (events), not a set's: it is the order their blocks enter the caches.
        for event in events:
            m = self.live.pop(event.request_id)
            del self.on_gpu[m.gpu_id][event.request_id]
            self._keep_prefix(m)
        self.bound_prefix_caches()
        return events

    def _keep_prefix(self, m: _Live) -> None:
        """A finished request's prompt blocks become historical KV on the GPU it finished on (MemServe
        §4.1 `insert` on completion). Only the prompt: the trace hashes no output blocks."""
        spec = self.prefix_spec
        if spec is None or not m.req.hash_ids:
            return
        pod = self.pods[m.gpu_id]  # it ran there this epoch, so the GPU and its pod are held
        if pod.prefix_cache is None:
            pod.prefix_cache = GpuPrefixCache(self.kv_bytes_per_token)
        pod.prefix_cache.insert(m.req.hash_ids, spec.block_tokens(m.req.prompt_tokens, len(m.req.hash_ids)))

    def bound_prefix_caches(self) -> None:
        """Keep each GPU's historical KV within the memory its running requests leave free (after they
        grew and finished: `_run_on` does the same when a request comes to a GPU)."""
        # Only held pods run requests; a warm pod's cache was bounded by C when it was let go.
        for gpu_id in self.pods:
            self._bound_prefix_cache(gpu_id)

    def _bound_prefix_cache(self, gpu_id: str) -> None:
        """MemServe retains history only in free memory (§4: MemPool hands blocks to active requests
        first), so blocks go, least recently used first, once cached + running KV would pass C.

        Running KV counts a request spanning GPUs whole on the GPU of its tail, and a request that
        found its prefix here both in its own KV and in the cache (the model does not share blocks):
        both only evict sooner.
        """
        pod = self.pods.get(gpu_id)
        cache = None if pod is None else pod.prefix_cache
        if cache is None:
            return
        running_bytes = sum(int(self.live[r].req.prompt_tokens + self.live[r].generated)
                            for r in self.on_gpu.get(gpu_id, {})) * self.kv_bytes_per_token
        self.result.num_prefix_evictions += cache.evict_to(max(0, self.capacity_bytes - running_bytes))

    def _match_prefix(self, m: _Live, gpu_id: str) -> None:
        """Where a request is first placed, its prefill skips the prompt's leading hash blocks that
        GPU holds (MemServe §4.2 `match`), but always computes at least the last prompt token."""
        req = m.req
        hit_tokens = 0
        pod = self.pods.get(gpu_id)
        cache = None if pod is None else pod.prefix_cache
        if cache is not None and self.prefix_spec is not None and req.hash_ids:
            hit_tokens = cache.match(req.hash_ids, self.prefix_spec.block_tokens(req.prompt_tokens, len(req.hash_ids)))
        m.prefill_tokens = max(1, req.prompt_tokens - hit_tokens)
        result = self.result
        result.prompt_tokens += req.prompt_tokens
        result.prefix_hit_tokens += hit_tokens
        result.prefill_tokens_saved += req.prompt_tokens - m.prefill_tokens
        if hit_tokens:
            result.num_prefix_hits += 1
            # Nothing else has moved its start yet (a pod that is not ready does so after this).
            m.earliest_decode_s = req.arrival_s + self.setup.prefill_s(m.prefill_tokens)
            m.decode_from_s = max(m.earliest_decode_s, m.not_before_s)

    def _record_finish(self, m: _Live, before: float, step: float, busy_s: float) -> None:
        """Queueing delay and TPOT of a request done this epoch.

        It finishes inside the epoch, when `generated` reaches its output: its last decode took
        the remaining tokens x the step, not the whole epoch.
        """
        if busy_s > 0:
            m.decoding_s += (m.req.output_tokens - before) * step
        self.result.queue_delays_s.append(m.waited_s)
        if m.req.output_tokens > 0:  # TPOT of a request with no output is undefined
            self.result.tpots_s.append(m.decoding_s / m.req.output_tokens)

    def report_growth(self) -> list[Event]:
        """A Grow for each running request whose reservation passed what the scheduler last heard."""
        events: list[Event] = []
        for rid, m in self.live.items():
            want = self.reservation_bytes(m.req.prompt_tokens + m.generated)
            if want > m.reported_bytes:
                m.reported_bytes = want
                events.append(Grow(rid, want))
                if want > self.capacity_bytes:
                    self._count_over_capacity(rid)
        return events

    def _count_over_capacity(self, request_id: str) -> None:
        if request_id not in self.over_capacity:
            self.over_capacity.add(request_id)
            self.result.num_over_capacity_requests += 1

    def admit_arrivals(self, now_s: float) -> list[Event]:
        """An Arrive for each request that arrived during the epoch ending at `now_s`.

        Decoding starts after the prefill, and never before the epoch began (no decode is owed
        for time before the scheduler heard of the request).
        """
        events: list[Event] = []
        while self.next_arrival < len(self.pending) and self.pending[self.next_arrival].arrival_s < now_s:
            req = self.pending[self.next_arrival]
            self.next_arrival += 1
            m = _Live(req, "", req.arrival_s + self.setup.prefill_s(req.prompt_tokens), not_before_s=now_s - self.epoch_s,
                      prefill_tokens=req.prompt_tokens)
            m.earliest_decode_s = m.decode_from_s
            m.decode_from_s = max(m.decode_from_s, m.not_before_s)
            m.reported_bytes = self.reservation_bytes(req.prompt_tokens)
            if m.reported_bytes > self.capacity_bytes:
                self._count_over_capacity(req.request_id)
            self.live[req.request_id] = m
            events.append(Arrive(req.request_id, m.reported_bytes))
        return events

    def schedule_unbatched(self, events: list[Event], now_s: float) -> Plan:
        """Without request operation batching (MELL §VI-C, Fig. 13's baseline): each operation is
        scheduled, and its moves carried out, on its own, in the order the replay produced them, so
        no move is reordered or cancelled (A->B->A costs two moves). The epoch's moves are costed
        together, against one epoch's §V boundaries, as batched ones are. Returns the epoch's plans
        merged, for recording."""
        # One batch per operation, then an empty one that ends the epoch: it runs the policy's
        # per-epoch work (the load balancer's rebalancing, once an epoch as batched) and Algorithm 1's
        # idle-GPU step even in an epoch without events.
        batches: list[tuple[Event, ...]] = [(event,) for event in events] + [()]
        plans: list[Plan] = []
        for i, batch in enumerate(batches):
            plan = self.policy.schedule(EventBatch(now_s, batch), end_of_epoch=i == len(batches) - 1)
            # The replay decoded the whole epoch first, so a request whose Finish comes later in this
            # epoch's events is already gone here, yet an earlier operation may move it: the move an
            # unbatched scheduler makes (and batching cancels) is counted and costed, with nothing to
            # relocate.
            self.apply_plan(replace(plan, migrations=tuple(m for m in plan.migrations if m.request_id in self.live),
                                    preemptions=tuple(m for m in plan.preemptions if m.request_id in self.live)),
                            now_s, cost_migrations=False)
            plans.append(plan)
        merged = merge_plans(now_s, plans)
        if merged.migrations:
            self._cost_migrations(merged.migrations, now_s)
        return merged

    def apply_plan(self, plan: Plan, now_s: float, cost_migrations: bool = True) -> None:
        """Carry out the plan on the replayed cluster, checking it moves what is really there.

        The pods of GPUs the plan lets go are released first, so that a GPU it activates in the
        same plan takes one of them, warm, rather than asking for a new one.
        """
        self._release_pods(plan.terminate_gpu_ids, now_s)
        self._activate(plan.activate_gpu_ids, now_s)
        for pl in plan.placements:
            m = self.live[pl.request_id]
            if m.gpu_id:  # a request whose tail passed C starts a new tail elsewhere
                del self.on_gpu[m.gpu_id][pl.request_id]
            elif self.prefix_spec is not None:
                self._match_prefix(m, pl.gpu_id)
            self._run_on(m, pl.request_id, pl.gpu_id, now_s)
        for mig in (*plan.migrations, *plan.preemptions):
            m = self.live[mig.request_id]
            if m.gpu_id != mig.source_gpu_id:
                raise AssertionError(f"plan moves {mig.request_id} from {mig.source_gpu_id}, it is on {m.gpu_id}")
            del self.on_gpu[m.gpu_id][mig.request_id]
            self._run_on(m, mig.request_id, mig.target_gpu_id, now_s)
        for mig in plan.preemptions:
            # vLLM recompute: the request re-prefills everything it had before decoding again.
            m = self.live[mig.request_id]
            tokens = m.req.prompt_tokens + int(m.generated)
            m.decode_from_s = max(m.decode_from_s, self._start_s(m.gpu_id, now_s) + self.setup.prefill_s(tokens))
        if plan.migrations and cost_migrations:
            self._cost_migrations(plan.migrations, now_s)
        self._terminate(plan.terminate_gpu_ids)

    def _activate(self, gpu_ids: Iterable[str], now_s: float) -> None:
        for gpu_id in gpu_ids:
            self.on_gpu.setdefault(gpu_id, {})
            gpu = self.policy.gpus.get(gpu_id)
            if gpu is not None:
                self.locations[gpu_id] = gpu.location
            self._pod_for(gpu_id, now_s)

    def _pod_for(self, gpu_id: str, now_s: float) -> _Pod:
        """The pod behind `gpu_id`: its own, else the last one released less than the delay ago
        (ready at once, already billed), else a new one, billed now and ready `scale_up_s` later.

        Pods are interchangeable: a warm pod is a GPU slot, whatever the policy calls the GPU.
        """
        pod = self.pods.get(gpu_id)
        if pod is not None:
            return pod
        self._expire_warm(now_s)
        if self.warm:
            pod = self.warm.pop()
            pod.released_s = None
        else:
            pod = _Pod(created_s=now_s, ready_s=now_s + self.scale_up_s)
        self.pods[gpu_id] = pod
        return pod

    def _expire_warm(self, now_s: float) -> None:
        """Delete the warm pods released `scale_down_delay_s` or more before `now_s`."""
        keep: list[_Pod] = []
        for pod in self.warm:
            assert pod.released_s is not None
            deleted_s = pod.released_s + self.scale_down_delay_s
            if deleted_s <= now_s:
                self.result.pod_lifetimes_s.append((pod.created_s, deleted_s))
            else:
                keep.append(pod)
        self.warm = keep

    def _release_pods(self, gpu_ids: Iterable[str], now_s: float) -> None:
        for gpu_id in gpu_ids:
            pod = self.pods.pop(gpu_id, None)
            if pod is not None:
                pod.released_s = now_s
                self.warm.append(pod)

    def close_pods(self, end_s: float) -> None:
        """At the end of the run: the GPUs still held are let go, and every warm pod lingers its delay."""
        self._release_pods(list(self.pods), end_s)
        self._expire_warm(math.inf)

    def _run_on(self, m: _Live, request_id: str, gpu_id: str, now_s: float) -> None:
        m.gpu_id = gpu_id
        self.on_gpu.setdefault(gpu_id, {})[request_id] = None
        # A request cannot run on a pod that is still starting: one that never decoded prefills
        # there once it is ready, a moved one resumes then. (Only a pod not ready *now* pushes it:
        # with scale_up_s=0 decode_from_s is left alone and the replay is the one without pods.)
        ready_s = self._pod_for(gpu_id, now_s).ready_s
        if ready_s > now_s:
            if m.last_decoded_s is None and m.generated == 0:
                ready_s += self.setup.prefill_s(m.prefill_tokens)
            m.decode_from_s = max(m.decode_from_s, ready_s)
        if self.prefix_spec is not None:
            self._bound_prefix_cache(gpu_id)  # before the next request placed here looks its prefix up

    def _start_s(self, gpu_id: str, now_s: float) -> float:
        """When work sent to `gpu_id` now can begin: now, or when its pod is ready."""
        pod = self.pods.get(gpu_id)
        return now_s if pod is None or pod.ready_s <= now_s else pod.ready_s

    def _cost_migrations(self, migrations: tuple[Migration, ...], now_s: float) -> None:
        """Charge each migration the transfer the §V planner picks: KV over its link, or a re-prefill.

        A token transfer also delays the request's decoding by its re-prefill.
        """
        sched = plan_migrations(
            migrations,
            lambda gid: self.locations.get(gid) or self.policy.gpus[gid].location,
            self.kv_bytes_per_token,
            self.boundaries,
        )
        setup = self.setup
        for cm in sched.kv:
            link_bw = setup.intra_node_bytes_per_s if cm.link_id.startswith("intra:") else setup.inter_node_bytes_per_s
            self.result.migration_time_s += cm.migration.size_bytes / link_bw
        for cm in sched.token:
            secs = setup.prefill_s(cm.num_tokens)
            self.result.migration_time_s += secs
            m = self.live.get(cm.migration.request_id)
            if m is not None:  # None: moved without batching, then finished within the epoch
                m.decode_from_s = max(m.decode_from_s, self._start_s(m.gpu_id, now_s) + secs)
        self.result.num_kv_transfers += len(sched.kv)
        self.result.num_token_transfers += len(sched.token)
        self.result.num_deferred += len(sched.deferred)

    def _terminate(self, gpu_ids: Iterable[str]) -> None:
        for gpu_id in gpu_ids:
            if self.on_gpu.pop(gpu_id, None):
                raise AssertionError(f"plan terminates {gpu_id} while requests run on it")

    def record_epoch(self, plan: Plan, now_s: float) -> None:
        """Append this epoch's GPUs, actual KV and fluid lower bound, and add up the plan's moves."""
        c = self.capacity_bytes
        heads = {sp.request_id: len(sp.gpu_ids) - 1 for sp in plan.spans}
        total_kv = 0
        for rids in self.on_gpu.values():
            kv_on_gpu = 0
            for r in rids:
                kv_r = int(self.live[r].req.prompt_tokens + self.live[r].generated) * self.kv_bytes_per_token
                total_kv += kv_r
                # A request larger than C has whole chunks of C on head GPUs; only its tail is here.
                kv_on_gpu += kv_r - heads.get(r, 0) * c
            if kv_on_gpu > c:
                self.result.num_capacity_violations += 1
        result = self.result
        result.times_s.append(now_s)
        result.gpus.append(self.policy.num_gpus())
        result.kv_bytes.append(total_kv)
        result.lower_bound.append(math.ceil(total_kv / c))
        result.migrations_per_epoch.append(len(plan.migrations))
        result.num_migrations += len(plan.migrations)
        result.migrated_bytes += sum(mg.size_bytes for mg in plan.migrations)
        result.num_preemptions += len(plan.preemptions)
        result.num_spanning = max(result.num_spanning, len(plan.spans))
        result.max_moves_per_operation = max(result.max_moves_per_operation, *plan.moves_per_operation, 0)
        result.num_moves_cancelled += plan.num_moves_cancelled
        result.num_item_moves += sum(plan.moves_per_operation)
