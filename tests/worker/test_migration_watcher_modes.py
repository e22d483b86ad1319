"""The watcher hands each KVMigration's mode to the executor as written, hybrid included (MELL §V);
it reads the spec and writes the status through the models the operator uses (kvfleet.api.models)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvfleet.api.models import SHORT_TEXT_MAX_LENGTH, KVMigrationSpec, KVMigrationStatus
from kvfleet.mell.migration import MoveMode
from kvfleet.worker.migration.executor import MigrationResult
from kvfleet.worker.migration.handoff import HandoffTarget
from kvfleet.worker.migration.watcher import MigrationWatcher, WatcherConfig


class Api:
    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    def list(self) -> tuple[list[dict[str, Any]], str]:
        return [], "1"

    def watch(self, resource_version: str, timeout_s: int, stop: Any) -> Any:
        return iter(())

    def patch_status(self, name: str, status: dict[str, Any]) -> None:
        self.patches.append(status)

    def pod_ip(self, pod_name: str) -> str | None:
        return "10.0.0.2"


@pytest.mark.parametrize("mode", ["kv", "token", "hybrid"])
def test_the_mode_reaches_the_executor(mode: str) -> None:
    asked: list[str] = []

    async def migrate(request_id: str, target: HandoffTarget, address: str, how: MoveMode,
                      kv_bytes: int | None) -> MigrationResult:
        asked.append(how)
        return MigrationResult(request_id, True, how, bytes_moved=10, tokens_moved=5, downtime_s=0.01)

    api = Api()
    watcher = MigrationWatcher(WatcherConfig("a", "ns", "p", http_port=8000, migration_port=8001), api, migrate)
    spec = KVMigrationSpec.model_validate({"pool": "p", "requestId": "r", "sourcePod": "a", "targetPod": "b",
                                           "mode": mode, "reason": "Update"})
    asyncio.run(watcher.execute("m", spec))
    assert asked == [mode]
    assert [p["phase"] for p in api.patches] == ["Transferring", "Succeeded"]


def considered(spec: dict[str, Any], message: str = "moved") -> tuple[list[dict[str, Any]], list[int | None]]:
    """The status patches and the executor's KV bytes when the watcher is handed a KVMigration with `spec`."""
    kv_bytes_asked: list[int | None] = []

    async def migrate(request_id: str, target: HandoffTarget, address: str, how: MoveMode,
                      kv_bytes: int | None) -> MigrationResult:
        kv_bytes_asked.append(kv_bytes)
        return MigrationResult(request_id, False, how, message=message)

    async def run() -> Api:
        api = Api()
        watcher = MigrationWatcher(WatcherConfig("a", "ns", "p", http_port=8000, migration_port=8001), api, migrate)
        watcher.consider({"metadata": {"name": "m"}, "spec": spec})
        while watcher._tasks:
            await asyncio.gather(*list(watcher._tasks))
        return api

    return asyncio.run(run()).patches, kv_bytes_asked


WRITTEN = {"pool": "p", "requestId": "r", "sourcePod": "a", "targetPod": "b", "mode": "hybrid", "expectedBytes": 64,
           "expectedTokens": 8, "reason": "Update", "epoch": 3}


def test_the_watcher_reads_the_spec_the_operator_writes_and_writes_statuses_the_operator_reads() -> None:
    patches, kv_bytes_asked = considered(WRITTEN, message="x" * 1000)
    assert kv_bytes_asked == [64]  # a hybrid move copies expectedBytes
    assert [KVMigrationStatus.model_validate(p).phase for p in patches] == ["Transferring", "Failed"]
    # A longer message would make the API server refuse the whole status (maxLength).
    assert len(patches[-1]["message"]) == SHORT_TEXT_MAX_LENGTH
    assert set(patches[-1]) == {"phase", "completionTime", "message"}  # a merge patch of what it says only


def test_a_kvmigration_of_ours_this_worker_cannot_read_fails_at_once() -> None:
    patches, kv_bytes_asked = considered({**WRITTEN, "mode": "teleport"})
    assert kv_bytes_asked == []
    assert [p["phase"] for p in patches] == ["Transferring", "Failed"]
    assert patches[-1]["message"].startswith("spec not readable by this worker") and "mode" in patches[-1]["message"]
    assert considered({**WRITTEN, "sourcePod": "c", "mode": "teleport"}) == ([], [])  # not ours: left alone
