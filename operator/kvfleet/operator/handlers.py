"""kopf wiring: one daemon per LLMPool that runs its epochs (kvfleet.operator.reconcile), poked early by changes.

The daemon runs a pass every `spec.scheduling.epochSeconds`. Watch events (a change of the pool's spec
or held-requests count, its worker pods' lifecycle) only wake it sooner; they never carry state, so a missed event costs at most one epoch.
`python -m kvfleet.operator` imports this module to register the handlers. What the handlers keep
between calls is the process's `Operator` (kvfleet.operator.runtime), which kopf hands each of them
in its `memo`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvfleet.api.models import GROUP, HELD_REQUESTS_ANNOTATION, POOL_LABEL, VERSION
from kvfleet.operator import resources
from kvfleet.operator.kube import PLURAL, Kube
from kvfleet.operator.reconcile import RETRY_S, reconcile_pool
from kvfleet.operator.runtime import MEMO_KEY, Lifecycle, Operator, operator_of
from kvfleet.operator.status import is_ready

__all__ = ["configure", "lifecycle_changed", "pool_changed", "pool_daemon", "worker_changed"]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's watches can stall silently without these timeouts.
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.connect_timeout = 10
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO
    if MEMO_KEY not in memo:
        # Started without `python -m kvfleet.operator` (which brings its own, fenced when leading).
        memo[MEMO_KEY] = Operator(Kube())


# On a pool's deletion kopf sets `stopped` and rechecks the daemon after the backoff; without one it
# goes straight to cancelling, which cannot interrupt this thread, and rechecks only when the whole
# timeout is over, so every deletion waited 10 s for its finalizer. The loop sees `stopped` within
# 0.5 s; one that a slow pass keeps past the backoff is rechecked after the timeout, as before.
@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=2.0, cancellation_timeout=10)
def pool_daemon(stopped: kopf.DaemonStopped, namespace: str | None, name: str, logger: kopf.Logger, memo: kopf.Memo,
                **_: Any) -> None:
    """The pool's epoch loop: reconcile, then sleep an epoch or until poked by a change."""
    assert namespace is not None  # LLMPool is namespaced; kopf passes None only for cluster-scoped objects
    operator = operator_of(memo)
    poke = operator.wakeups.event(namespace, name)
    while not stopped:
        poke.clear()
        try:
            wait_s = reconcile_pool(namespace, name, logger, operator.api, operator.pools)
        except ApiException as err:
            logger.warning("reconcile of %s/%s failed, retrying: %s %s", namespace, name, err.status, err.reason)
            wait_s = RETRY_S
        except ValidationError as err:
            # A KVMigration or status the models refuse is one the API server would refuse (422) too.
            logger.warning("reconcile of %s/%s failed, retrying: %s", namespace, name, err)
            wait_s = RETRY_S
        deadline = time.monotonic() + wait_s
        while not stopped and not poke.is_set() and time.monotonic() < deadline:
            poke.wait(min(0.5, max(0.0, deadline - time.monotonic())))


@kopf.on.event(GROUP, VERSION, PLURAL)
def pool_changed(type: str | None, body: kopf.Body, namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Wake the pool when what its pass reads from it changed (its spec, the router's held-requests
    count, its deletion), not on every event: each pass writes the pool's status, and waking on that
    ran passes back to back, several per epoch, each listing every worker (docs/scale.md)."""
    wakeups = operator_of(memo).wakeups
    key = (namespace, name)
    meta = body.get("metadata") or {}
    seen = (meta.get("generation"), (meta.get("annotations") or {}).get(HELD_REQUESTS_ANNOTATION),
            bool(meta.get("deletionTimestamp")))
    if type == "DELETED":
        wakeups.pool_seen.pop(key, None)
    elif wakeups.pool_seen.get(key) == seen:
        return
    else:
        wakeups.pool_seen[key] = seen
    wakeups.event(namespace, name).set()


def _lifecycle(body: kopf.Body) -> Lifecycle:
    pod = dict(body)
    return (str(pod.get("status", {}).get("phase")), is_ready(pod), bool(body["metadata"].get("deletionTimestamp")))


def lifecycle_changed(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> bool:
    """kopf's filter for worker_changed: a pod gone, or its phase, readiness or deletion changed. Other
    pod events (the operator's own label and annotation writes; before KVLoads, every load report) do
    not reach the handler, so kopf neither runs nor logs it for them."""
    seen = operator_of(memo).wakeups.pod_lifecycle
    return kwargs.get("type") == "DELETED" or seen.get(body["metadata"]["uid"]) != _lifecycle(body)


@kopf.on.event("", "v1", "pods", labels={POOL_LABEL: kopf.PRESENT, resources.COMPONENT_LABEL: "worker"},
               when=lifecycle_changed)
def worker_changed(type: str | None, body: kopf.Body, namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo,
                   **_: Any) -> None:
    """Wake the pool when a worker's lifecycle changes (ready, gone), not on every load report or
    metadata write: reports are read once per epoch, so waking on them would run MELL once per report."""
    wakeups = operator_of(memo).wakeups
    uid = body["metadata"]["uid"]
    if type == "DELETED":
        wakeups.pod_lifecycle.pop(uid, None)
    else:
        wakeups.pod_lifecycle[uid] = _lifecycle(body)
    wakeups.event(namespace, labels[POOL_LABEL]).set()
