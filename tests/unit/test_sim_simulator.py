"""The simulator on hand-sized workloads: speed model, reservations, metrics, determinism."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvfleet.sim.hardware import A100_40GB, GIB, LLAMA2_7B, LLAMA2_13B, RTX4090_24GB, derive_capacity
from kvfleet.sim.simulator import make_setup, simulate
from kvfleet.sim.traces import TraceRequest, read_trace, slice_trace

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
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
