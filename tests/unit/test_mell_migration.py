"""The §V planner: KV transfer vs token re-prefill as a global two-bin packing under boundaries."""

from __future__ import annotations

from kvfleet.mell.migration import Boundaries, MoveMode, plan_migrations
from kvfleet.mell.models import Location, Migration

LOC = {"g0": Location("n0", "z0"), "g1": Location("n0", "z0"), "g2": Location("n1", "z0")}


def mig(rid: str, src: str, dst: str, size: int) -> Migration:
    return Migration(rid, src, dst, size, "test")


def test_first_fit_fills_links_then_prefill_then_defers() -> None:
    bounds = Boundaries(intra_node_link_bytes=100, inter_node_link_bytes=30, instance_prefill_tokens=5)
    migs = [mig("a", "g0", "g1", 80), mig("b", "g0", "g1", 40), mig("c", "g0", "g2", 25),
            mig("d", "g0", "g2", 20), mig("e", "g1", "g2", 30), mig("f", "g0", "g2", 10)]
    plan = plan_migrations(migs, LOC.__getitem__, kv_bytes_per_token=10, boundaries=bounds)
    assert [(c.migration.request_id, c.mode) for c in plan.kv] == [("a", MoveMode.KV), ("e", MoveMode.KV)]
    # Largest first: a takes 80 of the intra link; b (40 B) no longer fits it and g1 re-prefills its
    # 4 tokens; e fills the n0->n1 link; c and d re-prefill 3 + 2 of g2's 5 tokens; f fits nowhere.
    assert [c.migration.request_id for c in plan.token] == ["b", "c", "d"]
    assert [m.request_id for m in plan.deferred] == ["f"]
    assert plan.kv_bytes == 110 and plan.token_count == 9


def test_global_consensus_shares_a_link_between_sources() -> None:
    # Two sources on n0 migrate to n1 over the same inter-node link (§V, Fig. 9).
    bounds = Boundaries(intra_node_link_bytes=0, inter_node_link_bytes=50, instance_prefill_tokens=0)
    migs = [mig("a", "g0", "g2", 40), mig("b", "g1", "g2", 40)]
    plan = plan_migrations(migs, LOC.__getitem__, kv_bytes_per_token=1, boundaries=bounds)
    assert len(plan.kv) == 1 and len(plan.deferred) == 1


def test_best_fit_picks_the_tighter_bin() -> None:
    bounds = Boundaries(intra_node_link_bytes=1000, inter_node_link_bytes=1000, instance_prefill_tokens=10)
    plan = plan_migrations([mig("a", "g0", "g1", 90)], LOC.__getitem__, 10, bounds, strategy="best-fit")
    assert plan.token and not plan.kv  # 9 of 10 tokens leaves the prefill bin fuller than the link


def test_each_pure_branch_charges_its_own_bin() -> None:
    bounds = Boundaries(intra_node_link_bytes=100, inter_node_link_bytes=0, instance_prefill_tokens=10)
    plan = plan_migrations([mig("a", "g0", "g1", 100), mig("b", "g0", "g2", 100)], LOC.__getitem__, 10, bounds,
                           block_size_tokens=4)
    (a,), (b,) = plan.kv, plan.token
    assert (a.migration.request_id, a.kv_bytes, a.kv_tokens, a.prefill_tokens) == ("a", 100, 10, 0)
    assert (b.migration.request_id, b.kv_bytes, b.kv_tokens, b.prefill_tokens) == ("b", 0, 0, 10)
    assert not plan.hybrid and not plan.deferred


def test_hybrid_sends_the_full_blocks_the_link_still_carries_and_reprefills_the_tail() -> None:
    # 30 tokens at 10 B: 300 B. The link holds 250 B, the target re-prefills 10 tokens: neither holds
    # the move whole. Blocks of 8 tokens (80 B): 3 blocks fit the link (240 B), 6 tokens are the tail.
    bounds = Boundaries(intra_node_link_bytes=250, inter_node_link_bytes=250, instance_prefill_tokens=10)
    plan = plan_migrations([mig("a", "g0", "g1", 300)], LOC.__getitem__, 10, bounds, block_size_tokens=8)
    (h,) = plan.hybrid
    assert h.mode is MoveMode.HYBRID and (h.kv_bytes, h.kv_tokens, h.prefill_tokens, h.num_tokens) == (240, 24, 6, 30)
    assert not plan.kv and not plan.token and not plan.deferred
    assert plan.kv_bytes == 240 and plan.token_count == 6


