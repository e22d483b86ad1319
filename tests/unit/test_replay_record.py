"""What `kvfleet replay` records of the KVMigrations it saw (kvfleet.replay.record.migration_facts): read
through the same models the operator writes them with, so a renamed field fails here, not silently."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from kvfleet.replay.record import REMOVE_WINDOW_S, migration_facts


def migration(name: str, created: str, request: str, *, mode: str = "kv", reason: str = "Consolidate",
              status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": {"pool": "p", "requestId": request, "sourcePod": "p-worker-0", "targetPod": "p-worker-1",
                 "mode": mode, "reason": reason, "epoch": 3}}
    if status is not None:
        obj["status"] = status
    return obj


def test_facts_count_phases_causes_downtimes_and_quick_second_moves() -> None:
    assert REMOVE_WINDOW_S > 5
    facts = migration_facts([
        migration("m2", "2026-01-01T00:00:05Z", "r1", status={"phase": "Failed", "message": "target gone"}),
        migration("m1", "2026-01-01T00:00:00Z", "r1", status={"phase": "Succeeded", "downtimeSeconds": 0.04}),
        migration("m3", "2026-01-01T00:00:06Z", "r2", mode="token"),
    ])
    assert facts.by_mode_phase == {"kv/Failed": 1, "kv/Succeeded": 1, "token/Pending": 1}
    assert (facts.failed, facts.total) == (1, 3)
    assert facts.failure_causes == {"target gone": 1}
    assert facts.quick_removes == 1  # m2 was ordered 5 s after r1's successful move
    assert facts.succeeded_downtime_ms == {"p50": 40.0, "p90": 40.0, "p99": 40.0}
    assert [row["name"] for row in facts.moves] == ["m1", "m2", "m3"]
    assert facts.moves[0] == {"name": "m1", "created": "2026-01-01T00:00:00Z", "request": "r1", "from": "p-worker-0",
                              "to": "p-worker-1", "mode": "kv", "reason": "Consolidate", "phase": "Succeeded",
                              "message": ""}


def test_a_migration_the_models_cannot_read_fails_loudly() -> None:
    bad = migration("m1", "2026-01-01T00:00:00Z", "r1")
    del bad["spec"]["requestId"]
    with pytest.raises(pydantic.ValidationError, match="requestId"):
        migration_facts([bad])
