"""BF, WF and LB on hand-checked states (MELL §VIII-B baselines)."""

from __future__ import annotations

from kvfleet.mell import Arrive, EventBatch, Grow, make_policy

C = 240


def test_best_fit_and_worst_fit_choose_opposite_gpus() -> None:
    for name, expected in (("bf", "gpu-0"), ("wf", "gpu-1")):
        pol = make_policy(name, capacity_bytes=C)
        pol.schedule(EventBatch(0.0, (Arrive("a", 200),)))
        pol.schedule(EventBatch(1.0, (Arrive("b", 100),)))  # does not fit gpu-0: a new GPU
        plan = pol.schedule(EventBatch(2.0, (Arrive("c", 30),)))
        assert plan.placements[0].gpu_id == expected, name
        assert plan.migrations == ()


def test_no_migration_baselines_preempt_the_latest_arrival_on_overflow() -> None:
    pol = make_policy("bf", capacity_bytes=C)
    pol.schedule(EventBatch(0.0, (Arrive("a", 100), Arrive("b", 100))))
    plan = pol.schedule(EventBatch(1.0, (Grow("a", 150),)))
    assert plan.migrations == ()
    assert [(p.request_id, p.source_gpu_id, p.target_gpu_id) for p in plan.preemptions] == [("b", "gpu-0", "gpu-1")]


def test_load_balance_moves_from_most_to_least_loaded_while_the_gap_narrows() -> None:
    pol = make_policy("lb", capacity_bytes=C, gap_fraction=0.1)
    pol.schedule(EventBatch(0.0, (Arrive("big", 230),)))
    pol.schedule(EventBatch(1.0, (Arrive("x", 20),)))  # WF: gpu-1 is new (gpu-0 has 10 free)
    pol.schedule(EventBatch(2.0, (Arrive("y", 20), Arrive("z", 20))))  # both to gpu-1 (most free)
    plan = pol.schedule(EventBatch(3.0, (Grow("y", 25),)))
    # gpu-0: 230, gpu-1: 65; the gap of 165 > 24: LB would move from gpu-0, but its only request
    # (230) is more than half the gap, so nothing narrows it: no migration.
    assert plan.migrations == ()
    pol2 = make_policy("lb", capacity_bytes=C, gap_fraction=0.1)
    pol2.schedule(EventBatch(0.0, (Arrive("b", 200),)))
    pol2.schedule(EventBatch(1.0, (Arrive("a", 20),)))  # gpu-0: 220
    plan = pol2.schedule(EventBatch(2.0, (Arrive("d", 30),)))  # does not fit: gpu-1 gets 30
    # gap 190 > 24: a (2 x 20 <= 190) moves; then the gap is 150 and b (200) would overshoot.
    assert [(m.request_id, m.source_gpu_id, m.target_gpu_id, m.cause) for m in plan.migrations] == [
        ("a", "gpu-0", "gpu-1", "balance")
    ]
    assert pol2.loads() == {"gpu-0": 200, "gpu-1": 50}


def test_load_balance_rebalances_only_when_the_epoch_ends() -> None:
    """schedule(..., end_of_epoch=False) (the simulator's unbatched mode) leaves the per-epoch
    rebalancing to the call that ends the epoch, so an operation scheduled on its own does not
    rebalance the pool after every request."""
    from kvfleet.mell import Arrive, EventBatch, make_policy

    policy = make_policy("lb", capacity_bytes=100)
    plans = [policy.schedule(EventBatch(0.0, (Arrive(rid, size),)), end_of_epoch=False)
             for rid, size in (("a", 30), ("b", 30), ("c", 30), ("d", 20))]
    assert [p.migrations for p in plans] == [(), (), (), ()]
    # Worst-fit fills gpu-0 to 90 before d opens gpu-1: a gap of 70, past the 10% the balancer allows.
    assert policy.loads() == {"gpu-0": 90, "gpu-1": 20}
    ended = policy.schedule(EventBatch(0.0, ()))
    assert [(m.source_gpu_id, m.target_gpu_id, m.cause) for m in ended.migrations] == [("gpu-0", "gpu-1", "balance")]
