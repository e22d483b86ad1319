"""kvfleet's default policy (`mell`, kvfleet.mell.mell_default): each rule on an exact small case.

C is 100 bytes and the headroom 5% of it (5 bytes), so the numbers can be checked by hand.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvfleet.mell import Arrive, EventBatch, Finish, Grow, MellDefaultConfig, Migration, Placement, make_policy
from kvfleet.mell.cluster import ClusterPolicy
from kvfleet.mell.models import Location
from kvfleet.mell.state import ClusterSnapshot, GpuSnapshot, ItemSnapshot

C = 100
CONFIG = MellDefaultConfig(capacity_bytes=C)


def policy(**knobs: object) -> ClusterPolicy:
    return make_policy("mell", dataclasses.replace(CONFIG, **knobs))  # type: ignore[arg-type]


def where(pol: ClusterPolicy) -> dict[str, str]:
    return {rid: pol.gpu_of(rid) for rid in pol.item_of}


def test_an_epochs_arrivals_are_placed_largest_first_on_the_fullest_gpu_that_holds_them() -> None:
    pol = policy()
    plan = pol.schedule(EventBatch(1.0, (Arrive("s", 30), Arrive("l", 70), Arrive("m", 60))))
    # 70 opens gpu-0, 60 does not fit beside it (gpu-1), 30 fits gpu-0 only without headroom (70 + 30 + 5
    # > 100) and gpu-1 with it: gpu-1.
    assert plan.placements == (Placement("l", "gpu-0"), Placement("m", "gpu-1"), Placement("s", "gpu-1"))
    assert plan.activate_gpu_ids == ("gpu-0", "gpu-1")


def test_a_request_uses_a_gpus_headroom_before_a_new_gpu_is_started() -> None:
    pol = policy()
    pol.schedule(EventBatch(1.0, (Arrive("a", 70),)))
    plan = pol.schedule(EventBatch(2.0, (Arrive("b", 28),)))  # 70 + 28 <= 100, but not with 5 to spare
    assert plan.placements == (Placement("b", "gpu-0"),) and plan.activate_gpu_ids == ()
    strict = policy(fill_without_headroom=False)
    strict.schedule(EventBatch(1.0, (Arrive("a", 70),)))
    assert strict.schedule(EventBatch(2.0, (Arrive("b", 28),))).activate_gpu_ids == ("gpu-1",)


def test_an_overloaded_gpu_sheds_the_smallest_request_that_clears_it_to_the_emptiest_gpu() -> None:
    pol = policy(consolidate=False)
    pol.schedule(EventBatch(1.0, (Arrive("a", 50), Arrive("b", 30), Arrive("c", 15))))
    pol.schedule(EventBatch(2.0, (Arrive("d", 50), Arrive("e", 10))))
    assert where(pol) == {"a": "gpu-0", "b": "gpu-0", "c": "gpu-0", "d": "gpu-1", "e": "gpu-1"}
    # b grows by 15: gpu-0 holds 110; to be back at 95 it must shed 15: c (15) is the smallest that does.
    plan = pol.schedule(EventBatch(3.0, (Grow("b", 45),)))
    assert plan.migrations == (Migration("c", "gpu-0", "gpu-1", 15, "overload"),)
    assert pol.loads() == {"gpu-0": 95, "gpu-1": 75}


def test_the_least_loaded_gpu_is_emptied_when_the_others_hold_it_with_headroom() -> None:
    pol = policy()
    pol.schedule(EventBatch(1.0, (Arrive("a", 60), Arrive("b", 50), Arrive("c", 20))))
    assert where(pol) == {"a": "gpu-0", "b": "gpu-1", "c": "gpu-0"}
    plan = pol.schedule(EventBatch(2.0, (Finish("a"),)))
    # gpu-0 holds c (20), gpu-1 b (50): 70 <= 0.9 x 100 fits one GPU fewer, and 50 + 20 + 5 <= 100.
    assert plan.migrations == (Migration("c", "gpu-0", "gpu-1", 20, "consolidate"),)
    assert plan.terminate_gpu_ids == ("gpu-0",)


def test_consolidation_waits_when_the_link_cannot_carry_the_move_this_epoch() -> None:
    pol = policy(intra_node_move_budget_bytes=10, inter_node_move_budget_bytes=10)
    pol.schedule(EventBatch(1.0, (Arrive("a", 60), Arrive("b", 50), Arrive("c", 20))))
    plan = pol.schedule(EventBatch(2.0, (Finish("a"),)))
    assert plan.migrations == () and plan.terminate_gpu_ids == ()


def test_a_tpot_objective_caps_each_gpus_load_by_its_request_count() -> None:
    # Load + 10 x requests must stay within 80 (a step-time cap, kvfleet.mell.tpot_load_cap).
    pol = policy(max_load_bytes=80, load_bytes_per_request=10, headroom_fraction=0.0)
    pol.schedule(EventBatch(1.0, (Arrive("a", 40), Arrive("b", 20))))
    # a and b: 60 + 2 x 10 = 80, full; a third request of any size needs a new GPU.
    assert where(pol) == {"a": "gpu-0", "b": "gpu-0"}
    pol.schedule(EventBatch(2.0, (Arrive("c", 1),)))
    assert where(pol)["c"] == "gpu-1"


def test_a_tpot_objective_counts_a_spans_heads_on_its_tail_gpu() -> None:
    # The tail's GPU steps over the span's whole KV (DistAttention): with a cap of 250, a span of
    # 2 heads (200) leaves its tail's GPU 50 for the tail and the requests beside it.
    pol = policy(max_load_bytes=250, load_bytes_per_request=0, headroom_fraction=0.0, consolidate=False)
    plan = pol.schedule(EventBatch(1.0, (Arrive("s", 230),)))
    assert plan.activate_gpu_ids == ("gpu-0", "gpu-1", "gpu-2") and where(pol) == {"s": "gpu-2"}
    pol.schedule(EventBatch(2.0, (Arrive("a", 15),)))
    assert where(pol)["a"] == "gpu-2"  # 30 + 15 <= 50
    plan = pol.schedule(EventBatch(3.0, (Arrive("b", 15),)))
    # 30 + 15 + 15 fits C but not the step: b starts a GPU.
    assert plan.activate_gpu_ids == ("gpu-3",) and where(pol)["b"] == "gpu-3"
    # The tail grows to 45: 60 on gpu-2 > 50, and a (the smallest that clears it) moves beside b.
    plan = pol.schedule(EventBatch(4.0, (Grow("s", 245),)))
    assert plan.migrations == (Migration("a", "gpu-2", "gpu-3", 15, "overload"),)
    # Without an objective the cap is C, whatever the spans.
    free = policy(headroom_fraction=0.0, consolidate=False)
    free.schedule(EventBatch(1.0, (Arrive("s", 230),)))
    free.schedule(EventBatch(2.0, (Arrive("a", 15), Arrive("b", 15))))
    assert where(free) == {"s": "gpu-2", "a": "gpu-2", "b": "gpu-2"}


def test_an_arrival_goes_to_the_gpu_with_its_longest_cached_prefix_that_has_room() -> None:
    # Rule 7 (MemServe §6) on gpu-0 holding 60, gpu-1 30 and gpu-2 50.
    def three(**knobs: object) -> ClusterPolicy:
        loc = Location("node-0", "zone-0")
        pol = policy(consolidate=False, **knobs)
        pol.restore(ClusterSnapshot(
            tuple(GpuSnapshot(f"gpu-{i}", i, i, loc) for i in range(3)),
            tuple(ItemSnapshot(((rid, size),), False, f"gpu-{i}") for i, (rid, size) in enumerate(
                (("a", 60), ("b", 30), ("c", 50)))), (), 3, 3))
        return pol

    def placed(pol: ClusterPolicy, arrive: Arrive) -> tuple[Placement, ...]:
        plan = pol.schedule(EventBatch(1.0, (arrive,)))
        assert plan.activate_gpu_ids == ()
        return plan.placements

    # Bytes alone: 30 goes to the fullest GPU holding it with 5 to spare, gpu-0 (60 + 30 + 5 <= 100).
    assert placed(three(), Arrive("x", 30)) == (Placement("x", "gpu-0"),)
    # Longest prefix first: gpu-2 holds 30 with room, so it takes it although gpu-0 is fuller.
    assert placed(three(), Arrive("x", 30, prefix_tiers=(("gpu-2",), ("gpu-1",)))) == (Placement("x", "gpu-2"),)
    # Among GPUs holding equally long prefixes, the fullest with room, as rule 1 would choose.
    assert placed(three(), Arrive("x", 30, prefix_tiers=(("gpu-1", "gpu-2"),))) == (Placement("x", "gpu-2"),)
    assert placed(three(), Arrive("x", 30, prefix_tiers=(("gpu-0", "gpu-1", "gpu-2"),))) == (Placement("x", "gpu-0"),)
    # A group without growth room is passed over for the next (50 + 48 + 5 > 100 on gpu-2).
    assert placed(three(), Arrive("x", 48, prefix_tiers=(("gpu-2",), ("gpu-1",)))) == (Placement("x", "gpu-1"),)
    # None named has room: rule 1, as if none were named (gpu-1 is the only GPU with 46 + 5 to spare).
    assert placed(three(), Arrive("x", 46, prefix_tiers=(("gpu-2",),))) == (Placement("x", "gpu-1"),)
    # A GPU the policy does not hold is no choice (a replay's prompt tree may name a GPU just let go).
    assert placed(three(), Arrive("x", 30, prefix_tiers=(("gpu-9",),))) == (Placement("x", "gpu-0"),)
    # prefix_affinity=False (a cache-blind router) ignores the names.
    assert placed(three(prefix_affinity=False), Arrive("x", 30, prefix_tiers=(("gpu-2",),))) == (
        Placement("x", "gpu-0"),)


def test_a_rebuilt_states_multi_items_are_split_into_requests() -> None:
    gpu = GpuSnapshot("gpu-0", 0, 0, Location("node-0", "zone-0"))
    snap = ClusterSnapshot((gpu,), (ItemSnapshot((("x", 5), ("y", 5)), True, "gpu-0"),), (), 1, 1)
    pol = policy()
    pol.restore(snap)
    assert pol.item_of["x"] is not pol.item_of["y"]
    pol.schedule(EventBatch(1.0, (Finish("x"),)))
    assert where(pol) == {"y": "gpu-0"} and pol.loads() == {"gpu-0": 5}


def test_new_gpus_fill_a_node_before_another_is_used() -> None:
    pol = policy(gpus_per_node=2, consolidate=False)
    pol.schedule(EventBatch(1.0, tuple(Arrive(f"r{i}", 90) for i in range(3))))
    nodes = {gid: g.location.node_id for gid, g in pol.gpus.items()}
    assert nodes == {"gpu-0": "node-0", "gpu-1": "node-0", "gpu-2": "node-1"}
    # gpu-0 empties and is deleted: its slot on node-0 is the next GPU's.
    pol.schedule(EventBatch(2.0, (Finish("r0"),)))
    pol.schedule(EventBatch(3.0, (Arrive("r3", 90),)))
    assert pol.gpus["gpu-3"].location.node_id == "node-0"


@pytest.mark.parametrize("name", ["mell", "bf"])
def test_an_empty_gpu_of_a_restored_state_is_let_go_and_forgotten(name: str) -> None:
    # A rebuilt state with a worker that reports nothing: its GPU is terminated at the first epoch's
    # end and must leave the free index with it (a later best fit read it and failed).
    loc = Location("node-0", "zone-0")
    snap = ClusterSnapshot((GpuSnapshot("gpu-0", 0, 0, loc), GpuSnapshot("gpu-1", 1, 1, loc)),
                           (ItemSnapshot((("a", 50),), False, "gpu-0"),), (), 2, 2)
    pol = make_policy(name, capacity_bytes=C)
    pol.restore(snap)
    assert pol.schedule(EventBatch(1.0, ())).terminate_gpu_ids == ("gpu-1",)
    plan = pol.schedule(EventBatch(2.0, (Arrive("b", 60),)))
    assert plan.activate_gpu_ids == ("gpu-2",) and set(pol.gpus) == {"gpu-0", "gpu-2"}
