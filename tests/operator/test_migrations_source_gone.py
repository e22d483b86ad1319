"""A KVMigration whose source worker died mid-move: only the source writes a move's status, so the
operator must fail it itself (migrations.view's `source_gone`) instead of leaving it Transferring until
its timeout. Exact cases over the pods' start times (kvfleet.operator.migrations.worker_started_s)."""

from __future__ import annotations

import math
from typing import Any

from kvfleet.api.models import LLMPoolSpec
from kvfleet.operator.migrations import parse_time, view, worker_started_s

SPEC = LLMPoolSpec.model_validate({"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"}})
CREATED = "2026-01-01T00:00:10Z"
NOW_S = (parse_time(CREATED) or 0.0) + 5


def transferring(name: str = "p-r-1") -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": CREATED},
            "spec": {"pool": "p", "requestId": "r", "sourcePod": "w0", "targetPod": "w1", "mode": "kv", "reason": "Update"},
            "status": {"phase": "Transferring", "startTime": CREATED}}


def pod(name: str, created: str, running_since: str | None) -> dict[str, Any]:
    state = {"running": {"startedAt": running_since}} if running_since else {"waiting": {"reason": "CrashLoopBackOff"}}
    return {"metadata": {"name": name, "creationTimestamp": created},
            "status": {"containerStatuses": [{"name": "worker", "state": state}]}}


def test_a_move_whose_source_runs_on_is_in_flight() -> None:
    started = {"w0": worker_started_s(pod("w0", "2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z")), "w1": 0.0}
    seen = view([transferring()], SPEC, NOW_S, {}, started)
    assert seen.source_gone == () and seen.in_flight == {"r": "w1"}


def test_a_move_whose_source_pod_is_gone_is_failed_at_once() -> None:
    seen = view([transferring()], SPEC, NOW_S, {}, {"w1": 0.0})
    assert seen.source_gone == ("p-r-1",) and seen.in_flight == {} and seen.timed_out == ()


def test_a_restarted_source_container_or_a_new_pod_of_its_name_is_not_the_source() -> None:
    restarted = pod("w0", "2026-01-01T00:00:00Z", "2026-01-01T00:00:11Z")
    recreated = pod("w0", "2026-01-01T00:00:12Z", "2026-01-01T00:00:12Z")
    crashed = pod("w0", "2026-01-01T00:00:00Z", None)
    for source in (restarted, recreated, crashed):
        assert view([transferring()], SPEC, NOW_S, {}, {"w0": worker_started_s(source)}).source_gone == ("p-r-1",)
    assert worker_started_s(crashed) == math.inf


def test_a_source_started_in_the_same_second_as_the_move_is_still_the_source() -> None:
    same_second = pod("w0", "2026-01-01T00:00:00Z", CREATED)
    assert view([transferring()], SPEC, NOW_S, {}, {"w0": worker_started_s(same_second)}).source_gone == ()


def test_finished_moves_and_callers_without_pods_are_unaffected() -> None:
    done = {**transferring(), "status": {"phase": "Failed", "completionTime": CREATED, "message": "x"}}
    assert view([done], SPEC, NOW_S, {}, {}).source_gone == ()
    assert view([transferring()], SPEC, NOW_S, {}).source_gone == ()
