"""The pool's daemon is woken by changes it must act on, not by the operator's own writes nor by load reports.

Each test makes its own operator (kvfleet.operator.runtime.Operator) and hands it to the handlers in a
memo, as kopf does."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest

from kvfleet.api.models import HELD_REQUESTS_ANNOTATION
from kvfleet.operator import handlers
from kvfleet.operator.memory import MemoryKube
from kvfleet.operator.runtime import MEMO_KEY, Operator, Wakeups, operator_of


def fresh_memo() -> kopf.Memo:
    """A kopf memo holding a new operator (its API is never called by the change handlers)."""
    return kopf.Memo({MEMO_KEY: Operator(MemoryKube({"metadata": {"name": "p"}}))})


def wakeups(memo: kopf.Memo) -> Wakeups:
    return operator_of(memo).wakeups


def event(type_: str | None, generation: int, held: str | None = None, status: int = 0) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": "ns", "generation": generation}
    if held is not None:
        meta["annotations"] = {HELD_REQUESTS_ANNOTATION: held}
    return {"type": type_, "body": kopf.Body({"metadata": meta, "status": {"epoch": status}}), "namespace": "ns", "name": "p"}


def woken(memo: kopf.Memo, **kw: Any) -> bool:
    poke = wakeups(memo).event("ns", "p")
    poke.clear()
    handlers.pool_changed(memo=memo, **kw)
    return poke.is_set()


def test_status_writes_do_not_wake_the_pool_spec_and_held_requests_do() -> None:
    memo = fresh_memo()
    assert woken(memo, **event(None, 1))  # first seen (the initial listing)
    assert not woken(memo, **event("MODIFIED", 1, status=2))  # the operator's own status write
    assert woken(memo, **event("MODIFIED", 2, status=2))  # a spec change
    assert woken(memo, **event("MODIFIED", 2, held="3 1700000000.000"))  # the router holds requests
    assert not woken(memo, **event("MODIFIED", 2, held="3 1700000000.000", status=3))
    assert woken(memo, **event("DELETED", 2))
    assert ("ns", "p") not in wakeups(memo).pool_seen


def pod(phase: str, ready: bool, annotations: dict[str, str] | None = None) -> kopf.Body:
    return kopf.Body({"metadata": {"name": "p-worker-0", "uid": "u-0", "annotations": annotations or {}},
                      "status": {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}})


def test_only_a_workers_lifecycle_reaches_the_pod_handler() -> None:
    memo = fresh_memo()
    labels = {"kvfleet.dev/pool": "p"}
    poke = wakeups(memo).event("ns", "p")
    for body, changed in [(pod("Pending", False), True), (pod("Running", True), True),
                          (pod("Running", True, {"kvfleet.dev/kv-load": "{}"}), False),  # a report, a label: no
                          (pod("Running", False), True)]:
        assert handlers.lifecycle_changed(body, memo, type="MODIFIED") is changed
        if changed:
            poke.clear()
            handlers.worker_changed(type="MODIFIED", body=body, namespace="ns", labels=labels, memo=memo)
            assert poke.is_set()
    assert handlers.lifecycle_changed(pod("Running", False), memo, type="DELETED")
    handlers.worker_changed(type="DELETED", body=pod("Running", False), namespace="ns", labels=labels, memo=memo)
    assert wakeups(memo).pod_lifecycle == {}


def test_every_objects_memo_shares_the_operator_and_two_operators_share_nothing() -> None:
    """kopf gives each object a shallow copy of the operator's memo: one Operator for all pools."""
    memo = fresh_memo()
    assert operator_of(copy.copy(memo)) is operator_of(memo)
    other = fresh_memo()
    assert woken(memo, **event(None, 1)) and woken(other, **event(None, 1))
    assert wakeups(memo).event("ns", "p") is not wakeups(other).event("ns", "p")
    with pytest.raises(RuntimeError, match="no kvfleet Operator"):
        operator_of(kopf.Memo())
