"""Prefix locality in the router (kvfleet.router.locality): MemServe's global prompt tree (§6) and the
equation-1 choice (§5.3.1), exact small cases; and the router's tokenizer against the worker's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.api.speed import PrefillPoint, SpeedProfile
from kvfleet.mell import SizeClass
from kvfleet.router.locality import GlobalPromptTree, LocalityInput, PrefillCost, Queued, prefer_cached, queued_s
from kvfleet.router.placement import PoolSnapshot, ReportedRequest, RouteChoice, WorkerState, place

BS = 4  # tokens a block
A = list(range(100, 112))  # three blocks
B = A[:8] + [7, 7, 7, 7]  # shares two blocks with A


def tree(ttl_s: float = 100.0, max_blocks: int = 1000) -> GlobalPromptTree:
    return GlobalPromptTree(BS, ttl_s, max_blocks)


def test_match_gives_each_worker_its_longest_whole_block_prefix() -> None:
    t = tree()
    t.insert("w0", A, now_s=0.0)
    t.insert("w1", B + [1, 2], now_s=1.0)  # the partial last block is not cached
    assert t.match(A, now_s=2.0) == {"w0": 12, "w1": 8}
    assert t.match(B, now_s=2.0) == {"w0": 8, "w1": 12}
    assert t.match([5] + A, now_s=2.0) == {}
    assert (t.blocks_of("w0"), t.blocks_of("w1"), t.num_blocks) == (3, 3, 6)


def test_entries_expire_after_the_ttl_and_a_touch_renews_them() -> None:
    t = tree(ttl_s=10.0)
    t.insert("w0", A, now_s=0.0)
    t.insert("w1", A[:4], now_s=5.0)
    t.touch("w0", A[:8], now_s=8.0)
    assert t.match(A, now_s=12.0) == {"w0": 8, "w1": 4}  # w0's third block was last seen at 0
    t.expire(12.0)
    assert t.blocks_of("w0") == 2
    t.expire(16.0)
    assert t.match(A, now_s=16.0) == {"w0": 8} and t.blocks_of("w1") == 0


def test_trim_keeps_a_workers_most_recent_blocks_as_its_report_bounds_them() -> None:
    t = tree()
    t.insert("w0", A, now_s=0.0)
    t.insert("w0", B, now_s=1.0)  # shares A's first two blocks, adds one
    assert t.blocks_of("w0") == 4
    t.trim("w0", 3)  # A's last block is the least recently seen leaf
    assert t.match(A, now_s=2.0) == {"w0": 8} and t.match(B, now_s=2.0) == {"w0": 12}
    t.trim("w0", 1)  # B's leaf, then the middle block: parents outlive their children
    assert t.match(B, now_s=2.0) == {"w0": 4} and t.blocks_of("w0") == 1
    t.insert("w0", A, now_s=5.0)
    t.trim("w0", 0, seen_before_s=5.0)  # a report older than the response that left them cuts none
    assert t.blocks_of("w0") == 3
    t.forget("w0")
    assert t.num_blocks == 0 and t.match(A, now_s=2.0) == {}


def test_the_tree_is_bounded_by_dropping_the_least_recently_seen() -> None:
    t = tree(max_blocks=4)
    t.insert("w0", A, now_s=0.0)
    t.insert("w1", B[:8], now_s=1.0)
    assert t.num_blocks == 4 and t.blocks_of("w0") == 2 and t.match(A, now_s=2.0) == {"w0": 8, "w1": 8}


def test_exec_follows_the_measured_prefill_at_the_uncached_tokens() -> None:
    profile = SpeedProfile(engine="builtin", model="m", kv_bytes_per_token=8, capacity_bytes=8000,
                           prefill=[PrefillPoint(tokens=100, step_seconds=0.1, samples=3),
                                    PrefillPoint(tokens=300, step_seconds=0.5, samples=1)])
    cost = PrefillCost.from_profile(profile)
    assert cost.exec_s(300, 0) == pytest.approx(0.5)
    assert cost.exec_s(300, 100) == pytest.approx(0.3)  # 200 uncached tokens, on the line between points
    assert cost.exec_s(300, 300) == pytest.approx(0.1)  # one token still computed: the curve's floor
    assert PrefillCost().exec_s(300, 100) == pytest.approx(200 * PrefillCost().exec_s(1, 0))
    assert queued_s([Queued("w0", 300, 0), Queued("w0", 300, 100), Queued("w1", 300, 200)], cost) == pytest.approx(
        {"w0": 0.8, "w1": 0.1})


def test_a_longer_cached_prefix_wins_only_when_equation_1_says_it_is_sooner() -> None:
    cost = PrefillCost()  # one unit a token
    unit = cost.exec_s(1, 0)
    cached = {"w1": 96, "w2": 64}
    # MELL chose w0 (nothing cached): w1 caches the most and nothing is queued there.
    assert prefer_cached("w0", ["w0", "w1", "w2"], LocalityInput(100, cached, {}, cost)) == "w1"
    # 200 tokens of prefill already queued on w1 outweigh its 96 cached: w2 (64 cached) is sooner.
    busy = {"w1": 200 * unit}
    assert prefer_cached("w0", ["w0", "w1", "w2"], LocalityInput(100, cached, busy, cost)) == "w2"
    # Only workers MELL finds room on, and only ones caching more than MELL's choice.
    assert prefer_cached("w0", ["w0"], LocalityInput(100, cached, {}, cost)) is None
    assert prefer_cached("w1", ["w0", "w1", "w2"], LocalityInput(100, cached, {}, cost)) is None
    # Everything queued everywhere else: MELL's choice stands.
    jammed = {"w1": 1000 * unit, "w2": 1000 * unit}
    assert prefer_cached("w0", ["w0", "w1", "w2"], LocalityInput(100, cached, jammed, cost)) is None


def test_placement_takes_the_cached_worker_mell_has_room_on_and_queues_where_mell_says() -> None:
    workers = tuple(WorkerState(f"w{i}", f"10.0.0.{i}:8000", True, i, 1000) for i in range(2))
    snapshot = PoolSnapshot(workers, {"T": "w0", "S": "w0", "M": "w0", "L": "w0"})
    cost = PrefillCost()
    locality = LocalityInput(100, {"w1": 96}, {}, cost)
    chosen = place(snapshot, [], 200, default_capacity_bytes=1000, locality=locality)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("w1", "prefix")
    assert place(snapshot, [], 200, default_capacity_bytes=1000) == RouteChoice("w0", "10.0.0.0:8000", "route")
    # Session affinity: the session's worker if it fits.
    session = LocalityInput(100, {}, {}, cost, session_pod="w1")
    assert place(snapshot, [], 200, default_capacity_bytes=1000, locality=session) == RouteChoice(
        "w1", "10.0.0.1:8000", "session")
    # No room on w1 (its report shows it full): MELL's packing decides, the cache does not.
    full = (workers[0], WorkerState("w1", "10.0.0.1:8000", True, 1, 1000, (ReportedRequest("r", 900, SizeClass.L),)))
    chosen = place(PoolSnapshot(full, snapshot.routes), [], 200, default_capacity_bytes=1000, locality=locality)
    assert isinstance(chosen, RouteChoice) and chosen.pod_name == "w0"


def test_the_routers_tokenizer_gives_the_workers_ids(tiny_model_dir: Path) -> None:
    from kvfleet.serving.tokens import PromptTokenizer
    from kvfleet.worker.text import Tokenizer

    worker = Tokenizer(tiny_model_dir)
    router = PromptTokenizer.from_payload({**worker.payload(), "blockSizeTokens": 16})
    for text in ("Hello there, how are you?", "The quick brown fox\njumps over 13 lazy dogs.", "é ü ß 漢字 🙂", ""):
        assert router.encode(text) == worker.encode(text)
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! What is 2+2?"}]
    assert router.encode_chat(chat) == worker.encode_chat(chat)
