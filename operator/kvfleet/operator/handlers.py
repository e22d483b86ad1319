"""kopf handlers: one daemon per LLMPool that runs its MELL epochs, poked early by changes.

Level-triggered: every pass reads the pool and its pods, computes what should exist with
`kvfleet.operator.reconcile`, writes only the difference, and writes status only when it changed.
Nothing is remembered between passes that the cluster does not hold, so a restarted operator
carries on where the last one stopped. Watch events (the pool, its worker pods) only wake the
daemon sooner; they never carry state.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from kvfleet.api.models import GROUP, VERSION, LLMPoolSpec
from kvfleet.api.reports import KVLoadReport
from kvfleet.mell import SchedulerConfig
from kvfleet.operator import epoch, metrics, migrations, pods, reconcile, resources
from kvfleet.operator.epoch import PoolScheduler

FIELD_MANAGER = "kvfleet-operator"
PLURAL = "llmpools"
# A daemon that cannot reach the API server retries this soon, not after a whole epoch.
RETRY_S = 2.0

_pokes: dict[tuple[str, str], threading.Event] = {}
_pokes_lock = threading.Lock()


def _poke_event(namespace: str, name: str) -> threading.Event:
    with _pokes_lock:
        return _pokes.setdefault((namespace, name), threading.Event())


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kube:
    """The few API calls the operator makes, each tolerant of the races a restart or a peer causes.

    Writes are counted per thread (each pool's daemon is one thread), so an epoch can report its own.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.core = client.CoreV1Api()
        self.rbac = client.RbacAuthorizationV1Api()
        self.custom = client.CustomObjectsApi()
        self.apps = client.AppsV1Api()
        self.scheduling = client.SchedulingV1Api()

    def writes(self) -> dict[str, int]:
        """This thread's write counts by kind since the last call (and resets them)."""
        counts: dict[str, int] = getattr(self._local, "writes", {})
        self._local.writes = {}
        return counts

    def record_write(self, kind: str) -> None:
        counts = getattr(self._local, "writes", None)
        if counts is None:
            counts = self._local.writes = {}
        counts[kind] = counts.get(kind, 0) + 1

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            pool: dict[str, Any] = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            return pool
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def worker_pods(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        listing = self.core.list_namespaced_pod(namespace, label_selector=resources.worker_selector(pool_name))
        return [client.ApiClient().sanitize_for_serialization(p) for p in listing.items]

    def create(self, namespace: str, obj: dict[str, Any]) -> bool:
        """Create unless it exists (409 means a previous pass or operator made it). True if created."""
        kind = obj["kind"]
        create = {
            "Pod": self.core.create_namespaced_pod,
            "Secret": self.core.create_namespaced_secret,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "Deployment": self.apps.create_namespaced_deployment,
            "Service": self.core.create_namespaced_service,
            "PriorityClass": lambda _namespace, body, **kw: self.scheduling.create_priority_class(body, **kw),
        }[kind]
        try:
            self.record_write(f"create_{kind.lower()}")
            create(namespace, obj, field_manager=FIELD_MANAGER)
            return True
        except ApiException as err:
            if err.status == 409:
                return False
            raise

    def exists(self, namespace: str, kind: str, name: str) -> bool:
        read = {
            "Secret": self.core.read_namespaced_secret,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Role": self.rbac.read_namespaced_role,
            "RoleBinding": self.rbac.read_namespaced_role_binding,
            "Service": self.core.read_namespaced_service,
            "PriorityClass": lambda name, _namespace: self.scheduling.read_priority_class(name),
        }[kind]
        try:
            read(name, namespace)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    def deployment_replicas(self, namespace: str, name: str) -> int | None:
        """The replicas of a Deployment, or None when it does not exist."""
        try:
            return int(self.apps.read_namespaced_deployment(name, namespace).spec.replicas or 0)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def deployment_image_and_ready(self, namespace: str, name: str) -> tuple[str, int] | None:
        """The first container's image and the ready replicas of a Deployment, or None when it does not exist."""
        try:
            deployment = self.apps.read_namespaced_deployment(name, namespace)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return str(deployment.spec.template.spec.containers[0].image), int(deployment.status.ready_replicas or 0)

    def replace_deployment_template(self, namespace: str, body: dict[str, Any]) -> None:
        """Roll a Deployment to the pod template of `body` (a merge patch of its spec.template)."""
        self.record_write("patch_deployment")
        self.apps.patch_namespaced_deployment(body["metadata"]["name"], namespace, {"spec": {"template": body["spec"]["template"]}},
                                              field_manager=FIELD_MANAGER)

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        self.record_write("patch_deployment")
        self.apps.patch_namespaced_deployment(name, namespace, {"spec": {"replicas": replicas}}, field_manager=FIELD_MANAGER)

    def delete_deployment(self, namespace: str, name: str) -> None:
        self.record_write("delete_deployment")
        try:
            self.apps.delete_namespaced_deployment(name, namespace)
        except ApiException as err:
            if err.status != 404:
                raise

    def delete_pod(self, namespace: str, name: str) -> None:
        self.record_write("delete_pod")
        try:
            self.core.delete_namespaced_pod(name, namespace)
        except ApiException as err:
            if err.status != 404:
                raise

    def node_zones(self) -> dict[str, str]:
        """Node name -> zone label, for MELL's distance term and the migration planner's links."""
        zone_label = "topology.kubernetes.io/zone"
        return {n.metadata.name: (n.metadata.labels or {}).get(zone_label, "") for n in self.core.list_node().items}

    def patch_pod_metadata(self, namespace: str, name: str, labels: Mapping[str, str | None],
                           annotations: Mapping[str, str | None]) -> None:
        body: dict[str, Any] = {"metadata": {}}
        if labels:
            body["metadata"]["labels"] = dict(labels)
        if annotations:
            body["metadata"]["annotations"] = dict(annotations)
        self.record_write("patch_pod")
        try:
            self.core.patch_namespaced_pod(name, namespace, body, field_manager=FIELD_MANAGER)
        except ApiException as err:
            if err.status != 404:
                raise

    def list_migrations(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        listing = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "kvmigrations",
                                                            label_selector=f"{resources.POOL_LABEL}={pool_name}")
        return list(listing.get("items", []))

    def create_migration(self, namespace: str, body: dict[str, Any]) -> bool:
        self.record_write("create_kvmigration")
        try:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "kvmigrations", body,
                                                        field_manager=FIELD_MANAGER)
            return True
        except ApiException as err:
            if err.status == 409:
                return False
            raise

    def patch_migration_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.record_write("patch_kvmigration_status")
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "kvmigrations", name,
                                                          {"status": status}, field_manager=FIELD_MANAGER)

    def delete_migration(self, namespace: str, name: str) -> None:
        self.record_write("delete_kvmigration")
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "kvmigrations", name)
        except ApiException as err:
            if err.status != 404:
                raise

    def post_event(self, pool: dict[str, Any], reason: str, message: str, warning: bool = False) -> None:
        """A Kubernetes Event on the pool (posted by kopf), counted as a write of the epoch."""
        self.record_write("event")
        (kopf.warn if warning else kopf.info)(pool, reason=reason, message=message)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.record_write("patch_llmpool_status")
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}, field_manager=FIELD_MANAGER
        )


