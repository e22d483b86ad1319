"""Hostile KV-load reports: the operator parses any annotation text without raising, and its epoch
code (rebuild, re-plan, epoch, routing preview) takes any report that parses without raising.

A worker writes its report on its own Pod, so a buggy, old or compromised worker can put anything
there; the operator must ignore what does not parse and schedule around what does (docs/operations.md).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvfleet.api.reports import ANNOTATION, MAX_REQUESTS_PER_REPORT, KVLoadReport, RequestLoad
from kvfleet.mell import PolicyConfig
from kvfleet.operator import epoch
from kvfleet.operator.epoch import PoolScheduler, WorkerView, routing_table

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)

_VALID = {"capacityBytes": 1200, "usedBytes": 700, "sequence": 3,
          "requests": [{"id": "r1", "kvBytes": 700, "tokens": 70, "sizeClass": "L"}]}
_REPORT_KEYS = ["capacityBytes", "usedBytes", "requests", "sequence", "linkBytesPerSecond", "prefillTokensPerSecond",
                "blockSizeTokens", "cpuBufferBytes", "evictableBytes", "prefixCacheBlocks", "unknownField"]
_REQUEST_KEYS = ["id", "kvBytes", "tokens", "sizeClass", "queued", "finishing", "sharedBytes", "kv_bytes", "extra"]
hostile_numbers = st.sampled_from([0, -1, 1, 2**31, 2**63, 10**18, 10**400, 1.5, float("nan"), float("inf"), "1", True, None])


@st.composite
def mutated_reports(draw: st.DrawFn) -> str:
    """A valid report with one field (of the report or of a request) replaced by something hostile."""
    report: dict[str, Any] = json.loads(json.dumps(_VALID))
    value = draw(hostile_numbers | json_values)
    if draw(st.booleans()):
        report[draw(st.sampled_from(_REPORT_KEYS))] = value
    else:
        report["requests"][0][draw(st.sampled_from(_REQUEST_KEYS))] = value
    return json.dumps(report, allow_nan=True)


annotation_texts = (st.text(max_size=200) | json_values.map(json.dumps) | mutated_reports()
                    | st.binary(max_size=100).map(lambda b: b.decode("latin-1")))


@SETTINGS
@given(text=annotation_texts)
@example(text="")
@example(text="null")
@example(text='"\\ud800"')
@example(text='{"capacityBytes": 1e999, "usedBytes": 0, "sequence": 0}')
@example(text='{"capacityBytes": NaN, "usedBytes": 0, "sequence": 0}')
@example(text="\ud800")
@example(text=json.dumps({**_VALID, "requests": [_VALID["requests"][0]] * (MAX_REQUESTS_PER_REPORT + 1)}))
@example(text="[" * 10_000 + "]" * 10_000)
def test_any_annotation_text_parses_to_a_report_or_none(text: str) -> None:
    parsed = KVLoadReport.from_annotations({ANNOTATION: text, "other": "x"})
    assert parsed is None or isinstance(parsed, KVLoadReport)
    if parsed is not None:
        # What parses is a report the operator's own writer could have written.
        assert KVLoadReport.from_annotations({ANNOTATION: parsed.to_annotation()}) == parsed


@SETTINGS
@given(text=annotation_texts)
@example(text="null")
def test_any_kvload_parses_to_a_report_or_none(text: str) -> None:
    """A KVLoad as served: whatever JSON its `report` holds (the CRD's schema is the API server's
    check; an object written before a schema change, or a server without it, may hold anything)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    parsed = KVLoadReport.from_kvload({"metadata": {"name": "w"}, "report": value})
    assert parsed is None or KVLoadReport.from_kvload({"report": parsed.to_json()}) == parsed
    assert KVLoadReport.from_kvload({"metadata": {}}) is None and KVLoadReport.from_kvload(None) is None


def test_a_missing_annotation_is_no_report() -> None:
    assert KVLoadReport.from_annotations(None) is None
    assert KVLoadReport.from_annotations({}) is None
    assert KVLoadReport.from_annotations({ANNOTATION: "{"}) is None


# Report values that parse: the bounds the model allows, and the worst of what fits inside them.
_ids = st.sampled_from(["r0", "r1", "r2", "shared", "x" * 256]) | st.text(min_size=1, max_size=8)
_sizes = st.sampled_from([0, 1, 2, 599, 600, 601, 1199, 1200, 1201, 10**12, 2**63]) | st.integers(0, 5000)


@st.composite
def _requests(draw: st.DrawFn) -> RequestLoad:
    return RequestLoad(id=draw(_ids), kv_bytes=draw(_sizes), tokens=draw(st.sampled_from([0, 1, 10**12]) | st.integers(0, 500)),
                       size_class=draw(st.sampled_from(["X", "L", "M", "S", "T", "tiny"])), queued=draw(st.booleans()),
                       finishing=draw(st.sampled_from([True, None])), shared_bytes=draw(st.sampled_from([None, 1, 10**12])))


