"""How the router knows the pool: its LLMPool (the routing table), its worker pods and their
KV-load reports, from the API.

Three watches (the pool by name, the workers by label, the workers' KVLoads by label), each a list
followed by a watch from the list's resourceVersion, re-listed after any error or a 410. A watch sees
a worker go NotReady or a new report within milliseconds at no cost per request, where polling every
second would cost three list calls a second per router and still lag; nothing on the request path
calls the API server. The view is an immutable `PoolSnapshot` swapped under a lock, so a request
reads one consistent state. Tests and a router run by hand use `StaticPoolView` instead: no API
server needed.

A worker's report is its own `KVLoad` object, not a pod annotation: a busy worker rewrites it every
epoch, and every pod write fans out to every pod watcher of the cluster (scheduler, controller
manager, kubelets, routers), where a KVLoad write reaches only the operator and the routers
(docs/scale.md). A worker's state is its pod plus the report `kvfleet.api.reports.pool_reports`
picks: its KVLoad if owned by the pod's current uid, else its annotation (workers from before
KVLoads, during an upgrade). Each state is kept with the resourceVersions of the pod and KVLoad it
was built from, so an event re-parses one worker's report, not the whole pool's.

`KubePoolView` reaches the API server only through a `PoolApi` it is given (the router's
`__main__` makes a `KubePoolApi`; tests give a fake): the three lists and watches, and the one write.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, Protocol

from pydantic import ValidationError

from kvfleet.api.incluster import load_config
from kvfleet.api.models import HELD_REFRESH_S, HELD_REQUESTS_ANNOTATION, POOL_LABEL, ROLE_LABEL, LLMPoolSpec
from kvfleet.api.quantity import parse_quantity
from kvfleet.api.reports import KVLOAD_PLURAL, KVLoadReport, pool_reports
from kvfleet.api.scheduling import scheduler_config
from kvfleet.mell import PolicyConfig
from kvfleet.router.locality import LOCALITIES, Locality
from kvfleet.router.placement import PDSettings, PoolSnapshot, ReportedRequest, WorkerState, parse_class

log = logging.getLogger(__name__)

COMPONENT_LABEL = "app.kubernetes.io/component"
INDEX_LABEL = "kvfleet.dev/worker-index"
WORKER_PORT = 8000
GROUP, VERSION, PLURAL = "kvfleet.dev", "v1alpha1", "llmpools"
# A watch is re-opened this often even when quiet, so a silently dead connection costs at most this.
WATCH_TIMEOUT_S = 60
RETRY_S = 1.0
_INDEX = re.compile(r"-worker-(\d+)$")

# The three kinds of object the view watches.
Kind = Literal["pods", "kvloads", "pool"]
KINDS: tuple[Kind, ...] = ("pods", "kvloads", "pool")


class PoolView(Protocol):
    def snapshot(self) -> PoolSnapshot: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def signal_held(self, held: int) -> None:
        """The router holds `held` requests for want of a Ready worker (0: none any more)."""
        ...


class StaticPoolView:
    """A pool view set by hand (tests, a router in front of workers started without Kubernetes)."""

    def __init__(self, snapshot: PoolSnapshot) -> None:
        self._snapshot = snapshot
        self.held = 0

    def set(self, snapshot: PoolSnapshot) -> None:
        self._snapshot = snapshot

    def snapshot(self) -> PoolSnapshot:
        return self._snapshot

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def signal_held(self, held: int) -> None:
        self.held = held  # no API server to tell: kept for tests and a router run by hand


def is_ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False  # terminating: it drains, and takes no new request
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def worker_state(pod: Mapping[str, Any], report: KVLoadReport | None) -> WorkerState:
    """One worker pod (as the API returns it, camelCase dict) and its KV-load report (None before its
    first; `report_of` finds it) in the router's terms."""
    meta = pod.get("metadata") or {}
    name = str(meta.get("name", ""))
    labels = meta.get("labels") or {}
    index_text = labels.get(INDEX_LABEL) or (m.group(1) if (m := _INDEX.search(name)) else "")
    ip = (pod.get("status") or {}).get("podIP") or ""
    reported: tuple[ReportedRequest, ...] = ()
    if report is not None:
        reported = tuple(ReportedRequest(r.id, r.kv_bytes, parse_class(r.size_class)) for r in report.requests)
    role = labels.get(ROLE_LABEL)
    return WorkerState(name, f"{ip}:{WORKER_PORT}" if ip else "", is_ready(pod),
                       int(index_text) if index_text.isdigit() else -1,
                       report.capacity_bytes if report else None, reported,
                       report.prefix_cache_blocks if report else None,
                       role=str(role) if role else None, migration_address=_migration_address(pod, ip))


