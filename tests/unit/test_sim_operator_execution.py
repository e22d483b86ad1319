"""The simulator carrying out plans as kvfleet's operator and router do (execution="operator"), and the
pool's floor (min_workers): what a live pool does while a worker pod starts, on hand-sized workloads."""

from __future__ import annotations

import pytest

from kvfleet.sim import bundled
from kvfleet.sim.hardware import A100_40GB, LLAMA2_13B
from kvfleet.sim.run import simulate
from kvfleet.sim.speed_model import make_setup
from kvfleet.sim.traces import TraceRequest, read_trace, slice_trace

SETUP = make_setup("13b-a100", LLAMA2_13B, A100_40GB)  # C = 15,408 tokens
ONE = TraceRequest("a", 0.0, 1000, 200)


def test_the_floor_pod_is_ready_from_the_start_and_billed_to_the_end() -> None:
    # The floor's pod exists, ready, at t=0: the plan at t=1 takes it, so the request decodes from 1
    # (no 10 s pod start) and finishes by t=6, where the run ends: the floor's pod is billed 0 to 6.
    r = simulate([ONE], SETUP, "mell", scale_up_s=10.0, scale_down_delay_s=30.0, min_workers=1)
    assert r.pod_lifetimes_s == [(0.0, 6.0)] and r.peak_pods == 1
    assert r.queue_delays_s == [1.0 - SETUP.prefill_s(1000)]
    # Without the floor the same request waits for a new pod (tests/unit/test_sim_simulator.py).
    assert simulate([ONE], SETUP, "mell", scale_up_s=10.0, scale_down_delay_s=30.0).pod_lifetimes_s == [(1.0, 46.0)]


def test_the_floor_pod_outlives_its_delay_and_serves_the_next_request_at_once() -> None:
    # Let go at 6, the floor's pod is not deleted 10 s later: the request at 100 runs on it, ready,
    # and the run's one pod is billed from 0 until the run ends at 106.
    late = TraceRequest("b", 100.0, 1000, 200)
    r = simulate([ONE, late], SETUP, "mell", scale_up_s=10.0, scale_down_delay_s=10.0, min_workers=1)
    assert r.pod_lifetimes_s == [(0.0, 106.0)]
    assert r.queue_delays_s[1] == 101.0 - (100.0 + SETUP.prefill_s(1000))
    # Two at once with a floor of one: the second pod lingers its delay after the run's end, and the
    # floor's lives until then (the pool has drained to its floor).
    both = [ONE, TraceRequest("c", 0.0, 14000, 200)]
    r2 = simulate(both, SETUP, "mell", scale_up_s=0.0, scale_down_delay_s=10.0, min_workers=1)
    assert len(r2.pod_lifetimes_s) == 2 and r2.pod_lifetimes_s[0][1] == r2.pod_lifetimes_s[1][1]
    with pytest.raises(ValueError, match="min_workers"):
        simulate([ONE], SETUP, "mell", min_workers=-1)


def test_a_request_with_no_ready_worker_waits_at_the_router_and_is_no_move() -> None:
    # No pod is ready until 11: the router refuses the request and the client retries, so it starts on
    # its pod then, as the plan says, and reaching it is not a migration.
    plan = simulate([ONE], SETUP, "mell", scale_up_s=10.0, scale_down_delay_s=30.0)
    operated = simulate([ONE], SETUP, "mell", scale_up_s=10.0, scale_down_delay_s=30.0, execution="operator")
    assert operated.pod_lifetimes_s == plan.pod_lifetimes_s == [(1.0, 46.0)]
    assert operated.queue_delays_s == plan.queue_delays_s
    assert operated.num_migrations == plan.num_migrations == 0


