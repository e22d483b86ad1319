"""The §V planner: KV transfer vs token re-prefill as a global two-bin packing under boundaries."""

from __future__ import annotations

from kvfleet.mell.migration import Boundaries, Mode, plan_migrations
from kvfleet.mell.models import Location, Migration

LOC = {"g0": Location("n0", "z0"), "g1": Location("n0", "z0"), "g2": Location("n1", "z0")}


def mig(rid: str, src: str, dst: str, size: int) -> Migration:
    return Migration(rid, src, dst, size, "test")


def test_first_fit_fills_links_then_prefill_then_defers() -> None:
    bounds = Boundaries(intra_node_link_bytes=100, inter_node_link_bytes=30, instance_prefill_tokens=5)
    migs = [mig("a", "g0", "g1", 80), mig("b", "g0", "g1", 40), mig("c", "g0", "g2", 25),
            mig("d", "g0", "g2", 20), mig("e", "g1", "g2", 30), mig("f", "g0", "g2", 10)]
    plan = plan_migrations(migs, LOC.__getitem__, kv_bytes_per_token=10, boundaries=bounds)
    assert [(c.migration.request_id, c.mode) for c in plan.kv] == [("a", Mode.KV), ("e", Mode.KV)]
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
