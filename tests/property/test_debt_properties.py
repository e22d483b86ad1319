"""Property tests of the gManager core: DGFM (Infinite-LLM §4.5) and the contract protocol (§4.4).

DGFM only ever shrinks debts around cycles, so every instance's debt and credit can only fall, its
balance (credit minus debt) and free blocks never change, and it stops with no cycle left whose
smallest debt reaches the threshold. Borrowing never lends past a creditor's room or its §4.3 cap and
covers a request exactly when the pool's room at that moment can.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.mell.debt import (
    BorrowRequest,
    Debt,
    DebtLedger,
    InstanceAccount,
    creditor_candidates,
    debt_graph,
    eliminate_debt_cycles,
    find_cycle,
    locality_cost,
    plan_borrowing,
)
from kvfleet.mell.models import Location

PROFILE = settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def ledgers(draw: st.DrawFn) -> DebtLedger:
    num_instances = draw(st.integers(1, 7))
    ids = [f"w{i}" for i in range(num_instances)]
    accounts = tuple(InstanceAccount(i, draw(st.integers(0, 20)), draw(st.integers(0, 25))) for i in ids)
    pairs = [(d, c) for d in ids for c in ids if d != c]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))) if pairs else []
    debts = tuple(Debt(d, c, draw(st.integers(1, 12))) for d, c in chosen)
    return DebtLedger(1024, accounts, debts)


def locations_for(ids: tuple[str, ...], data: st.DataObject) -> dict[str, Location]:
    """Four nodes in two zones, so the three cost levels (node, zone, elsewhere) all occur."""
    return {i: Location(f"node-{n}", f"zone-{n // 2}") for i in ids for n in [data.draw(st.integers(0, 3))]}


def has_cycle(ledger: DebtLedger, min_blocks: int) -> bool:
    """Independent of Algorithm 1: Kahn's topological sort gets stuck exactly when a cycle exists."""
    edges = [e for e, n in ledger.debt_map().items() if n >= min_blocks]
    indegree = dict.fromkeys(ledger.instance_ids, 0)
    for _, creditor in edges:
        indegree[creditor] += 1
    ready = [i for i, n in indegree.items() if n == 0]
    removed = 0
    while ready:
        node = ready.pop()
        removed += 1
        for debtor, creditor in edges:
            if debtor == node:
                indegree[creditor] -= 1
                if indegree[creditor] == 0:
                    ready.append(creditor)
    return removed < len(indegree)


@PROFILE
@given(ledgers(), st.integers(1, 8))
def test_algorithm1_finds_a_cycle_exactly_when_one_exists(ledger: DebtLedger, min_blocks: int) -> None:
    graph = debt_graph(ledger, min_blocks)
    cycle = find_cycle(graph, ledger.instance_ids)
    assert (cycle is not None) == has_cycle(ledger, min_blocks)
    if cycle is not None:
        assert len(set(cycle)) == len(cycle) >= 2
        for i, node in enumerate(cycle):
            assert ledger.debt_blocks(node, cycle[(i + 1) % len(cycle)]) >= min_blocks


