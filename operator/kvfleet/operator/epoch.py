"""One MELL epoch of a pool: worker reports in, a placement plan and the moves to reach it out.

This is the adapter between what the cluster says (each worker pod's KV-load report, the
KVMigrations in flight) and the pure scheduler `kvfleet.mell`. It is level-triggered: the policy
holds where every request *should* be, the reports say where it *is*, and every difference that is
not already being moved becomes a migration order. A failed or lost migration therefore comes back
by itself next epoch (as a retry); nothing depends on remembering what was ordered.

Workers and GPUs: the policy names GPUs `gpu-<n>`; a worker pod carries the GPU it serves in the
label `kvfleet.dev/gpu-id`, written when the pod is created or when an idle pod kept by the pool's
floor is bound to a newly activated GPU. After an operator restart the policy is rebuilt from the
pods: their GPU labels, their reports and their creation order (MELL's "most recently activated").
No I/O and no clock here; time comes in as an argument.

DistKV (docs/operator.md): a request whose KV spans workers (its report has `borrowedBytes`) is
packed by its local part and never moved, since its KV lives on several workers. A worker's lent
blocks are load on its GPU that MELL must not place new requests into: they are modelled as one
pseudo request `lent:<pod>` on that worker's GPU, which arrives, grows and finishes like a request
but is never moved, routed or migrated, and is put back on its worker's GPU whenever the policy
holds it elsewhere (`_pin_lent`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvfleet.api.reports import KVLoadReport
from kvfleet.mell import ClusterPolicy, EventBatch, PolicyConfig, make_policy
from kvfleet.mell.allocate import allocate_on_snapshot, items_of
from kvfleet.mell.models import Arrive, Event, Finish, Grow, Location
from kvfleet.mell.size_classes import ROUTED_CLASS_NAMES, class_of_name, middle_bytes
from kvfleet.mell.state import ClusterSnapshot, GpuSnapshot, ItemSnapshot

log = logging.getLogger(__name__)

# A reported request larger than this many GPUs' capacity is ignored: no context is that long, and
# MELL would activate one GPU per C of it (a report of 10**12 bytes against C = 1200 hung the epoch).
MAX_SPAN_GPUS = 64

# Reasons of KVMigration (the CRD's enum) for each cause the scheduler records.
_REASONS = {"allocate": "Allocate", "depart": "Depart", "update": "Update", "rebalance": "Rebalance", "preempt": "Rebalance",
            "overload": "Update", "consolidate": "Consolidate"}


@dataclass(frozen=True)
class WorkerView:
    """What the operator observed about one live worker pod."""

    pod_name: str
    gpu_id: str | None  # None: an idle pod kept only by the pool's floor
    created_order: int  # position in pod creation order (MELL's activation order after a restart)
    node_name: str
    zone: str
    ready: bool
    report: KVLoadReport | None
    pod_ip: str = ""  # "" until the pod has an address


# The pseudo request that stands for a worker's lent KV blocks in MELL's model (module docstring).
LENT_PREFIX = "lent:"


def lent_request_id(pod_name: str) -> str:
    return f"{LENT_PREFIX}{pod_name}"


def is_lent(request_id: str) -> bool:
    return request_id.startswith(LENT_PREFIX)


def lent_bytes_of(worker: WorkerView) -> int:
    """The KV blocks this worker lends now (0 without a report, or while it lends none)."""
    return (worker.report.lent_bytes or 0) if worker.report is not None else 0


def _lent_size_bytes(worker: WorkerView, capacity_bytes: int) -> int:
    """The size of the worker's lent-block pseudo request: never more than one GPU holds (a worker
    cannot lend more than its capacity; this keeps a bad report from asking MELL for a span)."""
    if worker.report is None:
        return 0
    return min(lent_bytes_of(worker), worker.report.capacity_bytes, capacity_bytes)


@dataclass(frozen=True)
class MoveOrder:
    """One KVMigration to create."""

    request_id: str
    source_pod: str
    target_pod: str
    size_bytes: int
    tokens: int
    reason: str


@dataclass(frozen=True)
class EpochOutcome:
    moves: tuple[MoveOrder, ...]
    # GPUs the policy needs that no pod serves yet (create a pod, or bind an idle floor pod).
    unserved_gpu_ids: tuple[str, ...]
    # Pods whose GPU the policy terminated and that hold nothing: unbind (or delete) them.
    released_pods: tuple[str, ...]
    # Moves that wait for their target pod to become ready.
    num_deferred_moves: int
    num_events: int
    used_bytes: int
    lower_bound_gpus: int
    active_gpus: int


def gpu_index(gpu_id: str) -> int:
    return int(gpu_id.rsplit("-", 1)[-1])


# A reported capacity this far from the one MELL plans with re-plans the pool: elastic workers'
# capacities move with their activations, and re-planning on every small move would only churn.
CAPACITY_REPLAN_FRACTION = 0.05


def reported_capacity_bytes(workers: Iterable[WorkerView]) -> int | None:
    """The KV capacity the pool's workers report: the smallest over the ready ones (MELL packs equal
    bins, and the smallest keeps every bin true; an idle floor pod counts, as the next GPU it serves
    has its capacity); None before any ready worker reports."""
    capacities = [w.report.capacity_bytes for w in workers if w.ready and w.report is not None]
    return min(capacities) if capacities else None


def capacity_to_plan(planned_bytes: int, reported_bytes: int | None) -> int:
    """The capacity the next epoch plans with: the reported one once it is CAPACITY_REPLAN_FRACTION
    away from the planned one, else the planned one."""
    if reported_bytes is None or abs(reported_bytes - planned_bytes) < CAPACITY_REPLAN_FRACTION * planned_bytes:
        return planned_bytes
    return reported_bytes


class PoolScheduler:
    """The scheduling state of one pool, kept in memory between epochs and rebuildable from pods."""

    def __init__(self, policy_name: str, config: PolicyConfig) -> None:
        self.policy_name = policy_name
        self.config = config
        self.policy: ClusterPolicy = make_policy(policy_name, config)
        self.sizes: dict[str, int] = {}
        # Why a request is out of place, from the epoch that decided it, kept until it is in place:
        # a move that waits for its target pod still says which operation caused it.
        self.causes: dict[str, str] = {}

    @classmethod
    def rebuild(cls, policy_name: str, config: PolicyConfig, workers: Iterable[WorkerView]) -> PoolScheduler:
        """The state a restarted operator starts from: requests where the reports put them."""
        self = cls(policy_name, config)
        bound = sorted((w for w in workers if w.gpu_id is not None), key=lambda w: w.created_order)
        gpus = tuple(GpuSnapshot(w.gpu_id, gpu_index(w.gpu_id), seq, Location(w.node_name, w.zone))
                     for seq, w in enumerate(bound) if w.gpu_id is not None)
        items: list[ItemSnapshot] = []
        capacity = config.capacity_bytes
        seen: set[str] = set()
        for worker in bound:
            assert worker.gpu_id is not None
            requests = sorted(worker.report.requests, key=lambda r: r.id) if worker.report else []
            kept: list[tuple[str, int]] = []
            load_bytes = 0
            lent_bytes = _lent_size_bytes(worker, capacity)
            if lent_bytes > 0:
                # Lent blocks are there for sure (the worker holds them for its debtors): placed first,
                # so that an overfilled worker's excess is always a request, which can be allocated afresh.
                lent_id = lent_request_id(worker.pod_name)
                load_bytes = lent_bytes
                self.sizes[lent_id] = lent_bytes
                kept.append((lent_id, lent_bytes))
            for req in requests:
                if req.id in seen:
                    continue  # reported twice mid-migration: the first (older) pod keeps it
                seen.add(req.id)
                if load_bytes + req.kv_bytes > capacity:
                    # Over capacity (the router overfilled it, or moves were still due; a request
                    # larger than C always is: DistAttention spans are not rebuilt from reports yet):
                    # the excess is left out, so the first epoch allocates it afresh and orders the moves.
                    continue
                load_bytes += req.kv_bytes
                self.sizes[req.id] = req.kv_bytes
                kept.append((req.id, req.kv_bytes))
            if self.policy.restores_multi_items:
                items.extend(items_of(worker.gpu_id, kept, capacity))
            else:
                items.extend(ItemSnapshot(((rid, size),), False, worker.gpu_id) for rid, size in kept)
        next_index = max((gpu_index(g.gpu_id) for g in gpus), default=-1) + 1
        self.policy.restore(ClusterSnapshot(gpus, tuple(items), (), next_index, len(gpus)))
        self.sizes = {rid: size for rid, size in self.sizes.items() if rid in self.policy.item_of}
        return self

    def replanned(self, capacity_bytes: int, workers: Iterable[WorkerView]) -> PoolScheduler:
        """This pool's scheduler planning with another capacity: rebuilt from the reports (requests
        stay where they are, as after a restart), keeping when each request was last moved (so none
        moves again sooner than the policy allows) and why those out of place are."""
        moved_at = self.policy.snapshot().moved_at_s
        fresh = PoolScheduler.rebuild(self.policy_name, dataclasses.replace(self.config, capacity_bytes=capacity_bytes),
                                      workers)
        for request_id, moved_s in moved_at:
            fresh.policy.note_moved([request_id], moved_s)
        fresh.causes = dict(self.causes)
        return fresh

    def routes(self) -> dict[str, str]:
        """Which GPU MELL's Allocate would give the next request of each size class (the routing table).

        Previewed on a copy of the state with one request of a representative size per class (the
        middle of the class's range), so the router can place new requests where MELL would and the
        next epoch orders no move for them.
        """
        capacity = self.config.capacity_bytes
        middles = {name: middle_bytes(class_of_name(name), capacity) for name in ROUTED_CLASS_NAMES}
        snapshot = self.policy.snapshot()
        return {name: allocate_on_snapshot(snapshot, size_bytes, self.config, self.policy_name).gpu_id
                for name, size_bytes in middles.items()}

    def epoch(self, workers: Iterable[WorkerView], in_flight: Mapping[str, str], now_s: float) -> EpochOutcome:
        """Feed the changes since the last epoch to the policy and order the moves to match it.

        `in_flight` maps request ids with an unfinished KVMigration to its target pod: those requests
        are neither finished nor moved again until their migration ends.
        """
        workers = list(workers)
        actual = _reported(workers, in_flight, MAX_SPAN_GPUS * self.config.capacity_bytes)
        known_before = frozenset(self.sizes)
        # Lent blocks first, in a batch of their own, and then put back where they are if the policy
        # placed them elsewhere: the requests of this epoch are then allocated around them.
        lent_events = self._events(actual, in_flight, lent=True)
        causes: dict[str, str] = {}
        if lent_events:
            first = self.policy.schedule(EventBatch(now_s, tuple(lent_events)), end_of_epoch=False)
            causes.update((m.request_id, m.cause) for m in first.migrations)
        self._pin_lent(workers, actual, known_before)
        # The default policy does not move by choice (consolidation, rebalancing) what moved within
        # min_move_interval_s: lent blocks count as just moved, every epoch, so it never tries.
        # (A tiny lent item shares its multi-item, which then stays too.) Forced moves are still
        # possible; the next epoch's _pin_lent puts the blocks back, and admit_by_room counts them.
        self.policy.note_moved([rid for rid, seen in actual.items() if seen.lent and rid in self.policy.item_of], now_s)
        events = self._events(actual, in_flight, lent=False)
        plan = self.policy.schedule(EventBatch(now_s, tuple(events)))
        causes.update((m.request_id, m.cause) for m in plan.migrations)
        placed_now = {p.request_id for p in plan.placements}
        pod_of_gpu = {w.gpu_id: w for w in workers if w.gpu_id is not None}
        # A request its worker expects to end within two epochs stays: its move would land after it ended.
        finishing = {rid for rid, seen in actual.items() if seen.finishing}
        moves, deferred = self._moves(actual, in_flight, causes, placed_now, pod_of_gpu, finishing)

        live_gpus = {g for g, gpu in self.policy.gpus.items() if not gpu.idle}
        # A worker that lends holds its debtors' KV: it is not released while it does.
        holding = {w.pod_name for w in workers if w.report and (w.report.requests or lent_bytes_of(w) > 0)}
        targets = set(in_flight.values())
        released = tuple(sorted(
            w.pod_name for w in workers
            if w.gpu_id is not None and w.gpu_id not in live_gpus and w.pod_name not in holding and w.pod_name not in targets
        ))
        unserved = tuple(sorted((g for g in live_gpus if g not in pod_of_gpu), key=gpu_index))
        used = sum(self.sizes.values())
        return EpochOutcome(
            moves=tuple(moves),
            unserved_gpu_ids=unserved,
            released_pods=released,
            num_deferred_moves=deferred,
            num_events=len(lent_events) + len(events),
            used_bytes=used,
            lower_bound_gpus=math.ceil(used / self.config.capacity_bytes),
            active_gpus=len(live_gpus),
        )

    def ordered(self, request_ids: Iterable[str], now_s: float) -> None:
        """Moves were ordered (their KVMigrations made) now: the policy counts them as moved from now,
        whatever epoch planned them (a move waits for its target pod, or for room) and whether or not
        the policy itself moved them (the router placed them elsewhere than Allocate)."""
        self.policy.note_moved(request_ids, now_s)

    def _events(self, actual: Mapping[str, Reported], in_flight: Mapping[str, str], *, lent: bool) -> list[Event]:
        """The policy's events since the last epoch (finishes, arrivals, growth), with `sizes` brought up to date:
        those of the lent-block pseudo requests (`lent`), or those of the real requests."""
        events: list[Event] = []
        for rid in list(self.sizes):
            if is_lent(rid) == lent and rid not in actual and rid not in in_flight:
                events.append(Finish(rid))
                del self.sizes[rid]
                self.causes.pop(rid, None)
        for rid, seen in actual.items():
            if is_lent(rid) != lent:
                continue
            size_bytes = seen.size_bytes
            known = self.sizes.get(rid)
            if known is None:
                events.append(Arrive(rid, size_bytes))
                self.sizes[rid] = size_bytes
            elif size_bytes > known:  # KV only grows (MELL §VI-A); a smaller report is stale
                events.append(Grow(rid, size_bytes))
                self.sizes[rid] = size_bytes
            elif lent and size_bytes < known:
                # Lent blocks shrink as debts are repaid, which no request does: the old size goes and
                # the new one comes (both in this batch, departs first), then is pinned (_pin_lent).
                events += [Finish(rid), Arrive(rid, size_bytes)]
                self.sizes[rid] = size_bytes
        return events

    def _pin_lent(self, workers: list[WorkerView], actual: Mapping[str, Reported], known_before: frozenset[str]) -> None:
        """Put lent blocks back on their worker's GPU when the policy holds them elsewhere.

        The policy places a new or grown pseudo request like any other, and may move it to make room;
        but lent blocks cannot move (the worker's debtors read them there), so a policy that holds them
        elsewhere believes in room that is not there. The state is then rebuilt from the reports (as
        after a restart, keeping when each request last moved), with only the requests it knew before
        this epoch: this epoch's arrivals still go through Allocate, around the lent blocks.
        """
        misplaced = [rid for rid, seen in actual.items()
                     if seen.lent and rid in self.policy.item_of and self.policy.gpu_of(rid) != seen.worker.gpu_id]
        if not misplaced:
            return
        log.debug("lent blocks %s held off their workers' GPUs: rebuilding from the reports", misplaced)
        known = [dataclasses.replace(w, report=w.report.model_copy(update={
            "requests": [r for r in w.report.requests if r.id in known_before]})) if w.report is not None else w
            for w in workers]
        fresh = self.replanned(self.config.capacity_bytes, known)
        self.policy, self.sizes = fresh.policy, fresh.sizes

    def _moves(self, actual: Mapping[str, Reported], in_flight: Mapping[str, str],
               causes: Mapping[str, str], placed_now: set[str],
               pod_of_gpu: Mapping[str, WorkerView], finishing: set[str]) -> tuple[list[MoveOrder], int]:
        """A move for every request reported away from where the policy holds it and not already moving,
        and how many wait (for their target pod, or to finish where they are); `causes` keeps why each
        is out of place."""
        moves: list[MoveOrder] = []
        deferred = 0
        for rid, seen in actual.items():
            worker, size_bytes, tokens = seen.worker, seen.move_bytes, seen.tokens
            if rid in in_flight or rid not in self.policy.item_of:
                continue
            if seen.lent or seen.spanning:
                # Never moved (module docstring): lent blocks are read where they are, and a spanning
                # request's KV lives on several workers. Not deferred either: no epoch will move them.
                continue
            want = self.policy.gpu_of(rid)
            if want == worker.gpu_id:
                self.causes.pop(rid, None)
                continue
            if rid in causes:
                self.causes[rid] = _REASONS.get(causes[rid], "Update")
            elif rid in placed_now:
                self.causes[rid] = "Allocate"  # the router placed it elsewhere than MELL's Allocate would
            target = pod_of_gpu.get(want)
            if target is None or not target.ready or rid in finishing:
                deferred += 1
                continue
            # Without a recorded cause, an earlier move of this request failed or was lost.
            reason = self.causes.get(rid, "Retry")
            moves.append(MoveOrder(rid, worker.pod_name, target.pod_name, size_bytes, tokens, reason))
        return moves, deferred


@dataclass(frozen=True)
class Reported:
    """A request as the reports say: the worker reporting it, its KV bytes and tokens, whether it ends soon.

    `size_bytes` counts blocks shared with older requests on its worker once, under them (the worker's
    load adds up); `move_bytes` is all it reads, what a move carries and its target must hold."""

    worker: WorkerView
    size_bytes: int
    tokens: int
    finishing: bool
    move_bytes: int
    spanning: bool = False  # part of its KV is borrowed from other workers (DistKV)
    lent: bool = False  # the pseudo request of the worker's lent blocks


def _reported(workers: Iterable[WorkerView], in_flight: Mapping[str, str], max_kv_bytes: int) -> dict[str, Reported]:
    """Request id -> where and how big it is, as the reports say (none larger than `max_kv_bytes`)."""
    actual: dict[str, Reported] = {}
    for worker in sorted(workers, key=lambda w: w.created_order):
        for req in worker.report.requests if worker.report else []:
            if req.kv_bytes > max_kv_bytes:
                log.warning("ignoring request %r reported by %s: %d bytes of KV is more than %d GPUs hold",
                            req.id, worker.pod_name, req.kv_bytes, MAX_SPAN_GPUS)
                continue
            # Mid-migration both pods may report a request: the migration's target wins.
            if req.id not in actual or in_flight.get(req.id) == worker.pod_name:
                actual[req.id] = Reported(worker, req.kv_bytes, req.tokens, bool(req.finishing), req.whole_kv_bytes,
                                          spanning=bool(req.borrowed_bytes or req.spans))
        # Only on a bound worker: an idle floor pod's lent blocks are on no GPU of the policy.
        lent_bytes = _lent_size_bytes(worker, max_kv_bytes // MAX_SPAN_GPUS)
        if lent_bytes > 0 and worker.gpu_id is not None:
            actual[lent_request_id(worker.pod_name)] = Reported(worker, lent_bytes, 0, False, lent_bytes, lent=True)
    return actual


def routing_table(routes: Mapping[str, str], workers: Iterable[WorkerView]) -> list[dict[str, str]]:
    """Size class -> the Ready worker pod that should take the next such request (for the router).

    `routes` is PoolScheduler.routes (size class -> GPU). A class routed to a GPU no pod serves yet
    goes to the oldest warm unbound pod (the next one MELL's new GPU would bind), or is left out: the
    router then picks a worker itself and MELL moves the request.
    """
    workers = list(workers)
    pod_of_gpu = {w.gpu_id: w.pod_name for w in workers if w.gpu_id is not None and w.ready}
    spare = sorted((w for w in workers if w.gpu_id is None and w.ready), key=lambda w: w.created_order)
    spare_names = [w.pod_name for w in spare]
    table = []
    for class_name in ("L", "M", "S", "T"):
        gpu_id = routes.get(class_name)
        pod_name = pod_of_gpu.get(gpu_id or "") or (spare_names[0] if spare_names else None)
        if pod_name:
            table.append({"sizeClass": class_name, "worker": pod_name})
    return table
