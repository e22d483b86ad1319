"""The operator's watch caches (kvfleet.operator.kube.WatchCache) against the real API server: a pass
reads the pool's worker pods, KVLoads and KVMigrations from them instead of listing, so they must show every
create, change and delete, one pool's objects only, and list while they have not read the first list.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvfleet.api.models import API_VERSION, POOL_LABEL, KVMigrationSpec
from kvfleet.api.reports import KVLoadReport, kvload_object
from kvfleet.localcluster.cluster import Cluster
from kvfleet.mell.migration import MoveMode
from kvfleet.operator.kube import Kube
from kvfleet.operator.resources import COMPONENT_LABEL


def worker_pod(name: str, pool: str) -> dict[str, Any]:
    # Bound to a node no agent serves: it never runs, which is all a cache needs of it.
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {POOL_LABEL: pool, COMPONENT_LABEL: "worker"}},
            "spec": {"nodeName": "nowhere", "containers": [{"name": "worker", "image": "kvfleet/none"}]}}


def eventually(read: Callable[[], object], expected: object, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := read()) != expected:
        assert time.monotonic() < deadline, f"still {seen!r}, not {expected!r}"
        time.sleep(0.1)


def test_the_caches_follow_the_pools_pods_and_kvloads(cluster: Cluster, namespace: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes import config

    # The client's default kubeconfig path was read from $KUBECONFIG when it was imported: name it.
    monkeypatch.setattr("kvfleet.operator.kube.load_config",
                        lambda: config.load_kube_config(config_file=str(cluster.kubeconfig)))
    kube = Kube()
    try:
        follow(cluster, namespace, kube)
    finally:
        kube.stop_watching()


def follow(cluster: Cluster, namespace: str, kube: Kube) -> None:
    cluster.apply_json(worker_pod("p-worker-0", "p"), namespace)
    cluster.apply_json(worker_pod("q-worker-0", "q"), namespace)

    def names() -> list[str]:
        return sorted(p["metadata"]["name"] for p in kube.worker_pods(namespace, "p"))

    # The first read lists (the cache has not read its first list yet), later ones read the cache.
    assert names() == ["p-worker-0"]
    cache = kube._caches[(namespace, "pods")]
    eventually(lambda: cache.items() is not None, True)

    cluster.apply_json(worker_pod("p-worker-1", "p"), namespace)
    eventually(names, ["p-worker-0", "p-worker-1"])
    cluster.kubectl("-n", namespace, "label", "pod", "p-worker-1", "kvfleet.dev/gpu=gpu-3")
    eventually(lambda: {p["metadata"]["name"]: p["metadata"]["labels"].get("kvfleet.dev/gpu")
                        for p in kube.worker_pods(namespace, "p")}, {"p-worker-0": None, "p-worker-1": "gpu-3"})
    cluster.kubectl("-n", namespace, "delete", "pod", "p-worker-0", "--grace-period=0", "--force", "--wait=false")
    eventually(names, ["p-worker-1"])
    assert cache.events >= 3  # the changes came by the watch, not by lists
    # Read now, not from the cache: what a pass reads right after its own creates and deletes.
    assert [p["metadata"]["name"] for p in kube.list_worker_pods(namespace, "p")] == ["p-worker-1"]

    def loads() -> dict[str, int]:
        return {k["metadata"]["name"]: k["report"]["usedBytes"] for k in kube.list_kvloads(namespace, "p")}

    uid = cluster.kubectl("-n", namespace, "get", "pod", "p-worker-1", "-o", "jsonpath={.metadata.uid}").stdout.strip()
    report = KVLoadReport(capacity_bytes=1000, used_bytes=10, sequence=1)
    cluster.apply_json(kvload_object("p-worker-1", uid, "p", report), namespace)
    eventually(loads, {"p-worker-1": 10})
    other = kvload_object("q-worker-0", uid, "q", report)
    cluster.apply_json(other, namespace)
    newer = kvload_object("p-worker-1", uid, "p", KVLoadReport(capacity_bytes=1000, used_bytes=20, sequence=2))
    cluster.apply_json(newer, namespace)
    eventually(loads, {"p-worker-1": 20})

    # KVMigrations: from their cache too, with the operator's own creates, status patches and deletes
    # showing at once (OwnWrites), whether or not the watch has brought them yet.
    def moves() -> dict[str, str]:
        return {m["metadata"]["name"]: (m.get("status") or {}).get("phase", "") for m in kube.list_migrations(namespace, "p")}

    def migration(name: str, pool: str) -> dict[str, Any]:
        spec = KVMigrationSpec(pool=pool, request_id=f"r-{name}", source_pod="p-worker-1", target_pod="p-worker-2",
                               mode=MoveMode.KV, reason="Allocate", epoch=1)
        return {"apiVersion": API_VERSION, "kind": "KVMigration",
                "metadata": {"name": name, "labels": {POOL_LABEL: pool}}, "spec": spec.to_wire()}

    assert moves() == {}  # the first read lists
    eventually(lambda: kube._caches[(namespace, "kvmigrations")].items() is not None, True)
    assert kube.create_migration(namespace, migration("m1", "p")) and kube.create_migration(namespace, migration("m2", "p"))
    assert moves() == {"m1": "", "m2": ""}  # at once
    assert kube.create_migration(namespace, migration("m3", "q"))  # another pool's
    kube.patch_migration_status(namespace, "m1", {"phase": "Failed", "message": "timed out"})
    assert moves()["m1"] == "Failed"
    kube.delete_migration(namespace, "m2")
    assert moves() == {"m1": "Failed"}
    eventually(moves, {"m1": "Failed"})  # and so it stays once the cache has caught up
    cluster.kubectl("-n", namespace, "delete", "kvmigration", "m1")
    eventually(moves, {})
