"""Hand-checked cases for every branch of MELL Fig. 10 (Allocate / Depart / Update).

C = 240 bytes keeps the class boundaries whole: tiny <= 30 < T <= 60 < S <= 80 < M <= 120 < L <= 240.
States are built exactly with ClusterSnapshot (GPU ids, activation order, who is where), so every
expected move below can be checked by hand.
"""

from __future__ import annotations

from kvfleet.mell import Arrive, EventBatch, Finish, Grow, Plan
from kvfleet.mell.mell_paper import MellPaperConfig, MellPaperPolicy
from kvfleet.mell.models import Location
from kvfleet.mell.state import ClusterSnapshot, GpuSnapshot, ItemSnapshot

C = 240


def policy(**kw: object) -> MellPaperPolicy:
    # Fig. 10 with one refinement on: Depart T refills only from a newest GPU at most half full.
    cfg = MellPaperConfig(capacity_bytes=C, refill_source_max_fill=0.5, **kw)  # type: ignore[arg-type]
    return MellPaperPolicy(cfg)


def build(layout: dict[str, dict[str, int]], **kw: object) -> MellPaperPolicy:
    """layout: gpu id -> {request id: size}, in activation order (the last is the newest)."""
    pol = policy(**kw)
    gpus = tuple(
        GpuSnapshot(gid, int(gid.split("-")[1]), seq, Location(f"node-{int(gid.split('-')[1]) // 8}", "zone-0"))
        for seq, gid in enumerate(layout)
    )
    items = tuple(
        ItemSnapshot(((rid, size),), False, gid) for gid, reqs in layout.items() for rid, size in reqs.items()
    )
    pol.restore(ClusterSnapshot(gpus, items, (), next_gpu_index=len(layout), next_seq=len(layout)))
    return pol


def step(pol: MellPaperPolicy, *events: Arrive | Finish | Grow) -> Plan:
    return pol.schedule(EventBatch(0.0, tuple(events)))


def moves(plan: Plan) -> set[tuple[str, str, str]]:
    return {(m.request_id, m.source_gpu_id, m.target_gpu_id) for m in plan.migrations}


def where(pol: MellPaperPolicy) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for rid in pol.item_of:
        out.setdefault(pol.gpu_of(rid), set()).add(rid)
    return out


# ---------------------------------------------------------------- Allocate


def test_allocate_t_prefers_l_gpu_with_room() -> None:
    pol = build({"gpu-0": {"big": 150}})
    plan = step(pol, Arrive("t", 50))
    assert [(p.request_id, p.gpu_id) for p in plan.placements] == [("t", "gpu-0")]
    assert plan.activate_gpu_ids == ()


def test_allocate_t_goes_to_most_recent_t_gpu_then_a_new_one() -> None:
    pol = build({"gpu-0": {"a": 50, "b": 50}, "gpu-1": {"c": 50}})
    plan = step(pol, Arrive("d", 50))
    assert plan.placements[0].gpu_id == "gpu-1"  # the most recently activated T-GPU, not the older one
    step(pol, Arrive("e", 50), Arrive("f", 50))
    plan = step(pol, Arrive("g", 50))  # gpu-1 holds 200: 250 would pass C
    assert plan.activate_gpu_ids == ("gpu-2",)
    assert plan.placements[0].gpu_id == "gpu-2"


def test_allocate_sm_into_l_gpu_evicts_t() -> None:
    pol = build({"gpu-0": {"big": 150, "t": 50}})
    plan = step(pol, Arrive("s", 70))  # 150 + 70 < 240
    assert [(p.request_id, p.gpu_id) for p in plan.placements] == [("s", "gpu-0")]
    assert moves(plan) == {("t", "gpu-0", "gpu-1")}
    assert plan.migrations[0].cause == "evict-t"


def test_allocate_sm_without_l_gpu_uses_own_class_gpu() -> None:
    pol = policy()
    placed = [step(pol, Arrive(f"m{i}", 100)).placements[0].gpu_id for i in range(3)]
    assert placed == ["gpu-0", "gpu-0", "gpu-1"]  # two M per M-GPU (Theorem 1 property 1)
    placed = [step(pol, Arrive(f"s{i}", 70)).placements[0].gpu_id for i in range(4)]
    assert placed == ["gpu-2", "gpu-2", "gpu-2", "gpu-3"]  # three S per S-GPU (property 2)


