"""Writes the worker's KV-load report to its own KVLoad object, the one place the operator reads load from.

The format is `kvfleet.api.reports.KVLoadReport` (docs/worker.md), in a KVLoad named after the
worker's pod and owned by it (`kvload_writer`); `pod_annotation_writer` writes it where workers
wrote it before KVLoad objects existed, an annotation of the pod, which bench/report_scale.py measures it against.
MELL only needs to hear about a request when it arrives, finishes, or changes size
class, so the reporter compares the set of (request, size class) pairs with what it last wrote and
writes only when that changed, at most once per scheduling epoch, never per token. A failed write is
retried on the next tick; a report is always a whole snapshot, so nothing is lost by coalescing.

The report also carries what the migration executor measured (link bytes/s as a source, re-prefill
tokens/s as a target) and the engine's block size: the inputs of the operator's §V planner. A new
measurement alone does not cause a write; it rides on the next one, and every migration that
measures something also changes the request set of both workers, which does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from kvfleet.api.incluster import load_config, read_through
from kvfleet.api.models import GROUP, VERSION
from kvfleet.api.reports import (
    ANNOTATION,
    KVLOAD_PLURAL,
    MAX_REQUESTS_PER_REPORT,
    KVLoadReport,
    RequestLoad,
    kvload_object,
    size_class_name,
)
from kvfleet.worker.engines.base import RequestKV
from kvfleet.worker.engines.capabilities import MemoryState

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

WriteReport = Callable[[KVLoadReport], Awaitable[None]]


@dataclass(frozen=True)
class ReportKey:
    """What decides whether a new report is worth a write: the requests and their size classes, and
    an elastic worker's capacity in steps of CAPACITY_STEP_FRACTION of its capacity at rest."""

    classes: tuple[tuple[str, str, str, str], ...]
    capacity_step: int = 0
    # DistKV: what it lends and borrows (the operator's ledger and plan follow it, docs/distkv.md).
    lending: tuple[int, tuple[tuple[str, int], ...]] = (0, ())
    # A prefill worker's hand-overs so far (the pool's status sums them): a request handed over within
    # one interval of its arrival leaves the requests as they were, and the count would go unwritten.
    transfers: int = 0


# An elastic worker's capacity moves with its activations; a change of this fraction is news to MELL
# (the operator re-plans at 5%, operator/kvfleet/operator/epoch.py), smaller ones ride on the next write.
CAPACITY_STEP_FRACTION = 0.05


@dataclass(frozen=True)
class Measured:
    """The executor's last measured rates; None where nothing was measured yet."""

    link_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None


# The executor's gauges (kvfleet.worker.migration.result.MigrationMetrics) hold its measurements.
LINK_GAUGE = "kvfleet_worker_migration_link_bytes_per_second"
PREFILL_GAUGE = "kvfleet_worker_migration_prefill_tokens_per_second"


def measured_from(registry: CollectorRegistry) -> Callable[[], Measured]:
    """Reads the executor's rate gauges; a gauge at 0 was never set (no migration measured yet)."""

    def read(name: str) -> float | None:
        value = registry.get_sample_value(name)
        return value if value is not None and value > 0 else None

    return lambda: Measured(read(LINK_GAUGE), read(PREFILL_GAUGE))


def build_report(usage: list[RequestKV], capacity_bytes: int, sequence: int,
                 queued: list[RequestKV] | None = None, measured: Measured | None = None,
                 block_size_tokens: int | None = None, finishing_tokens: float | None = None,
                 cpu_buffer_bytes: int | None = None, prefix_cache: CacheFigures | None = None,
                 distkv: DistKVFigures | None = None, pd: PDFigures | None = None) -> KVLoadReport:
    """A report of the requests holding KV (`usage`) and those queued for it. Beyond the size limit
    only the largest are listed (the rest are rare and tiny at that count); used_bytes counts every
    request holding KV, and only those."""
    measured = measured or Measured()
    entries = [(r, False) for r in usage] + [(r, True) for r in queued or []]
    if len(entries) > MAX_REQUESTS_PER_REPORT:
        entries = sorted(entries, key=lambda e: (-e[0].kv_bytes, e[0].request_id))[:MAX_REQUESTS_PER_REPORT]
    entries.sort(key=lambda e: e[0].request_id)
    loads = [RequestLoad(id=r.request_id, kv_bytes=r.kv_bytes, tokens=r.tokens, queued=waiting,
                         size_class=size_class_name(r.kv_bytes, capacity_bytes),
                         finishing=True if _finishing(r, waiting, finishing_tokens) else None,
                         shared_bytes=r.shared_bytes or None, borrowed_bytes=r.borrowed_bytes or None,
                         spans=True if r.spans else None)
             for r, waiting in entries]
    return KVLoadReport(capacity_bytes=capacity_bytes, used_bytes=sum(r.kv_bytes for r in usage), requests=loads,
                        sequence=sequence, link_bytes_per_second=measured.link_bytes_per_s,
                        prefill_tokens_per_second=measured.prefill_tokens_per_s, block_size_tokens=block_size_tokens,
                        cpu_buffer_bytes=cpu_buffer_bytes,
                        evictable_bytes=prefix_cache.evictable_bytes if prefix_cache else None,
                        prefix_cache_blocks=prefix_cache.cached_blocks if prefix_cache else None,
                        lend_cap_bytes=distkv.lend_cap_bytes if distkv else None,
                        lent_bytes=distkv.lent_bytes if distkv and distkv.lend_cap_bytes is not None else None,
                        borrowed=dict(distkv.borrowed) if distkv and distkv.borrowed else None,
                        queued_prefill_tokens=pd.queued_prefill_tokens if pd else None,
                        kv_transfers=pd.kv_transfers if pd else None)


