"""kvfleet.operator.kube.OwnWrites: a watch cache's view with the operator's own KVMigration writes laid
over it until the cache shows them, so a pass one second after another sees what that one wrote."""

from __future__ import annotations

from typing import Any

from kvfleet.api.models import POOL_LABEL
from kvfleet.operator.kube import OWN_WRITES_S, OwnWrites


def mig(name: str, version: str, phase: str = "Pending", pool: str = "p") -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version, "labels": {POOL_LABEL: pool}},
            "status": {"phase": phase}}


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def names(objs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((o["metadata"]["name"], o["status"]["phase"]) for o in objs)


def test_a_created_migration_shows_until_the_cache_has_it() -> None:
    own = OwnWrites(Clock())
    own.created("ns", mig("m1", "5"))
    assert names(own.over("ns", [], "p")) == [("m1", "Pending")]
    assert own.over("other", [], "p") == [] and own.over("ns", [], "q") == []  # another namespace, pool
    # The cache has it, and a worker has moved it on since: the cache's copy is the one that counts.
    assert names(own.over("ns", [mig("m1", "7", "Running")], "p")) == [("m1", "Running")]
    assert own.over("ns", [], "p") == []  # caught up once: dropped


def test_a_patched_status_shows_until_the_cached_version_changes() -> None:
    own = OwnWrites(Clock())
    own.patched("ns", mig("m1", "9", "Failed"), "8")
    assert names(own.over("ns", [mig("m1", "8", "Running")], "p")) == [("m1", "Failed")]  # the cache lags
    assert names(own.over("ns", [mig("m1", "9", "Failed")], "p")) == [("m1", "Failed")]
    assert names(own.over("ns", [mig("m1", "8", "Running")], "p")) == [("m1", "Running")]  # dropped above


def test_a_deleted_migration_is_hidden_while_the_cache_still_has_it() -> None:
    own = OwnWrites(Clock())
    own.deleted("ns", "m1")
    assert own.over("ns", [mig("m1", "3")], "p") == []
    assert own.over("ns", [], "p") == []  # gone from the cache too: dropped
    assert names(own.over("ns", [mig("m1", "3")], "p")) == [("m1", "Pending")]


def test_a_write_the_cache_never_shows_is_dropped_after_its_time() -> None:
    clock = Clock()
    own = OwnWrites(clock)
    own.created("ns", mig("m1", "5"))
    own.deleted("ns", "m2")
    clock.now_s += OWN_WRITES_S + 1
    assert names(own.over("ns", [mig("m2", "4")], "p")) == [("m2", "Pending")]