def test_allocate_l_activates_and_pulls_sm_then_refills_source() -> None:
    # Weights are the provider's: here busier GPUs rank first so that the pull comes from gpu-0 and
    # the refill branch ("fulfil j' from the most recently activated S/M-GPU") runs.
    pol = build({"gpu-0": {"m1": 100, "m2": 100}, "gpu-1": {"m3": 100}}, weight_free=0.0, weight_requests=-1.0)
    plan = step(pol, Arrive("big", 130))
    assert plan.activate_gpu_ids == ("gpu-2",)
    assert moves(plan) == {("m1", "gpu-0", "gpu-2"), ("m3", "gpu-1", "gpu-0")}  # ties: the first
    assert plan.terminate_gpu_ids == ("gpu-1",)
    assert where(pol) == {"gpu-0": {"m2", "m3"}, "gpu-2": {"big", "m1"}}


def test_allocate_l_pull_prefers_the_gpu_with_most_room_by_default() -> None:
    pol = build({"gpu-0": {"m1": 100, "m2": 100}, "gpu-1": {"m3": 100}})
    plan = step(pol, Arrive("big", 130))
    assert moves(plan) == {("m3", "gpu-1", "gpu-2")}
    assert plan.terminate_gpu_ids == ("gpu-1",)


# ---------------------------------------------------------------- Depart


def test_depart_case1_latest_gpu_just_removes() -> None:
    pol = build({"gpu-0": {"a": 50, "b": 50}, "gpu-1": {"c": 50, "d": 50}})
    plan = step(pol, Finish("c"))
    assert plan.migrations == ()


def test_depart_t_from_t_gpu_refills_from_latest() -> None:
    pol = build({"gpu-0": {"a": 50, "b": 50, "c": 50, "d": 50}, "gpu-1": {"e": 50, "f": 40}})
    plan = step(pol, Finish("a"))
    assert moves(plan) == {("e", "gpu-1", "gpu-0")}  # the largest T that fits
    assert plan.migrations[0].cause == "refill-t"


def test_depart_t_no_refill_when_still_three_quarters_full() -> None:
    pol = build({"gpu-0": {"a": 60, "b": 60, "c": 60, "d": 50}, "gpu-1": {"e": 50}})
    assert step(pol, Finish("d")).migrations == ()  # 180 = 3/4 C: property 3 holds


def test_depart_t_from_l_gpu_pulls_from_latest_t_gpu() -> None:
    pol = build({"gpu-0": {"big": 150, "t1": 40, "t2": 40}, "gpu-1": {"t3": 40}})
    plan = step(pol, Finish("t1"))
    assert moves(plan) == {("t3", "gpu-1", "gpu-0")}
    assert plan.terminate_gpu_ids == ("gpu-1",)


def test_depart_sm_from_sm_gpu_refills_and_reallocates_t() -> None:
    pol = build({"gpu-0": {"a": 100, "b": 90, "t": 40}, "gpu-1": {"c": 100}})
    plan = step(pol, Finish("a"))
    # c fills the hole; t leaves the M-GPU for a T-GPU (here the GPU that c just emptied).
    assert moves(plan) == {("c", "gpu-1", "gpu-0"), ("t", "gpu-0", "gpu-1")}
    assert where(pol) == {"gpu-0": {"b", "c"}, "gpu-1": {"t"}}


def test_depart_sm_from_l_gpu_pulls_by_priority_and_refills() -> None:
    pol = build({"gpu-0": {"big": 150, "m0": 85}, "gpu-1": {"m1": 85, "m2": 100}, "gpu-2": {"m3": 100}})
    plan = step(pol, Finish("m0"))
    assert moves(plan) == {("m1", "gpu-1", "gpu-0"), ("m3", "gpu-2", "gpu-1")}
    assert plan.terminate_gpu_ids == ("gpu-2",)


def test_depart_l_reallocates_the_others() -> None:
    pol = build({"gpu-0": {"big": 150, "t": 40}, "gpu-1": {"u": 50}})
    plan = step(pol, Finish("big"))
    assert moves(plan) == {("t", "gpu-0", "gpu-1")}
    assert plan.terminate_gpu_ids == ("gpu-0",)


# ---------------------------------------------------------------- Update


def test_update_t_to_s_departs_and_reallocates() -> None:
    pol = build({"gpu-0": {"a": 50, "b": 50, "c": 50}, "gpu-1": {"d": 50}})
    plan = step(pol, Grow("a", 70))
    # Depart a (T) refills gpu-0 with d; a, now S, needs an S-GPU: the GPU d emptied is reused.
    assert moves(plan) == {("d", "gpu-1", "gpu-0"), ("a", "gpu-0", "gpu-1")}
    assert plan.terminate_gpu_ids == () and plan.activate_gpu_ids == ()


