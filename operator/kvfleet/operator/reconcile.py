"""One pass over one LLMPool: the pool's MELL epoch, as the list of steps `reconcile_pool` runs.

Level-triggered: every pass reads the pool and its pods, decides with the pure modules (epoch: MELL;
migrations: which KVMigrations; pods: which worker pods; status: the status), writes only the
difference, and writes status only when it changed. The one thing kept between passes is the
pool's scheduler (`PoolState`, in the operator's `PoolStates`: kvfleet.operator.runtime), and it is
rebuilt from the pods' reports whenever it is missing, so a restarted operator carries on where the
last one stopped. The cluster is reached only through kvfleet.operator.kube.KubeApi. What a pass
writes on its LLMPool's status and on KVMigrations goes through their models (kvfleet.api.models).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvfleet.api.models import Condition, LLMPoolSpec, LLMPoolStatus
from kvfleet.api.quantity import format_bytes
from kvfleet.api.reports import KVLoadReport, pool_reports
from kvfleet.api.scheduling import scheduler_config
from kvfleet.mell import PolicyConfig
from kvfleet.operator import distkv, epoch, metrics, migrations, pods, prefill, resources
from kvfleet.operator.epoch import EpochOutcome, MoveOrder, PoolScheduler
from kvfleet.operator.kube import KubeApi
from kvfleet.operator.owned import reconcile_owned
from kvfleet.operator.status import SchedulingFigures, floor_workers, held_requests, pool_status

Logger = logging.Logger | logging.LoggerAdapter[Any]

# A daemon that cannot reach the API server retries this soon, not after a whole epoch.
RETRY_S = 2.0
# How long a pass trusts the last check of the pool's owned objects (check_owned).
OWNED_CHECK_S = 10.0


def now_utc() -> dt.datetime:
    """Now, to the second: the models write it as now_rfc3339() does."""
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PoolState:
    """What the operator keeps in memory for a pool: the scheduler, rebuildable from the cluster.

    Mutable: one pool's daemon thread updates it every epoch, and nothing else touches it.
    """

    uid: str
    key: tuple[str, PolicyConfig]  # (policy, its knobs): a change rebuilds the scheduler
    scheduler: PoolScheduler
    epoch: int = 0
    routes: dict[str, str] | None = None
    counted_migrations: set[str] = field(default_factory=set)
    last_writes: dict[str, int] = field(default_factory=dict)


class PoolStates:
    """The operator's `PoolState` of each pool, by (namespace, name); one per operator (kvfleet.operator.runtime).

    Mutable: each pool's daemon thread reads and replaces only its own pool's entry.
    """

    def __init__(self) -> None:
        self._by_pool: dict[tuple[str, str], PoolState] = {}
        # When each pool's owned objects were last checked: (pool uid and generation, monotonic s, router Ready).
        self.owned_checks: dict[tuple[str, str], tuple[tuple[str, int], float, bool]] = {}

    def get(self, namespace: str, name: str) -> PoolState | None:
        """The pool's in-memory state, if a pass has made one."""
        return self._by_pool.get((namespace, name))

    def put(self, namespace: str, name: str, state: PoolState) -> None:
        self._by_pool[(namespace, name)] = state

    def forget(self, namespace: str, name: str) -> None:
        """Drop the pool's in-memory state: the next pass rebuilds it from the cluster, as after a restart."""
        self._by_pool.pop((namespace, name), None)
        self.owned_checks.pop((namespace, name), None)


@dataclass(frozen=True)
class PassContext:
    """What every step of one pass works on: where to write, the pool as read, its parsed spec."""

    api: KubeApi
    namespace: str
    name: str
    pool: dict[str, Any]
    spec: LLMPoolSpec
    logger: Logger


@dataclass(frozen=True)
class Observed:
    """The pool's workers and migrations as one pass read them."""

    now_s: float
    raw_pods: list[dict[str, Any]]
    infos: list[pods.PodInfo]  # the pool's MELL worker pods (decode workers if disaggregated), live or not
    node_of_pod: dict[str, str]
    workers: list[epoch.WorkerView]  # the live workers, as the scheduler sees them
    view: migrations.MigrationView
    # A disaggregated pool's prefill workers, live or not, and the reports of the live ones: never MELL's.
    prefill_infos: list[pods.PodInfo] = field(default_factory=list)
    prefill_reports: list[KVLoadReport] = field(default_factory=list)


