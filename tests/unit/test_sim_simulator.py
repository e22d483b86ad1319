"""The simulator on hand-sized workloads: speed model, reservations, metrics, determinism."""

from __future__ import annotations

import math

import pytest

from kvfleet.api.models import AutoscalingSpec
from kvfleet.sim import bundled
from kvfleet.sim.bounds import shared_bound
from kvfleet.sim.hardware import A100_40GB, GIB, LLAMA2_7B, LLAMA2_13B, RTX4090_24GB, derive_capacity
from kvfleet.sim.result import nearest_rank
from kvfleet.sim.run import DEFAULT_SCALE_DOWN_DELAY_S, simulate
from kvfleet.sim.speed_model import make_setup
from kvfleet.sim.traces import TraceRequest, read_trace, slice_trace

TRACES = bundled.trace_dir()
SETUP = make_setup("13b-a100", LLAMA2_13B, A100_40GB)


def test_capacity_is_memory_minus_weights_minus_reserve() -> None:
    cap = derive_capacity(LLAMA2_13B, A100_40GB)
    assert cap.kv_bytes_per_token == 2 * 40 * 40 * 128 * 2 == 819_200
    raw = 40 * GIB - 13_015_864_320 * 2 - 4 * GIB
    assert cap.capacity_bytes == raw // (16 * 819_200) * (16 * 819_200)
    assert cap.capacity_tokens == 15_408
    assert derive_capacity(LLAMA2_7B, RTX4090_24GB).capacity_tokens == 18_528
    with pytest.raises(ValueError, match="does not fit"):
        derive_capacity(LLAMA2_13B, RTX4090_24GB)


def test_one_request_runs_to_completion_on_one_gpu() -> None:
    req = TraceRequest("a", 0.0, 1000, 200)
    r = simulate([req], SETUP, "mell")
    assert r.peak_gpus == 1 and r.num_migrations == 0
    # Decoding 200 tokens at one request per step takes 200 x step_s, plus the prefill.
    expected_s = SETUP.prefill_s(1000) + 200 * SETUP.step_s(1, 1100 * 819_200)
    assert abs(r.duration_s - math.ceil(expected_s)) <= 1
    assert r.lower_bound_peak == 1
    assert 0 < r.utilization < 0.2


def test_request_larger_than_c_spans_gpus_without_violation() -> None:
    req = TraceRequest("big", 0.0, 30_000, 50)  # about 2 x C
    r = simulate([req], SETUP, "mell")
    assert r.peak_gpus == 2 and r.num_spanning == 1 and r.num_capacity_violations == 0


@pytest.mark.parametrize("policy", ["mell", "bf", "wf", "lb"])
def test_azure_slice_keeps_capacity_and_is_deterministic(policy: str) -> None:
    reqs = slice_trace(read_trace(TRACES / "AzureLLMInferenceTrace_conv.csv"), 600.0, 120.0)
    a = simulate(reqs, SETUP, policy)
    b = simulate(reqs, SETUP, policy)
    assert a.gpus == b.gpus and a.num_migrations == b.num_migrations
    assert a.num_capacity_violations == 0
    assert a.peak_gpus >= a.lower_bound_peak
    assert all(g >= lb for g, lb in zip(a.gpus, a.lower_bound))
    if policy in ("bf", "wf"):
        assert a.num_migrations == 0


# --- Honest accounting: pods, queueing delay and TPOT, the shared bound -------------------------------