def test_while_a_pod_starts_a_request_runs_on_a_ready_worker_and_then_moves_to_its_gpu() -> None:
    # a runs on the floor's pod. b (14,400 + 900 tokens) fits beside it nowhere: best-fit activates a
    # second GPU, whose pod is ready at 13. The router sends b to the only Ready worker, which has no
    # room for it whole, so b waits in its queue; c (300 + 1,500) is held beside b on the starting GPU,
    # and the router has no whole room for it either, but the Ready worker's engine starts it from its
    # queue at once (its KV fits now). At 13 both move to their GPU: b from the queue (no KV), c with
    # its KV. c waits well under a second where the plan kept it waiting ~10 s for the pod.
    reqs = [TraceRequest("a", 0.0, 1000, 2000), TraceRequest("b", 2.5, 14400, 900), TraceRequest("c", 3.5, 300, 1500)]
    plan = simulate(reqs, SETUP, "bf", scale_up_s=10.0, scale_down_delay_s=30.0, min_workers=1)
    operated = simulate(reqs, SETUP, "bf", scale_up_s=10.0, scale_down_delay_s=30.0, min_workers=1, execution="operator")
    assert plan.num_migrations == 0
    assert operated.num_migrations == 2 and operated.num_kv_transfers == 1 and operated.migrated_bytes > 0
    assert max(plan.queue_delays_s) > 9.0 and sorted(operated.queue_delays_s)[-2] < 1.0
    assert operated.pod_lifetimes_s == plan.pod_lifetimes_s and operated.num_capacity_violations == 0


def test_at_the_pools_ceiling_a_gpu_without_a_pod_waits_for_one() -> None:
    # One pod at most: b's GPU never gets one while a runs, so b waits in the floor pod's queue and
    # starts there once a has finished (its engine's queue), never moved.
    reqs = [TraceRequest("a", 0.0, 1000, 200), TraceRequest("b", 0.5, 15000, 100)]
    r = simulate(reqs, SETUP, "mell", scale_up_s=10.0, scale_down_delay_s=30.0, min_workers=1, max_workers=1,
                 execution="operator")
    assert len(r.pod_lifetimes_s) == 1 and len(r.jcts_s) == 2 and r.num_migrations == 0
    with pytest.raises(ValueError, match="max_workers"):
        simulate(reqs, SETUP, "mell", max_workers=1)


@pytest.mark.parametrize("policy", ["mell", "bf"])
def test_an_azure_slice_as_operated_finishes_every_request_and_counts_the_moves_it_makes(policy: str) -> None:
    reqs = slice_trace(read_trace(bundled.trace_dir() / "AzureLLMInferenceTrace_conv.csv"), 600.0, 120.0)
    plan = simulate(reqs, SETUP, policy, scale_up_s=20.0, scale_down_delay_s=30.0, min_workers=1)
    operated = simulate(reqs, SETUP, policy, scale_up_s=20.0, scale_down_delay_s=30.0, min_workers=1,
                        execution="operator")
    assert len(operated.jcts_s) == len(plan.jcts_s) == len(reqs)
    assert operated.num_migrations == sum(operated.migrations_per_epoch)
    if policy == "bf":  # best-fit's plans never move a request; the operator moves those the router put elsewhere
        assert plan.num_migrations == 0 < operated.num_migrations
    # Requests run on Ready workers while pods start instead of waiting for them.
    assert sum(operated.queue_delays_s) < sum(plan.queue_delays_s)
    again = simulate(reqs, SETUP, policy, scale_up_s=20.0, scale_down_delay_s=30.0, min_workers=1, execution="operator")
    assert (again.gpus, again.num_migrations, again.queue_delays_s) == (operated.gpus, operated.num_migrations,
                                                                        operated.queue_delays_s)


def test_without_pod_starts_the_operator_moves_what_the_router_put_elsewhere() -> None:
    # Pods ready at once. The router sends a request where its whole size fits (prompt + output), the
    # plan packs by what requests hold now: where they disagree the operator moves it later. Nothing
    # outgrows its GPU and every request finishes.
    reqs = slice_trace(read_trace(bundled.trace_dir() / "AzureLLMInferenceTrace_conv.csv"), 600.0, 120.0)
    operated = simulate(reqs, SETUP, "mell", execution="operator")
    assert operated.num_migrations > simulate(reqs, SETUP, "mell").num_migrations > 0
    assert operated.num_capacity_violations == 0 and len(operated.jcts_s) == len(reqs)


def test_execution_is_checked() -> None:
    with pytest.raises(ValueError, match="execution must be one of plan, operator"):
        simulate([ONE], SETUP, "mell", execution="live")
    with pytest.raises(ValueError, match="needs batching"):
        simulate([ONE], SETUP, "mell", execution="operator", batching=False)