@dataclass(frozen=True)
class PlannedMoves:
    """The KVMigrations one epoch ordered."""

    chosen: list[tuple[MoveOrder, str]]  # (order, mode), including those a previous pass had created already
    targets: set[str]  # pods a migration is heading to: in flight, or created now
    num_deferred: int  # by the migration planner, to a later epoch
    num_waiting_room: int  # for room on their target
    moving: set[str] = field(default_factory=set)  # sources and targets of unfinished moves, and of those created now


def reconcile_pool(namespace: str, name: str, logger: Logger, api: KubeApi, states: PoolStates) -> float:
    """One level-triggered pass over a pool (one MELL epoch), keeping its scheduler in `states`.
    Returns the seconds until the next pass."""
    started_s = time.monotonic()
    pool = api.get_pool(namespace, name)
    if pool is None or pool["metadata"].get("deletionTimestamp"):
        states.forget(namespace, name)
        return RETRY_S
    spec = parse_spec(api, namespace, name, pool)
    if spec is None:
        return RETRY_S * 5
    ctx = PassContext(api, namespace, name, pool, spec, logger)
    phases = Phases(started_s)
    router_ready = check_owned(ctx, states)
    observed = read_observed(ctx)
    settle_migrations(ctx, observed.view)
    phases.mark("read")
    state = scheduler_state(ctx, states, observed.workers)
    outcome = run_scheduler(state, observed)
    count_finished_migrations(state, namespace, name, observed.view.finished)
    distkv_status = run_gmanager(ctx, observed)
    phases.mark("plan")
    planned = write_migrations(ctx, state, observed, outcome)
    phases.mark("moves")
    table = epoch.routing_table(state.routes or {}, observed.workers)
    held = held_requests(pool, time.time())
    demand = prefill.demand_of(spec, observed.prefill_reports,
                               [w.report for w in observed.workers if w.report is not None],
                               sum(1 for i in observed.prefill_infos if i.live))
    desired_prefill = prefill.desired_for_pool(spec, demand)
    actions = plan_pods(ctx, observed, outcome, planned, table, held)
    actions = pods.merged(actions, pods.plan_prefill_pods(
        observed.prefill_infos, desired=desired_prefill, scale_down_delay_s=spec.autoscaling.scale_down_delay_seconds,
        now_s=observed.now_s))
    woken_at = note_wake(ctx, observed, actions, held)
    raw_pods = write_pods(ctx, actions, observed.raw_pods)
    phases.mark("pods")
    figures = SchedulingFigures(
        gpus_in_use=outcome.active_gpus,
        lower_bound_gpus=outcome.lower_bound_gpus,
        used_bytes=outcome.used_bytes,
        migrations_in_flight=len(observed.view.in_flight) + len(planned.chosen),
        waiting_for_max=len(actions.waiting_for_max),
        capacity_bytes=state.scheduler.config.capacity_bytes,
        cpu_buffer_bytes=sum(w.report.cpu_buffer_bytes or 0 for w in observed.workers if w.report is not None),
        held_requests=held,
        woken_at=woken_at,
        desired_prefill_workers=desired_prefill,
        kv_transfers=prefill.kv_transfers(observed.prefill_reports),
    )
    status = write_status(ctx, raw_pods, figures, table, router_ready, distkv_status)
    phases.mark("status")
    log_epoch(ctx, state, outcome, planned, actions, phases)
    record_metrics(ctx, state, status, outcome, figures, started_s)
    return spec.scheduling.epoch_seconds


def check_owned(ctx: PassContext, states: PoolStates) -> bool:
    """The pool's owned objects (Secret, workers' RBAC, headroom, router: owned.reconcile_owned), checked
    when the spec changed, while the router is not Ready yet, and otherwise every OWNED_CHECK_S; True
    when a router replica is Ready (as last checked).

    Those checks are about ten reads made one after another, and on an API server loaded by a large
    pool's reports each waits on the order of 100 ms (docs/scale.md): every pass paid a second for
    objects that change when a person changes them. A deleted one is made again within OWNED_CHECK_S."""
    meta = ctx.pool["metadata"]
    version = (str(meta.get("uid", "")), int(meta.get("generation") or 0))
    last = states.owned_checks.get((ctx.namespace, ctx.name))
    now_s = time.monotonic()
    if last is not None and last[0] == version and last[2] and now_s - last[1] < OWNED_CHECK_S:
        return True
    ready = reconcile_owned(ctx.api, ctx.namespace, ctx.pool, ctx.spec)
    states.owned_checks[(ctx.namespace, ctx.name)] = (version, now_s, ready)
    return ready


