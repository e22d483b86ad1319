"""The Kubernetes API as a pool's epoch uses it: the `KubeApi` contract and `Kube`, the real client.

An epoch (kvfleet.operator.reconcile) talks to the cluster only through `KubeApi`, a Protocol of the few
reads and writes it makes, so that anything standing in for the cluster (kvfleet.operator.memory, for
the unit tests and bench/operator_epochs.py) is checked against the same contract by mypy and cannot
fall behind the reconcile. `Kube` implements it over the kubernetes client; each call tolerates the
races a restart or a peer causes (a 409 on create, a 404 on delete), so a pass can be repeated.
Every write goes through `Kube.record_write` first, which is also where the leader's write fence
(the `write_fence` a `Kube` is made with, kvfleet.operator.leader) runs: a replica that lost its
Lease makes no write.

The pool's worker pods and KVLoads, which every pass reads whole, come from watch caches (`WatchCache`,
one per namespace and kind: a list, then a watch from its resourceVersion) instead of a list per
pass: at 1,000 workers that list was 9.4 MB of JSON parsed every pass (docs/scale.md). Until a cache
has read its first list, a pass lists, as before.

Every Kubernetes client call of the operator's own code is here or in leader.py:
tests/unit/test_chart.py reads them out of these sources to check the chart's RBAC.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar, cast

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvfleet.api.incluster import load_config, read_items, read_through
from kvfleet.api.models import GROUP, POOL_LABEL, VERSION
from kvfleet.api.reports import KVLOAD_PLURAL
from kvfleet.operator import resources

T = TypeVar("T")
# Labels, then annotations, to set on one pod (a None value removes the key).
MetadataChanges = tuple[Mapping[str, str | None], Mapping[str, str | None]]
# Pod patches of one epoch in flight at once (the client's connection pool holds cpu_count * 5).
PATCH_CONCURRENCY = 8

log = logging.getLogger(__name__)

# A cache's watch is re-opened this often even when quiet (server side), so a silently dead
# connection costs at most this plus the client's read timeout; after a failure it retries this soon.
# The longest a write of the operator's own is laid over a watch cache that has not shown it (OwnWrites).
OWN_WRITES_S = 30.0
# How long the nodes' zones are trusted, and how soon a node not among them makes the list be read again.
NODE_ZONES_TTL_S = 60.0
NODE_ZONES_MISS_S = 5.0
WATCH_TIMEOUT_S = 60
WATCH_RETRY_S = 1.0

FIELD_MANAGER = "kvfleet-operator"
PLURAL = "llmpools"

# Called with the write's kind before every write; raises (or ends the process) to refuse it.
WriteFence = Callable[[str], None]


class KubeApi(Protocol):
    """The reads and writes of one pool's epoch. Objects are dicts shaped as the API serialises them.

    Creates return False when the object exists already; deletes and pod patches of an object that
    is gone do nothing. Every write is counted for the calling thread (one pool's daemon), by kind
    (`create_pod`, `patch_llmpool_status`, ...), until `writes` hands the counts over.
    """

    def writes(self) -> dict[str, int]:
        """This thread's write counts by kind since the last call (and resets them)."""
        ...

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The LLMPool, or None when it does not exist."""
        ...

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge `status` into the LLMPool's status subresource."""
        ...

    def exists(self, namespace: str, kind: str, name: str) -> bool:
        """Whether an owned object (Secret, ServiceAccount, Role, RoleBinding, Service, PriorityClass) exists."""
        ...

    def create(self, namespace: str, obj: dict[str, Any]) -> bool:
        """Create `obj` (a Pod or an owned object) unless it exists. True if created."""
        ...

    def role_rules(self, namespace: str, name: str) -> list[dict[str, Any]] | None:
        """A Role's rules (camelCase dicts), or None when it does not exist."""
        ...

    def patch_role_rules(self, namespace: str, name: str, rules: list[dict[str, Any]]) -> None:
        """Set a Role's rules (a release that changes what its workers or router may do)."""
        ...

    def deployment_replicas(self, namespace: str, name: str) -> int | None:
        """The replicas of a Deployment, or None when it does not exist."""
        ...

    def deployment_image_and_ready(self, namespace: str, name: str) -> tuple[str, int] | None:
        """The first container's image and the ready replicas of a Deployment, or None when it does not exist."""
        ...

    def replace_deployment_template(self, namespace: str, body: dict[str, Any]) -> None:
        """Roll a Deployment to the pod template of `body`."""
        ...

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None: ...

    def delete_deployment(self, namespace: str, name: str) -> None: ...

    def worker_pods(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        """The pool's worker pods (resources.worker_selector), as a watch cache has them."""
        ...

    def list_worker_pods(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        """The pool's worker pods read now, the pass's own creates and deletes included."""
        ...

    def list_kvloads(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        """The KV-load reports of the pool's workers (KVLoads labelled POOL_LABEL)."""
        ...

    def delete_pod(self, namespace: str, name: str) -> None: ...

    def patch_pods_metadata(self, namespace: str, changes: Mapping[str, MetadataChanges]) -> None:
        """Set these labels and annotations (in this order) of each pod named (a None value removes the
        key); one write per pod, counted in the calling thread."""
        ...

    def node_zones(self, nodes: Collection[str]) -> dict[str, str]:
        """Node name -> zone label, for MELL's distance term and the migration planner's links: at least
        these nodes (a node the API does not know is missing)."""
        ...

    def list_migrations(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        """The pool's KVMigrations (label POOL_LABEL)."""
        ...

    def create_migration(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create a KVMigration unless one of that name exists. True if created."""
        ...

    def patch_migration_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...

    def delete_migration(self, namespace: str, name: str) -> None: ...

    def post_event(self, pool: dict[str, Any], reason: str, message: str, warning: bool = False) -> None:
        """A Kubernetes Event on the pool, counted as a write of the epoch."""
        ...


def _or_none_on(status: int, call: Callable[[], T]) -> T | None:
    """`call()`, or None when the API server answers `status`: 404 for a read of something missing or a
    delete or patch of something already gone, 409 for a create of something a previous pass (or a
    peer) made. Any other error is raised."""
    try:
        return call()
    except ApiException as err:
        if err.status == status:
            return None
        raise


class WatchCache:
    """The objects one list call selects, kept current in a thread by a watch from the list's
    resourceVersion (re-listed after a 410 or a failed stream), the way a client-go informer does.

    `lister(**kwargs)` is the kubernetes client's list call with its namespace and selectors bound;
    it is called with `_preload_content=False` (objects stay the API's JSON, no client models) for the
    list and, with `watch=True`, for the watch. `items()` is None until the first list is in.
    Objects are never changed in place: an event replaces the object, so a list handed out stays as
    it was.
    """

    def __init__(self, what: str, lister: Callable[..., Any]) -> None:
        self.what = what
        self._lister = lister
        self._lock = threading.Lock()
        self._objects: dict[str, dict[str, Any]] | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{what}", daemon=True)
        self.events = 0  # watch events applied (tests, the bench's curiosity)

    def start(self) -> WatchCache:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def items(self) -> list[dict[str, Any]] | None:
        with self._lock:
            return None if self._objects is None else list(self._objects.values())

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                listing = json.loads(self._lister(_preload_content=False).data)
                version = str(listing["metadata"]["resourceVersion"])
                with self._lock:
                    self._objects = {obj["metadata"]["name"]: _slim(obj) for obj in listing.get("items") or []}
                while not self._stopped.is_set():
                    resumed = self._watch(version)
                    if resumed is None:
                        break  # the version is gone (410): list again
                    version = resumed
            except Exception as err:  # the API server away or restarting: keep what is cached, retry
                log.warning("watching %s failed, listing again in %.0f s: %s", self.what, WATCH_RETRY_S, err)
                time.sleep(WATCH_RETRY_S)

    def _watch(self, version: str) -> str | None:
        """Apply events from `version` until the watch ends; the version to resume from, or None
        when the server says to list again."""
        answer = self._lister(watch=True, resource_version=version, timeout_seconds=WATCH_TIMEOUT_S,
                              allow_watch_bookmarks=True, _preload_content=False,
                              _request_timeout=(10, WATCH_TIMEOUT_S + 30))
        try:
            for line in _lines(answer):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return None
                version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                with self._lock:
                    assert self._objects is not None
                    if kind == "DELETED":
                        self._objects.pop(name, None)
                    else:
                        self._objects[name] = _slim(obj)
                self.events += 1
                if self._stopped.is_set():
                    break
        finally:
            answer.close()  # a stream left midway (stopped) must not go back to the pool unread
            answer.release_conn()
        return version


class OwnWrites:
    """A watch cache's view with this process's own writes laid over it until the cache shows them
    (read-your-writes, as a controller's "expectations" give it): a pass reads the KVMigrations from a
    watch cache, and one second later the next pass must see the ones it created, failed or deleted,
    or it orders the same move twice.

    Per object: one created shows until the cache has it; one patched shows until the cache's
    resourceVersion of it is no longer the one it had before the patch (any newer version includes the
    patch: writes to an object are serialised); one deleted is hidden while the cache still has it.
    Each is dropped after OWN_WRITES_S whatever the cache says, so a lost event cannot pin an object.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # (namespace, name) -> (written at, the object as written or None if deleted, cache version before)
        self._writes: dict[tuple[str, str], tuple[float, dict[str, Any] | None, str | None]] = {}

    def created(self, namespace: str, obj: dict[str, Any]) -> None:
        self._put(namespace, obj["metadata"]["name"], obj, None)

    def patched(self, namespace: str, obj: dict[str, Any], version_before: str | None) -> None:
        self._put(namespace, obj["metadata"]["name"], obj, version_before)

    def deleted(self, namespace: str, name: str) -> None:
        self._put(namespace, name, None, None)

    def _put(self, namespace: str, name: str, obj: dict[str, Any] | None, version_before: str | None) -> None:
        with self._lock:
            self._writes[(namespace, name)] = (self._clock(), obj, version_before)

    def over(self, namespace: str, cached: list[dict[str, Any]], pool_name: str) -> list[dict[str, Any]]:
        """`cached` (one pool's objects in a namespace) with this process's writes laid over it."""
        by_name = {obj["metadata"]["name"]: obj for obj in cached}
        now_s = self._clock()
        with self._lock:
            for key, (at_s, obj, version_before) in list(self._writes.items()):
                name = key[1]
                seen = by_name.get(name)
                if now_s - at_s > OWN_WRITES_S:
                    del self._writes[key]
                elif key[0] != namespace:
                    continue
                elif obj is None:  # deleted by us
                    if seen is None:
                        del self._writes[key]
                    else:
                        del by_name[name]
                elif seen is not None and (version_before is None
                                           or str(seen["metadata"].get("resourceVersion")) != version_before):
                    del self._writes[key]  # the cache has caught up with the write
                elif (obj["metadata"].get("labels") or {}).get(POOL_LABEL) == pool_name:
                    by_name[name] = obj
        return list(by_name.values())


def _of_pool(objects: list[dict[str, Any]], pool_name: str) -> list[dict[str, Any]]:
    """The objects a namespace's cache holds that are labelled with this pool."""
    return [obj for obj in objects if (obj["metadata"].get("labels") or {}).get(POOL_LABEL) == pool_name]


def _slim(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as cached: without its managedFields (who set which field, a third of a pod's JSON
    here), which nothing in a pass reads."""
    obj.get("metadata", {}).pop("managedFields", None)
    return obj


def _lines(answer: Any) -> Iterator[str]:
    """The lines of a streamed answer (one watch event each), a line split across reads joined."""
    rest = b""
    for chunk in answer.stream(amt=None, decode_content=False):
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            if line.strip():
                yield line.decode()
    if rest.strip():
        yield rest.decode()


class Kube:
    """`KubeApi` over the kubernetes client.

    Writes are counted per thread (each pool's daemon is one thread), so an epoch can report its own.
    `write_fence(kind)` is checked before each write (None: no check, without leader election).
    """

    def __init__(self, write_fence: WriteFence | None = None) -> None:
        self._local = threading.local()
        self._write_fence = write_fence
        load_config()
        self.core = client.CoreV1Api()
        self.rbac = client.RbacAuthorizationV1Api()
        self.custom = client.CustomObjectsApi()
        self.apps = client.AppsV1Api()
        self.scheduling = client.SchedulingV1Api()
        self._patchers = ThreadPoolExecutor(PATCH_CONCURRENCY, thread_name_prefix="pod-patch")
        # (namespace, "pods" | "kvloads") -> its cache, started by the first pass that reads it.
        self._caches: dict[tuple[str, str], WatchCache] = {}
        self._caches_lock = threading.Lock()
        # The operator's own KVMigration writes, until the watch cache shows them (OwnWrites).
        self._own_migrations = OwnWrites()
        # The nodes' zones as last listed, and when (node_zones).
        self._zones: tuple[float, dict[str, str]] = (-math.inf, {})
        self._zones_lock = threading.Lock()

    def writes(self) -> dict[str, int]:
        counts: dict[str, int] = getattr(self._local, "writes", {})
        self._local.writes = {}
        return counts

    def record_write(self, kind: str) -> None:
        """Called before each write: the fence may refuse it (by raising), else it is counted."""
        if self._write_fence is not None:
            self._write_fence(kind)
        counts: dict[str, int] | None = getattr(self._local, "writes", None)
        if counts is None:
            counts = self._local.writes = {}
        counts[kind] = counts.get(kind, 0) + 1

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        # CustomObjectsApi returns the decoded JSON, which its annotations call `object`.
        return cast(dict[str, Any] | None,
                    _or_none_on(404, lambda: self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)))

    def stop_watching(self) -> None:
        """End the watch caches' threads (each at its stream's next event or end)."""
        with self._caches_lock:
            for cache in self._caches.values():
                cache.stop()

    def _cache(self, namespace: str, kind: str) -> WatchCache:
        with self._caches_lock:
            cache = self._caches.get((namespace, kind))
            if cache is None:
                # Calls written out (not functools.partial): tests/unit/test_chart.py reads each call's
                # resource from these sources to check the chart's RBAC.
                if kind == "pods":
                    def lister(**kwargs: Any) -> Any:
                        return self.core.list_namespaced_pod(
                            namespace, label_selector=f"{POOL_LABEL},{resources.COMPONENT_LABEL}=worker", **kwargs)
                elif kind == "kvmigrations":
                    def lister(**kwargs: Any) -> Any:
                        return self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "kvmigrations",
                                                                         label_selector=POOL_LABEL, **kwargs)
                else:
                    def lister(**kwargs: Any) -> Any:
                        return self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, KVLOAD_PLURAL,
                                                                         label_selector=POOL_LABEL, **kwargs)
                cache = self._caches[(namespace, kind)] = WatchCache(f"{kind} of {namespace}", lister).start()
            return cache

    def worker_pods(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        # Dicts as the API serialises them, like every other object here.
        cached = self._cache(namespace, "pods").items()
        if cached is not None:
            return _of_pool(cached, pool_name)
        return self.list_worker_pods(namespace, pool_name)

    def list_worker_pods(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        """The pool's worker pods read now (what a pass reads right after creating or deleting some)."""
        return read_items(self.core.list_namespaced_pod(namespace, label_selector=resources.worker_selector(pool_name),
                                                        _preload_content=False))

    def list_kvloads(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        cached = self._cache(namespace, "kvloads").items()
        if cached is not None:
            return _of_pool(cached, pool_name)
        return read_items(self.custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, KVLOAD_PLURAL, label_selector=f"{POOL_LABEL}={pool_name}", _preload_content=False))

    def create(self, namespace: str, obj: dict[str, Any]) -> bool:
        kind = obj["kind"]
        creates: dict[str, Callable[..., object]] = {
            "Pod": self.core.create_namespaced_pod,
            "Secret": self.core.create_namespaced_secret,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "Deployment": self.apps.create_namespaced_deployment,
            "Service": self.core.create_namespaced_service,
            "PriorityClass": lambda _namespace, body, **kw: self.scheduling.create_priority_class(body, **kw),
        }
        create = creates[kind]
        self.record_write(f"create_{kind.lower()}")
        # A dict body goes to the API server as it is; the client's annotations ask for its models.
        return _or_none_on(409, lambda: create(namespace, obj, field_manager=FIELD_MANAGER)) is not None

    def exists(self, namespace: str, kind: str, name: str) -> bool:
        reads: dict[str, Callable[[str, str], object]] = {
            "Secret": self.core.read_namespaced_secret,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Role": self.rbac.read_namespaced_role,
            "RoleBinding": self.rbac.read_namespaced_role_binding,
            "Service": self.core.read_namespaced_service,
            "PriorityClass": lambda name, _namespace: self.scheduling.read_priority_class(name),
        }
        read = reads[kind]
        return _or_none_on(404, lambda: read(name, namespace)) is not None

    def role_rules(self, namespace: str, name: str) -> list[dict[str, Any]] | None:
        role = _or_none_on(404, lambda: self.rbac.read_namespaced_role(name, namespace))
        if role is None:
            return None
        rules = client.ApiClient().sanitize_for_serialization(role.rules or [])  # type: ignore[no-untyped-call]
        return list(rules)

    def patch_role_rules(self, namespace: str, name: str, rules: list[dict[str, Any]]) -> None:
        self.record_write("patch_role")
        # A merge patch replaces the rules list whole.
        self.rbac.patch_namespaced_role(name, namespace, {"rules": rules}, field_manager=FIELD_MANAGER)

    def deployment_replicas(self, namespace: str, name: str) -> int | None:
        deployment = _or_none_on(404, lambda: self.apps.read_namespaced_deployment(name, namespace))
        if deployment is None:
            return None
        # The API server always returns a Deployment's spec (a missing replicas field reads as 0).
        assert deployment.spec is not None
        return int(deployment.spec.replicas or 0)

    def deployment_image_and_ready(self, namespace: str, name: str) -> tuple[str, int] | None:
        deployment = _or_none_on(404, lambda: self.apps.read_namespaced_deployment(name, namespace))
        if deployment is None:
            return None
        # The API server always returns a Deployment's spec with its pod template's spec, and a status.
        assert deployment.spec is not None and deployment.spec.template.spec is not None and deployment.status is not None
        return str(deployment.spec.template.spec.containers[0].image), int(deployment.status.ready_replicas or 0)

    def replace_deployment_template(self, namespace: str, body: dict[str, Any]) -> None:
        """A merge patch of the Deployment's spec.template with `body`'s."""
        self.record_write("patch_deployment")
        self.apps.patch_namespaced_deployment(body["metadata"]["name"], namespace, {"spec": {"template": body["spec"]["template"]}},
                                              field_manager=FIELD_MANAGER)

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        self.record_write("patch_deployment")
        self.apps.patch_namespaced_deployment(name, namespace, {"spec": {"replicas": replicas}}, field_manager=FIELD_MANAGER)

    def delete_deployment(self, namespace: str, name: str) -> None:
        self.record_write("delete_deployment")
        _or_none_on(404, lambda: self.apps.delete_namespaced_deployment(name, namespace))

    def delete_pod(self, namespace: str, name: str) -> None:
        self.record_write("delete_pod")
        _or_none_on(404, lambda: self.core.delete_namespaced_pod(name, namespace))

    def node_zones(self, nodes: Collection[str]) -> dict[str, str]:
        # A node's zone does not change while it lives: the list is kept NODE_ZONES_TTL_S, and read again
        # sooner only for a node it does not hold (a new node, at most once per NODE_ZONES_MISS_S).
        now_s = time.monotonic()
        with self._zones_lock:
            listed_s, zones = self._zones
            age_s = now_s - listed_s
            if age_s < NODE_ZONES_TTL_S and (age_s < NODE_ZONES_MISS_S or all(n in zones for n in nodes if n)):
                return zones
            zone_label = "topology.kubernetes.io/zone"
            zones = {str(n["metadata"]["name"]): (n["metadata"].get("labels") or {}).get(zone_label, "")
                     for n in read_items(self.core.list_node(_preload_content=False))}
            self._zones = (now_s, zones)
            return zones

    def patch_pods_metadata(self, namespace: str, changes: Mapping[str, MetadataChanges]) -> None:
        # The patches go out together (PATCH_CONCURRENCY at a time): an epoch that rebinds hundreds of
        # workers waited for each answer in turn, seconds at 1,000 workers (docs/scale.md).
        def patch(name: str, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]) -> None:
            body: dict[str, Any] = {"metadata": {}}
            if labels:
                body["metadata"]["labels"] = dict(labels)
            if annotations:
                body["metadata"]["annotations"] = dict(annotations)
            _or_none_on(404, lambda: read_through(self.core.patch_namespaced_pod(
                name, namespace, body, field_manager=FIELD_MANAGER, _preload_content=False)))

        for _ in changes:
            self.record_write("patch_pod")
        # list() waits for all and raises the first failure.
        list(self._patchers.map(lambda item: patch(item[0], *item[1]), changes.items()))

    def list_migrations(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        cached = self._cache(namespace, "kvmigrations").items()
        if cached is None:
            listing = cast(dict[str, Any], self.custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, "kvmigrations", label_selector=f"{POOL_LABEL}={pool_name}"))
            return list(listing.get("items", []))
        return self._own_migrations.over(namespace, _of_pool(cached, pool_name), pool_name)

    def create_migration(self, namespace: str, body: dict[str, Any]) -> bool:
        self.record_write("create_kvmigration")
        made = _or_none_on(409, lambda: self.custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "kvmigrations", body, field_manager=FIELD_MANAGER))
        if made is not None:
            self._own_migrations.created(namespace, cast(dict[str, Any], made))
        return made is not None

    def patch_migration_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.record_write("patch_kvmigration_status")
        before = self._cached_version(namespace, "kvmigrations", name)
        patched = self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "kvmigrations", name,
                                                                    {"status": status}, field_manager=FIELD_MANAGER)
        self._own_migrations.patched(namespace, cast(dict[str, Any], patched), before)

    def delete_migration(self, namespace: str, name: str) -> None:
        self.record_write("delete_kvmigration")
        _or_none_on(404, lambda: self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "kvmigrations", name))
        self._own_migrations.deleted(namespace, name)

    def _cached_version(self, namespace: str, kind: str, name: str) -> str | None:
        """The resourceVersion the cache holds of one object (None: not cached, or no cache yet)."""
        for obj in self._cache(namespace, kind).items() or []:
            if obj["metadata"]["name"] == name:
                return str(obj["metadata"].get("resourceVersion"))
        return None

    def post_event(self, pool: dict[str, Any], reason: str, message: str, warning: bool = False) -> None:
        """Posted by kopf (its event queue), so it needs kopf's context: call it from a handler's thread."""
        self.record_write("event")
        (kopf.warn if warning else kopf.info)(kopf.Body(cast(kopf.RawBody, pool)), reason=reason, message=message)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.record_write("patch_llmpool_status")
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}, field_manager=FIELD_MANAGER
        )
