"""Exact small cases of the gManager core (kvfleet.mell.debt, Infinite-LLM §4.3-4.5)."""

from __future__ import annotations

import random

import pytest

from kvfleet.mell.debt import (
    BlockMove,
    BorrowRequest,
    Debt,
    DebtLedger,
    DebtSwap,
    Grant,
    InstanceAccount,
    LedgerError,
    WorkerDebtReport,
    blocks_needed_for_bytes,
    build_ledger,
    clear_refusals,
    creditor_candidates,
    debt_graph,
    eliminate_debt_cycles,
    find_cycle,
    find_cycle_from,
    free_blocks_for_bytes,
    locality_cost,
    plan_borrowing,
)
from kvfleet.mell.models import Location

BLOCK = 4096


def ledger_of(accounts: dict[str, tuple[int, int]], debts: dict[tuple[str, str], int]) -> DebtLedger:
    return DebtLedger(BLOCK, tuple(InstanceAccount(i, free, cap) for i, (free, cap) in accounts.items()),
                      tuple(Debt(d, c, n) for (d, c), n in debts.items()))


def figure4() -> DebtLedger:
    """Figure 4: Inst-0 lends to 1 and 3, Inst-1 borrows from 0 and 3, Inst-3 borrows from 0 and lends to 1,
    Inst-2 (and Inst-4) neither borrow nor lend."""
    reports = [
        WorkerDebtReport("inst-0", free_blocks=10, lend_cap_blocks=8),
        WorkerDebtReport("inst-1", free_blocks=0, lend_cap_blocks=8, borrowed_blocks={"inst-0": 3, "inst-3": 1}),
        WorkerDebtReport("inst-2", free_blocks=4, lend_cap_blocks=8),
        WorkerDebtReport("inst-3", free_blocks=2, lend_cap_blocks=8, borrowed_blocks={"inst-0": 2}),
        WorkerDebtReport("inst-4", free_blocks=6, lend_cap_blocks=2),
    ]
    return build_ledger(reports, BLOCK)


# ---- ledger ----


def test_figure4_ledger_totals() -> None:
    ledger = figure4()
    assert [ledger.lent_blocks(i) for i in ledger.instance_ids] == [5, 0, 0, 1, 0]
    assert [ledger.borrowed_blocks(i) for i in ledger.instance_ids] == [0, 4, 0, 2, 0]
    # room = min(free, cap - lent): inst-0 is held by its cap (8 - 5), inst-4 by its cap (2).
    assert [ledger.room_blocks(i) for i in ledger.instance_ids] == [3, 0, 4, 2, 2]
    assert ledger.debt_map() == {("inst-1", "inst-0"): 3, ("inst-1", "inst-3"): 1, ("inst-3", "inst-0"): 2}


def test_ledger_is_canonical() -> None:
    a = ledger_of({"b": (1, 1), "a": (1, 1)}, {("a", "b"): 2, ("b", "a"): 0})
    b = ledger_of({"a": (1, 1), "b": (1, 1)}, {("a", "b"): 2})
    assert a == b
    assert a.instance_ids == ("a", "b")
    assert a.debts == (Debt("a", "b", 2),)


def test_lent_above_cap_leaves_no_room_rather_than_failing() -> None:
    ledger = ledger_of({"a": (9, 2), "b": (0, 0)}, {("b", "a"): 3})
    assert ledger.room_blocks("a") == 0


@pytest.mark.parametrize(("reports", "message"), [
    ([WorkerDebtReport("a", -1, 0)], "must be >= 0"),
    ([WorkerDebtReport("a", 0, -1)], "must be >= 0"),
    ([WorkerDebtReport("a", 0, 0, {"a": 1})], "cannot owe itself"),
    ([WorkerDebtReport("a", 0, 0, {"gone": 1})], "creditor 'gone'"),
    ([WorkerDebtReport("a", 0, 0, {"b": -2}), WorkerDebtReport("b", 0, 0)], "negative"),
    ([WorkerDebtReport("a", 0, 0), WorkerDebtReport("a", 1, 0)], "twice"),
])
def test_inconsistent_reports_are_refused_with_the_instance_named(reports: list[WorkerDebtReport], message: str) -> None:
    with pytest.raises(LedgerError, match=message):
        build_ledger(reports, BLOCK)


def test_block_units_round_the_safe_way() -> None:
    assert free_blocks_for_bytes(3 * BLOCK - 1, BLOCK) == 2  # a part-block cannot be lent
    assert blocks_needed_for_bytes(2 * BLOCK + 1, BLOCK) == 3  # a part-full block still takes a block
    assert blocks_needed_for_bytes(2 * BLOCK, BLOCK) == 2
    with pytest.raises(LedgerError):
        free_blocks_for_bytes(1, 0)


# ---- contract protocol ----