def parse_spec(api: KubeApi, namespace: str, name: str, pool: dict[str, Any]) -> LLMPoolSpec | None:
    """The pool's spec, or None after saying in its status (Degraded, InvalidSpec) why it is invalid."""
    try:
        return LLMPoolSpec.model_validate(pool.get("spec") or {})
    except ValidationError as err:
        # The API server's schema should have refused this; say so instead of crashing every epoch.
        status = LLMPoolStatus(observed_generation=pool["metadata"].get("generation"), conditions=[
            Condition(type="Degraded", status="True", reason="InvalidSpec", message=str(err)[:2000],
                      last_transition_time=now_utc())]).to_wire()
        if (pool.get("status") or {}).get("conditions") != status["conditions"]:
            api.patch_status(namespace, name, status)
        return None


def read_observed(ctx: PassContext) -> Observed:
    """Read the worker pods, their KV-load reports (kvfleet.api.reports.pool_reports), the nodes' zones
    and the pool's KVMigrations. A disaggregated pool's prefill workers are kept apart from the first
    read on: they never become WorkerViews, so MELL, the routing table, the lower bound, the planned
    capacity and GPU binding never see them."""
    now_s = time.time()
    raw_pods = ctx.api.worker_pods(ctx.namespace, ctx.name)
    reports = pool_reports(ctx.api.list_kvloads(ctx.namespace, ctx.name), raw_pods)
    infos = [info for p in raw_pods if (info := pods.pod_info(p, reports.get(p["metadata"]["name"]))) is not None]
    prefill_infos = [info for p in raw_pods
                     if (info := pods.prefill_pod_info(p, reports.get(p["metadata"]["name"]))) is not None]
    prefill_reports = [report for i in prefill_infos if i.live and (report := reports.get(i.name)) is not None]
    node_of_pod = {p["metadata"]["name"]: p["spec"].get("nodeName") or "" for p in raw_pods}
    zones = ctx.api.node_zones(set(node_of_pod.values()))
    ip_of_pod = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") or "" for p in raw_pods}
    workers = [
        epoch.WorkerView(i.name, i.gpu_id, i.index, node_of_pod[i.name], zones.get(node_of_pod[i.name], ""), i.ready,
                         reports.get(i.name), ip_of_pod[i.name])
        for i in infos if i.live
    ]
    reported_on: dict[str, list[str]] = {}
    for worker in workers:
        for req in worker.report.requests if worker.report else []:
            reported_on.setdefault(req.id, []).append(worker.pod_name)
    pods_started_s = {p["metadata"]["name"]: migrations.worker_started_s(p) for p in raw_pods}
    view = migrations.view(ctx.api.list_migrations(ctx.namespace, ctx.name), ctx.spec, now_s, reported_on, pods_started_s)
    return Observed(now_s, raw_pods, infos, node_of_pod, workers, view, prefill_infos, prefill_reports)


def settle_migrations(ctx: PassContext, view: migrations.MigrationView) -> None:
    """Mark the KVMigrations that ran out of time Failed (the scheduler retries them) and delete expired ones."""
    for mig_name in view.timed_out:
        ctx.api.patch_migration_status(ctx.namespace, mig_name, migrations.failed_status(
            f"not finished within migration.timeoutSeconds={ctx.spec.migration.timeout_seconds}", now_utc()))
        ctx.api.post_event(ctx.pool, "MigrationTimedOut", f"{mig_name} timed out; the scheduler will retry it", warning=True)
    for mig_name in view.source_gone:
        # The source wrote no final status because it died; its request lives on only where the
        # router resumed it (by re-prefill), which the next reports show.
        ctx.api.patch_migration_status(ctx.namespace, mig_name, migrations.failed_status(
            "the source worker is gone: its process died or its pod was deleted before the move finished", now_utc()))
        ctx.api.post_event(ctx.pool, "MigrationSourceLost", f"{mig_name} failed: its source pod is gone", warning=True)
    for mig_name in view.expired:
        ctx.api.delete_migration(ctx.namespace, mig_name)