@dataclass(frozen=True)
class PDFigures:
    """A disaggregated pool's worker's figures (docs/disaggregation.md): the prompt tokens queued on it,
    which the operator sizes the prefill tier by, and (a prefill worker) the requests it handed over."""

    queued_prefill_tokens: int
    kv_transfers: int | None = None


@dataclass(frozen=True)
class DistKVFigures:
    """A DistKV engine's lending and borrowing as a report states them (docs/distkv.md)."""

    lend_cap_bytes: int | None
    lent_bytes: int
    borrowed: Mapping[str, int]


@dataclass(frozen=True)
class CacheFigures:
    """A prefix-caching engine's cache as a report states it (capabilities.PrefixCacheStats in bytes);
    None where the engine cannot see it (vLLM)."""

    evictable_bytes: int | None
    cached_blocks: int | None


def _finishing(r: RequestKV, queued: bool, finishing_tokens: float | None) -> bool:
    """It runs and has at most `finishing_tokens` left to write (what the worker decodes in the window)."""
    return (not queued and finishing_tokens is not None and r.remaining_tokens is not None
            and r.remaining_tokens <= finishing_tokens)


def report_key(report: KVLoadReport, rest_capacity_bytes: int | None = None) -> ReportKey:
    step = round(report.capacity_bytes / (rest_capacity_bytes * CAPACITY_STEP_FRACTION)) if rest_capacity_bytes else 0
    lending = (report.lent_bytes or 0, tuple(sorted((report.borrowed or {}).items())))
    return ReportKey(tuple((r.id, r.size_class, str(r.queued), str(r.finishing)) for r in report.requests), step,
                     lending, report.kv_transfers or 0)