def test_hybrid_is_capped_by_the_full_blocks_the_request_has() -> None:
    # A roomy link but a request of 3 full blocks and 5 tail tokens: the tail is re-prefilled even
    # though the link could carry more (the partial block is never sent as KV).
    bounds = Boundaries(intra_node_link_bytes=290, inter_node_link_bytes=0, instance_prefill_tokens=5)
    plan = plan_migrations([mig("a", "g0", "g1", 290)], LOC.__getitem__, 10, bounds, block_size_tokens=8)
    assert plan.kv  # whole fits: no split
    bounds = Boundaries(intra_node_link_bytes=289, inter_node_link_bytes=0, instance_prefill_tokens=5)
    plan = plan_migrations([mig("a", "g0", "g1", 290)], LOC.__getitem__, 10, bounds, block_size_tokens=8)
    (h,) = plan.hybrid
    assert (h.kv_tokens, h.prefill_tokens) == (24, 5)


def test_hybrid_defers_when_the_tail_does_not_fit_or_no_block_does() -> None:
    tight_prefill = Boundaries(intra_node_link_bytes=250, inter_node_link_bytes=0, instance_prefill_tokens=5)
    plan = plan_migrations([mig("a", "g0", "g1", 300)], LOC.__getitem__, 10, tight_prefill, block_size_tokens=8)
    assert [m.request_id for m in plan.deferred] == ["a"]  # 6 tail tokens > 5
    tight_link = Boundaries(intra_node_link_bytes=79, inter_node_link_bytes=0, instance_prefill_tokens=29)
    plan = plan_migrations([mig("a", "g0", "g1", 300)], LOC.__getitem__, 10, tight_link, block_size_tokens=8)
    assert [m.request_id for m in plan.deferred] == ["a"]  # not one 80 B block fits
    roomy = Boundaries(intra_node_link_bytes=250, inter_node_link_bytes=0, instance_prefill_tokens=10)
    plan = plan_migrations([mig("a", "g0", "g1", 300)], LOC.__getitem__, 10, roomy)
    assert [m.request_id for m in plan.deferred] == ["a"]  # no block size: no split


def test_hybrid_shares_the_bins_with_later_moves() -> None:
    # a (300 B) splits 240 B + 6 tokens; b (50 B, 5 tokens) then fits neither the 10 B left on the
    # link nor the 4 tokens left at g1, and has no full block to send: deferred.
    bounds = Boundaries(intra_node_link_bytes=250, inter_node_link_bytes=0, instance_prefill_tokens=10)
    plan = plan_migrations([mig("b", "g0", "g1", 50), mig("a", "g0", "g1", 300)], LOC.__getitem__, 10, bounds,
                           block_size_tokens=8)
    assert [c.migration.request_id for c in plan.hybrid] == ["a"]
    assert [m.request_id for m in plan.deferred] == ["b"]


def test_measured_rates_refine_but_never_raise_the_boundaries() -> None:
    bounds = Boundaries(intra_node_link_bytes=100, inter_node_link_bytes=100, instance_prefill_tokens=10)
    migs = [mig("a", "g0", "g1", 90)]
    slow_link = plan_migrations(migs, LOC.__getitem__, 10, bounds, measured_link_bytes={"intra:n0": 50})
    assert [c.migration.request_id for c in slow_link.token] == ["a"]
    fast_link = plan_migrations(migs, LOC.__getitem__, 10, bounds, measured_link_bytes={"intra:n0": 10**9},
                                measured_prefill_tokens={"g1": 5})
    assert [c.migration.request_id for c in fast_link.kv] == ["a"]
    both_slow = plan_migrations([mig("a", "g0", "g1", 150)], LOC.__getitem__, 10, bounds,
                                measured_link_bytes={"intra:n0": 10**9}, measured_prefill_tokens={"g1": 10**9})
    assert [m.request_id for m in both_slow.deferred] == ["a"]  # 150 B > 100 B cap, 15 tokens > 10 cap
