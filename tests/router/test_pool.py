"""The router's reading of the pool's objects (pods, KVLoads and LLMPool as the API returns them),
without an API server: directly, and through KubePoolView's watches on a fake API, handed to it as
the router's __main__ hands it the real one (a KubePoolApi over fake clients)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvfleet.api.models import POOL_LABEL
from kvfleet.api.reports import ANNOTATION, KVLoadReport, RequestLoad, kvload_object
from kvfleet.mell import SizeClass
from kvfleet.router import pool as pool_module
from kvfleet.router.placement import PoolSnapshot, ReportedRequest
from kvfleet.router.pool import KubePoolApi, KubePoolView, report_of, routes_of, worker_state


def pod(name: str, *, ready: bool = True, ip: str = "10.1.0.7", deleting: bool = False,
        report: KVLoadReport | None = None, index: str | None = None, uid: str = "uid-1",
        version: str = "1") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid, "resourceVersion": version,
                            "labels": {"kvfleet.dev/worker-index": index} if index else {}, "annotations": {}}
    if report is not None:
        meta["annotations"][ANNOTATION] = report.to_annotation()
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def kvload(name: str, report: KVLoadReport, *, uid: str = "uid-1", version: str = "1") -> dict[str, Any]:
    obj = kvload_object(name, uid, "p", report)
    obj["metadata"]["resourceVersion"] = version
    return obj


def load(capacity: int, *request_ids: str, sequence: int = 1) -> KVLoadReport:
    return KVLoadReport(capacity_bytes=capacity, used_bytes=10 * len(request_ids), sequence=sequence,
                        requests=[RequestLoad(id=r, kv_bytes=10, tokens=1, size_class="T") for r in request_ids])


def test_a_worker_pod_becomes_address_readiness_order_and_report() -> None:
    report = KVLoadReport(capacity_bytes=1000, used_bytes=300, sequence=3,
                          requests=[RequestLoad(id="r1", kv_bytes=300, tokens=10, size_class="S")])
    state = worker_state(pod("p-worker-3"), report)
    assert (state.pod_name, state.address, state.ready, state.activation_order, state.capacity_bytes) == (
        "p-worker-3", "10.1.0.7:8000", True, 3, 1000)
    assert state.reported == (ReportedRequest("r1", 300, SizeClass.S),)
    assert worker_state(pod("p-worker-3", index="9"), None).activation_order == 9  # the label wins over the name


def test_terminating_unready_or_addressless_pods_take_no_request() -> None:
    assert not worker_state(pod("p-worker-0", deleting=True), None).ready
    assert not worker_state(pod("p-worker-0", ready=False), None).ready
    assert worker_state(pod("p-worker-0", ip=""), None).address == ""
    assert worker_state(pod("p-worker-0"), None).capacity_bytes is None
    assert worker_state(pod("p-worker-0"), None).reported == ()


def test_a_workers_report_is_its_kvloads_else_its_annotation_never_another_pods() -> None:
    mine, old, stale = load(1000, "a"), load(2000, "b"), load(3000, "c")
    # Its KVLoad, even where an annotation (written before an upgrade) is still on the pod.
    assert report_of(pod("p-worker-0", report=old), kvload("p-worker-0", mine)) == mine
    # A worker from before KVLoads: its annotation.
    assert report_of(pod("p-worker-0", report=old), None) == old
    # The KVLoad of a previous pod of the same name (not yet garbage-collected) is not this pod's.
    assert report_of(pod("p-worker-0", uid="uid-2", report=old), kvload("p-worker-0", stale)) == old
    assert report_of(pod("p-worker-0", uid="uid-2"), kvload("p-worker-0", stale)) is None
    # Unreadable: no report yet.
    broken = pod("p-worker-0")
    broken["metadata"]["annotations"][ANNOTATION] = "{not json"
    assert report_of(broken, None) is None
    unreadable = kvload("p-worker-0", mine)
    unreadable["report"] = {"capacityBytes": -1}
    assert report_of(pod("p-worker-0", report=old), unreadable) == old


def test_routes_come_from_the_pools_routing_table() -> None:
    pool = {"status": {"routingTable": [{"sizeClass": "L", "worker": "p-worker-1"}, {"sizeClass": "T", "worker": "p-worker-0"}]}}
    assert routes_of(pool) == {"L": "p-worker-1", "T": "p-worker-0"}
    assert routes_of(None) == {} and routes_of({"status": {}}) == {}


def by_name(snapshot: PoolSnapshot) -> dict[str, tuple[int | None, tuple[str, ...]]]:
    return {w.pod_name: (w.capacity_bytes, tuple(r.request_id for r in w.reported)) for w in snapshot.workers}


def test_the_view_builds_each_worker_from_its_pod_and_the_report_pool_reports_picks() -> None:
    view = KubePoolView("ns", "p", pool_api(FakeAPI()))
    view.replace("pool", [{"metadata": {"name": "p", "generation": 1}, "spec": {}}])
    view.replace("pods", [pod("p-worker-0"), pod("p-worker-1", report=load(2000, "b")),
                           pod("p-worker-2", uid="uid-new", report=load(3000, "c")), pod("p-worker-3")])
    assert not view.snapshot().synced  # the KVLoads not listed yet
    view.replace("kvloads", [kvload("p-worker-0", load(1000, "a")),
                              kvload("p-worker-2", load(9000, "stale"), uid="uid-old"),
                              kvload("p-worker-9", load(9000, "podless"))])
    snapshot = view.snapshot()
    assert snapshot.synced
    assert by_name(snapshot) == {
        "p-worker-0": (1000, ("a",)),        # its KVLoad
        "p-worker-1": (2000, ("b",)),        # a worker from before KVLoads: its annotation
        "p-worker-2": (3000, ("c",)),        # a previous pod's KVLoad is ignored
        "p-worker-3": (None, ()),            # no report yet
    }
    assert [w.pod_name for w in snapshot.workers] == ["p-worker-0", "p-worker-1", "p-worker-2", "p-worker-3"]


def test_kvload_and_pod_events_update_the_snapshot_and_reparse_only_what_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    view = KubePoolView("ns", "p", pool_api(FakeAPI()))
    view.replace("pool", [])
    view.replace("pods", [pod(f"p-worker-{i}") for i in range(3)])
    view.replace("kvloads", [kvload(f"p-worker-{i}", load(1000, f"r{i}")) for i in range(3)])
    parsed: list[str] = []
    real = pool_module.report_of

    def counting(p: dict[str, Any], k: dict[str, Any] | None) -> KVLoadReport | None:
        parsed.append(p["metadata"]["name"])
        return real(p, k)

    monkeypatch.setattr(pool_module, "report_of", counting)
    view.apply("kvloads", "MODIFIED", kvload("p-worker-1", load(1000, "r1", "r9", sequence=2), version="2"))
    assert by_name(view.snapshot())["p-worker-1"] == (1000, ("r1", "r9"))
    assert parsed == ["p-worker-1"]
    # A re-list of unchanged objects re-reads nothing; the pool's own events neither.
    view.replace("kvloads", [kvload(f"p-worker-{i}", load(1000, f"r{i}")) for i in (0, 2)]
                  + [kvload("p-worker-1", load(1000, "r1", "r9", sequence=2), version="2")])
    view.apply("pool", "MODIFIED", {"metadata": {"name": "p"}, "status": {"routingTable": [{"sizeClass": "T", "worker": "p-worker-0"}]}})
    assert parsed == ["p-worker-1"] and view.snapshot().routes == {"T": "p-worker-0"}
    # A pod event re-reads its worker (it went NotReady).
    view.apply("pods", "MODIFIED", pod("p-worker-2", ready=False, version="2"))
    assert parsed == ["p-worker-1", "p-worker-2"]
    assert [w.ready for w in view.snapshot().workers] == [True, True, False]
    # Its KVLoad deleted: a worker falls back to its annotation, here none.
    view.apply("kvloads", "DELETED", kvload("p-worker-0", load(1000, "r0")))
    assert by_name(view.snapshot())["p-worker-0"] == (None, ())
    # A new pod of the same name (new uid): the old pod's KVLoad is not its report, its own is.
    view.apply("pods", "DELETED", pod("p-worker-1", version="2"))
    view.apply("pods", "ADDED", pod("p-worker-1", uid="uid-2", version="3"))
    assert by_name(view.snapshot())["p-worker-1"] == (None, ())
    view.apply("kvloads", "MODIFIED", kvload("p-worker-1", load(5000, "fresh"), uid="uid-2", version="4"))
    assert by_name(view.snapshot())["p-worker-1"] == (5000, ("fresh",))
    assert view.workers == {"p-worker-0", "p-worker-1", "p-worker-2"}
    view.apply("pods", "DELETED", pod("p-worker-2", version="2"))
    assert view.workers == {"p-worker-0", "p-worker-1"}  # a gone worker's state is not kept


# ----------------------------------------------------------------- the watches, on a fake API


class FakeAPI:
    """The list calls KubePoolView makes, answered from `objects`, and their watches: `send` queues
    an event for the watch of that kind (FakeWatch streams it), until `close`."""

    def __init__(self) -> None:
        self.objects: dict[str, list[dict[str, Any]]] = {"pods": [], "kvloads": [], "pool": []}
        self.events: dict[str, queue.Queue[dict[str, Any]]] = {k: queue.Queue() for k in self.objects}
        self.lists: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.patches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.closed = threading.Event()

    def send(self, kind: str, event_type: str, obj: dict[str, Any]) -> None:
        self.events[kind].put({"type": event_type, "object": obj})

    def close(self) -> None:
        self.closed.set()

    def _answer(self, kind: str, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        if kw.pop("watch", False):
            return self.stream(kind)
        self.lists.append((kind, args, kw))
        return {"metadata": {"resourceVersion": "1"}, "items": list(self.objects[kind])}

    def stream(self, kind: str) -> Iterator[dict[str, Any]]:
        while not self.closed.is_set():
            try:
                yield self.events[kind].get(timeout=0.02)
            except queue.Empty:
                pass

    def core(self) -> Any:
        api = self

        class Core:
            def list_namespaced_pod(self, namespace: str, **kw: Any) -> Any:
                return api._answer("pods", (namespace,), kw)
        return Core()

    def custom(self) -> Any:
        api = self

        class Custom:
            def list_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, **kw: Any) -> Any:
                return api._answer("kvloads" if plural == "kvloads" else "pool", (group, version, namespace, plural), kw)

            def patch_namespaced_custom_object(self, *args: Any) -> None:
                api.patches.append((args[:5], args[5]))
        return Custom()


class FakeWatch:
    """kubernetes.watch.Watch on a FakeAPI: the events the lister, called with watch=True, streams."""

    def stream(self, lister: Callable[..., Any], **kw: Any) -> Iterator[dict[str, Any]]:
        events: Iterator[dict[str, Any]] = lister(watch=True, **kw)
        yield from events

    def stop(self) -> None:
        pass


def pool_api(api: FakeAPI) -> KubePoolApi:
    """A KubePoolApi for pool p in ns over `api`'s clients (their objects are dicts already)."""
    return KubePoolApi("ns", "p", api.core(), api.custom(), FakeWatch, lambda obj: obj)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_view_watches_the_pools_kvloads_and_a_kvload_event_updates_the_snapshot() -> None:
    api = FakeAPI()
    api.objects["pool"] = [{"metadata": {"name": "p", "generation": 1}, "spec": {}}]
    api.objects["pods"] = [pod("p-worker-0"), pod("p-worker-1", report=load(2000, "old"))]
    api.objects["kvloads"] = [kvload("p-worker-0", load(1000, "a"))]
    view = KubePoolView("ns", "p", pool_api(api))
    view.start()
    try:
        wait_until(lambda: view.snapshot().synced, "the view never synced")
        assert ("kvloads", ("kvfleet.dev", "v1alpha1", "ns", "kvloads"), {"label_selector": f"{POOL_LABEL}=p"}) in api.lists
        assert by_name(view.snapshot()) == {"p-worker-0": (1000, ("a",)), "p-worker-1": (2000, ("old",))}
        # The worker of before the upgrade restarts on the new image: its KVLoad takes over.
        api.send("kvloads", "ADDED", kvload("p-worker-1", load(4000, "new"), version="7"))
        wait_until(lambda: by_name(view.snapshot())["p-worker-1"] == (4000, ("new",)), "the KVLoad event never arrived")
        api.send("kvloads", "MODIFIED", kvload("p-worker-0", load(1000, "a", "b", sequence=2), version="8"))
        wait_until(lambda: by_name(view.snapshot())["p-worker-0"] == (1000, ("a", "b")), "the KVLoad update never arrived")
    finally:
        view.stop()
        api.close()
        view.join(timeout_s=5)


def test_held_requests_are_written_on_the_pool_through_the_api_it_is_given() -> None:
    api = FakeAPI()
    view = KubePoolView("ns", "p", pool_api(api))
    view.start()
    try:
        view.signal_held(3)
        wait_until(lambda: bool(api.patches), "the held count was never written")
        where, body = api.patches[0]
        assert where == ("kvfleet.dev", "v1alpha1", "ns", "llmpools", "p")
        count, _when = body["metadata"]["annotations"]["kvfleet.dev/held-requests"].split()
        assert count == "3"
    finally:
        view.stop()
        api.close()
        view.join(timeout_s=5)
