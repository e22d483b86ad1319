"""The KV-load reporter writes when MELL needs to hear, at most once an interval, never per token."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from kvfleet.api.reports import MAX_REQUESTS_PER_REPORT, KVLoadReport
from kvfleet.worker.engines.base import RequestKV
from kvfleet.worker.reporter import LoadReporter, build_report

CAPACITY = 1_000_000  # classes: L > 500,000; M > 333,333; S > 250,000; T > 125,000; tiny below


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make(usage: list[RequestKV], fail: list[bool] | None = None) -> tuple[LoadReporter, list[KVLoadReport], Clock]:
    written: list[KVLoadReport] = []
    clock = Clock()

    async def write(report: KVLoadReport) -> None:
        annotation = report.to_annotation()  # what it would write
        if fail and fail.pop(0):
            raise ConnectionError("API server away")
        written.append(KVLoadReport.model_validate_json(annotation))

    return LoadReporter(lambda: list(usage), CAPACITY, write, interval_s=5.0, clock=clock), written, clock


def check(reporter: LoadReporter) -> bool:
    return asyncio.run(reporter.maybe_write())


def test_writes_on_arrival_finish_and_class_change_only() -> None:
    usage: list[RequestKV] = []
    reporter, written, clock = make(usage)
    assert check(reporter)  # the first report says "empty"
    assert written[-1].requests == [] and written[-1].capacity_bytes == CAPACITY and written[-1].sequence == 1

    clock.now_s = 10
    usage.append(RequestKV("a", tokens=10, kv_bytes=20_000))
    assert check(reporter)  # arrival
    assert [(r.id, r.kv_bytes, r.tokens, r.size_class) for r in written[-1].requests] == [("a", 20_000, 10, "tiny")]

    clock.now_s = 20
    usage[0] = RequestKV("a", tokens=60, kv_bytes=120_000)
    assert not check(reporter), "growth within a size class is not worth a write"
    usage[0] = RequestKV("a", tokens=70, kv_bytes=140_000)
    assert check(reporter), "tiny -> T is a class change"
    assert written[-1].requests[0].size_class == "T" and written[-1].used_bytes == 140_000

    clock.now_s = 30
    usage.clear()
    assert check(reporter)  # finish
    assert written[-1].requests == [] and written[-1].used_bytes == 0
    assert [w.sequence for w in written] == [1, 2, 3, 4]


def test_at_most_one_write_per_interval_and_nothing_lost() -> None:
    usage: list[RequestKV] = []
    reporter, written, clock = make(usage)
    assert check(reporter)
    clock.now_s = 1
    usage.append(RequestKV("a", 1, 2048))
    assert not check(reporter), "within the interval: coalesced"
    clock.now_s = 3
    usage.append(RequestKV("b", 1, 2048))
    assert not check(reporter)
    clock.now_s = 5
    assert check(reporter)
    assert [r.id for r in written[-1].requests] == ["a", "b"], "the coalesced write carries both arrivals"
    assert reporter.writes == 2


def test_a_failed_write_is_retried_with_the_same_content() -> None:
    usage = [RequestKV("a", 1, 2048)]
    reporter, written, _ = make(usage, fail=[True, False])
    assert not check(reporter)
    assert reporter.failures == 1 and written == []
    assert check(reporter)
    assert [r.id for r in written[0].requests] == ["a"] and written[0].sequence == 1


def test_a_huge_report_lists_the_largest_requests_and_counts_all_bytes() -> None:
    usage = [RequestKV(f"r{i:05d}", i, 1000 + i) for i in range(MAX_REQUESTS_PER_REPORT + 10)]
    report = build_report(usage, CAPACITY, sequence=1)
    assert len(report.requests) == MAX_REQUESTS_PER_REPORT
    assert report.used_bytes == sum(r.kv_bytes for r in usage)
    assert {r.id for r in report.requests} == {r.request_id for r in usage[10:]}
    assert [r.id for r in report.requests] == sorted(r.id for r in report.requests)
    assert len(report.to_annotation()) < 256 * 1024


def test_queued_requests_are_reported_and_their_admission_is_news() -> None:
    usage: list[RequestKV] = []
    queued = [RequestKV("q", tokens=200, kv_bytes=400_000)]
    written: list[KVLoadReport] = []
    clock = Clock()

    async def write(report: KVLoadReport) -> None:
        annotation = report.to_annotation()  # what it would write
        written.append(KVLoadReport.model_validate_json(annotation))

    reporter = LoadReporter(lambda: list(usage), CAPACITY, write, interval_s=5.0, clock=clock, queued=lambda: list(queued))
    assert check(reporter)
    [entry] = written[-1].requests
    assert (entry.id, entry.queued, entry.size_class, entry.kv_bytes) == ("q", True, "M", 400_000)
    assert written[-1].used_bytes == 0, "a queued request holds no KV yet"
    clock.now_s = 10
    queued.clear()
    usage.append(RequestKV("q", tokens=201, kv_bytes=402_000))
    assert check(reporter), "admission (queued -> holding KV) is written"
    assert written[-1].requests[0].queued is False and written[-1].used_bytes == 402_000


def test_measured_rates_and_block_size_ride_on_the_report() -> None:
    from prometheus_client import CollectorRegistry, Gauge

    from kvfleet.worker.reporter import LINK_GAUGE, PREFILL_GAUGE, measured_from

    registry = CollectorRegistry()
    link = Gauge(LINK_GAUGE, "link", registry=registry)
    Gauge(PREFILL_GAUGE, "prefill", registry=registry)
    written: list[KVLoadReport] = []
    usage = [RequestKV("a", tokens=10, kv_bytes=1000)]

    async def write(report: KVLoadReport) -> None:
        annotation = report.to_annotation()  # what it would write
        written.append(KVLoadReport.model_validate_json(annotation))

    clock = Clock()
    reporter = LoadReporter(lambda: list(usage), CAPACITY, write, interval_s=5.0, clock=clock,
                            measured=measured_from(registry), block_size_tokens=16)
    assert check(reporter)
    first = written[-1]
    assert (first.link_bytes_per_second, first.prefill_tokens_per_second, first.block_size_tokens) == (None, None, 16)
    link.set(2.5e9)
    clock.now_s = 10
    assert not check(reporter), "a new measurement alone is no news to MELL"
    usage.append(RequestKV("b", tokens=10, kv_bytes=1000))
    assert check(reporter)
    assert (written[-1].link_bytes_per_second, written[-1].prefill_tokens_per_second) == (2.5e9, None)


def test_a_report_without_measurements_is_the_old_format() -> None:
    report = build_report([RequestKV("a", tokens=10, kv_bytes=1000)], CAPACITY, sequence=1)
    text = report.to_annotation()
    assert "linkBytesPerSecond" not in text and "blockSizeTokens" not in text
    assert KVLoadReport.model_validate_json(text) == report
    old = '{"capacityBytes":10,"usedBytes":0,"requests":[],"sequence":3}'
    assert KVLoadReport.model_validate_json(old).link_bytes_per_second is None


def test_a_request_about_to_end_is_news_marked_finishing() -> None:
    usage = [RequestKV("a", tokens=10, kv_bytes=20_000, remaining_tokens=400), RequestKV("b", tokens=10, kv_bytes=20_000)]
    written: list[KVLoadReport] = []
    clock = Clock()
    steps: list[float | None] = [0.05]

    async def write(report: KVLoadReport) -> None:
        annotation = report.to_annotation()  # what it would write
        assert '"finishing":false' not in annotation and "remaining" not in annotation  # only a true flag is written
        written.append(KVLoadReport.model_validate_json(annotation))

    reporter = LoadReporter(lambda: list(usage), CAPACITY, write, interval_s=1.0, clock=clock, step_s=lambda: steps[0])
    assert check(reporter)
    assert [(r.id, r.finishing) for r in written[-1].requests] == [("a", None), ("b", None)]
    # Two intervals at 50 ms a step are 40 tokens: a with 40 left is finishing (and that is worth a
    # write); b, whose engine cannot tell what is left, never is.
    clock.now_s = 10
    usage[0] = RequestKV("a", tokens=370, kv_bytes=20_000, remaining_tokens=40)
    assert check(reporter)
    assert [(r.id, r.finishing) for r in written[-1].requests] == [("a", True), ("b", None)]
    # Unmeasured speed: nothing is judged finishing (the step period is read again after an interval).
    clock.now_s = 20
    steps[0] = None
    assert check(reporter)
    assert [r.finishing for r in written[-1].requests] == [None, None]


def test_an_elastic_worker_reports_its_moving_capacity_and_cpu_buffer() -> None:
    from kvfleet.worker.engines.capabilities import MemoryState

    state = [MemoryState(kv_capacity_bytes=CAPACITY, cpu_buffer_bytes=0, cpu_buffer_capacity_bytes=10 * CAPACITY,
                         activation_bytes=0, budget_bytes=CAPACITY)]
    written: list[KVLoadReport] = []
    clock = Clock()

    async def write(report: KVLoadReport) -> None:
        annotation = report.to_annotation()  # what it would write
        written.append(KVLoadReport.model_validate_json(annotation))

    reporter = LoadReporter(lambda: [], CAPACITY, write, interval_s=5.0, clock=clock, memory=lambda: state[0])
    assert check(reporter)
    assert (written[-1].capacity_bytes, written[-1].cpu_buffer_bytes) == (CAPACITY, 0)
    clock.now_s = 10
    state[0] = MemoryState(CAPACITY - 20_000, 300_000, 10 * CAPACITY, 20_000, CAPACITY)
    assert not check(reporter), "a 2% move and parked bytes alone are not worth a write"
    state[0] = MemoryState(CAPACITY - 60_000, 300_000, 10 * CAPACITY, 60_000, CAPACITY)
    assert check(reporter), "a move across a 5% step is"
    assert (written[-1].capacity_bytes, written[-1].cpu_buffer_bytes) == (CAPACITY - 60_000, 300_000)
    # A static worker's report reads as before (no cpuBufferBytes key at all).
    assert "cpuBuffer" not in build_report([], CAPACITY, 1).to_annotation()


def test_a_distkv_worker_reports_what_it_lends_and_borrows_and_writes_when_that_changes() -> None:
    from kvfleet.worker.reporter import DistKVFigures

    usage = [RequestKV("long", 900, 100_000, borrowed_bytes=700_000, spans=True)]
    figures = [DistKVFigures(300_000, 0, {"w-2": 700_000})]
    written: list[KVLoadReport] = []
    clock = Clock()

    async def write(report: KVLoadReport) -> None:
        annotation = report.to_annotation()  # what it would write
        written.append(KVLoadReport.model_validate_json(annotation))

    reporter = LoadReporter(lambda: list(usage), CAPACITY, write, interval_s=5.0, clock=clock,
                            distkv=lambda: figures[-1])
    assert check(reporter)
    report = written[-1]
    assert (report.lend_cap_bytes, report.lent_bytes, report.borrowed) == (300_000, 0, {"w-2": 700_000})
    assert report.requests[0].borrowed_bytes == 700_000 and report.used_bytes == 100_000  # the local part only
    assert report.requests[0].spans
    clock.now_s += 5
    assert not check(reporter)  # nothing changed
    figures.append(DistKVFigures(300_000, 65_536, {}))  # it lends now, and borrows no more
    assert check(reporter)
    assert (written[-1].lent_bytes, written[-1].borrowed) == (65_536, None)
    plain = build_report([], CAPACITY, 1)
    assert (plain.lend_cap_bytes, plain.lent_bytes, plain.borrowed) == (None, None, None)  # a worker without DistKV


def test_the_report_path_loads_no_torch() -> None:
    """What writes reports (and the e2e tests' scripted worker, started a few hundred times a run)
    imports no torch: 1.4 s of CPU at every start for nothing (capabilities.py needs it for annotations)."""
    code = "import sys, kvfleet.worker.reporter; sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