def test_a_new_pod_is_billed_from_the_plan_that_asks_for_it_until_its_delay_after_release() -> None:
    # One request at t=0 (prompt 1000, output 200). The first plan sees it at the end of epoch 1
    # (t=1) and asks for a pod, ready at 1 + 10 = 11; the request prefills there and decodes from
    # 11 + prefill, ~4.4 s of decoding, done by t=16, where the plan lets the GPU go; the pod
    # lingers 30 s: billed from 1 to 46. Its queueing delay: decode start - (arrival + prefill).
    req = TraceRequest("a", 0.0, 1000, 200)
    r = simulate([req], SETUP, "mell", scale_up_s=10.0, scale_down_delay_s=30.0)
    assert r.times_s[-1] == 16.0 and r.gpus[-1] == 0
    assert r.pod_lifetimes_s == [(1.0, 46.0)]
    assert r.billed_gpu_hours == 45.0 / 3600
    assert r.active_gpu_hours == 15.0 / 3600 and r.peak_pods == 1
    prefill_s = SETUP.prefill_s(1000)
    assert r.queue_delays_s == [(11.0 + prefill_s) - (0.0 + prefill_s)]  # = 11: 1 s epoch + 10 s pod start
    # A second request, arriving while the pod is warm (released at 16, taken again at 31 < 16 + 30),
    # reuses it: one pod, billed once, from 1 until 30 s after its last release (36). It arrives
    # 0.1 s before the epoch ends and its prefill (0.167 s) runs past it, so nothing makes it wait.
    late = TraceRequest("b", 30.9, 1000, 200)
    r2 = simulate([req, late], SETUP, "mell", scale_up_s=10.0, scale_down_delay_s=30.0)
    assert r2.times_s[-1] == 36.0
    assert r2.pod_lifetimes_s == [(1.0, 66.0)] and r2.billed_gpu_hours == 65.0 / 3600
    assert r2.queue_delays_s[1] == 0.0


def test_a_pod_released_the_delay_ago_or_more_is_gone() -> None:
    # No scale-up: the first request is done by t=6 (1 + ~4.4 s of decoding). With a 10 s delay its
    # pod, released at 6, is deleted at 16, before the second request's plan at 31: a second pod,
    # billed from 31 until 10 s after the plan at 36 lets it go.
    reqs = [TraceRequest("a", 0.0, 1000, 200), TraceRequest("b", 30.9, 1000, 200)]
    r = simulate(reqs, SETUP, "mell", scale_down_delay_s=10.0)
    assert r.pod_lifetimes_s == [(1.0, 16.0), (31.0, 46.0)]
    assert r.peak_pods == 1


def test_finish_is_interpolated_inside_the_epoch() -> None:
    # Unloaded, the request waits only for the first plan (t=1) and decodes one token per step;
    # its TPOT is that step (between the step with its prompt's KV and with all its KV). It finishes
    # at 1 + 200 x TPOT = ~5.37 s, inside the epoch ending at 6: rounding to the epoch would have
    # made its decode 5 s.
    r = simulate([TraceRequest("a", 0.0, 1000, 200)], SETUP, "mell")
    assert r.queue_delays_s == [1.0 - (0.0 + SETUP.prefill_s(1000))]
    (tpot_s,) = r.tpots_s
    assert SETUP.step_s(1, 1000 * 819_200) <= tpot_s <= SETUP.step_s(1, 1200 * 819_200)
    assert r.times_s[-1] == 6.0 and 5.0 < 1.0 + 200 * tpot_s < 6.0


def test_pods_do_not_change_the_replay_without_a_scale_up() -> None:
    reqs = slice_trace(read_trace(TRACES / "AzureLLMInferenceTrace_conv.csv"), 600.0, 60.0)
    a = simulate(reqs, SETUP, "mell", scale_down_delay_s=0.0)
    b = simulate(reqs, SETUP, "mell", scale_down_delay_s=300.0)
    assert (a.gpus, a.kv_bytes, a.num_migrations, a.queue_delays_s) == (b.gpus, b.kv_bytes, b.num_migrations,
                                                                        b.queue_delays_s)
    assert a.billed_gpu_hours == a.active_gpu_hours < b.billed_gpu_hours
    assert a.shared_bound == b.shared_bound and a.shared_bound.gpu_hours <= a.active_gpu_hours