_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


@dataclass
class PoolState:
    """What the operator keeps in memory for a pool: the scheduler, rebuildable from the cluster."""

    uid: str
    key: tuple[str, SchedulerConfig]  # (policy, its knobs): a change rebuilds the scheduler
    scheduler: PoolScheduler
    epoch: int = 0
    routes: dict[str, str] | None = None
    counted_migrations: set[str] = field(default_factory=set)
    last_writes: dict[str, int] = field(default_factory=dict)


_states: dict[tuple[str, str], PoolState] = {}


def reconcile_pool(namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter[Any],
                   api: Kube | None = None) -> float:
    """One level-triggered pass over a pool (one MELL epoch). Returns the seconds until the next pass."""
    api = api or kube()
    started_s = time.monotonic()
    pool = api.get_pool(namespace, name)
    if pool is None or pool["metadata"].get("deletionTimestamp"):
        _states.pop((namespace, name), None)
        return RETRY_S
    try:
        spec = LLMPoolSpec.model_validate(pool.get("spec") or {})
    except ValidationError as err:
        # The API server's schema should have refused this; say so instead of crashing every epoch.
        status = {"observedGeneration": pool["metadata"].get("generation"), "conditions": [
            {"type": "Degraded", "status": "True", "reason": "InvalidSpec", "message": str(err)[:2000],
             "lastTransitionTime": now_rfc3339()}]}
        if (pool.get("status") or {}).get("conditions") != status["conditions"]:
            api.patch_status(namespace, name, status)
        return RETRY_S * 5

    # Owned objects every worker needs before it starts: the pool token and the workers' RBAC.
    secret_name = resources.token_secret_name(name)
    if not api.exists(namespace, "Secret", secret_name):
        api.create(namespace, resources.token_secret(pool, secrets.token_hex(32)))
    for obj in resources.worker_rbac(pool):
        if not api.exists(namespace, obj["kind"], obj["metadata"]["name"]):
            api.create(namespace, obj)

    reconcile_headroom(api, namespace, pool, spec)
    router_ready = reconcile_router(api, namespace, pool, spec)

    now_s = time.time()
    raw_pods = api.worker_pods(namespace, name)
    infos = [info for p in raw_pods if (info := pods.pod_info(p)) is not None]
    zones = api.node_zones()
    node_of_pod = {p["metadata"]["name"]: p["spec"].get("nodeName") or "" for p in raw_pods}
    workers = [
        epoch.WorkerView(i.name, i.gpu_id, i.index, node_of_pod[i.name], zones.get(node_of_pod[i.name], ""), i.ready,
                         KVLoadReport.from_annotations(i.annotations))
        for i in infos if i.live
    ]

    reported_on: dict[str, list[str]] = {}
    for worker in workers:
        for req in worker.report.requests if worker.report else []:
            reported_on.setdefault(req.id, []).append(worker.pod_name)
    view = migrations.view(api.list_migrations(namespace, name), spec, now_s, reported_on)
    for mig_name in view.timed_out:
        api.patch_migration_status(namespace, mig_name, {
            "phase": "Failed", "completionTime": now_rfc3339(),
            "message": f"not finished within migration.timeoutSeconds={spec.migration.timeout_seconds}"})
        api.post_event(pool, "MigrationTimedOut", f"{mig_name} timed out; the scheduler will retry it", warning=True)
    for mig_name in view.expired:
        api.delete_migration(namespace, mig_name)

    # Any change of policy or of its knobs (capacity, weights) rebuilds the scheduler from the reports.
    key = (spec.scheduling.policy, epoch.scheduler_config(spec))
    state = _states.get((namespace, name))
    if state is None or state.uid != pool["metadata"]["uid"] or state.key != key:
        state = PoolState(pool["metadata"]["uid"], key, PoolScheduler.rebuild(key[0], key[1], workers))
        _states[(namespace, name)] = state
        logger.info("scheduler state rebuilt from %d workers", len(workers))
    outcome = state.scheduler.epoch(workers, view.in_flight, now_s)
    state.epoch += 1
    if outcome.num_events or outcome.moves or state.routes is None:
        state.routes = state.scheduler.routes()
    count_finished_migrations(state, namespace, name, view.finished)

    reports = {w.pod_name: w.report for w in workers}
    orders, num_waiting_room = migrations.admit_by_room(outcome.moves, reports, view.in_flight, state.scheduler.sizes)
    chosen, num_deferred = migrations.choose_modes(spec, orders, node_of_pod, spec.scheduling.epoch_seconds, reports)
    targets = set(view.in_flight.values())
    for order, mode in chosen:
        attempt = view.attempts.get(order.request_id, 0) + 1
        if api.create_migration(namespace, migrations.migration_body(pool, order, mode, attempt, state.epoch)):
            targets.add(order.target_pod)
            metrics.MIGRATIONS_PLANNED.labels(namespace, name, mode, order.reason).inc()
            api.post_event(pool, "MigrationPlanned", f"{order.request_id}: {order.source_pod} -> {order.target_pod} ({mode}, {order.reason})")

    table = routing_table(state.routes or {}, workers)
    actions = pods.plan_pods(
        infos,
        unserved_gpu_ids=outcome.unserved_gpu_ids,
        released_pods=outcome.released_pods,
        migration_targets=targets,
        routed={entry["worker"] for entry in table},
        floor=reconcile.floor_workers(spec),
        max_workers=spec.workers.max,
        scale_down_delay_s=spec.autoscaling.scale_down_delay_seconds,
        now_s=now_s,
    )
    for index, gpu_id in actions.create:
        if api.create(namespace, resources.worker_pod(pool, spec, index, gpu_id)):
            logger.info("created worker %s for %s", resources.worker_name(name, index), gpu_id or "the floor")
    for pod_name in actions.delete:
        api.delete_pod(namespace, pod_name)
        logger.info("deleted worker %s", pod_name)
    for pod_name, (label_changes, annotation_changes) in actions.metadata.items():
        api.patch_pod_metadata(namespace, pod_name, label_changes, annotation_changes)
    if actions.create:
        api.post_event(pool, "ScaleUp", f"created {len(actions.create)} worker pod(s)")
    if actions.delete:
        api.post_event(pool, "ScaleDown", f"deleted worker pod(s) {', '.join(actions.delete)}")
    if actions.create or actions.delete:
        raw_pods = api.worker_pods(namespace, name)

    figures = reconcile.SchedulingFigures(
        gpus_in_use=outcome.active_gpus,
        lower_bound_gpus=outcome.lower_bound_gpus,
        used_bytes=outcome.used_bytes,
        migrations_in_flight=len(view.in_flight) + len(chosen),
        waiting_for_max=len(actions.waiting_for_max),
    )
    status = reconcile.pool_status(pool, spec, raw_pods, figures, now_rfc3339(), router_ready=router_ready)
    status["routingTable"] = table
    current = pool.get("status") or {}
    if any(current.get(k) != v for k, v in status.items()):
        api.patch_status(namespace, name, status)
    if outcome.num_events or chosen or actions.create or actions.delete:
        logger.info("epoch %d: %d events, %d moves (%d deferred by the migration planner, %d waiting for targets, "
                    "%d for room on them), %d GPUs in use, lower bound %d", state.epoch, outcome.num_events, len(chosen),
                    num_deferred, outcome.num_deferred_moves, num_waiting_room, outcome.active_gpus,
                    outcome.lower_bound_gpus)
    labels = (namespace, name)
    metrics.GPUS_DESIRED.labels(*labels).set(status["desiredWorkers"])
    metrics.GPUS_ACTIVE.labels(*labels).set(outcome.active_gpus)
    metrics.GPUS_LOWER_BOUND.labels(*labels).set(outcome.lower_bound_gpus)
    metrics.WORKERS_READY.labels(*labels).set(status["readyWorkers"])
    metrics.KV_USED.labels(*labels).set(outcome.used_bytes)
    metrics.KV_UTILIZATION.labels(*labels).set(status["kvUtilizationPercent"] / 100)
    metrics.MIGRATIONS_IN_FLIGHT.labels(*labels).set(figures.migrations_in_flight)
    metrics.EPOCH_SECONDS.labels(*labels).observe(time.monotonic() - started_s)
    state.last_writes = api.writes()
    for kind, count in state.last_writes.items():
        metrics.API_WRITES.labels(*labels, kind).inc(count)
    return spec.scheduling.epoch_seconds