LOCATIONS = {
    "d": Location("node-0", "zone-0"),
    "same-node": Location("node-0", "zone-0"),
    "same-zone-big": Location("node-1", "zone-0"),
    "same-zone-small": Location("node-2", "zone-0"),
    "far-huge": Location("node-9", "zone-1"),
}


def test_locality_cost() -> None:
    cost = locality_cost(LOCATIONS)
    assert cost("d", "same-node") == 0
    assert cost("d", "same-zone-big") == 1
    assert cost("d", "far-huge") == 2
    assert cost("d", "unknown") == 2


def test_candidates_rank_by_locality_then_room() -> None:
    ledger = ledger_of({"d": (0, 0), "same-node": (3, 10), "same-zone-big": (8, 10), "same-zone-small": (5, 10),
                        "far-huge": (10, 10)}, {})
    cost = locality_cost(LOCATIONS)
    assert creditor_candidates(ledger, "d", 3, cost) == ("same-node", "same-zone-big", "same-zone-small")
    # same-node cannot hold 4 blocks, so it is not proposed: a candidate must be able to say yes.
    assert creditor_candidates(ledger, "d", 4, cost) == ("same-zone-big", "same-zone-small", "far-huge")
    assert creditor_candidates(ledger, "d", 4, cost, refused=frozenset({"same-zone-big"}), count=2) == (
        "same-zone-small", "far-huge")
    assert creditor_candidates(ledger, "d", 11, cost) == ()


def test_candidates_never_include_the_debtor() -> None:
    ledger = ledger_of({"d": (10, 10), "e": (1, 1)}, {})
    assert creditor_candidates(ledger, "d", 1, lambda a, b: 0) == ("e",)


def test_refusal_lasts_until_the_next_heartbeat() -> None:
    assert clear_refusals(frozenset({"a", "b"}), ["b", "c"]) == frozenset({"a"})


def test_competing_debtors_are_spread_over_equal_creditors() -> None:
    ledger = ledger_of({"d1": (0, 0), "d2": (0, 0), "c1": (10, 10), "c2": (9, 10)}, {})
    plan = plan_borrowing(ledger, [BorrowRequest("d1", 4), BorrowRequest("d2", 4)], lambda a, b: 0)
    # d1 takes c1 (most room); c1 is left with 6, c2 now has more, so d2 goes to c2.
    assert plan.grants == (Grant("d1", "c1", 4), Grant("d2", "c2", 4))
    assert plan.unmet == ()
    assert plan.ledger.debt_map() == {("d1", "c1"): 4, ("d2", "c2"): 4}
    assert [plan.ledger.account(i).free_blocks for i in ("c1", "c2")] == [6, 5]


def test_a_request_no_creditor_holds_alone_is_split_closest_first() -> None:
    ledger = ledger_of({"d": (0, 0), "near": (3, 10), "far": (5, 10), "farther": (6, 10)}, {})
    cost = {"near": 0, "far": 1, "farther": 2}
    plan = plan_borrowing(ledger, [BorrowRequest("d", 7)], lambda a, b: cost[b])
    assert plan.grants == (Grant("d", "near", 3), Grant("d", "far", 4))


def test_a_request_the_pool_cannot_hold_gets_nothing_and_later_ones_still_fit() -> None:
    ledger = ledger_of({"d": (0, 0), "c": (5, 4), "e": (2, 10)}, {})
    plan = plan_borrowing(ledger, [BorrowRequest("d", 7), BorrowRequest("d", 5)], lambda a, b: 0)
    # The pool's room is 4 (c's cap) + 2 = 6: 7 is unmet and takes nothing; 5 is split 4 + 1.
    assert plan.unmet == (BorrowRequest("d", 7),)
    assert plan.grants == (Grant("d", "c", 4), Grant("d", "e", 1))


# ---- Algorithm 1 ----


def test_a_cross_edge_is_not_a_cycle() -> None:
    # Algorithm 1 as printed ("visited and u != parent") reports a cycle here.
    assert find_cycle_from({"a": ("b", "c"), "b": ("c",), "c": ()}, "a") is None


def test_a_mutual_debt_is_a_cycle() -> None:
    # ... and misses this one, where u is the parent.
    assert find_cycle_from({"a": ("b",), "b": ("a",)}, "a") == ("a", "b")


def test_cycle_returned_in_edge_order_from_where_it_closes() -> None:
    graph = {"s": ("x",), "x": ("y",), "y": ("z",), "z": ("x",)}
    assert find_cycle_from(graph, "s") == ("x", "y", "z")
    assert find_cycle(graph, ["z", "s"]) == ("z", "x", "y")


# ---- DGFM ----


def test_figure4_has_no_debt_cycle() -> None:
    ledger = figure4()
    assert find_cycle(debt_graph(ledger), ledger.instance_ids) is None
    result = eliminate_debt_cycles(ledger, random.Random(0), min_swap_blocks=1)
    assert result.swaps == ()
    assert result.ledger == ledger


