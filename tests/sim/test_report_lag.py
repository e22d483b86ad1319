"""The simulator's report lag (`simulate(..., execution="operator", report_lag_epochs=k)`): the plan hears
each epoch's events k epochs late, as a live operator hears workers' reports, so a request waits for a
GPU k epochs longer and a GPU whose request finished stays held, its pod billed, k epochs longer.

One request on a pool without a floor, pods ready at once, every step and prefill 0.25 s, epochs of
1 s: exact in floating point, so the assertions are equalities.
"""

from __future__ import annotations

import pytest

from kvfleet.api.speed import SpeedProfile
from kvfleet.sim.run import simulate
from kvfleet.sim.speed_model import profile_setup
from kvfleet.sim.traces import TraceRequest

SETUP = profile_setup(SpeedProfile.model_validate({
    "engine": "builtin", "model": "tiny", "kvBytesPerToken": 1024, "capacityBytes": 4096 * 1024,
    "decode": [{"batch": b, "contextTokens": c, "stepSeconds": 0.25, "samples": 1} for b, c in ((1, 0), (1, 4096), (4, 0))],
    "prefill": [{"tokens": t, "stepSeconds": 0.25, "samples": 1} for t in (16, 4096)]}))
OUTPUT_TOKENS = 8


def run(lag: int) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    r = simulate([TraceRequest("a", 0.5, 100, OUTPUT_TOKENS)], SETUP, "mell", 1.0, scale_down_delay_s=0.0,
                 execution="operator", report_lag_epochs=lag)
    return r.ttfts_s, r.jcts_s, r.pod_lifetimes_s


def test_without_lag_the_plan_places_the_request_at_the_epoch_it_arrived_in() -> None:
    # Heard at 1.0 (the epoch's end), decoding from then: 8 steps end at 3.0, the GPU is let go then.
    assert run(0) == ([0.75], [2.5], [(1.0, 3.0)])


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_a_lagging_plan_places_it_and_lets_its_gpu_go_lag_epochs_later(lag: int) -> None:
    ttfts, jcts, pods = run(lag)
    # No worker runs while no plan holds a GPU: the router queues it. The plan hears it at 1 + lag and
    # starts a pod (ready at once); it prefills there (0.25 s) and decodes 8 steps: done at 3.25 + lag.
    assert ttfts == [1.0 + lag + 0.25 + 0.25 - 0.5] and jcts == [3.25 + lag - 0.5]
    # Its finish is seen at the end of its epoch (4 + lag) and heard lag epochs later: the pod lives on.
    assert pods == [(1.0 + lag, 4.0 + 2 * lag)]


def test_a_lag_needs_the_operated_execution() -> None:
    with pytest.raises(ValueError, match="report_lag_epochs"):
        simulate([TraceRequest("a", 0.5, 100, OUTPUT_TOKENS)], SETUP, "mell", 1.0, report_lag_epochs=1)
