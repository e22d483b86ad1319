"""choose_modes: the pool's boundaries as caps, the workers' measured rates as refinements (MELL §V)."""

from __future__ import annotations

from typing import Any

from kvfleet.api.models import LLMPoolSpec
from kvfleet.api.reports import KVLoadReport, RequestLoad
from kvfleet.operator.epoch import MoveOrder
from kvfleet.operator.migrations import admit_by_room, choose_modes

NODES = {"w0": "n0", "w1": "n1", "w2": "n1"}
# 30 tokens at 10 bytes each.
MOVE = MoveOrder("r", "w0", "w1", 300, 30, "Update")


def spec(mode: str = "adaptive", link: str = "1000", prefill: int = 10) -> LLMPoolSpec:
    body: dict[str, Any] = {"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"},
                            "migration": {"mode": mode, "communicationBoundaryBytesPerSecond": link,
                                          "computationBoundaryTokensPerSecond": prefill}}
    return LLMPoolSpec.model_validate(body)


def report(link_bytes_per_s: float | None = None, prefill_tokens_per_s: float | None = None,
           block_size_tokens: int | None = 8) -> KVLoadReport:
    return KVLoadReport(capacity_bytes=10**9, used_bytes=0, sequence=1, link_bytes_per_second=link_bytes_per_s,
                        prefill_tokens_per_second=prefill_tokens_per_s, block_size_tokens=block_size_tokens)


def modes(chosen: list[tuple[MoveOrder, str]]) -> list[tuple[str, str]]:
    return [(o.request_id, m) for o, m in chosen]


def test_a_fixed_mode_is_used_for_every_move() -> None:
    assert choose_modes(spec("token"), [MOVE], NODES, 1.0) == ([(MOVE, "token")], 0)


def test_without_measurements_the_pool_boundaries_decide() -> None:
    assert modes(choose_modes(spec(), [MOVE], NODES, 1.0)[0]) == [("r", "kv")]
    # 300 B over a 250 B/s link for one epoch: too much; 30 tokens over 10/s: too much; no block size
    # reported, so no split either.
    assert choose_modes(spec(link="250"), [MOVE], NODES, 1.0) == ([], 1)


def test_a_slow_measured_link_turns_kv_into_hybrid() -> None:
    reports = {"w0": report(link_bytes_per_s=250.0), "w1": report()}
    chosen, deferred = choose_modes(spec(), [MOVE], NODES, 1.0, reports)
    assert modes(chosen) == [("r", "hybrid")] and deferred == 0  # 3 blocks of 8 tokens as KV, 6 re-prefilled
    [(order, _)] = chosen
    assert (order.size_bytes, order.tokens) == (240, 30), "expectedBytes is the KV part; expectedTokens the whole"


def test_a_slow_measured_prefill_defers_what_the_boundary_would_split() -> None:
    reports = {"w0": report(), "w1": report(prefill_tokens_per_s=5.0)}
    assert choose_modes(spec(link="250"), [MOVE], NODES, 1.0, reports) == ([], 1)
    reports = {"w0": report(), "w1": report(prefill_tokens_per_s=500.0)}
    assert modes(choose_modes(spec(link="250"), [MOVE], NODES, 1.0, reports)[0]) == [("r", "hybrid")]


def test_measurements_above_the_boundaries_do_not_raise_them() -> None:
    reports = {"w0": report(link_bytes_per_s=1e12), "w1": report(prefill_tokens_per_s=1e9)}
    assert choose_modes(spec(link="100", prefill=2), [MOVE], NODES, 1.0, reports) == ([], 1)


def test_the_slowest_source_on_a_shared_link_sets_its_budget() -> None:
    # w0 and w3 share node n0, so both send over the n0->n1 link.
    nodes = {"w0": "n0", "w3": "n0", "w1": "n1"}
    moves = [MOVE, MoveOrder("s", "w3", "w1", 100, 10, "Update")]
    reports = {"w0": report(link_bytes_per_s=5000.0), "w3": report(link_bytes_per_s=350.0)}
    chosen, deferred = choose_modes(spec(), moves, nodes, 1.0, reports)
    # The n0->n1 link gets 350 B: r (300 B) goes as KV, s (100 B, 10 tokens) re-prefills at w1.
    assert modes(chosen) == [("r", "kv"), ("s", "token")] and deferred == 0


def test_rates_are_scaled_to_the_epoch() -> None:
    reports = {"w0": report(link_bytes_per_s=150.0)}
    assert modes(choose_modes(spec(), [MOVE], NODES, 2.0, reports)[0]) == [("r", "kv")]  # 300 B in 2 s


def succeeded(request_id: str, source: str, target: str, name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"pool": "p", "requestId": request_id, "sourcePod": source, "targetPod": target, "mode": "kv",
                     "reason": "Update"},
            "status": {"phase": "Succeeded", "completionTime": "2026-01-01T00:00:01Z"}}


