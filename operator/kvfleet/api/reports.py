"""The KV-load report a worker writes about itself, and the operator reads every epoch.

A report lives in the worker's own `KVLoad` object (kvfleet.dev/v1alpha1, `kubectl get kvloads`):
named after the worker's pod, labelled with its pool, owned by the pod so it goes with it. Earlier
workers kept it in an annotation of the pod (`kvfleet.dev/kv-load`); a busy worker rewrites its
report every epoch, and every pod write fans out to every pod watcher of the cluster (the scheduler,
the controller manager, the kubelet, the router), where a KVLoad reaches only the operator and the
router (docs/scale.md has the measurements). Readers take the KVLoad and fall back to the annotation,
so workers from before it keep being heard during an upgrade. Workers write when a request arrives,
finishes or changes MELL size class, coalesced to at most one write per epoch, never per token
(docs/worker.md, docs/operator.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

from kvfleet.api.models import API_VERSION, POOL_LABEL
from kvfleet.mell.size_classes import SizeClassName as SizeClassName
from kvfleet.mell.size_classes import size_class_name as size_class_name

# Where workers from before the KVLoad object wrote their report (still read, see the module's docstring).
ANNOTATION = "kvfleet.dev/kv-load"
KVLOAD_KIND = "KVLoad"
KVLOAD_PLURAL = "kvloads"
# Annotations share 256 KiB per object; this keeps one report well inside it (~80 bytes a request).
MAX_REQUESTS_PER_REPORT = 2048

# A report spells each request's size class as kvfleet.mell.size_classes does (re-exported above for
# the workers and benches that write reports).


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class RequestLoad(_Model):
    """One running request's KV footprint on this worker."""

    id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    kv_bytes: int = Field(ge=0)
    tokens: int = Field(ge=0)
    size_class: SizeClassName
    # Waiting on this worker for KV blocks: kv_bytes is what it will hold once admitted. MELL
    # allocates it like any arrival; it holds no KV yet, so a move of it is a token move.
    queued: bool = False
    # The worker expects it to end within two report intervals (its remaining output at the worker's
    # measured step period): a move would land after it ended, so the operator orders none. Written
    # only when true, so a report reads the same to an operator from before this field.
    finishing: Literal[True] | None = None
    # KV this request reads from blocks counted under an older request of this report (a prompt
    # prefix shared through the worker's prefix cache): every block is counted once, so the sum of
    # kv_bytes is the worker's load, while a move carries kv_bytes + shared_bytes and its target must
    # hold that. Written only when not zero.
    shared_bytes: int | None = Field(default=None, gt=0)

    # DistKV (docs/distkv.md): this request's KV held in blocks other workers lent it; kv_bytes is
    # only the part on this worker. Such a request is never moved: its KV lives on several workers.
    # Written only when not zero.
    borrowed_bytes: int | None = Field(default=None, gt=0)
    # Larger than its worker's whole cache (DistKV): it borrows, or will as it grows, so it is never
    # moved either, from its first report on. Written only when true.
    spans: Literal[True] | None = None

    @property
    def whole_kv_bytes(self) -> int:
        """All the KV the request reads, shared blocks included: what moving it carries."""
        return self.kv_bytes + (self.shared_bytes or 0)