def test_update_m_to_l_on_l_gpu_moves_to_new_gpu() -> None:
    pol = build({"gpu-0": {"big": 150, "m": 85}})
    plan = step(pol, Grow("m", 125))
    assert moves(plan) == {("m", "gpu-0", "gpu-1")}
    assert plan.activate_gpu_ids == ("gpu-1",)


def test_update_m_to_l_on_m_gpu_stays_unless_overloaded() -> None:
    pol = build({"gpu-0": {"m1": 100, "m2": 100}})
    assert step(pol, Grow("m1", 130)).migrations == ()  # 230 <= C: it stays, gpu-0 is now an L-GPU
    plan = step(pol, Grow("m1", 150))  # 250 > C: the others leave
    assert moves(plan) == {("m2", "gpu-0", "gpu-1")}


def test_update_l_to_l_overload_reallocates_others() -> None:
    pol = build({"gpu-0": {"big": 150, "t1": 40, "t2": 40}})
    plan = step(pol, Grow("big", 170))
    # t1 cannot stay (170 + 40 + 40 > C) and goes to a new GPU; t2 is re-allocated onto gpu-0 again.
    assert moves(plan) == {("t1", "gpu-0", "gpu-1")}
    assert pol.loads() == {"gpu-0": 210, "gpu-1": 40}


def test_growth_within_class_that_overloads_moves_the_grown_request() -> None:
    pol = build({"gpu-0": {"m1": 100, "m2": 120}, "gpu-1": {"x": 100}})
    plan = step(pol, Grow("m1", 121))  # M -> L, no other L, overload 241 > C: the other M leaves
    assert moves(plan) == {("m2", "gpu-0", "gpu-1")}


# ---------------------------------------------------------------- multi-items, spans, batching


def test_tiny_requests_share_multi_items_of_at_most_c_over_4() -> None:
    pol = policy()
    step(pol, *(Arrive(f"r{i}", 10) for i in range(7)))
    sizes = sorted(item.size_bytes for item in pol._bundles.values())
    assert sizes == [10, 60]
    assert all(pol.gpu_of(f"r{i}") == "gpu-0" for i in range(7))


def test_request_larger_than_c_spans_gpus() -> None:
    pol = policy()
    plan = step(pol, Arrive("huge", 500))  # two whole chunks of C and a tail of 20
    assert [s.request_id for s in plan.spans] == ["huge"]
    assert len(plan.spans[0].gpu_ids) == 3
    assert sorted(pol.loads().values()) == [20, 240, 240]
    plan = step(pol, Finish("huge"))
    assert len(plan.terminate_gpu_ids) == 3


def test_batching_cancels_moves_of_requests_finishing_in_the_same_epoch() -> None:
    pol = build({"gpu-0": {"a": 50, "b": 50, "c": 50, "d": 50}, "gpu-1": {"e": 50}})
    plan = step(pol, Finish("a"), Finish("e"))  # a's departure pulls e, which then finishes
    assert plan.migrations == ()
    assert plan.num_moves_cancelled >= 1


def test_new_request_moved_in_its_epoch_is_just_placed() -> None:
    pol = build({"gpu-0": {"big": 150}})
    plan = step(pol, Arrive("t", 50), Arrive("s", 70))  # t goes to gpu-0, then s evicts it
    assert plan.migrations == ()
    assert {(p.request_id, p.gpu_id) for p in plan.placements} == {("t", "gpu-1"), ("s", "gpu-0")}


def test_unknown_requests_are_refused() -> None:
    import pytest

    pol = policy()
    with pytest.raises(ValueError, match="unknown request"):
        step(pol, Finish("nope"))
    step(pol, Arrive("a", 10))
    with pytest.raises(ValueError, match="arrived twice"):
        step(pol, Arrive("a", 10))


def test_t_on_sm_gpus_option_uses_the_newest_m_gpu_room() -> None:
    pol = build({"gpu-0": {"m1": 100}}, t_on_sm_gpus=True)
    plan = step(pol, Arrive("t", 50))  # no L- or T-GPU: the M-GPU's spare room takes one T
    assert plan.placements[0].gpu_id == "gpu-0" and plan.activate_gpu_ids == ()
    plan = step(pol, Arrive("u", 50))  # only one T per S/M-GPU: a T-GPU is started
    assert plan.activate_gpu_ids == ("gpu-1",)