def test_a_succeeded_move_stays_in_flight_while_either_report_lags() -> None:
    from kvfleet.operator.migrations import parse_time, view

    now_s = (parse_time("2026-01-01T00:00:01Z") or 0.0) + 2
    move = [succeeded("r", "w0", "w1", "p-r-1")]
    # The target has not reported it yet: in flight to w1.
    assert view(move, spec(), now_s, {"r": ["w0"]}).in_flight == {"r": "w1"}
    # Both report it (the source's report is one interval stale): still in flight, so the target wins.
    assert view(move, spec(), now_s, {"r": ["w0", "w1"]}).in_flight == {"r": "w1"}
    # Only the target: settled.
    assert view(move, spec(), now_s, {"r": ["w1"]}).in_flight == {}
    # Moved back later (w1 -> w0): the latest move decides, whatever order the API lists them in.
    back = {**succeeded("r", "w1", "w0", "p-r-2"), "metadata": {"name": "p-r-2", "creationTimestamp": "2026-01-01T00:00:01Z"}}
    assert view([back, *move], spec(), now_s, {"r": ["w1"]}).in_flight == {"r": "w0"}


def test_a_failed_move_leaves_its_request_alone_until_the_reports_are_fresh() -> None:
    from kvfleet.operator.migrations import parse_time, retry_backoff_s, view

    failed = {**succeeded("r", "w0", "w1", "p-r-1"), "status": {"phase": "Failed", "completionTime": "2026-01-01T00:00:01Z"}}
    done_s = parse_time("2026-01-01T00:00:01Z") or 0.0
    backoff_s = retry_backoff_s(spec())
    # Two epochs (a worker writes a report per epoch at most), at least 2 s.
    assert backoff_s == max(2.0, 2 * spec().scheduling.epoch_seconds)
    # Within the backoff the request is where the failure left it (the source), so no retry is ordered
    # from the report the failure disproved; after it, it is nobody's in-flight move.
    assert view([failed], spec(), done_s + backoff_s - 0.1, {"r": ["w0"]}).in_flight == {"r": "w0"}
    assert view([failed], spec(), done_s + backoff_s, {"r": ["w0"]}).in_flight == {}
    # A newer move of the same request has the last word.
    retry = {**succeeded("r", "w0", "w2", "p-r-2"), "status": {},
             "metadata": {"name": "p-r-2", "creationTimestamp": "2026-01-01T00:00:02Z"}}
    assert view([retry, failed], spec(), done_s + 1, {"r": ["w0"]}).in_flight == {"r": "w2"}
    # Only the unfinished move's pods are in a move (a node autoscaler leaves them alone until it ends).
    assert view([retry, failed], spec(), done_s + 1, {"r": ["w0"]}).moving == {"w0", "w2"}
    assert view([failed], spec(), done_s + 1, {"r": ["w0"]}).moving == frozenset()


def holding(*requests: tuple[str, int, bool], capacity: int = 1000) -> KVLoadReport:
    loads = [RequestLoad(id=rid, kv_bytes=size, tokens=size // 10, size_class="T", queued=queued)
             for rid, size, queued in requests]
    return KVLoadReport(capacity_bytes=capacity, used_bytes=sum(s for _, s, q in requests if not q),
                        requests=loads, sequence=1)


def move(request_id: str, target: str, size: int) -> MoveOrder:
    return MoveOrder(request_id, "src", target, size, size // 10, "Update")


def test_a_move_waits_until_its_target_has_room_for_it() -> None:
    reports = {"a": holding(("x", 600, False)), "b": holding(("y", 300, False), ("q", 200, True))}
    orders = [move("r1", "a", 400), move("r2", "a", 100), move("r3", "b", 600), move("r4", "b", 500)]
    admitted, waiting = admit_by_room(orders, reports, in_flight={}, sizes={})
    # a: 400 free take r1, leaving none for r2; b: 1000 - 300 - 200 (queued q counts) = 500 fits r4, not r3.
    assert [o.request_id for o in admitted] == ["r1", "r4"] and waiting == 2


def test_moves_already_heading_to_a_target_hold_its_room_until_it_reports_them() -> None:
    reports = {"a": holding(("x", 600, False))}
    in_flight = {"m1": "a", "x": "a", "m2": "elsewhere"}
    sizes = {"m1": 300, "x": 600, "m2": 900}
    admitted, waiting = admit_by_room([move("r1", "a", 200)], reports, in_flight, sizes)
    assert admitted == [] and waiting == 1  # 1000 - 600 - 300 (m1, not yet reported) < 200
    admitted, _ = admit_by_room([move("r1", "a", 100)], reports, in_flight, sizes)
    assert [o.request_id for o in admitted] == ["r1"]  # x is counted once: a already reports it


def test_a_target_keeps_a_block_per_running_request_for_its_growth() -> None:
    # 10 B a token, 16-token blocks (160 B): x runs (20 tokens, 2 blocks), q is queued (no blocks).
    report = KVLoadReport(capacity_bytes=1000, used_bytes=320, sequence=1, block_size_tokens=16, requests=[
        RequestLoad(id="x", kv_bytes=320, tokens=20, size_class="T"),
        RequestLoad(id="q", kv_bytes=160, tokens=10, size_class="T", queued=True)])
    # Free: 1000 - 320 - 160 = 520, less one block for x's growth = 360.
    admitted, waiting = admit_by_room([move("r1", "a", 361)], {"a": report}, {}, {})
    assert admitted == [] and waiting == 1
    admitted, _ = admit_by_room([move("r1", "a", 360)], {"a": report}, {}, {})
    assert [o.request_id for o in admitted] == ["r1"]


def test_a_target_without_a_report_is_not_gated() -> None:
    admitted, waiting = admit_by_room([move("r1", "new", 10**9)], {"new": None}, {}, {})
    assert len(admitted) == 1 and waiting == 0
