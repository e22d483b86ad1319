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
Deterministic: no clock, no randomness (synthetic workloads take their seed outside).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvfleet.mell.cluster import ClusterPolicy, SchedulerConfig
from kvfleet.mell.migration import Boundaries, plan_migrations
from kvfleet.mell.models import Arrive, Event, EventBatch, Finish, Grow, Location, Migration, Plan
from kvfleet.mell.policy import make_policy
from kvfleet.sim.hardware import BLOCK_SIZE_TOKENS, CapacityDerivation, GpuSpec, ModelShape, derive_capacity
from kvfleet.sim.traces import TraceRequest


@dataclass(frozen=True)
class Setup:
    """A model on a GPU type, with the KV capacity C derived from them."""

    name: str
    model: ModelShape
    gpu: GpuSpec
    capacity: CapacityDerivation
    bandwidth_efficiency: float = 0.8
    per_sequence_overhead_s: float = 0.0002
    mfu: float = 0.5
    intra_node_bytes_per_s: float = 25e9  # PCIe 4.0 x16 (§VIII-B)
    inter_node_bytes_per_s: float = 1.25e9  # 10 Gbps (§VIII-B)

    @property
    def capacity_bytes(self) -> int:
        return self.capacity.capacity_bytes

    def step_s(self, batch: int, kv_bytes: int) -> float:
        bandwidth = self.gpu.mem_bandwidth_bytes_per_s * self.bandwidth_efficiency
        return (self.model.weight_bytes + kv_bytes) / bandwidth + batch * self.per_sequence_overhead_s

    def prefill_s(self, tokens: int) -> float:
        return 2.0 * self.model.num_params * tokens / (self.gpu.peak_flops * self.mfu)


def make_setup(name: str, model: ModelShape, gpu: GpuSpec, activation_reserve_bytes: int | None = None) -> Setup:
    return Setup(name, model, gpu, derive_capacity(model, gpu, activation_reserve_bytes))


@dataclass
class _Live:
    """A request the replay is decoding: where it runs, how far it got, what the scheduler was told."""

    req: TraceRequest
    gpu_id: str
    decode_from_s: float
    generated: float = 0.0
    reported_bytes: int = 0


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


def simulate(
    requests: list[TraceRequest],
    setup: Setup,
    policy_name: str,
    epoch_s: float = 1.0,
    config: SchedulerConfig | None = None,
    on_epoch: Callable[[int], None] | None = None,
    lookahead_epochs: float = 1.0,
) -> RunResult:
    """Replay `requests` (sorted by arrival) under one policy.

    Each epoch runs the same steps in this order (the order is part of the results: events reach
    the scheduler as finishes, then growths, then arrivals): decode, report growth, admit arrivals,
    schedule, apply the plan, record the epoch.
    """
    if epoch_s <= 0:
        raise ValueError("epoch_s must be positive")
    cfg = config or SchedulerConfig(capacity_bytes=setup.capacity_bytes)
    replay = _Replay(requests, setup, make_policy(policy_name, cfg), epoch_s, lookahead_epochs)
    now_s = 0.0
    epoch = 0
    while replay.has_work():
        epoch += 1
        start_s, now_s = now_s, epoch * epoch_s
        events = replay.decode_epoch(start_s, now_s)
        events += replay.report_growth()
        events += replay.admit_arrivals(now_s)
        plan = replay.policy.schedule(EventBatch(now_s, tuple(events)))
        replay.apply_plan(plan, now_s)
        replay.record_epoch(plan, now_s)
        if on_epoch is not None:
            on_epoch(epoch)
    return replay.result