def reconcile_headroom(api: Kube, namespace: str, pool: dict[str, Any], spec: LLMPoolSpec) -> None:
    """Keep `autoscaling.headroomWorkers` headroom pods (see resources.headroom_deployment)."""
    name = resources.headroom_name(pool["metadata"]["name"])
    want = spec.autoscaling.headroom_workers
    have = api.deployment_replicas(namespace, name)
    if want and have is None:
        if not api.exists(namespace, "PriorityClass", resources.HEADROOM_PRIORITY_CLASS):
            api.create(namespace, resources.headroom_priority_class())
        api.create(namespace, resources.headroom_deployment(pool, spec))
    elif want and have != want:
        api.scale_deployment(namespace, name, want)
    elif not want and have is not None:
        api.delete_deployment(namespace, name)


def reconcile_router(api: Kube, namespace: str, pool: dict[str, Any], spec: LLMPoolSpec) -> bool:
    """Keep the pool's router (resources.router_objects); True when a router replica is Ready.

    Created when missing; the Deployment is rolled when the image derived from the worker template
    changes (a new release), and otherwise left alone, so a person may tune it.
    """
    ready = False
    for obj in resources.router_objects(pool, spec):
        kind, obj_name = obj["kind"], obj["metadata"]["name"]
        if kind == "Deployment":
            observed = api.deployment_image_and_ready(namespace, obj_name)
            if observed is None:
                api.create(namespace, obj)
            elif observed[0] != obj["spec"]["template"]["spec"]["containers"][0]["image"]:
                api.replace_deployment_template(namespace, obj)
            ready = observed is not None and observed[1] > 0
        elif not api.exists(namespace, kind, obj_name):
            api.create(namespace, obj)
    return ready