def test_three_cycle_resolved_by_its_minimum() -> None:
    ledger = ledger_of({"a": (1, 10), "b": (2, 10), "c": (3, 10)}, {("a", "b"): 5, ("b", "c"): 3, ("c", "a"): 4})
    result = eliminate_debt_cycles(ledger, random.Random(0), min_swap_blocks=2)
    assert len(result.swaps) == 1
    swap = result.swaps[0]
    assert swap.num_blocks == 3
    assert set(swap.recalls) == {BlockMove("a", "b", "a", 3), BlockMove("b", "c", "b", 3), BlockMove("c", "a", "c", 3)}
    assert result.ledger.debt_map() == {("a", "b"): 2, ("c", "a"): 1}
    assert result.ledger.accounts == ledger.accounts  # a swap needs and frees no memory


def test_recalls_follow_the_cycle() -> None:
    assert DebtSwap(("a", "b"), 2).recalls == (BlockMove("a", "b", "a", 2), BlockMove("b", "a", "b", 2))


def test_cycle_under_the_threshold_is_left_alone() -> None:
    ledger = ledger_of({"a": (0, 9), "b": (0, 9), "c": (0, 9)}, {("a", "b"): 5, ("b", "c"): 3, ("c", "a"): 4})
    result = eliminate_debt_cycles(ledger, random.Random(0), min_swap_blocks=4)
    assert result.swaps == ()
    assert result.ledger == ledger


def test_a_cycle_whose_minimum_equals_the_threshold_is_swapped() -> None:
    ledger = ledger_of({"a": (0, 9), "b": (0, 9), "c": (0, 9)}, {("a", "b"): 5, ("b", "c"): 3, ("c", "a"): 4})
    assert [s.num_blocks for s in eliminate_debt_cycles(ledger, random.Random(0), min_swap_blocks=3).swaps] == [3]


def test_the_threshold_skips_a_small_cycle_but_not_a_big_one_beside_it() -> None:
    # a-b-c-a has a 1-block edge; a <-> d is 6 both ways.
    debts = {("a", "b"): 9, ("b", "c"): 9, ("c", "a"): 1, ("a", "d"): 6, ("d", "a"): 7}
    ledger = ledger_of({i: (0, 20) for i in "abcd"}, debts)
    result = eliminate_debt_cycles(ledger, random.Random(3), min_swap_blocks=2)
    assert [(set(s.cycle), s.num_blocks) for s in result.swaps] == [({"a", "d"}, 6)]
    assert result.ledger.debt_map() == {("a", "b"): 9, ("b", "c"): 9, ("c", "a"): 1, ("d", "a"): 1}


def test_no_cycle_no_action() -> None:
    ledger = ledger_of({"a": (0, 9), "b": (0, 9), "c": (0, 9)}, {("a", "b"): 5, ("b", "c"): 5, ("a", "c"): 5})
    assert eliminate_debt_cycles(ledger, random.Random(1), min_swap_blocks=1).swaps == ()


def test_overlapping_cycles_all_resolved_and_deterministic_for_a_seed() -> None:
    debts = {("a", "b"): 4, ("b", "a"): 4, ("b", "c"): 4, ("c", "a"): 4}
    ledger = ledger_of({i: (0, 20) for i in "abc"}, debts)
    runs = [eliminate_debt_cycles(ledger, random.Random(seed), min_swap_blocks=1) for seed in (7, 7)]
    assert runs[0] == runs[1]
    assert find_cycle(debt_graph(runs[0].ledger), ledger.instance_ids) is None


def test_threshold_must_be_positive() -> None:
    with pytest.raises(LedgerError):
        eliminate_debt_cycles(figure4(), random.Random(0), min_swap_blocks=0)


def test_recalls_sum_each_debtors_moves_over_all_swaps() -> None:
    ledger = DebtLedger(1, tuple(InstanceAccount(i, 0, 10) for i in "abc"),
                        (Debt("a", "b", 5), Debt("b", "a", 2), Debt("b", "c", 3), Debt("c", "a", 4)))
    result = eliminate_debt_cycles(ledger, random.Random(0), min_swap_blocks=1)
    moved: dict[tuple[str, str], int] = {}
    for swap in result.swaps:
        for move in swap.recalls:
            moved[(move.owner_id, move.from_id)] = moved.get((move.owner_id, move.from_id), 0) + move.num_blocks
    assert result.recalls() == tuple(Debt(d, c, n) for (d, c), n in sorted(moved.items()))
    # What is recalled is exactly what the ledger lost.
    for debt in result.recalls():
        assert ledger.debt_blocks(debt.debtor_id, debt.creditor_id) - result.ledger.debt_blocks(
            debt.debtor_id, debt.creditor_id) == debt.num_blocks
