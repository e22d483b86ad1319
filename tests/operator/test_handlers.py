"""The pool's daemon is woken by changes it must act on, not by the operator's own writes nor by load reports."""

from __future__ import annotations

from typing import Any

import kopf

from kvfleet.api.models import HELD_REQUESTS_ANNOTATION
from kvfleet.operator import handlers


def event(type_: str | None, generation: int, held: str | None = None, status: int = 0) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": "ns", "generation": generation}
    if held is not None:
        meta["annotations"] = {HELD_REQUESTS_ANNOTATION: held}
    return {"type": type_, "body": kopf.Body({"metadata": meta, "status": {"epoch": status}}), "namespace": "ns", "name": "p"}


def woken(**kw: Any) -> bool:
    poke = handlers._poke_event("ns", "p")
    poke.clear()
    handlers.pool_changed(**kw)
    return poke.is_set()


def test_status_writes_do_not_wake_the_pool_spec_and_held_requests_do() -> None:
    handlers._pool_seen.clear()
    assert woken(**event(None, 1))  # first seen (the initial listing)
    assert not woken(**event("MODIFIED", 1, status=2))  # the operator's own status write
    assert woken(**event("MODIFIED", 2, status=2))  # a spec change
    assert woken(**event("MODIFIED", 2, held="3 1700000000.000"))  # the router holds requests
    assert not woken(**event("MODIFIED", 2, held="3 1700000000.000", status=3))
    assert woken(**event("DELETED", 2))
    assert ("ns", "p") not in handlers._pool_seen


def pod(phase: str, ready: bool, annotations: dict[str, str] | None = None) -> kopf.Body:
    return kopf.Body({"metadata": {"name": "p-worker-0", "uid": "u-0", "annotations": annotations or {}},
                      "status": {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}})


def test_only_a_workers_lifecycle_reaches_the_pod_handler() -> None:
    handlers._pod_lifecycle.clear()
    labels = {"kvfleet.dev/pool": "p"}
    poke = handlers._poke_event("ns", "p")
    for body, changed in [(pod("Pending", False), True), (pod("Running", True), True),
                          (pod("Running", True, {"kvfleet.dev/kv-load": "{}"}), False),  # a report, a label: no
                          (pod("Running", False), True)]:
        assert handlers.lifecycle_changed(body, type="MODIFIED") is changed
        if changed:
            poke.clear()
            handlers.worker_changed(type="MODIFIED", body=body, namespace="ns", labels=labels)
            assert poke.is_set()
    assert handlers.lifecycle_changed(pod("Running", False), type="DELETED")
    handlers.worker_changed(type="DELETED", body=pod("Running", False), namespace="ns", labels=labels)
    assert handlers._pod_lifecycle == {}