def scheduler_state(ctx: PassContext, states: PoolStates, workers: list[epoch.WorkerView]) -> PoolState:
    """The pool's state, rebuilt from the workers' reports when missing, for another pool of that name,
    or after any change of policy or of its knobs (capacity, weights); re-planned when the capacity the
    workers report moves away from the one it plans with (epoch.capacity_to_plan)."""
    key = (ctx.spec.scheduling.policy, scheduler_config(ctx.spec))
    state = states.get(ctx.namespace, ctx.name)
    reported = epoch.reported_capacity_bytes(workers)
    if state is None or state.uid != ctx.pool["metadata"]["uid"] or state.key != key:
        capacity = reported or key[1].capacity_bytes
        scheduler = PoolScheduler.rebuild(key[0], dataclasses.replace(key[1], capacity_bytes=capacity), workers)
        state = PoolState(ctx.pool["metadata"]["uid"], key, scheduler)
        states.put(ctx.namespace, ctx.name, state)
        ctx.logger.info("scheduler state rebuilt from %d workers (KV capacity per worker %d bytes)", len(workers), capacity)
        return state
    planned = state.scheduler.config.capacity_bytes
    capacity = epoch.capacity_to_plan(planned, reported)
    if capacity != planned:
        state.scheduler = state.scheduler.replanned(capacity, workers)
        state.routes = None
        message = (f"KV capacity per worker now {format_bytes(capacity)} (was {format_bytes(planned)}), "
                   "the smallest the workers report")
        ctx.logger.info("%s", message)
        ctx.api.post_event(ctx.pool, "CapacityChanged", message)
    return state


def run_scheduler(state: PoolState, observed: Observed) -> EpochOutcome:
    """One epoch of the pool's policy over the reports; the routing table is previewed again when it may have changed."""
    outcome = state.scheduler.epoch(observed.workers, observed.view.in_flight, observed.now_s)
    state.epoch += 1
    if outcome.num_events or outcome.moves or state.routes is None:
        state.routes = state.scheduler.routes()
    return outcome


def run_gmanager(ctx: PassContext, observed: Observed) -> dict[str, Any] | None:
    """DistKV's gManager (kvfleet.operator.distkv): the ledger and DGFM over the reports, as
    `status.distkv` (with the recalls the workers carry out when spec.distkv.dgfm is true); None
    when the pool does not use DistKV. A `DebtCycle` Event when DGFM's finding changes (not every epoch
    while the same cycles stand: the workers' reports take a moment to show a swap done)."""
    if not ctx.spec.distkv.enabled:
        return None
    previous = ctx.pool.get("status")
    plan = distkv.plan(observed.workers, f"{ctx.namespace}/{ctx.name}", execute=ctx.spec.distkv.dgfm,
                       previous_status=previous)
    if plan.dgfm.swaps and distkv.dgfm_changed(previous, plan.status):
        message = distkv.cycle_message(plan.dgfm, plan.ledger.block_bytes, ctx.spec.distkv.dgfm)
        ctx.logger.info("%s", message)
        ctx.api.post_event(ctx.pool, distkv.EVENT_REASON, message)
    return plan.status


def count_finished_migrations(state: PoolState, namespace: str, name: str,
                              finished: Mapping[str, migrations.ListedMigration]) -> None:
    """Count each finished KVMigration once (by name) in the migration counters."""
    for mig_name, mig in finished.items():
        if mig_name in state.counted_migrations:
            continue
        mode = mig.spec.mode.value
        result = mig.phase
        metrics.MIGRATIONS_FINISHED.labels(namespace, name, mode, result).inc()
        if result == "Succeeded":
            metrics.MIGRATION_BYTES.labels(namespace, name, mode).inc(mig.status.bytes_moved)
    state.counted_migrations = set(finished)


