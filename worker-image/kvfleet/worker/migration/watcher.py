"""Runs the KVMigration objects that name this worker as the source, and reports them in their status.

The operator plans migrations as KVMigration objects (docs/operator.md); the source worker is the one
that can carry a move out, because it holds the request and its stream. This watcher lists and
watches its pool's KVMigrations (label `kvfleet.dev/pool=<pool>`, in its namespace), runs each
Pending one whose `spec.sourcePod` is this pod, once, and writes the status the operator reads,
as the e2e suite's scripted worker does: `Transferring` with `startTime`, then `Succeeded`
(`bytesMoved`, `tokensMoved`, `downtimeSeconds`, `downtime`, `message`) or `Failed` (`message`), with
`completionTime`. The target's address is its Pod's IP with the pool's HTTP and migration ports.
The spec is read, and the status written, through kvfleet.api.models (`KVMigrationSpec`,
`KVMigrationStatus`), the models the operator writes and reads them with: a field renamed on one
side is an error on both, not a move this side silently misreads.

The Kubernetes client is synchronous: its calls run in threads, and the watch stream runs in a
thread of its own that hands objects to the event loop.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from pydantic import ValidationError

from kvfleet.api.incluster import load_config
from kvfleet.api.models import GROUP, POOL_LABEL, SHORT_TEXT_MAX_LENGTH, VERSION, KVMigrationSpec, KVMigrationStatus
from kvfleet.mell.migration import MoveMode
from kvfleet.worker.migration.executor import MigrationResult
from kvfleet.worker.migration.handoff import HandoffTarget

log = logging.getLogger(__name__)

PLURAL = "kvmigrations"
# A watch is re-opened this often (and after any error, after RETRY_S) so that a silently stalled
# stream cannot hide new migrations for long.
WATCH_TIMEOUT_S = 30
RETRY_S = 1.0

# (request id, target, migration address, mode, KV bytes a hybrid move copies or None)
Migrate = Callable[[str, HandoffTarget, str, MoveMode, int | None], Awaitable[MigrationResult]]


class MigrationAPI(Protocol):
    """The three Kubernetes calls the watcher makes (a fake stands in for them in unit tests)."""

    def list(self) -> tuple[list[dict[str, Any]], str]:
        """The pool's KVMigrations and the list's resourceVersion."""
        ...

    def watch(self, resource_version: str, timeout_s: int, stop: threading.Event) -> Any:
        """Iterates watch events ({"type", "object"}) from resource_version until timeout or stop."""
        ...

    def patch_status(self, name: str, status: dict[str, Any]) -> None: ...

    def pod_ip(self, pod_name: str) -> str | None: ...


def _stamp() -> dt.datetime:
    """Now, to the second (the status's times are RFC 3339 seconds)."""
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _message(text: str) -> str:
    """`text` cut to what status.message holds: the API server refuses a longer one, and with it the
    whole status write, which would leave the move Transferring until the operator's timeout."""
    return text[:SHORT_TEXT_MAX_LENGTH]


def format_downtime(seconds: float) -> str:
    """downtimeSeconds for people, as `kubectl get kvmigrations` shows it: 35ms, 1.2s."""
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.1f}s"


@dataclass(frozen=True)
class WatcherConfig:
    pod_name: str
    namespace: str
    pool: str
    http_port: int
    migration_port: int


