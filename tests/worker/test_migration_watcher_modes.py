"""The watcher hands each KVMigration's mode to the executor as written, hybrid included (MELL §V)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

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
    asyncio.run(watcher.execute("m", {"requestId": "r", "sourcePod": "a", "targetPod": "b", "mode": mode}))
    assert asked == [mode]
    assert [p["phase"] for p in api.patches] == ["Transferring", "Succeeded"]