class LoadReporter:
    """Ticks every `tick_s`; writes a report when the key changed and the last write is an interval old.

    The key is each request's id, size class, whether it is queued and whether it is finishing:
    admission is news to MELL (the request now holds KV), and so is a request about to end (no move
    should be ordered for it); growth within a class is not. A request is finishing when its remaining
    output takes at most two intervals at `step_s()`, the worker's measured decode step period.
    An elastic engine's `memory()` gives the capacity to report (it moves, see ReportKey) and the KV
    parked in its CPU buffer."""

    def __init__(self, usage: Callable[[], list[RequestKV]], capacity_bytes: int, write: WriteReport, *,
                 interval_s: float, tick_s: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 queued: Callable[[], list[RequestKV]] | None = None,
                 measured: Callable[[], Measured] | None = None, block_size_tokens: int | None = None,
                 step_s: Callable[[], float | None] | None = None,
                 memory: Callable[[], MemoryState] | None = None,
                 prefix_cache: Callable[[], CacheFigures] | None = None,
                 distkv: Callable[[], DistKVFigures] | None = None,
                 pd: Callable[[], PDFigures] | None = None) -> None:
        self._usage = usage
        self._pd = pd
        self._distkv = distkv
        self._memory = memory
        self._prefix_cache = prefix_cache
        self._step_s = step_s
        self._step_s_cached: tuple[float, float | None] = (float("-inf"), None)  # (when read, value)
        self._queued = queued
        self._measured = measured
        self._block_size_tokens = block_size_tokens
        self._capacity_bytes = capacity_bytes
        self._write = write
        self.interval_s = interval_s
        self._tick_s = tick_s
        self._clock = clock
        self._last_key: ReportKey | None = None
        self._last_write_s = float("-inf")
        self.sequence = 0
        self.writes = 0
        self.failures = 0
        self._wake = asyncio.Event()

    def nudge(self) -> None:
        """Check now rather than at the next tick (a request arrived or finished)."""
        self._wake.set()

    async def maybe_write(self) -> bool:
        """One check; True when a report was written."""
        step_s = self._decode_step_s()
        memory = self._memory() if self._memory else None
        report = build_report(self._usage(), memory.kv_capacity_bytes if memory else self._capacity_bytes,
                              self.sequence + 1, self._queued() if self._queued else None,
                              self._measured() if self._measured else None, self._block_size_tokens,
                              finishing_tokens=2 * self.interval_s / step_s if step_s else None,
                              cpu_buffer_bytes=memory.cpu_buffer_bytes if memory else None,
                              prefix_cache=self._prefix_cache() if self._prefix_cache else None,
                              distkv=self._distkv() if self._distkv else None,
                              pd=self._pd() if self._pd else None)
        key = report_key(report, self._capacity_bytes if memory else None)
        if key == self._last_key or self._clock() - self._last_write_s < self.interval_s:
            return False
        try:
            await self._write(report)
        except Exception as err:  # the API server may be briefly away; the next tick retries
            self.failures += 1
            log.warning("KV-load report not written (will retry): %s", err)
            return False
        self.sequence = report.sequence
        self._last_key = key
        self._last_write_s = self._clock()
        self.writes += 1
        return True

    def _decode_step_s(self) -> float | None:
        """The measured decode step period, read at most once an interval (it changes slowly)."""
        if self._step_s is None:
            return None
        read_s, value = self._step_s_cached
        if self._clock() - read_s >= self.interval_s:
            value = self._step_s()
            self._step_s_cached = (self._clock(), value)
        return value

    async def run(self) -> None:
        while True:
            await self.maybe_write()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self._tick_s)
            except TimeoutError:
                pass


def kvload_writer(pod_name: str, namespace: str, pod_uid: str, pool: str,
                  api_client: ApiClient | None = None) -> WriteReport:
    """Writes the report into the worker's KVLoad (kvfleet.api.reports.kvload_object), with its
    ServiceAccount's credentials unless `api_client` is given.

    A write is one JSON patch that replaces the report, on the condition that the object is this
    pod's: a worker pod's name comes back after its pod is deleted (the operator reuses indices), and
    the previous pod's KVLoad lingers until the garbage collector removes it. A missing object is
    created; another pod's is taken over (owner and report replaced in one patch), so it is not
    collected from under this worker."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    if api_client is None:
        load_config()
    custom = client.CustomObjectsApi(api_client)

    def patch(ops: list[dict[str, Any]]) -> None:
        read_through(custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, KVLOAD_PLURAL, pod_name, ops, _content_type="application/json-patch+json",
            _request_timeout=10, _preload_content=False))

    def write_sync(report: KVLoadReport) -> None:
        obj = kvload_object(pod_name, pod_uid, pool, report)
        try:
            patch([{"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": pod_uid},
                   {"op": "replace", "path": "/report", "value": obj["report"]}])
            return
        except ApiException as err:
            if err.status not in (404, 422):
                raise
            if err.status == 422:  # the test failed: a previous pod's object of this name
                try:
                    patch([{"op": "add", "path": "/metadata/ownerReferences", "value": obj["metadata"]["ownerReferences"]},
                           {"op": "add", "path": "/metadata/labels", "value": obj["metadata"]["labels"]},
                           {"op": "add", "path": "/report", "value": obj["report"]}])
                    return
                except ApiException as again:
                    if again.status != 404:  # collected meanwhile: create it
                        raise
        read_through(custom.create_namespaced_custom_object(GROUP, VERSION, namespace, KVLOAD_PLURAL, obj,
                                                             _request_timeout=10, _preload_content=False))

    async def write(report: KVLoadReport) -> None:
        await asyncio.to_thread(write_sync, report)

    return write


def pod_annotation_writer(pod_name: str, namespace: str, api_client: ApiClient | None = None) -> WriteReport:
    """Patches the report annotation on the worker's own Pod: how workers reported before KVLoads
    (bench/report_scale.py's baseline)."""
    from kubernetes import client

    if api_client is None:
        load_config()
    core = client.CoreV1Api(api_client)

    async def write(report: KVLoadReport) -> None:
        body = {"metadata": {"annotations": {ANNOTATION: report.to_annotation()}}}
        await asyncio.to_thread(lambda: read_through(core.patch_namespaced_pod(
            pod_name, namespace, body, _request_timeout=10, _preload_content=False)))

    return write

