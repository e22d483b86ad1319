"""kopf handlers: one daemon per LLMPool that reconciles it every epoch, poked early by changes.

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
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from kvfleet.api.models import GROUP, VERSION, LLMPoolSpec
from kvfleet.operator import reconcile, resources

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
    """The few API calls the operator makes, each tolerant of the races a restart or a peer causes."""

    def __init__(self) -> None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.core = client.CoreV1Api()
        self.rbac = client.RbacAuthorizationV1Api()
        self.custom = client.CustomObjectsApi()

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
        }[kind]
        try:
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
        }[kind]
        try:
            read(name, namespace)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    def delete_pod(self, namespace: str, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace)
        except ApiException as err:
            if err.status != 404:
                raise

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}, field_manager=FIELD_MANAGER
        )


_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


def reconcile_pool(namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter[Any]) -> float:
    """One level-triggered pass over a pool. Returns the seconds until the next pass (its epoch)."""
    api = kube()
    pool = api.get_pool(namespace, name)
    if pool is None or pool["metadata"].get("deletionTimestamp"):
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

    pods = api.worker_pods(namespace, name)
    changes = reconcile.plan_workers(pods, reconcile.desired_workers(spec))
    for index in changes.create_indexes:
        if api.create(namespace, resources.worker_pod(pool, spec, index)):
            logger.info("created worker %s", resources.worker_name(name, index))
    for pod_name in changes.delete_names:
        api.delete_pod(namespace, pod_name)
        logger.info("deleted worker %s", pod_name)
    if changes.create_indexes:
        kopf.info(pool, reason="ScaleUp", message=f"created {len(changes.create_indexes)} worker pod(s)")
    if changes.delete_names:
        kopf.info(pool, reason="ScaleDown", message=f"deleted worker pod(s) {', '.join(changes.delete_names)}")
        pods = api.worker_pods(namespace, name)
    elif changes.create_indexes:
        pods = api.worker_pods(namespace, name)

    status = reconcile.pool_status(pool, spec, pods, now_rfc3339())
    current = pool.get("status") or {}
    if any(current.get(key) != value for key, value in status.items()):
        api.patch_status(namespace, name, status)
    return spec.scheduling.epoch_seconds


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


@kopf.on.event("", "v1", "pods", labels={resources.POOL_LABEL: kopf.PRESENT, resources.COMPONENT_LABEL: "worker"})
def worker_changed(namespace: str, labels: dict[str, str], **_: Any) -> None:
    _poke_event(namespace, labels[resources.POOL_LABEL]).set()