def write_migrations(ctx: PassContext, state: PoolState, observed: Observed, outcome: EpochOutcome) -> PlannedMoves:
    """Create a KVMigration for each move whose target has room now, in the mode the migration planner picks."""
    reports = {w.pod_name: w.report for w in observed.workers}
    view = observed.view
    orders, num_waiting_room = migrations.admit_by_room(outcome.moves, reports, view.in_flight, state.scheduler.sizes)
    chosen, num_deferred = migrations.choose_modes(ctx.spec, orders, observed.node_of_pod,
                                                   ctx.spec.scheduling.epoch_seconds, reports)
    targets = set(view.in_flight.values())
    moving = set(view.moving)
    made: list[str] = []
    for order, mode in chosen:
        attempt = view.attempts.get(order.request_id, 0) + 1
        if ctx.api.create_migration(ctx.namespace, migrations.migration_body(ctx.pool, order, mode, attempt, state.epoch)):
            made.append(order.request_id)
            targets.add(order.target_pod)
            moving.update((order.source_pod, order.target_pod))
            metrics.MIGRATIONS_PLANNED.labels(ctx.namespace, ctx.name, mode, order.reason).inc()
            ctx.api.post_event(ctx.pool, "MigrationPlanned",
                               f"{order.request_id}: {order.source_pod} -> {order.target_pod} ({mode}, {order.reason})")
    state.scheduler.ordered(made, observed.now_s)  # the 30 s between a request's moves count from here
    return PlannedMoves(chosen, targets, num_deferred, num_waiting_room, moving)


def plan_pods(ctx: PassContext, observed: Observed, outcome: EpochOutcome, planned: PlannedMoves,
              table: list[dict[str, str]], held: int = 0) -> pods.PodActions:
    """Which worker pods to create, delete or relabel for the epoch's outcome (kvfleet.operator.pods).

    A pool whose floor is zero goes to zero: its last idle worker is in the routing table (the router
    would send the next request there), and that must not keep it; the router holds what comes while
    it has no Ready worker, and `held` (its count on the pool) raises the floor to one at once."""
    spec = ctx.spec
    floor = floor_workers(spec, held)
    return pods.plan_pods(
        observed.infos,
        unserved_gpu_ids=outcome.unserved_gpu_ids,
        released_pods=outcome.released_pods,
        migration_targets=planned.targets,
        moving=planned.moving,
        routed={entry["worker"] for entry in table} if floor > 0 else set(),
        floor=floor,
        max_workers=spec.workers.max,
        scale_down_delay_s=spec.autoscaling.scale_down_delay_seconds,
        now_s=observed.now_s,
    )


def note_wake(ctx: PassContext, observed: Observed, actions: pods.PodActions, held: int) -> str | None:
    """When requests held by the router make a pool without a live worker start one: an Event, and the
    time for the status (`lastWokenAt`)."""
    if not held or not actions.create or any(info.live for info in observed.infos):
        return None
    ctx.api.post_event(ctx.pool, "WakingUp", f"the router holds {held} request(s) and the pool has no worker: "
                                             f"starting {len(actions.create)}")
    ctx.logger.info("waking %s from zero workers for %d held request(s)", ctx.name, held)
    return now_rfc3339()