class _Replay:
    """The state of one `simulate` run between epochs, and the steps that advance it.

    A class rather than one long loop so that each step (decode, growth, arrivals, applying the
    plan, costing migrations, recording) can be read, and extended, on its own.
    """

    def __init__(
        self, requests: list[TraceRequest], setup: Setup, policy: ClusterPolicy, epoch_s: float, lookahead_epochs: float
    ) -> None:
        self.setup = setup
        self.policy = policy
        self.epoch_s = epoch_s
        self.capacity_bytes = setup.capacity_bytes
        self.kv_bytes_per_token = setup.model.kv_bytes_per_token
        self.block_bytes = BLOCK_SIZE_TOKENS * self.kv_bytes_per_token
        # Look-ahead: tokens a request can write in one epoch at the fastest step (batch 1, no KV).
        self.lookahead_tokens = math.ceil(lookahead_epochs * epoch_s / setup.step_s(1, 0))
        self.boundaries = Boundaries(
            intra_node_link_bytes=int(setup.intra_node_bytes_per_s * epoch_s),
            inter_node_link_bytes=int(setup.inter_node_bytes_per_s * epoch_s),
            instance_prefill_tokens=int(epoch_s / setup.prefill_s(1) * 0.1),
        )
        # Where each GPU the plans activated is, kept after the policy forgets a GPU it terminated.
        self.locations: dict[str, Location] = {}
        self.live: dict[str, _Live] = {}
        # Request ids per GPU, as an insertion-ordered set: the order fixes the order of Finish events.
        self.on_gpu: dict[str, dict[str, None]] = {}
        self.pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.next_arrival = 0
        self.result = RunResult(
            policy=policy.name, epoch_s=epoch_s, capacity_bytes=self.capacity_bytes, num_requests=len(requests)
        )

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
                busy_s = now_s - max(start_s, m.decode_from_s)
                if busy_s > 0:
                    m.generated += busy_s / step
                if m.generated >= m.req.output_tokens:
                    events.append(Finish(m.req.request_id))
        finished = {e.request_id for e in events}
        for rid in finished:
            m = self.live.pop(rid)
            del self.on_gpu[m.gpu_id][rid]
        return events

    def report_growth(self) -> list[Event]:
        """A Grow for each running request whose reservation passed what the scheduler last heard."""
        events: list[Event] = []
        for rid, m in self.live.items():
            want = self.reservation_bytes(m.req.prompt_tokens + m.generated)
            if want > m.reported_bytes:
                m.reported_bytes = want
                events.append(Grow(rid, want))
        return events

    def admit_arrivals(self, now_s: float) -> list[Event]:
        """An Arrive for each request that arrived during the epoch ending at `now_s`.

        Decoding starts after the prefill, and never before the epoch began (no decode is owed
        for time before the scheduler heard of the request).
        """
        events: list[Event] = []
        while self.next_arrival < len(self.pending) and self.pending[self.next_arrival].arrival_s < now_s:
            req = self.pending[self.next_arrival]
            self.next_arrival += 1
            m = _Live(req, "", req.arrival_s + self.setup.prefill_s(req.prompt_tokens))
            m.decode_from_s = max(m.decode_from_s, now_s - self.epoch_s)
            m.reported_bytes = self.reservation_bytes(req.prompt_tokens)
            self.live[req.request_id] = m
            events.append(Arrive(req.request_id, m.reported_bytes))
        return events

    def apply_plan(self, plan: Plan, now_s: float) -> None:
        """Carry out the plan on the replayed cluster, checking it moves what is really there."""
        self._activate(plan.activate_gpu_ids)
        for pl in plan.placements:
            m = self.live[pl.request_id]
            if m.gpu_id:  # a request whose tail passed C starts a new tail elsewhere
                del self.on_gpu[m.gpu_id][pl.request_id]
            self._run_on(m, pl.request_id, pl.gpu_id)
        for mig in (*plan.migrations, *plan.preemptions):
            m = self.live[mig.request_id]
            if m.gpu_id != mig.source_gpu_id:
                raise AssertionError(f"plan moves {mig.request_id} from {mig.source_gpu_id}, it is on {m.gpu_id}")
            del self.on_gpu[m.gpu_id][mig.request_id]
            self._run_on(m, mig.request_id, mig.target_gpu_id)
        for mig in plan.preemptions:
            # vLLM recompute: the request re-prefills everything it had before decoding again.
            m = self.live[mig.request_id]
            tokens = m.req.prompt_tokens + int(m.generated)
            m.decode_from_s = max(m.decode_from_s, now_s + self.setup.prefill_s(tokens))
        if plan.migrations:
            self._cost_migrations(plan.migrations, now_s)
        self._terminate(plan.terminate_gpu_ids)

    def _activate(self, gpu_ids: Iterable[str]) -> None:
        for gpu_id in gpu_ids:
            self.on_gpu.setdefault(gpu_id, {})
            gpu = self.policy.gpus.get(gpu_id)
            if gpu is not None:
                self.locations[gpu_id] = gpu.location

    def _run_on(self, m: _Live, request_id: str, gpu_id: str) -> None:
        m.gpu_id = gpu_id
        self.on_gpu.setdefault(gpu_id, {})[request_id] = None

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
            m = self.live[cm.migration.request_id]
            m.decode_from_s = max(m.decode_from_s, now_s + secs)
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
