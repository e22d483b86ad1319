"""The default policy's per-request growth estimate (rule 6, MellDefaultConfig.growth_estimate).

C is 100 bytes, the pool headroom 5 (5% of C) and the growth horizon 10 (10% of C), so every room
can be checked by hand: a GPU keeps room for what its requests with a known final size will still
write, each up to the horizon, those that finish sooner leaving.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvfleet.mell import Arrive, EventBatch, Finish, Grow, MellDefaultConfig, Placement, make_policy
from kvfleet.mell.cluster import ClusterPolicy

C = 100
CONFIG = MellDefaultConfig(capacity_bytes=C, consolidate=False)


def policy(**knobs: object) -> ClusterPolicy:
    return make_policy("mell", dataclasses.replace(CONFIG, **knobs))  # type: ignore[arg-type]


def where(pol: ClusterPolicy) -> dict[str, str]:
    return {rid: pol.gpu_of(rid) for rid in pol.item_of}


def two_gpus(pol: ClusterPolicy) -> None:
    """gpu-0 holds a (60, 40 bytes still to write), gpu-1 z (45, done growing)."""
    pol.schedule(EventBatch(1.0, (Arrive("a", 60, final_size_bytes=100), Arrive("z", 45, final_size_bytes=45))))
    assert where(pol) == {"a": "gpu-0", "z": "gpu-1"}


def test_a_request_with_much_left_to_write_is_not_placed_where_it_would_overflow_as_it_grows() -> None:
    pol = policy()
    two_gpus(pol)
    # b (30, 50 to write) beside a: both grow 10 over the horizon, 60 + 30 + 2 x 10 = 110 > 100. Beside
    # z, which writes nothing more (it leaves, in the model, as soon as the others grow): room 0.
    plan = pol.schedule(EventBatch(2.0, (Arrive("b", 30, final_size_bytes=80),)))
    assert plan.placements == (Placement("b", "gpu-1"),)
    # The pool allowance sees 60 + 30 + 5 <= 100 on the fullest GPU: there it goes.
    pool = policy(growth_estimate="pool")
    two_gpus(pool)
    assert pool.schedule(EventBatch(2.0, (Arrive("b", 30, final_size_bytes=80),))).placements == (
        Placement("b", "gpu-0"),)


def test_a_request_about_to_finish_needs_no_room() -> None:
    pol = policy()
    pol.schedule(EventBatch(1.0, (Arrive("a", 60, final_size_bytes=60), Arrive("z", 45, final_size_bytes=45))))
    # c (38, 2 to write) beside a (done): 98, and at most max(98, 38 + 2) later: no room needed.
    plan = pol.schedule(EventBatch(2.0, (Arrive("c", 38, final_size_bytes=40),)))
    assert plan.placements == (Placement("c", "gpu-0"),)
    assert pol.last_allocate_step == "best-fit"  # type: ignore[attr-defined]
    # The pool allowance keeps 5 free on gpu-0 (98 + 5 > 100): c goes beside z.
    pool = policy(growth_estimate="pool")
    pool.schedule(EventBatch(1.0, (Arrive("a", 60, final_size_bytes=60), Arrive("z", 45, final_size_bytes=45))))
    assert pool.schedule(EventBatch(2.0, (Arrive("c", 38, final_size_bytes=40),))).placements == (
        Placement("c", "gpu-1"),)


@pytest.mark.parametrize(("final", "gpu"), [(25, "gpu-0"), (35, "gpu-1")])
def test_the_room_is_the_peak_of_the_requests_growing_in_lockstep(final: int, gpu: str) -> None:
    pol = policy()
    # gpu-0: p (40, 5 to write), q (30, 30 to write: 10 within the horizon); gpu-1: z (50, done).
    pol.schedule(EventBatch(1.0, (Arrive("p", 40, final_size_bytes=45), Arrive("q", 30, final_size_bytes=60))))
    pol.schedule(EventBatch(2.0, (Arrive("z", 50, final_size_bytes=50),)))
    assert where(pol) == {"p": "gpu-0", "q": "gpu-0", "z": "gpu-1"}
    # c (25): done growing, gpu-0 peaks at 95 now (later p + q + 2 x 5 = 80, then q + 10 = 40): it fits.
    # With 10 to write: after 5 bytes each, 40 + 30 + 25 + 3 x 5 = 110 > 100: it goes beside z.
    plan = pol.schedule(EventBatch(3.0, (Arrive("c", 25, final_size_bytes=final),)))
    assert plan.placements == (Placement("c", gpu),)


def test_without_final_sizes_the_per_request_estimate_is_the_pool_allowance() -> None:
    events = [(Arrive("a", 60), Arrive("z", 45)), (Arrive("b", 30), Grow("a", 70)), (Arrive("c", 38), Finish("z"))]
    placed = []
    for knobs in ({}, {"growth_estimate": "pool"}):
        pol = policy(**knobs)
        plans = [pol.schedule(EventBatch(float(i + 1), batch)) for i, batch in enumerate(events)]
        placed.append(([p.placements for p in plans], [p.migrations for p in plans], where(pol)))
    assert placed[0] == placed[1]


def test_an_unknown_final_size_keeps_the_pool_headroom_on_its_gpu() -> None:
    pol = policy()
    pol.schedule(EventBatch(1.0, (Arrive("a", 60), Arrive("z", 45, final_size_bytes=45))))
    # a's final size is unknown: gpu-0 keeps 5 free (60 + 38 + 5 > 100), so c goes beside z.
    plan = pol.schedule(EventBatch(2.0, (Arrive("c", 38, final_size_bytes=38),)))
    assert plan.placements == (Placement("c", "gpu-1"),)


def test_final_sizes_survive_a_snapshot_and_a_restart_of_the_same_request() -> None:
    pol = policy()
    two_gpus(pol)
    snap = pol.snapshot()
    assert snap.final_sizes_bytes == (("a", 100), ("z", 45))
    rebuilt = policy()
    rebuilt.restore(snap)
    assert rebuilt.schedule(EventBatch(2.0, (Arrive("b", 30, final_size_bytes=80),))).placements == (
        Placement("b", "gpu-1"),)
    # The operator sends a restarted request as a Finish and an Arrive in one batch: the new final size stays.
    pol.schedule(EventBatch(2.0, (Finish("z"), Arrive("z", 10, final_size_bytes=20))))
    assert dict(pol.snapshot().final_sizes_bytes)["z"] == 20
    pol.schedule(EventBatch(3.0, (Finish("z"),)))
    assert "z" not in dict(pol.snapshot().final_sizes_bytes)


def test_an_unknown_growth_estimate_is_refused() -> None:
    with pytest.raises(ValueError, match="growth_estimate"):
        policy(growth_estimate="oracle")
