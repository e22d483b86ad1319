"""The `hpa` baseline (today's stack): an HPA on mean KV usage over a least-loaded router, on hand-checked states."""

from __future__ import annotations

import pytest

from kvfleet.mell import Arrive, EventBatch, Finish, make_policy
from kvfleet.mell.kv_autoscaler import KvAutoscalerConfig, KvAutoscalerPolicy

C = 100


def hpa(**knobs: float) -> KvAutoscalerPolicy:
    policy = make_policy("hpa", KvAutoscalerConfig(capacity_bytes=C, **knobs))  # type: ignore[arg-type]
    assert isinstance(policy, KvAutoscalerPolicy)
    return policy


def serving(policy: KvAutoscalerPolicy) -> list[str]:
    return sorted(g.gpu_id for g in policy.gpus.values() if not g.idle and g.gpu_id not in policy.draining)


def test_a_sync_sizes_the_replicas_to_the_target_and_the_router_spreads_onto_them() -> None:
    policy = hpa(target_utilization=0.5, sync_s=15)
    # 90 bytes on one replica: 1.8 x the target; the sync at t=0 asks for ceil(90 / 50) = 2.
    plan = policy.schedule(EventBatch(0.0, (Arrive("a", 50), Arrive("b", 40))))
    assert plan.activate_gpu_ids == ("gpu-0", "gpu-1")
    assert policy.desired_replicas == 2
    # The least-loaded router sends the next request to the new, empty replica; nothing ever moves.
    plan = policy.schedule(EventBatch(1.0, (Arrive("c", 10),)))
    assert [(p.request_id, p.gpu_id) for p in plan.placements] == [("c", "gpu-1")]
    assert plan.migrations == ()


def test_no_change_within_the_tolerance_and_none_between_syncs() -> None:
    policy = hpa(target_utilization=0.5, sync_s=15, tolerance=0.1)
    policy.schedule(EventBatch(0.0, (Arrive("a", 54),)))  # 1.08 x the target: within 10%, one replica
    assert serving(policy) == ["gpu-0"]
    policy.schedule(EventBatch(5.0, (Arrive("b", 30),)))  # 1.68 x, but the next sync is at 15 s
    assert serving(policy) == ["gpu-0"]
    policy.schedule(EventBatch(15.0, ()))
    assert serving(policy) == ["gpu-0", "gpu-1"]


def test_a_request_that_fits_nowhere_starts_a_replica_at_once() -> None:
    policy = hpa(target_utilization=1.0, sync_s=15)
    policy.schedule(EventBatch(0.0, (Arrive("a", 80),)))
    plan = policy.schedule(EventBatch(1.0, (Arrive("b", 30),)))
    assert plan.activate_gpu_ids == ("gpu-1",) and plan.placements[0].gpu_id == "gpu-1"


def test_scale_down_waits_out_the_stabilization_window_then_drains_the_least_loaded() -> None:
    policy = hpa(target_utilization=0.5, sync_s=10, stabilization_s=30)
    policy.schedule(EventBatch(0.0, (Arrive("a", 40), Arrive("b", 40))))  # ceil(80 / 50) = 2 replicas
    policy.schedule(EventBatch(1.0, (Arrive("c", 5),)))  # to the emptier replica (gpu-1, 0 + 5)
    assert serving(policy) == ["gpu-0", "gpu-1"]
    # Load falls to 45 (one replica's worth), but the window still holds the 2 of t=0.
    policy.schedule(EventBatch(10.0, (Finish("b"),)))
    policy.schedule(EventBatch(20.0, ()))
    policy.schedule(EventBatch(30.0, ()))
    assert serving(policy) == ["gpu-0", "gpu-1"]
    # At t=40 the t=0 recommendation has left the window: the least-loaded replica drains.
    policy.schedule(EventBatch(40.0, ()))
    loads = {g.gpu_id: g.load_bytes for g in policy.gpus.values()}
    least = min(loads, key=lambda g: loads[g])
    assert policy.draining == {least}
    # A draining replica gets nothing new, and goes as soon as it holds nothing.
    plan = policy.schedule(EventBatch(41.0, (Arrive("d", 1),)))
    assert plan.placements[0].gpu_id != least
    holders = [rid for rid, item in policy.item_of.items() if item.gpu is not None and item.gpu.gpu_id == least]
    plan = policy.schedule(EventBatch(42.0, tuple(Finish(rid) for rid in holders)))
    assert plan.terminate_gpu_ids == (least,) and policy.draining == frozenset()


def test_an_emptied_replica_stays_while_the_hpa_wants_it() -> None:
    policy = hpa(target_utilization=0.5, sync_s=10, stabilization_s=30)
    policy.schedule(EventBatch(0.0, (Arrive("a", 40), Arrive("b", 40))))
    policy.schedule(EventBatch(1.0, (Arrive("c", 5),)))
    plan = policy.schedule(EventBatch(2.0, (Finish("c"),)))  # gpu-1 holds nothing, but 2 are wanted
    assert plan.terminate_gpu_ids == () and serving(policy) == ["gpu-0", "gpu-1"]


@pytest.mark.parametrize("knobs", [{"target_utilization": 0.0}, {"target_utilization": 1.5}, {"sync_s": 0.0}])
def test_bad_knobs_are_refused(knobs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        KvAutoscalerConfig(capacity_bytes=C, **knobs)  # type: ignore[arg-type]