@PROFILE
@given(ledgers(), st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_dgfm_only_cancels_debts_around_cycles(ledger: DebtLedger, min_swap_blocks: int, seed: int) -> None:
    result = eliminate_debt_cycles(ledger, random.Random(seed), min_swap_blocks=min_swap_blocks)
    after = result.ledger
    for i in ledger.instance_ids:
        assert after.borrowed_blocks(i) <= ledger.borrowed_blocks(i)
        assert after.lent_blocks(i) <= ledger.lent_blocks(i)
        assert after.lent_blocks(i) - after.borrowed_blocks(i) == ledger.lent_blocks(i) - ledger.borrowed_blocks(i)
    assert after.accounts == ledger.accounts
    for edge, num_blocks in after.debt_map().items():
        assert 0 < num_blocks <= ledger.debt_blocks(*edge)
    # Terminates within one swap per debt (each swap zeroes at least one edge), each worth the threshold.
    assert len(result.swaps) <= len(ledger.debts)
    assert all(s.num_blocks >= min_swap_blocks and len(s.cycle) >= 2 for s in result.swaps)
    # Replaying the recalls on the old ledger gives the new one exactly.
    replay = dict(ledger.debt_map())
    for swap in result.swaps:
        for move in swap.recalls:
            replay[(move.owner_id, move.from_id)] -= move.num_blocks
            assert replay[(move.owner_id, move.from_id)] >= 0
    assert {e: n for e, n in replay.items() if n > 0} == after.debt_map()
    # Nothing worth a swap is left, and something was swapped whenever something was worth it.
    assert not has_cycle(after, min_swap_blocks)
    assert bool(result.swaps) == has_cycle(ledger, min_swap_blocks)
    # Deterministic for a seed.
    assert eliminate_debt_cycles(ledger, random.Random(seed), min_swap_blocks=min_swap_blocks) == result


@PROFILE
@given(st.data())
def test_plan_borrowing_respects_room_and_covers_exactly_when_the_pool_can(data: st.DataObject) -> None:
    ledger = data.draw(ledgers())
    ids = ledger.instance_ids
    cost = locality_cost(locations_for(ids, data))
    refused = frozenset(data.draw(st.lists(st.sampled_from(ids), max_size=2)))
    requests = data.draw(st.lists(st.builds(BorrowRequest, st.sampled_from(ids), st.integers(1, 30)), max_size=6))
    plan = plan_borrowing(ledger, requests, cost, refused=refused)

    room = {i: ledger.room_blocks(i) for i in ids}
    grants = list(plan.grants)
    unmet = list(plan.unmet)
    for request in requests:
        pool = sum(room[i] for i in ids if i != request.debtor_id and i not in refused)
        if pool >= request.num_blocks:
            taken = 0
            while taken < request.num_blocks:
                grant = grants.pop(0)
                assert grant.debtor_id == request.debtor_id
                assert grant.creditor_id != request.debtor_id and grant.creditor_id not in refused
                assert 0 < grant.num_blocks <= room[grant.creditor_id]
                room[grant.creditor_id] -= grant.num_blocks
                taken += grant.num_blocks
            assert taken == request.num_blocks
        else:
            assert unmet.pop(0) == request
    assert grants == [] and unmet == []

    after = plan.ledger
    for i in ids:
        before = ledger.account(i)
        assert after.account(i).free_blocks >= 0
        assert after.lent_blocks(i) <= max(before.lend_cap_blocks, ledger.lent_blocks(i))
        assert after.lent_blocks(i) - ledger.lent_blocks(i) == before.free_blocks - after.account(i).free_blocks


@PROFILE
@given(st.data())
def test_candidates_are_the_best_that_can_hold_the_request(data: st.DataObject) -> None:
    ledger = data.draw(ledgers())
    ids = ledger.instance_ids
    cost = locality_cost(locations_for(ids, data))
    debtor = data.draw(st.sampled_from(ids))
    need = data.draw(st.integers(1, 20))
    count = data.draw(st.integers(1, 4))
    refused = frozenset(data.draw(st.lists(st.sampled_from(ids), max_size=2)))
    got = creditor_candidates(ledger, debtor, need, cost, count=count, refused=refused)

    def rank(i: str) -> tuple[float, int]:
        return cost(debtor, i), -ledger.room_blocks(i)

    eligible = [i for i in ids if i != debtor and i not in refused and ledger.room_blocks(i) >= need]
    assert len(got) == min(count, len(eligible))
    assert set(got) <= set(eligible)
    assert [rank(i) for i in got] == sorted(rank(i) for i in got)
    if got:
        assert all(rank(i) >= rank(got[-1]) for i in eligible if i not in got)