@st.composite
def parsed_reports(draw: st.DrawFn) -> KVLoadReport | None:
    if draw(st.integers(0, 9)) == 0:
        return None
    requests = draw(st.lists(_requests(), max_size=12))
    if draw(st.integers(0, 24)) == 0:  # the most a report may hold: one id repeated, or all distinct
        one = requests[0] if requests else RequestLoad(id="r0", kv_bytes=1, tokens=0, size_class="tiny")
        distinct = draw(st.booleans())
        requests = [one.model_copy(update={"id": f"{one.id}-{i}"}) if distinct else one for i in range(MAX_REQUESTS_PER_REPORT)]
    return KVLoadReport(capacity_bytes=draw(st.sampled_from([1, 2, 7, 1200, 10**15]) | st.integers(1, 5000)),
                        used_bytes=draw(_sizes), requests=requests, sequence=draw(st.integers(0, 2**63)))


@st.composite
def pools(draw: st.DrawFn) -> list[WorkerView]:
    # GPU labels are the operator's own (one pod per GPU), not the workers': only the reports are hostile.
    gpus = draw(st.lists(st.sampled_from(["gpu-0", "gpu-1", "gpu-2", "gpu-7"]), unique=True, max_size=3))
    gpus = draw(st.permutations([*gpus, *[None] * draw(st.integers(0, 2))]))
    return [WorkerView(f"p-worker-{i}", gpu, draw(st.integers(0, 3)), f"node-{i % 2}", "zone-0", draw(st.booleans()),
                       draw(parsed_reports())) for i, gpu in enumerate(gpus)]


@SETTINGS
@given(policy=st.sampled_from(["mell", "mell-paper", "best-fit", "worst-fit", "load-balance"]),
       capacity=st.sampled_from([1, 8, 1200, 10**15]), first=pools(), later=st.lists(pools(), min_size=1, max_size=3),
       in_flight=st.dictionaries(_ids, st.sampled_from(["p-worker-0", "p-worker-1", "p-gone"]), max_size=3))
# Found by this test: a baseline pool rebuilt with two tiny requests on one worker (a multi-item)
# crashed on an assertion when one of them finished.
@example(policy="best-fit", capacity=1200, in_flight={}, later=[[]], first=[
    WorkerView("p-worker-0", "gpu-0", 0, "n", "z", True,
               KVLoadReport(capacity_bytes=1200, used_bytes=2, sequence=0,
                            requests=[RequestLoad(id=rid, kv_bytes=1, tokens=0, size_class="tiny") for rid in ("r0", "r1")]))])
# Found by this test: one request of 10**12 bytes against C = 1200 made MELL activate ~10**9 GPUs (a hang).
@example(policy="mell", capacity=1200, first=[], in_flight={}, later=[[
    WorkerView("p-worker-0", "gpu-0", 0, "n", "z", True,
               KVLoadReport(capacity_bytes=1200, used_bytes=0, sequence=0,
                            requests=[RequestLoad(id="a", kv_bytes=10**12, tokens=0, size_class="X")]))]])
@example(policy="mell", capacity=1200, first=[], in_flight={}, later=[[
    WorkerView("p-worker-0", "gpu-0", 0, "n", "z", True,
               KVLoadReport(capacity_bytes=1, used_bytes=5000, sequence=0,
                            requests=[RequestLoad(id="a", kv_bytes=5000, tokens=0, size_class="tiny")]))]])
@example(policy="mell", capacity=1200, first=[], in_flight={}, later=[[
    WorkerView(f"p-worker-{i}", f"gpu-{i}", i, "n", "z", True,
               KVLoadReport(capacity_bytes=1200, used_bytes=700, sequence=0,
                            requests=[RequestLoad(id="dup", kv_bytes=700 + i, tokens=0, size_class="L")]))
    for i in range(2)]])
def test_the_epoch_takes_any_report_that_parses(policy: str, capacity: int, first: list[WorkerView],
                                                later: list[list[WorkerView]], in_flight: dict[str, str]) -> None:
    """What reconcile.scheduler_state and run_scheduler do with the reports, epoch after epoch."""
    reported = epoch.reported_capacity_bytes(first)
    scheduler = PoolScheduler.rebuild(policy, PolicyConfig(capacity_bytes=reported or capacity), first)
    for now_s, workers in enumerate(later, start=1):
        planned = scheduler.config.capacity_bytes
        replan = epoch.capacity_to_plan(planned, epoch.reported_capacity_bytes(workers))
        if replan != planned:
            scheduler = scheduler.replanned(replan, workers)
        outcome = scheduler.epoch(workers, in_flight, now_s=float(now_s))
        scheduler.ordered([m.request_id for m in outcome.moves], float(now_s))
        pods = {w.pod_name for w in workers}
        assert all(m.source_pod in pods and m.target_pod in pods and m.source_pod != m.target_pod for m in outcome.moves)
        assert outcome.used_bytes >= 0 and outcome.active_gpus >= 0 and outcome.lower_bound_gpus >= 0
        table = routing_table(scheduler.routes(), workers)
        assert all(row["worker"] in pods for row in table)