def count_finished_migrations(state: PoolState, namespace: str, name: str, finished: Mapping[str, dict[str, Any]]) -> None:
    """Count each finished KVMigration once (by name) in the migration counters."""
    for mig_name, obj in finished.items():
        if mig_name in state.counted_migrations:
            continue
        mode = obj["spec"].get("mode", "")
        result = migrations.phase(obj)
        metrics.MIGRATIONS_FINISHED.labels(namespace, name, mode, result).inc()
        if result == "Succeeded":
            metrics.MIGRATION_BYTES.labels(namespace, name, mode).inc((obj.get("status") or {}).get("bytesMoved", 0))
    state.counted_migrations = set(finished)


def routing_table(routes: Mapping[str, str], workers: list[epoch.WorkerView]) -> list[dict[str, str]]:
    """Size class -> the Ready worker pod that should take the next such request (for the router).

    A class routed to a GPU no pod serves yet goes to the oldest warm unbound pod (the next one MELL's
    new GPU would bind), or is left out: the router then picks a worker itself and MELL moves the request.
    """
    pod_of_gpu = {w.gpu_id: w.pod_name for w in workers if w.gpu_id is not None and w.ready}
    spare = sorted((w for w in workers if w.gpu_id is None and w.ready), key=lambda w: w.created_order)
    spare_names = [w.pod_name for w in spare]
    table = []
    for size_class in ("L", "M", "S", "T"):
        gpu_id = routes.get(size_class)
        pod_name = pod_of_gpu.get(gpu_id or "") or (spare_names[0] if spare_names else None)
        if pod_name:
            table.append({"sizeClass": size_class, "worker": pod_name})
    return table


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Watches can stall silently without these (FIELD-NOTES, kopf).
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.connect_timeout = 10
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
def pool_daemon(stopped: kopf.DaemonStopped, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
    """The pool's epoch loop: reconcile, then sleep an epoch or until poked by a change."""
    poke = _poke_event(namespace, name)
    while not stopped:
        poke.clear()
        try:
            wait_s = reconcile_pool(namespace, name, logger)
        except ApiException as err:
            logger.warning("reconcile of %s/%s failed, retrying: %s %s", namespace, name, err.status, err.reason)
            wait_s = RETRY_S
        deadline = time.monotonic() + wait_s
        while not stopped and not poke.is_set() and time.monotonic() < deadline:
            poke.wait(min(0.5, max(0.0, deadline - time.monotonic())))


@kopf.on.event(GROUP, VERSION, PLURAL)
def pool_changed(namespace: str, name: str, **_: Any) -> None:
    _poke_event(namespace, name).set()


_pod_lifecycle: dict[str, tuple[str, bool, bool]] = {}


@kopf.on.event("", "v1", "pods", labels={resources.POOL_LABEL: kopf.PRESENT, resources.COMPONENT_LABEL: "worker"})
def worker_changed(type: str | None, body: kopf.Body, namespace: str, labels: dict[str, str], **_: Any) -> None:
    """Wake the pool when a worker's lifecycle changes (ready, gone), not on every load report:
    reports are read once per epoch, so waking on them would run MELL once per report."""
    uid = body["metadata"]["uid"]
    if type == "DELETED":
        _pod_lifecycle.pop(uid, None)
        _poke_event(namespace, labels[resources.POOL_LABEL]).set()
        return
    pod = dict(body)
    state = (str(pod.get("status", {}).get("phase")), reconcile.is_ready(pod), bool(body["metadata"].get("deletionTimestamp")))
    if _pod_lifecycle.get(uid) != state:
        _pod_lifecycle[uid] = state
        _poke_event(namespace, labels[resources.POOL_LABEL]).set()