def write_pods(ctx: PassContext, actions: pods.PodActions, raw_pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Create, delete and relabel worker pods (prefill workers too). Returns the worker pods after the
    writes (read again only when some were created or deleted)."""
    api, namespace = ctx.api, ctx.namespace
    for index, gpu_id in actions.create:
        if api.create(namespace, resources.worker_pod(ctx.pool, ctx.spec, index, gpu_id)):
            ctx.logger.info("created worker %s for %s", resources.worker_name(ctx.name, index), gpu_id or "the floor")
    for index in actions.create_prefill:
        if api.create(namespace, resources.prefill_pod(ctx.pool, ctx.spec, index)):
            ctx.logger.info("created prefill worker %s", resources.prefill_name(ctx.name, index))
    for pod_name in actions.delete:
        api.delete_pod(namespace, pod_name)
        ctx.logger.info("deleted worker %s", pod_name)
    if actions.metadata:
        api.patch_pods_metadata(namespace, actions.metadata)
    if actions.create:
        api.post_event(ctx.pool, "ScaleUp", f"created {len(actions.create)} worker pod(s)")
    if actions.create_prefill:
        api.post_event(ctx.pool, "ScaleUp", f"created {len(actions.create_prefill)} prefill worker pod(s)")
    if actions.delete:
        api.post_event(ctx.pool, "ScaleDown", f"deleted worker pod(s) {', '.join(actions.delete)}")
    if actions.create or actions.create_prefill or actions.delete:
        return api.list_worker_pods(namespace, ctx.name)  # read now: a watch cache may not have them yet
    return raw_pods


def write_status(ctx: PassContext, raw_pods: list[dict[str, Any]], figures: SchedulingFigures,
                 table: list[dict[str, str]], router_ready: bool, distkv_status: dict[str, Any] | None = None,
                 ) -> dict[str, Any]:
    """The pool's status (kvfleet.operator.status.pool_status plus the routing table and, under DistKV,
    `distkv`), written only if it changed. `LLMPoolStatus` (what the router and kubectl read it as)
    checks it first: a key the model does not know, or a value it refuses, is an error here rather
    than a field the API server prunes or a status it refuses."""
    status = pool_status(ctx.pool, ctx.spec, raw_pods, figures, now_rfc3339(), router_ready=router_ready)
    status["routingTable"] = table
    current = ctx.pool.get("status") or {}
    if distkv_status is not None or current.get("distkv") is not None:
        # Absent without DistKV: None removes what an earlier pass wrote (the status write is a merge patch).
        status["distkv"] = distkv_status
    LLMPoolStatus.model_validate(status)
    if any(current.get(k) != v for k, v in status.items()):
        ctx.api.patch_status(ctx.namespace, ctx.name, status)
    return status


class Phases:
    """Where a pass's wall time went: the milliseconds from one mark to the next, by name."""

    def __init__(self, started_s: float) -> None:
        self.started_s = self._last_s = started_s
        self.ms: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now_s = time.monotonic()
        self.ms[name] = (now_s - self._last_s) * 1000
        self._last_s = now_s

    def __str__(self) -> str:
        return ", ".join(f"{name} {ms:.0f}" for name, ms in self.ms.items())


def log_epoch(ctx: PassContext, state: PoolState, outcome: EpochOutcome, planned: PlannedMoves,
              actions: pods.PodActions, phases: Phases) -> None:
    """One line for an epoch that changed something; a quiet epoch logs nothing."""
    if outcome.num_events or planned.chosen or actions.create or actions.create_prefill or actions.delete:
        # Which labels and annotations the epoch rewrites on how many pods: the pass waits for those writes.
        keys = Counter(key.rsplit("/", 1)[-1] for labels, notes in actions.metadata.values() for key in (*labels, *notes))
        ctx.logger.info("epoch %d: %d events, %d moves (%d deferred by the migration planner, %d waiting for targets, "
                        "%d for room on them), %d GPUs in use, lower bound %d; %d pods rewritten (%s); %.0f ms (%s)",
                        state.epoch,
                        outcome.num_events, len(planned.chosen), planned.num_deferred, outcome.num_deferred_moves,
                        planned.num_waiting_room, outcome.active_gpus, outcome.lower_bound_gpus, len(actions.metadata),
                        ", ".join(f"{key} {count}" for key, count in sorted(keys.items())) or "none",
                        (time.monotonic() - phases.started_s) * 1000, phases)


def record_metrics(ctx: PassContext, state: PoolState, status: Mapping[str, Any], outcome: EpochOutcome,
                   figures: SchedulingFigures, started_s: float) -> None:
    """The pool's gauges, the epoch's duration, and its writes (kept in `state.last_writes` too)."""
    labels = (ctx.namespace, ctx.name)
    metrics.GPUS_DESIRED.labels(*labels).set(status["desiredWorkers"])
    metrics.GPUS_ACTIVE.labels(*labels).set(outcome.active_gpus)
    metrics.GPUS_LOWER_BOUND.labels(*labels).set(outcome.lower_bound_gpus)
    metrics.WORKERS_READY.labels(*labels).set(status["readyWorkers"])
    metrics.KV_USED.labels(*labels).set(outcome.used_bytes)
    metrics.KV_UTILIZATION.labels(*labels).set(status["kvUtilizationPercent"] / 100)
    metrics.MIGRATIONS_IN_FLIGHT.labels(*labels).set(figures.migrations_in_flight)
    metrics.EPOCH_SECONDS.labels(*labels).observe(time.monotonic() - started_s)
    state.last_writes = ctx.api.writes()
    for kind, count in state.last_writes.items():
        metrics.API_WRITES.labels(*labels, kind).inc(count)
