"""`kvfleet replay`'s refusals: bad arguments and an unreachable cluster exit 2 with a message, before
any request is sent. (The replay itself runs against the real control plane: e2e/test_replay.py.)"""

from __future__ import annotations

import pytest

from kvfleet.cli import main
from kvfleet.replay.cli import Shape
from kvfleet.sim import bundled
from kvfleet.sim.traces import TraceRequest

TRACE = bundled.trace_path(bundled.CONV)


@pytest.mark.parametrize(("args", "message"), [
    (["--time-scale", "nan"], "--time-scale must be positive"),
    (["--time-scale", "0"], "--time-scale must be positive"),
    (["--every", "0"], "--every must be at least 1"),
    (["--policy", "bf"], "an LLMPool's policy is one of mell, mell-paper, best-fit"),
    (["--window", "10"], "START:DURATION"),
    (["--window", "99999999:5"], "no requests in window"),
    (["--max-request-tokens", "1"], "--max-request-tokens must be at least 2"),
    (["--kubeconfig", "/nonexistent/kubeconfig"], "cannot read LLMPool default/p"),
])
def test_bad_input_exits_2_with_a_message(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["replay", "--pool", "p", "--trace", str(TRACE), "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_shape_thins_scales_and_caps_requests() -> None:
    reqs = [TraceRequest(f"r{i}", float(i), 800, 300) for i in range(5)]
    shaped = Shape(every=2, prompt_scale=0.125, output_scale=0.5, max_request_tokens=120).apply(reqs)
    # Every second request; prompt 800/8 = 100 capped at 60 (half of 120), output 150 capped at 120 - 60.
    assert [(r.request_id, r.prompt_tokens, r.output_tokens) for r in shaped] == [
        ("r0", 60, 60), ("r2", 60, 60), ("r4", 60, 60)]
    assert Shape().apply(reqs) == reqs