def _migration_address(pod: Mapping[str, Any], ip: str) -> str:
    """The pod's migration port (its container port named `migration`) on its IP; "" if it lists none."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "migration" and port.get("containerPort") and ip:
                return f"{ip}:{int(port['containerPort'])}"
    return ""


def report_of(pod: Mapping[str, Any], kvload: Mapping[str, Any] | None) -> KVLoadReport | None:
    """The report of one worker pod given the KVLoad of its name (if any), as `pool_reports` decides:
    the KVLoad's when the pod owns it, else the pod's annotation."""
    name = str((pod.get("metadata") or {}).get("name", ""))
    return pool_reports([kvload] if kvload is not None else [], [pod]).get(name)


def _versions(pod: Mapping[str, Any], kvload: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """The resourceVersions a worker's state is built from ("" for no KVLoad), or None when one is
    missing (an object not served by an API server): such a state is not cached."""
    pod_version = (pod.get("metadata") or {}).get("resourceVersion")
    if not pod_version:
        return None
    if kvload is None:
        return str(pod_version), ""
    kvload_version = (kvload.get("metadata") or {}).get("resourceVersion")
    return (str(pod_version), str(kvload_version)) if kvload_version else None


def routes_of(pool: Mapping[str, Any] | None) -> dict[str, str]:
    table = ((pool or {}).get("status") or {}).get("routingTable") or []
    return {str(e["sizeClass"]): str(e["worker"]) for e in table if e.get("sizeClass") and e.get("worker")}


def config_of(pool: Mapping[str, Any] | None) -> PolicyConfig | None:
    """The pool's MELL knobs, mapped from its spec as the operator maps them (kvfleet.api.scheduling),
    so the router's Allocate weighs GPUs as the operator's epochs do. None without a readable spec
    (the API server validates it; a newer operator's field this router does not know is the case)."""
    spec = (pool or {}).get("spec")
    if not spec:
        return None
    try:
        return scheduler_config(LLMPoolSpec.model_validate(spec))
    except (ValidationError, ValueError) as err:
        log.warning("cannot read the pool's scheduling settings, using MELL's defaults: %s", err)
        return None


def locality_of(pool: Mapping[str, Any] | None) -> tuple[Locality, float]:
    """The pool's prefixCaching routing and TTL (kvfleet.router.locality): "none" when its workers do
    not cache prefixes, the spec's defaults where unset."""
    caching = ((pool or {}).get("spec") or {}).get("prefixCaching") or {}
    routing = caching.get("routing", "prompt-tree") if caching.get("enabled") else "none"
    ttl_s = caching.get("ttlSeconds", 600)
    locality: Locality = routing if routing in LOCALITIES else "prompt-tree"
    return locality, float(ttl_s) if isinstance(ttl_s, (int, float)) and ttl_s > 0 else 600.0


def disaggregation_of(pool: Mapping[str, Any] | None) -> PDSettings | None:
    """The pool's spec.disaggregation while enabled (the spec's defaults where unset); None: colocated."""
    spec = (pool or {}).get("spec") or {}
    pd = spec.get("disaggregation") or {}
    if not pd.get("enabled"):
        return None
    link = ((spec.get("migration") or {}).get("communicationBoundaryBytesPerSecond"))
    try:
        link_bytes_per_s = float(parse_quantity(link)) if link is not None else PDSettings().link_bytes_per_s
    except ValueError:
        link_bytes_per_s = PDSettings().link_bytes_per_s
    return PDSettings(str(pd.get("caching", "full")), str(pd.get("choice", "per-request")), link_bytes_per_s)


def policy_of(pool: Mapping[str, Any] | None) -> str:
    """The pool's scheduling.policy (the LLMPool default, `mell`, when unset or unreadable)."""
    policy = (((pool or {}).get("spec") or {}).get("scheduling") or {}).get("policy")
    return policy if isinstance(policy, str) and policy else "mell"


class PoolApi(Protocol):
    """The API calls of a pool's router: list and watch its LLMPool, worker pods and KVLoads, and
    annotate its LLMPool. Objects are dicts as the API serialises them (camelCase)."""

    def list(self, kind: Kind) -> tuple[list[dict[str, Any]], str]:
        """The objects of `kind` and the list's resourceVersion."""
        ...

    def watch(self, kind: Kind, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event type, object) of `kind` from `resource_version` until `timeout_s` ends the watch or
        the caller closes the iterator; an "ERROR" event (e.g. 410 Gone) means list again."""
        ...

    def annotate_pool(self, annotations: dict[str, str]) -> None:
        """Merge `annotations` into the LLMPool's metadata."""
        ...


class KubePoolApi:
    """`PoolApi` over the kubernetes client, within the router's Role: this one pool (by name), its
    worker pods and its KVLoads (by label)."""

    def __init__(self, namespace: str, pool_name: str, core: Any, custom: Any,
                 watch: Callable[[], Any], sanitize: Callable[[Any], Any]) -> None:
        """`core` and `custom`: a CoreV1Api and a CustomObjectsApi; `watch` makes a kubernetes.watch.Watch;
        `sanitize` turns the client's objects into dicts (ApiClient.sanitize_for_serialization)."""
        self.namespace = namespace
        self.pool_name = pool_name
        self._custom = custom
        self._watch = watch
        self._sanitize = sanitize
        selector = f"{POOL_LABEL}={pool_name},{COMPONENT_LABEL}=worker"

        def list_pods(**kw: Any) -> Any:
            return core.list_namespaced_pod(namespace, label_selector=selector, **kw)

        def list_pool(**kw: Any) -> Any:
            # The Role allows this one pool only (resourceNames), which a list must name by field selector.
            return custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                        field_selector=f"metadata.name={pool_name}", **kw)

        def list_kvloads(**kw: Any) -> Any:
            return custom.list_namespaced_custom_object(GROUP, VERSION, namespace, KVLOAD_PLURAL,
                                                        label_selector=f"{POOL_LABEL}={pool_name}", **kw)

        self._listers: dict[Kind, Callable[..., Any]] = {"pods": list_pods, "kvloads": list_kvloads, "pool": list_pool}

    @classmethod
    def connect(cls, namespace: str, pool_name: str) -> KubePoolApi:
        """On the cluster's API server, as the pod's ServiceAccount (else the kubeconfig)."""
        from kubernetes import client, watch

        load_config()
        return cls(namespace, pool_name, client.CoreV1Api(), client.CustomObjectsApi(), watch.Watch,
                   client.ApiClient().sanitize_for_serialization)

    def list(self, kind: Kind) -> tuple[list[dict[str, Any]], str]:
        listing = self._sanitize(self._listers[kind]())
        return list(listing.get("items") or []), str(listing["metadata"]["resourceVersion"])

    def watch(self, kind: Kind, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict[str, Any]]]:
        stream = self._watch()
        try:
            for event in stream.stream(self._listers[kind], resource_version=resource_version, timeout_seconds=timeout_s):
                yield event["type"], self._sanitize(event["object"])
        finally:
            stream.stop()

    def annotate_pool(self, annotations: dict[str, str]) -> None:
        self._custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.pool_name,
                                                    {"metadata": {"annotations": annotations}})