class MigrationWatcher:
    def __init__(self, config: WatcherConfig, api: MigrationAPI, migrate: Migrate) -> None:
        self.config = config
        self._api = api
        self._migrate = migrate
        # Names seen through to a final status, or running: each KVMigration runs at most once here.
        self._taken: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        stop = threading.Event()

        def pump() -> None:
            """The blocking list-then-watch loop, in its own thread."""
            while not stop.is_set():
                try:
                    items, version = self._api.list()
                    for item in items:
                        loop.call_soon_threadsafe(queue.put_nowait, item)
                    for event in self._api.watch(version, WATCH_TIMEOUT_S, stop):
                        if event.get("type") == "ERROR":  # e.g. 410 Gone: the version is too old
                            raise RuntimeError(f"watch error: {event.get('object')}")
                        if event.get("type") in ("ADDED", "MODIFIED"):
                            loop.call_soon_threadsafe(queue.put_nowait, event["object"])
                except Exception as err:  # the API server may be away; list again shortly
                    if stop.is_set():
                        return
                    log.warning("watching KVMigrations: %s; listing again in %.0f s", err, RETRY_S)
                    stop.wait(RETRY_S)

        thread = threading.Thread(target=pump, name="kvfleet-kvmigration-watch", daemon=True)
        thread.start()
        try:
            while True:
                self.consider(await queue.get())
        finally:
            stop.set()
            for task in list(self._tasks):
                task.cancel()

    def consider(self, obj: dict[str, Any]) -> None:
        """Starts the migration if it is ours, Pending, and not taken yet."""
        raw_spec = obj.get("spec") or {}
        name = (obj.get("metadata") or {}).get("name")
        phase = (obj.get("status") or {}).get("phase", "Pending")
        if not name or raw_spec.get("sourcePod") != self.config.pod_name or phase != "Pending" or name in self._taken:
            return
        self._taken.add(name)
        try:
            spec: KVMigrationSpec | str = KVMigrationSpec.model_validate(raw_spec)
        except ValidationError as err:
            # Ours, but not a spec this worker reads (an operator of another release): say so at once
            # rather than leave the move Pending until its timeout.
            spec = f"spec not readable by this worker: {err}"
        task = asyncio.create_task(self.execute(name, spec), name=f"kvfleet-kvmigration-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _patch(self, name: str, status: KVMigrationStatus) -> None:
        try:
            await asyncio.to_thread(self._api.patch_status, name, status.to_wire())
        except Exception as err:
            log.warning("KVMigration %s: status %s not written: %s", name, status.phase, err)

    async def execute(self, name: str, spec: KVMigrationSpec | str) -> None:
        """Run one KVMigration (`spec`; or the reason it could not be read, to fail it with)."""
        await self._patch(name, KVMigrationStatus(phase="Transferring", start_time=_stamp()))
        if isinstance(spec, str):
            await self._patch(name, KVMigrationStatus(phase="Failed", completion_time=_stamp(), message=_message(spec)))
            return
        request_id, target_pod, mode = spec.request_id, spec.target_pod, spec.mode
        try:
            ip = await asyncio.to_thread(self._api.pod_ip, target_pod)
        except Exception as err:
            ip = None
            log.warning("KVMigration %s: reading target pod %s: %s", name, target_pod, err)
        if not ip:
            await self._patch(name, KVMigrationStatus(phase="Failed", completion_time=_stamp(),
                                                      message=_message(f"target pod {target_pod} has no IP (gone or not started)")))
            return
        target = HandoffTarget(target_pod, f"{ip}:{self.config.http_port}")
        log.info("KVMigration %s: moving %s to %s (%s) in %s mode", name, request_id, target_pod, ip, mode)
        # A hybrid move copies what the planner gave its link (expectedBytes) and re-prefills the rest.
        kv_bytes = spec.expected_bytes if mode == MoveMode.HYBRID else None
        result = await self._migrate(request_id, target, f"{ip}:{self.config.migration_port}", mode, kv_bytes)
        if result.succeeded:
            downtime_s = result.downtime_s or 0.0
            await self._patch(name, KVMigrationStatus(
                phase="Succeeded", completion_time=_stamp(), bytes_moved=result.bytes_moved,
                tokens_moved=result.tokens_moved, downtime_seconds=round(downtime_s, 4),
                downtime=format_downtime(downtime_s), message=_message(result.message)))
        else:
            await self._patch(name, KVMigrationStatus(phase="Failed", completion_time=_stamp(),
                                                      message=_message(result.message)))


class KubernetesMigrationAPI:
    """MigrationAPI with the pod's ServiceAccount (the Role `<pool>-worker`)."""

    def __init__(self, namespace: str, pool: str) -> None:
        from kubernetes import client

        load_config()
        self._custom = client.CustomObjectsApi()
        self._core = client.CoreV1Api()
        self._namespace = namespace
        self._selector = f"{POOL_LABEL}={pool}"

    def list(self) -> tuple[list[dict[str, Any]], str]:
        listing = cast(dict[str, Any], self._custom.list_namespaced_custom_object(
            GROUP, VERSION, self._namespace, PLURAL, label_selector=self._selector, _request_timeout=30))
        return list(listing.get("items", [])), str(listing.get("metadata", {}).get("resourceVersion", ""))

    def watch(self, resource_version: str, timeout_s: int, stop: threading.Event) -> Any:
        from kubernetes import watch

        w = watch.Watch()  # type: ignore[no-untyped-call]
        for event in w.stream(self._custom.list_namespaced_custom_object, GROUP, VERSION, self._namespace, PLURAL,
                              label_selector=self._selector, resource_version=resource_version,
                              timeout_seconds=timeout_s, _request_timeout=timeout_s + 5):  # type: ignore[no-untyped-call]
            if stop.is_set():
                w.stop()  # type: ignore[no-untyped-call]
                return
            yield event

    def patch_status(self, name: str, status: dict[str, Any]) -> None:
        self._custom.patch_namespaced_custom_object_status(GROUP, VERSION, self._namespace, PLURAL, name,
                                                           {"status": status}, _request_timeout=10)

    def pod_ip(self, pod_name: str) -> str | None:
        pod = self._core.read_namespaced_pod(pod_name, self._namespace, _request_timeout=10)
        ip = pod.status.pod_ip if pod.status else None
        return str(ip) if ip else None
