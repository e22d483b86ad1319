"""MELL's Allocate (mell-paper, Fig. 10) for one request on an observer's view (kvfleet.mell.allocate), with exact small cases.

C is 120 bytes: L (60, 120], M (40, 60], S (30, 40], T (15, 30], tiny up to 15 (MELL §VI-C).
"""

from __future__ import annotations

from kvfleet.mell import (
    AllocateDecision,
    GpuLoad,
    MellPaperConfig,
    Migration,
    PolicyConfig,
    allocate_one,
    cluster_snapshot,
)
from kvfleet.mell.state import ItemSnapshot

C = 120
CONFIG = PolicyConfig(capacity_bytes=C)


def decide(gpus: list[GpuLoad], size_bytes: int, config: PolicyConfig = CONFIG) -> AllocateDecision:
    return allocate_one(cluster_snapshot(gpus, C), size_bytes, config, "mell-paper")


def test_t_goes_on_the_l_gpu_of_highest_priority() -> None:
    busy, roomy = GpuLoad("a", 0, (("l1", 70), ("t1", 20))), GpuLoad("b", 1, (("l2", 70),))
    assert decide([busy, roomy], 20) == AllocateDecision("b", False, "T-on-L-GPU", ())


def test_sm_on_an_l_gpu_orders_the_t_request_there_away() -> None:
    # Fig. 10 Allocate case 2: S(i_L) + S(i) < C (T-requests aside), then depart and re-allocate the T.
    got = decide([GpuLoad("a", 0, (("l", 70), ("t", 20)))], 45)
    assert got == AllocateDecision("a", False, "SM-on-L-GPU", (Migration("t", "a", "gpu-1", 20, "evict-t"),))


def test_l_activates_a_gpu_and_pulls_an_sm_request_into_it() -> None:
    # Case 3: a new GPU; the S/M-request that fits moves there. New GPUs never take a given id.
    got = decide([GpuLoad("gpu-5", 0, (("m", 45),))], 70)
    assert got == AllocateDecision("gpu-6", True, "new-GPU", (Migration("m", "gpu-5", "gpu-6", 45, "pull-sm"),))


def test_t_goes_to_the_latest_t_gpu_and_tiny_joins_the_oldest_multi_item() -> None:
    old, new = GpuLoad("c", 2, (("t1", 20),)), GpuLoad("d", 3, (("t2", 20),))
    assert decide([new, old], 20) == AllocateDecision("d", False, "T-on-latest-T-GPU", ())
    tiny_old, tiny_new = GpuLoad("c", 2, (("x", 10),)), GpuLoad("d", 3, (("y", 10),))
    assert decide([tiny_old, tiny_new], 5) == AllocateDecision("c", False, "tiny-in-multi-item", ())


def test_the_view_bundles_tiny_requests_into_multi_items_of_at_most_c_over_4() -> None:
    snap = cluster_snapshot([GpuLoad("a", 0, (("z", 12), ("x", 10), ("w", 20), ("y", 11)))], C)
    assert snap.items == (
        ItemSnapshot((("w", 20),), False, "a"),
        ItemSnapshot((("x", 10), ("y", 11)), True, "a"),
        ItemSnapshot((("z", 12),), True, "a"),
    )


def test_a_request_reported_twice_holds_room_on_both_gpus() -> None:
    # Mid-migration both workers hold the KV: neither has room for another L-request.
    snap = cluster_snapshot([GpuLoad("a", 0, (("r", 70),)), GpuLoad("b", 1, (("r", 70),))], C)
    assert sum(size for item in snap.items for _, size in item.members) == 140
    assert decide([GpuLoad("a", 0, (("r", 70),)), GpuLoad("b", 1, (("r", 70),))], 70).new_gpu


def test_the_weights_decide_between_l_gpus() -> None:
    # Without the workload term every GPU ranks the same and the older one wins the tie (§VI-C).
    gpus = [GpuLoad("a", 0, (("l1", 70), ("t1", 20))), GpuLoad("b", 1, (("l2", 70),))]
    flat = MellPaperConfig(capacity_bytes=C, weight_free=0.0, weight_requests=0.0)
    assert decide(gpus, 20, flat).gpu_id == "a"


def test_pure_the_same_view_gives_the_same_decision() -> None:
    snap = cluster_snapshot([GpuLoad("a", 0, (("l", 70), ("t", 20))), GpuLoad("b", 1, (("m", 45),))], C)
    assert allocate_one(snap, 45, CONFIG) == allocate_one(snap, 45, CONFIG)