def test_shared_bound_of_one_request() -> None:
    # Prompt P=1000, output N=200, arriving at 0: placed at the first epoch end (t=1), after its prefill
    # (~0.167 s), so it decodes from t0 = 1 at one token every s = step_s(1, 0): during its j-th step it
    # holds P + j whole tokens, so sum_j (P + j) x s = s x (N x P + N(N-1)/2) token-seconds, x 819,200
    # bytes per token. It ends at 1 + 200 s = ~5.22 s: 6 epochs.
    s = SETUP.step_s(1, 0)
    bound = shared_bound([TraceRequest("a", 0.0, 1000, 200)], SETUP, 1.0)
    assert bound.kv_byte_seconds == 819_200 * s * (200 * 1000 + 200 * 199 / 2)
    assert bound.duration_s == 6.0 and bound.peak == 1
    assert bound.mean == bound.kv_byte_seconds / (SETUP.capacity_bytes * 6.0)
    # One whose prefill runs past the epoch end is placed then and holds its prompt until it ends.
    prefill_s = SETUP.prefill_s(1000)
    late = shared_bound([TraceRequest("a", 0.9, 1000, 200)], SETUP, 1.0)
    held_s = 0.9 + prefill_s - 1.0
    assert held_s > 0
    assert late.kv_byte_seconds == 819_200 * (1000 * held_s + s * (200 * 1000 + 200 * 199 / 2))
    assert bound.gpu_hours == bound.kv_byte_seconds / SETUP.capacity_bytes / 3600
    # At t=1 it has written floor((1 - t0) / s) tokens; a prompt of 2 x C needs 3 GPUs' worth there.
    big = shared_bound([TraceRequest("big", 0.0, 2 * 15_408, 50)], SETUP, 1.0)
    assert big.peak == 3


def test_requests_larger_than_c_are_counted() -> None:
    r = simulate([TraceRequest("big", 0.0, 30_000, 50), TraceRequest("small", 0.0, 100, 5)], SETUP, "mell")
    assert r.num_over_capacity_requests == 1 and r.num_spanning == 1


@pytest.mark.parametrize(
    ("values", "percent", "expected"),
    [
        ([3.0, 1.0, 2.0], 50, 2.0),  # rank ceil(1.5) = 2
        ([3.0, 1.0, 2.0, 4.0], 50, 2.0),  # rank ceil(2) = 2: no interpolation
        ([float(v) for v in range(1, 101)], 99, 99.0),  # rank 99
        ([float(v) for v in range(1, 11)], 99, 10.0),  # rank ceil(9.9) = 10
        ([5.0], 99, 5.0),
        ([2.0, 1.0], 0, 1.0),
        ([2.0, 1.0], 100, 2.0),
        ([], 50, 0.0),
    ],
)
def test_nearest_rank_percentile(values: list[float], percent: float, expected: float) -> None:
    assert nearest_rank(values, percent) == expected


def test_default_scale_down_delay_is_the_llmpool_default() -> None:
    assert DEFAULT_SCALE_DOWN_DELAY_S == AutoscalingSpec().scale_down_delay_seconds
    with pytest.raises(ValueError, match=">= 0"):
        simulate([TraceRequest("a", 0.0, 10, 10)], SETUP, "mell", scale_up_s=-1.0)


def test_merged_plans_keep_the_order_of_what_the_epoch_did() -> None:
    from kvfleet.mell.models import Migration, Plan, Span
    from kvfleet.sim.run import merge_plans

    first = Plan(5.0, (), (Migration("a", "g0", "g1", 10, "depart"),), (), (Span("x", ("g0", "g1")),), ("g1",), (),
                 (1,), 0)
    second = Plan(5.0, (), (Migration("a", "g1", "g0", 10, "depart"),), (), (), (), ("g1",), (1,), 0)
    merged = merge_plans(5.0, [first, second])
    # A->B->A: two moves (batching would cancel both), the GPU activated then terminated, and the
    # spans of the state the epoch ends in.
    assert [(m.source_gpu_id, m.target_gpu_id) for m in merged.migrations] == [("g0", "g1"), ("g1", "g0")]
    assert (merged.activate_gpu_ids, merged.terminate_gpu_ids, merged.spans) == (("g1",), ("g1",), ())
    assert merged.moves_per_operation == (1, 1) and merged.num_moves_cancelled == 0


@pytest.mark.parametrize("delay_s", [0.0, 0.5, 1.5, 3.2, 60.0])
def test_a_run_is_never_billed_less_than_its_own_bound_as_billed(delay_s: float) -> None:
    # Isolated requests, so pods come and go: the window is floor(delay / epoch) + 1 epoch ends (a
    # pod let go at the next epoch end lingers the delay), whatever the delay's fraction of an epoch.
    reqs = [TraceRequest(f"r{i}", 10.0 * i, 2000, 30) for i in range(4)]
    r = simulate(reqs, SETUP, "mell", scale_down_delay_s=delay_s)
    assert r.billed_gpu_hours >= r.own_bound_billed_gpu_hours > 0
