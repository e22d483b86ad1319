"""KVMigration objects of a pool: which are in flight, which timed out or expired, and new ones to make.

Pure over the listed objects and the time, so the lifecycle rules are unit-tested: a migration not
finished within `migration.timeoutSeconds` is marked Failed by the operator (the scheduler then
orders it again as a retry, never losing the request); finished ones are deleted after
`migration.ttlSecondsAfterFinished`. Names are deterministic per request and attempt, so a restarted
operator that plans the same move again gets a conflict instead of a duplicate.

A KVMigration's spec and status cross to the worker that runs it (kvfleet.worker.migration.watcher):
both ends write and read them through kvfleet.api.models (`KVMigrationSpec`, `KVMigrationStatus`),
so a field renamed on one side is an error on both, not a move the other side silently misreads.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from kvfleet.api.models import API_VERSION, POOL_LABEL, KVMigrationSpec, KVMigrationStatus, LLMPoolSpec, MigrationReason
from kvfleet.api.quantity import quantity_bytes
from kvfleet.api.reports import KVLoadReport
from kvfleet.mell.migration import Boundaries, MoveMode, link_of, plan_migrations
from kvfleet.mell.models import Location, Migration
from kvfleet.operator.epoch import MoveOrder
from kvfleet.operator.resources import MANAGED_BY, owner_reference

FINISHED = ("Succeeded", "Failed")
REQUEST_LABEL = "kvfleet.dev/request-hash"


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def phase(obj: dict[str, Any]) -> str:
    return str((obj.get("status") or {}).get("phase") or "Pending")


@dataclass(frozen=True)
class ListedMigration:
    """One KVMigration as listed: its name, when it was made (Unix s, None if unstamped), and its
    spec and status parsed by the models the worker writes them with."""

    name: str
    created_s: float | None
    spec: KVMigrationSpec
    status: KVMigrationStatus

    @property
    def phase(self) -> str:
        return self.status.phase

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> ListedMigration:
        meta = obj["metadata"]
        return cls(meta["name"], parse_time(meta.get("creationTimestamp")), KVMigrationSpec.model_validate(obj["spec"]),
                   KVMigrationStatus.model_validate(obj.get("status") or {}))


def request_hash(request_id: str) -> str:
    return hashlib.sha256(request_id.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class MigrationView:
    in_flight: dict[str, str]  # request id -> target pod
    timed_out: tuple[str, ...]  # names to mark Failed
    expired: tuple[str, ...]  # names to delete
    attempts: dict[str, int]  # request id -> objects already made for it
    finished: dict[str, ListedMigration]  # name -> migration, for Succeeded and Failed ones
    source_gone: tuple[str, ...] = ()  # unfinished, their source pod gone: names to mark Failed
    # The source and target pods of every unfinished move: a node autoscaler must not disrupt them
    # until it ends (kvfleet.operator.pods sets `karpenter.sh/do-not-disrupt` on them).
    moving: frozenset[str] = frozenset()


def view(objects: Iterable[dict[str, Any]], spec: LLMPoolSpec, now_s: float,
         reported_on: Mapping[str, Iterable[str]] | None = None,
         pods_started_s: Mapping[str, float] | None = None) -> MigrationView:
    """Sort the pool's migrations by what the scheduler must do about them.

    Only the source writes a migration's status, so one whose source pod died mid-move would stay
    Transferring until its timeout: given when each of the pool's pods started its current worker
    process (name -> Unix s, `worker_started_s`), an unfinished migration whose source pod no longer
    exists, or whose source process started after the migration was made (a restarted container, a
    newer pod of the same name), is sorted out to be marked Failed at once.

    A migration that succeeded counts as in flight until the target's report shows the request and
    the source's no longer does (or a settling window passes): reports lag the handover by up to one
    report interval, and reading the source's stale report as the truth would order the same move again.
    """
    reported_on = reported_on or {}
    settle_s = max(10.0, 3 * spec.scheduling.epoch_seconds)
    retry_after_s = retry_backoff_s(spec)
    in_flight: dict[str, str] = {}
    timed_out: list[str] = []
    expired: list[str] = []
    attempts: dict[str, int] = {}
    finished: dict[str, ListedMigration] = {}
    source_gone: list[str] = []
    moving: set[str] = set()
    # Oldest first, so that a request's latest migration has the last word on where it is going.
    for obj in sorted(objects, key=lambda o: (o["metadata"].get("creationTimestamp") or "", o["metadata"]["name"])):
        mig = ListedMigration.parse(obj)
        name, request_id = mig.name, mig.spec.request_id
        attempts[request_id] = attempts.get(request_id, 0) + 1
        if mig.phase in FINISHED:
            finished[name] = mig
            completed = mig.status.completion_time
            finished_s = (completed.timestamp() if completed is not None else None) or mig.created_s or now_s
            if now_s - finished_s >= spec.migration.ttl_seconds_after_finished:
                expired.append(name)
            elif (mig.phase == "Succeeded" and now_s - finished_s < settle_s
                  and (mig.spec.target_pod not in reported_on.get(request_id, ())
                       or mig.spec.source_pod in reported_on.get(request_id, ()))):
                # Until the target reports the request and the source has stopped reporting it
                # (each writes at most once an interval), the target is where it is.
                in_flight[request_id] = mig.spec.target_pod
            elif mig.phase == "Failed" and now_s - finished_s < retry_after_s:
                # The request stayed on the source; the report that made this move may be the one the
                # failure disproved (it finished there, or its room was gone). No retry until the
                # workers have written anew: ordering again from the same stale report fails again.
                in_flight[request_id] = mig.spec.source_pod
            continue
        created_s = mig.created_s or now_s
        if pods_started_s is not None:
            source_started_s = pods_started_s.get(mig.spec.source_pod)
            if source_started_s is None or source_started_s > created_s:
                source_gone.append(name)
                continue
        if now_s - created_s >= spec.migration.timeout_seconds:
            timed_out.append(name)
            continue
        in_flight[request_id] = mig.spec.target_pod
        moving.update((mig.spec.source_pod, mig.spec.target_pod))
    return MigrationView(in_flight, tuple(sorted(timed_out)), tuple(sorted(expired)), attempts, finished,
                         tuple(sorted(source_gone)), frozenset(moving))


def worker_started_s(pod: dict[str, Any]) -> float:
    """When the pod's current worker process started (Unix s): the pod's creation, or the latest start
    of a running container if later; infinity while no container runs (no process holds anything)."""
    created_s = parse_time(pod["metadata"].get("creationTimestamp")) or 0.0
    statuses = (pod.get("status") or {}).get("containerStatuses")
    if not statuses:
        return created_s  # not reported yet: a pod that is starting, or a stand-in without a status
    starts = [parse_time(((c.get("state") or {}).get("running") or {}).get("startedAt")) for c in statuses]
    if any(s is None for s in starts):
        return math.inf
    return max([created_s, *(s for s in starts if s is not None)])


def retry_backoff_s(spec: LLMPoolSpec) -> float:
    """How long a failed move's request is left alone: two report intervals (a worker writes at most
    one report per epoch), so the retry, if any, is planned from reports written after the failure."""
    return max(2.0, 2 * spec.scheduling.epoch_seconds)


def migration_name(pool_name: str, request_id: str, attempt: int) -> str:
    return f"{pool_name}-{request_hash(request_id)}-{attempt}"


def migration_body(pool: dict[str, Any], order: MoveOrder, mode: str, attempt: int, epoch: int) -> dict[str, Any]:
    """The KVMigration to create for `order`; its spec is a `KVMigrationSpec`, the model the worker reads it with."""
    name = pool["metadata"]["name"]
    spec = KVMigrationSpec(
        pool=name,
        request_id=order.request_id,
        source_pod=order.source_pod,
        target_pod=order.target_pod,
        mode=MoveMode(mode),
        expected_bytes=order.size_bytes,
        expected_tokens=order.tokens,
        # The planner's reasons are the model's (a Literal); a reason it does not know fails here,
        # as the API server's enum would refuse it.
        reason=cast(MigrationReason, order.reason if attempt == 1 else "Retry"),
        epoch=epoch,
    )
    return {
        "apiVersion": API_VERSION,
        "kind": "KVMigration",
        "metadata": {
            "name": migration_name(name, order.request_id, attempt),
            "labels": {**MANAGED_BY, POOL_LABEL: name, REQUEST_LABEL: request_hash(order.request_id)},
            "ownerReferences": [owner_reference(pool)],
        },
        "spec": spec.to_wire(),
    }


def failed_status(message: str, now: dt.datetime) -> dict[str, Any]:
    """The status patch the operator writes on a KVMigration it gives up on (timed out, source gone)."""
    return KVMigrationStatus(phase="Failed", completion_time=now, message=message).to_wire()


def admit_by_room(orders: Sequence[MoveOrder], reports: Mapping[str, KVLoadReport | None],
                  in_flight: Mapping[str, str], sizes: Mapping[str, int]) -> tuple[list[MoveOrder], int]:
    """The orders whose target has room for them now, and how many wait for room (ordered again later).

    MELL plans a move into a GPU's room as it will be once its own planned moves out are done, but an
    engine can only take a request into blocks that are free now: a destination refuses a stage it
    has no room for (`reserve_kv`), and a token move into a full engine queues there. Ordering such a
    move only makes a Failed KVMigration (and a retry each epoch). A target's free room is its
    reported capacity less the KV of every request it reports (running and queued: queued work takes
    the next free blocks first), less the blocks it lent to other workers (DistKV) and less the moves
    already heading to it that it does not report yet; the orders are admitted in turn while they
    fit. A target without a report is not gated.

    The report is up to an epoch old when the move lands, and every request running there has kept
    decoding: where the report gives the block size, one block per running request is kept back for
    that growth (a request needs a new block every block-size tokens), so a move is not ordered into
    room that the target's own requests are about to take (the target would refuse it).
    """
    reported = {pod: {r.id for r in report.requests} for pod, report in reports.items() if report is not None}
    room: dict[str, int] = {
        # Blocks it lent (DistKV) are not room either: its debtors read them.
        pod: report.capacity_bytes - sum(r.kv_bytes for r in report.requests) - (report.lent_bytes or 0)
        - _growth_margin_bytes(report)
        for pod, report in reports.items() if report is not None
    }
    for request_id, target in in_flight.items():
        if target in room and request_id not in reported[target]:
            room[target] -= sizes.get(request_id, 0)
    admitted: list[MoveOrder] = []
    waiting = 0
    for order in orders:
        free = room.get(order.target_pod)
        if free is None:
            admitted.append(order)
        elif order.size_bytes <= free:
            room[order.target_pod] = free - order.size_bytes
            admitted.append(order)
        else:
            waiting += 1
    return admitted, waiting


def _growth_margin_bytes(report: KVLoadReport) -> int:
    """One KV block for each request the report shows running (queued ones hold no blocks yet)."""
    running = [r for r in report.requests if not r.queued and r.tokens > 0]
    kv_bytes_per_token = report.kv_bytes_per_token()
    if report.block_size_tokens is None or kv_bytes_per_token is None:
        return 0
    return len(running) * report.block_size_tokens * kv_bytes_per_token


def choose_modes(spec: LLMPoolSpec, orders: Sequence[MoveOrder], node_of_pod: Mapping[str, str],
                 epoch_s: float, reports: Mapping[str, KVLoadReport | None] | None = None,
                 ) -> tuple[list[tuple[MoveOrder, str]], int]:
    """Each order with its mode (`kv`, `token` or `hybrid`), and how many are deferred to the next epoch.

    A pool with a fixed mode uses it for every move. `adaptive` runs MELL's §V global two-bin packing
    (kvfleet.mell.migration) over one epoch: a move goes whole to its link (KV) or its target
    (tokens), else splits into full blocks over the link and a re-prefilled tail (hybrid), else waits
    and the scheduler orders it again.

    The pool's boundaries are the caps; the workers' reports (by pod name) refine them with what was
    measured (§V, "Boundary Profiling"): a link's budget is the smaller of the communication boundary
    and the slowest copy rate reported by a source sending over it, a target's the smaller of the
    computation boundary and its reported re-prefill rate. A worker measures its link only as a
    whole (its last copy, whatever the peer), so that figure stands for every link it sends on.
    Hybrid needs the engine's block size, from the reports; without one no move is split.
    """
    if spec.migration.mode != "adaptive":
        return [(order, spec.migration.mode) for order in orders], 0
    reports = reports or {}
    link_bytes = int(quantity_bytes(spec.migration.communication_boundary_bytes_per_second) * epoch_s)
    boundaries = Boundaries(intra_node_link_bytes=link_bytes, inter_node_link_bytes=link_bytes,
                            instance_prefill_tokens=int(spec.migration.computation_boundary_tokens_per_second * epoch_s))
    per_token = [o.size_bytes // o.tokens for o in orders if o.tokens > 0]
    kv_bytes_per_token = max(1, max(per_token, default=1))

    def locate(pod: str) -> Location:
        return Location(node_of_pod.get(pod, pod), "")

    measured_link: dict[str, int] = {}
    measured_prefill: dict[str, int] = {}
    for o in orders:
        source, target = reports.get(o.source_pod), reports.get(o.target_pod)
        if source is not None and source.link_bytes_per_second is not None:
            link = link_of(locate(o.source_pod), locate(o.target_pod))
            rate_bytes = int(source.link_bytes_per_second * epoch_s)
            measured_link[link] = min(measured_link.get(link, rate_bytes), rate_bytes)
        if target is not None and target.prefill_tokens_per_second is not None:
            measured_prefill[o.target_pod] = int(target.prefill_tokens_per_second * epoch_s)
    # One engine and model per pool, so one block size; the largest reported is the safe one should
    # workers disagree mid-rollout (a coarser block only shrinks what a hybrid move sends as KV).
    block_size_tokens = max((r.block_size_tokens for r in reports.values()
                             if r is not None and r.block_size_tokens is not None), default=None)

    by_request = {o.request_id: o for o in orders}
    moves = [Migration(o.request_id, o.source_pod, o.target_pod, o.size_bytes, o.reason) for o in orders]
    schedule = plan_migrations(moves, locate, kv_bytes_per_token, boundaries, block_size_tokens=block_size_tokens,
                               measured_link_bytes=measured_link, measured_prefill_tokens=measured_prefill)
    # A hybrid move's KVMigration expects only its planned full blocks as KV bytes (expectedBytes).
    chosen = [(replace(by_request[c.migration.request_id], size_bytes=c.kv_bytes) if c.mode is MoveMode.HYBRID
               else by_request[c.migration.request_id], c.mode.value) for c in schedule.scheduled]
    return chosen, len(schedule.deferred)