class KubePoolView:
    """The pool, its workers and their KVLoads, kept current by three watches in background threads."""

    def __init__(self, namespace: str, pool_name: str, api: PoolApi) -> None:
        self.namespace = namespace
        self.pool_name = pool_name
        self._api = api
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, Any]] = {}
        self._kvloads: dict[str, dict[str, Any]] = {}
        # Pod name -> (the resourceVersions of its pod and KVLoad, the state built from them).
        self._states: dict[str, tuple[tuple[str, str], WorkerState]] = {}
        self._pool: dict[str, Any] | None = None
        self._config: PolicyConfig | None = None
        # The spec's generation the config was read from: status writes (every epoch) do not change it.
        self._config_generation: object = None
        self._synced = {"pods": False, "kvloads": False, "pool": False}
        self._snapshot = PoolSnapshot((), {}, synced=False)
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        # The held count to write on the pool (HELD_REQUESTS_ANNOTATION), and a wake-up for the writer thread.
        self._held = 0
        self._held_changed = threading.Event()

    def snapshot(self) -> PoolSnapshot:
        return self._snapshot

    def signal_held(self, held: int) -> None:
        if held != self._held:
            self._held = held
            self._held_changed.set()

    def start(self) -> None:
        for kind in KINDS:
            thread = threading.Thread(target=self._watch_loop, args=(kind,), name=f"watch-{kind}", daemon=True)
            thread.start()
            self._threads.append(thread)
        writer = threading.Thread(target=self._held_loop, name="held-requests", daemon=True)
        writer.start()
        self._threads.append(writer)

    def _held_loop(self) -> None:
        """Write the held count on the pool when it changes, and every HELD_REFRESH_S while it is not
        0; a failed write is retried a second later (the count to write is always the latest)."""
        written: int | None = None
        written_s = 0.0
        while not self._stopped.is_set():
            self._held_changed.wait(1.0)
            self._held_changed.clear()
            held = self._held
            if held == written and (held == 0 or time.monotonic() - written_s < HELD_REFRESH_S):
                continue
            if written is None and held == 0:
                continue  # nothing held since this router started: nothing to say
            try:
                self._api.annotate_pool({HELD_REQUESTS_ANNOTATION: f"{held} {time.time():.3f}"})
                written, written_s = held, time.monotonic()
            except Exception as err:  # the API server away: the next round writes the latest count
                log.warning("could not tell the operator about %d held requests: %s", held, err)

    def stop(self) -> None:
        self._stopped.set()
        self._held_changed.set()

    def join(self, timeout_s: float) -> None:
        """Wait for the stopped view's threads, at most `timeout_s` each (a watch blocked in the API
        server's stream ends with its next event or the stream's end)."""
        for thread in self._threads:
            thread.join(timeout=timeout_s)

    @property
    def workers(self) -> frozenset[str]:
        """The pods the view keeps a worker state for (a gone worker's state is not kept)."""
        with self._lock:
            return frozenset(self._states)

    def _watch_loop(self, kind: Kind) -> None:
        while not self._stopped.is_set():
            try:
                items, version = self._api.list(kind)
                self.replace(kind, items)
                events = self._api.watch(kind, version, WATCH_TIMEOUT_S)
                try:
                    for event_type, obj in events:
                        if self._stopped.is_set() or event_type == "ERROR":
                            break  # ERROR: usually 410 Gone, the version is too old; re-list
                        self.apply(kind, event_type, obj)
                finally:
                    close = getattr(events, "close", None)
                    if close is not None:
                        close()  # ends the stream (KubePoolApi stops its Watch)
            except Exception as err:  # the API server away or restarting: keep the last view, retry
                log.warning("watching the pool's %s failed, retrying in %.0f s: %s", kind, RETRY_S, err)
                time.sleep(RETRY_S)

    def replace(self, kind: Kind, items: list[dict[str, Any]]) -> None:
        """Take a fresh list of `kind` (what each watch does first and after each lost stream)."""
        with self._lock:
            if kind == "pods":
                self._pods = {p["metadata"]["name"]: p for p in items}
            elif kind == "kvloads":
                self._kvloads = {k["metadata"]["name"]: k for k in items}
            else:
                self._pool = items[0] if items else None
                self._refresh_config()
            self._synced[kind] = True
            self._publish()

    def apply(self, kind: Kind, event_type: str, obj: dict[str, Any]) -> None:
        """Take one watch event of `kind` (ADDED, MODIFIED or DELETED)."""
        with self._lock:
            if kind in ("pods", "kvloads"):
                objects = self._pods if kind == "pods" else self._kvloads
                if event_type == "DELETED":
                    objects.pop(obj["metadata"]["name"], None)
                else:
                    objects[obj["metadata"]["name"]] = obj
            else:
                self._pool = None if event_type == "DELETED" else obj
                self._refresh_config()
            self._publish()

    def _refresh_config(self) -> None:
        """Re-read the scheduling settings when the spec changed, not on every status write (so an
        unreadable spec is warned about once per generation, not once per epoch)."""
        generation = ((self._pool or {}).get("metadata") or {}).get("generation") if self._pool else None
        if self._pool is None or generation is None or generation != self._config_generation:
            self._config = config_of(self._pool)
            self._config_generation = generation

    def _publish(self) -> None:
        # A worker whose pod and KVLoad are the versions its state was built from keeps that state:
        # an event re-reads one worker, and a re-list (every WATCH_TIMEOUT_S) none that did not change.
        cached, self._states = self._states, {}
        states: list[WorkerState] = []
        for name in sorted(self._pods):
            pod, kvload = self._pods[name], self._kvloads.get(name)
            versions = _versions(pod, kvload)
            hit = cached.get(name)
            state = hit[1] if hit is not None and versions is not None and hit[0] == versions else (
                worker_state(pod, report_of(pod, kvload)))
            if versions is not None:
                self._states[name] = (versions, state)
            states.append(state)
        workers = tuple(states)
        locality, ttl_s = locality_of(self._pool)
        self._snapshot = PoolSnapshot(workers, routes_of(self._pool), synced=all(self._synced.values()),
                                      config=self._config, policy=policy_of(self._pool), locality=locality,
                                      prefix_ttl_s=ttl_s, disaggregation=disaggregation_of(self._pool))
