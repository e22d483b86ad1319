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
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.mell.cluster import SchedulerConfig
from kvfleet.mell.migration import Boundaries, plan_migrations
from kvfleet.mell.models import (
    Arrive,
    CapacityDerivation,
    Event,
    EventBatch,
    Finish,
    GpuSpec,
    Grow,
    Location,
    ModelSpec,
    derive_capacity,
)
from kvfleet.mell.policy import make_policy
from kvfleet.sim.traces import TraceRequest

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Setup:
    """A model on a GPU type, with the KV capacity C derived from them."""

    name: str
    model: ModelSpec
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


def make_setup(name: str, model: ModelSpec, gpu: GpuSpec, activation_reserve_bytes: int | None = None) -> Setup:
    return Setup(name, model, gpu, derive_capacity(model, gpu, activation_reserve_bytes))


@dataclass
class _Live:
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
    """Replay `requests` (sorted by arrival) under one policy."""
    if epoch_s <= 0:
        raise ValueError("epoch_s must be positive")
    c = setup.capacity_bytes
    cfg = config or SchedulerConfig(capacity_bytes=c)
    policy = make_policy(policy_name, cfg)
    bpt = setup.model.kv_bytes_per_token
    block_bytes = BLOCK_TOKENS * bpt
    # Look-ahead: tokens a request can write in one epoch at the fastest step (batch 1, no KV).
    lookahead_tokens = math.ceil(lookahead_epochs * epoch_s / setup.step_s(1, 0))
    boundaries = Boundaries(
        intra_node_link_bytes=int(setup.intra_node_bytes_per_s * epoch_s),
        inter_node_link_bytes=int(setup.inter_node_bytes_per_s * epoch_s),
        instance_prefill_tokens=int(epoch_s / setup.prefill_s(1) * 0.1),
    )
    locations: dict[str, Location] = {}

    def reservation(tokens: float) -> int:
        blocks = math.ceil((tokens + lookahead_tokens) / BLOCK_TOKENS)
        return blocks * block_bytes

    result = RunResult(policy=policy.name, epoch_s=epoch_s, capacity_bytes=c, num_requests=len(requests))
    live: dict[str, _Live] = {}
    on_gpu: dict[str, dict[str, None]] = {}
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
    nxt = 0
    now = 0.0
    epoch = 0
    while nxt < len(pending) or live:
        epoch += 1
        start, now = now, epoch * epoch_s
        events: list[Event] = []
        # 1. decode for one epoch on every GPU, at the speed its batch allows
        for rids in on_gpu.values():
            if not rids:
                continue
            members = [live[r] for r in rids]
            kv = sum(int(m.req.prompt_tokens + m.generated) * bpt for m in members)
            step = setup.step_s(len(members), kv)
            for m in members:
                busy_s = now - max(start, m.decode_from_s)
                if busy_s > 0:
                    m.generated += busy_s / step
                if m.generated >= m.req.output_tokens:
                    events.append(Finish(m.req.request_id))
        finished = {e.request_id for e in events}
        for rid in finished:
            m = live.pop(rid)
            del on_gpu[m.gpu_id][rid]
        # 2. growth of the running requests' reservations
        for rid, m in live.items():
            want = reservation(m.req.prompt_tokens + m.generated)
            if want > m.reported_bytes:
                m.reported_bytes = want
                events.append(Grow(rid, want))
        # 3. arrivals of this epoch
        while nxt < len(pending) and pending[nxt].arrival_s < now:
            req = pending[nxt]
            nxt += 1
            m = _Live(req, "", req.arrival_s + setup.prefill_s(req.prompt_tokens))
            m.decode_from_s = max(m.decode_from_s, now - epoch_s)
            m.reported_bytes = reservation(req.prompt_tokens)
            live[req.request_id] = m
            events.append(Arrive(req.request_id, m.reported_bytes))
        plan = policy.schedule(EventBatch(now, tuple(events)))
        # 4. apply the plan
        for gpu_id in plan.activate_gpu_ids:
            on_gpu.setdefault(gpu_id, {})
            gpu = policy.gpus.get(gpu_id)
            if gpu is not None:
                locations[gpu_id] = gpu.location
        heads = {sp.request_id: len(sp.gpu_ids) - 1 for sp in plan.spans}
        for pl in plan.placements:
            m = live[pl.request_id]
            if m.gpu_id:  # a request whose tail passed C starts a new tail elsewhere
                del on_gpu[m.gpu_id][pl.request_id]
            m.gpu_id = pl.gpu_id
            on_gpu.setdefault(pl.gpu_id, {})[pl.request_id] = None
        for mig in (*plan.migrations, *plan.preemptions):
            m = live[mig.request_id]
            if m.gpu_id != mig.source_gpu_id:
                raise AssertionError(f"plan moves {mig.request_id} from {mig.source_gpu_id}, it is on {m.gpu_id}")
            del on_gpu[m.gpu_id][mig.request_id]
            m.gpu_id = mig.target_gpu_id
            on_gpu.setdefault(mig.target_gpu_id, {})[mig.request_id] = None
        for mig in plan.preemptions:
            # vLLM recompute: the request re-prefills everything it had before decoding again.
            m = live[mig.request_id]
            tokens = m.req.prompt_tokens + int(m.generated)
            m.decode_from_s = max(m.decode_from_s, now + setup.prefill_s(tokens))
        if plan.migrations:
            sched = plan_migrations(
                plan.migrations,
                lambda gid: locations.get(gid) or policy.gpus[gid].location,
                bpt,
                boundaries,
            )
            for cm in sched.kv:
                link_bw = setup.intra_node_bytes_per_s if cm.link_id.startswith("intra:") else setup.inter_node_bytes_per_s
                result.migration_time_s += cm.migration.size_bytes / link_bw
            for cm in sched.token:
                secs = setup.prefill_s(cm.num_tokens)
                result.migration_time_s += secs
                m = live[cm.migration.request_id]
                m.decode_from_s = max(m.decode_from_s, now + secs)
            result.num_kv_transfers += len(sched.kv)
            result.num_token_transfers += len(sched.token)
            result.num_deferred += len(sched.deferred)
        for gpu_id in plan.terminate_gpu_ids:
            if on_gpu.pop(gpu_id, None):
                raise AssertionError(f"plan terminates {gpu_id} while requests run on it")
        # 5. measure
        total_kv = 0
        for rids in on_gpu.values():
            kv_on_gpu = 0
            for r in rids:
                kv_r = int(live[r].req.prompt_tokens + live[r].generated) * bpt
                total_kv += kv_r
                # A request larger than C has whole chunks of C on head GPUs; only its tail is here.
                kv_on_gpu += kv_r - heads.get(r, 0) * c
            if kv_on_gpu > c:
                result.num_capacity_violations += 1
        result.times_s.append(now)
        result.gpus.append(policy.num_gpus())
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
        if on_epoch is not None:
            on_epoch(epoch)
    return result