class KVLoadReport(_Model):
    """A worker's KV cache at one moment: capacity, use, and the requests holding it."""

    capacity_bytes: int = Field(gt=0)
    used_bytes: int = Field(ge=0)
    requests: list[RequestLoad] = Field(default_factory=list, max_length=MAX_REQUESTS_PER_REPORT)
    # Increases with every write, so a reader can tell a new report from a re-read of an old one.
    sequence: int = Field(ge=0)
    # What this worker's migration executor measured, for MELL's §V planner (docs/migration.md): the
    # KV bytes per second of its last copy as the source, and the tokens per second of its last
    # re-prefill as the target. None until measured; the operator then plans with the pool's
    # boundaries alone, and otherwise with the smaller of boundary and measurement.
    link_bytes_per_second: float | None = Field(default=None, ge=0)
    prefill_tokens_per_second: float | None = Field(default=None, ge=0)
    # The engine's KV block: a hybrid move copies only full blocks and re-prefills the rest.
    block_size_tokens: int | None = Field(default=None, gt=0)
    # An elastic worker (docs/elastic-memory.md): KV of its waiting or preempted requests parked in
    # host memory. Its capacity_bytes is then what KV can hold now, which moves with activations.
    cpu_buffer_bytes: int | None = Field(default=None, ge=0)
    # A worker with a prefix cache (docs/caching.md): cached KV no running request reads. The engine
    # frees it, least recently used first, before a request waits for room, so it is room, not load:
    # it is in neither used_bytes nor any request's kv_bytes.
    evictable_bytes: int | None = Field(default=None, ge=0)
    # Blocks its prefix cache indexes (read by running requests, or evictable): the router's global
    # prompt tree keeps no more for this worker, which is how the worker's evictions reach it.
    prefix_cache_blocks: int | None = Field(default=None, ge=0)

    # A worker of a disaggregated pool (docs/operator.md, "Disaggregated pools"). queued_prefill_tokens:
    # prompt tokens waiting to be prefilled on this worker; the prefill workers' sum is what the
    # operator scales them by. kv_transfers: requests this worker handed to a decode worker since it
    # started (it only grows). Its role is its pod's label (ROLE_LABEL), not part of the report.
    queued_prefill_tokens: int | None = Field(default=None, ge=0)
    kv_transfers: int | None = Field(default=None, ge=0)

    # DistKV (docs/distkv.md, Infinite-LLM §4.3-4.4). lend_cap_bytes: the most KV this worker lends
    # to requests of other workers (absent: it lends none). lent_bytes: its blocks lent now; they are
    # in neither used_bytes nor any request's kv_bytes, and are not room. borrowed: creditor pod ->
    # bytes of this worker's requests' KV held there (only the debtor reports a debt, mell/debt.py).
    lend_cap_bytes: int | None = Field(default=None, ge=0)
    lent_bytes: int | None = Field(default=None, ge=0)
    borrowed: dict[Annotated[str, StringConstraints(min_length=1, max_length=253)], Annotated[int, Field(gt=0)]] | None = (
        Field(default=None, max_length=MAX_REQUESTS_PER_REPORT))

    def kv_bytes_per_token(self) -> int | None:
        """The model's KV bytes per token as this report shows it, or None when it cannot tell: the
        spec does not know the model, so it is read off the running requests, each holding whole blocks
        (its whole KV over its tokens rounded up to blocks). A request that borrows is left out: its
        kv_bytes is only its local part. The largest, as a block not yet full would understate it."""
        bs = self.block_size_tokens
        if bs is None:
            return None
        per_token = [r.whole_kv_bytes // (-(-r.tokens // bs) * bs)
                     for r in self.requests if not r.queued and r.tokens > 0 and not r.borrowed_bytes]
        return max(per_token, default=None)

    def to_json(self) -> dict[str, Any]:
        # Unset optional fields are left out, so a report without measurements is exactly what
        # an operator from before these fields reads (its model forbids unknown keys).
        return self.model_dump(by_alias=True, exclude_none=True)

    def to_annotation(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_annotations(cls, annotations: dict[str, str] | None) -> KVLoadReport | None:
        """The report on a pod, or None when it has none yet or it does not parse (then it is ignored)."""
        text = (annotations or {}).get(ANNOTATION)
        if not text:
            return None
        try:
            return cls.model_validate_json(text)
        except ValueError:
            return None

    @classmethod
    def from_kvload(cls, obj: Mapping[str, Any] | None) -> KVLoadReport | None:
        """The report of a KVLoad object as the API serves it, or None when it does not parse."""
        try:
            return cls.model_validate((obj or {}).get("report"))
        except ValueError:
            return None


class KVLoad(_Model):
    """A worker's KV-load report, written by the worker about itself (`kubectl get kvloads`)."""

    kind: ClassVar[str] = KVLOAD_KIND
    plural: ClassVar[str] = KVLOAD_PLURAL
    short_names: ClassVar[tuple[str, ...]] = ("kvl",)

    report: KVLoadReport


def kvload_object(pod_name: str, pod_uid: str, pool: str, report: KVLoadReport) -> dict[str, Any]:
    """The KVLoad a worker creates for itself: its pod's name, owned by its pod (deleted with it; the
    admission policy refuses a worker any other name or owner), labelled with its pool."""
    return {
        "apiVersion": API_VERSION, "kind": KVLOAD_KIND,
        "metadata": {"name": pod_name, "labels": {POOL_LABEL: pool},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid}]},
        "report": report.to_json(),
    }


def pool_reports(kvloads: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> dict[str, KVLoadReport]:
    """Pod name -> its report, for the pods given (as the API serves them): its KVLoad's, else (a worker
    from before KVLoads, during an upgrade) the one in its annotation. A KVLoad owned by another pod
    is a previous pod's of the same name, not yet garbage-collected: not this pod's. A pod with no
    readable report has none yet."""
    kvload_of = {(obj.get("metadata") or {}).get("name", ""): obj for obj in kvloads}
    reports: dict[str, KVLoadReport] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = meta.get("name", "")
        kvload = kvload_of.get(name)
        owners = {ref.get("uid") for ref in ((kvload or {}).get("metadata") or {}).get("ownerReferences") or []
                  if ref.get("kind") == "Pod"}
        report = KVLoadReport.from_kvload(kvload) if meta.get("uid", "") in owners else None
        if report is None:
            report = KVLoadReport.from_annotations(meta.get("annotations"))
        if report is not None:
            reports[name] = report
    return reports
