"""The router's reading of the pool's objects (pods and LLMPool as the API returns them), without an API server."""

from __future__ import annotations

from typing import Any

from kvfleet.api.reports import ANNOTATION, KVLoadReport, RequestLoad
from kvfleet.mell.models import SizeClass
from kvfleet.router.placement import ReportedRequest
from kvfleet.router.pool import routes_of, worker_state


def pod(name: str, *, ready: bool = True, ip: str = "10.1.0.7", deleting: bool = False,
        report: KVLoadReport | None = None, index: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"kvfleet.dev/worker-index": index} if index else {}, "annotations": {}}
    if report is not None:
        meta["annotations"][ANNOTATION] = report.to_annotation()
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_a_worker_pod_becomes_address_readiness_order_and_report() -> None:
    report = KVLoadReport(capacity_bytes=1000, used_bytes=300, sequence=3,
                          requests=[RequestLoad(id="r1", kv_bytes=300, tokens=10, size_class="S")])
    state = worker_state(pod("p-worker-3", report=report))
    assert (state.pod_name, state.address, state.ready, state.activation_order, state.capacity_bytes) == (
        "p-worker-3", "10.1.0.7:8000", True, 3, 1000)
    assert state.reported == (ReportedRequest("r1", 300, SizeClass.S),)
    assert worker_state(pod("p-worker-3", index="9")).activation_order == 9  # the label wins over the name


def test_terminating_unready_or_addressless_pods_take_no_request() -> None:
    assert not worker_state(pod("p-worker-0", deleting=True)).ready
    assert not worker_state(pod("p-worker-0", ready=False)).ready
    assert worker_state(pod("p-worker-0", ip="")).address == ""
    broken = pod("p-worker-0")
    broken["metadata"]["annotations"][ANNOTATION] = "{not json"
    assert worker_state(broken).capacity_bytes is None and worker_state(broken).reported == ()


def test_routes_come_from_the_pools_routing_table() -> None:
    pool = {"status": {"routingTable": [{"sizeClass": "L", "worker": "p-worker-1"}, {"sizeClass": "T", "worker": "p-worker-0"}]}}
    assert routes_of(pool) == {"L": "p-worker-1", "T": "p-worker-0"}
    assert routes_of(None) == {} and routes_of({"status": {}}) == {}
