"""`kvfleet simulate` end to end on small slices of the Azure traces, cut at run time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.sim import bundled

TRACES = bundled.trace_dir()
CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"
GOLDEN = Path(__file__).resolve().parent / "golden" / "azure_conv_600_120_13b.json"
KEYS = {"peak_gpus", "mean_gpus", "utilization", "migrations_per_s", "migrated_bytes", "active_gpu_hours",
        "billed_gpu_hours", "peak_pods", "queue_p50_s", "queue_p99_s", "tpot_p50_ms", "tpot_p99_ms",
        "num_over_capacity_requests", "num_spanning", "lower_bound_peak", "lower_bound_mean", "shared_bound_peak",
        "shared_bound_mean", "shared_bound_gpu_hours", "mean_vs_own_bound", "active_vs_shared_bound",
        "billed_vs_shared_bound", "scale_up_s", "scale_down_delay_s", "batching", "ttft_p50_s", "ttft_p90_s",
        "ttft_p99_s", "jct_p50_s", "jct_p90_s", "jct_p99_s", "last_finish_s"}


def simulate_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    code = main(["simulate", "--trace", str(CONV), "--window", "600:120", "--setup", "13b-a100",
                 "--json", "--no-progress", *extra])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object on one line
    payload = json.loads(out)
    assert isinstance(payload, dict)
    return payload


def test_json_has_every_policy_and_the_lower_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    payload = simulate_json(capsys)
    policies = payload["policies"]
    assert isinstance(policies, dict) and set(policies) == {"mell", "mell-paper", "bf", "wf", "lb"}
    for stats in policies.values():
        assert KEYS <= set(stats)
        assert stats["capacity_violations"] == 0
    # MELL Theorem 3 bounds Fig. 10's moves per operation (the default's consolidation may move more).
    assert policies["mell-paper"]["max_moves_per_operation"] <= 10
    # The default plans within the §V boundaries and packs nodes first: nothing deferred.
    assert policies["mell"]["deferred_migrations"] == 0
    assert isinstance(payload["shared_bound_peak"], int) and isinstance(payload["shared_bound_mean"], float)
    assert "lower_bound_peak" not in payload  # no policy's own bound stands for the others'
    assert policies["bf"]["migrations_per_s"] == 0 and policies["wf"]["migrations_per_s"] == 0
    for stats in policies.values():
        # The shared bound is the workload's: the same beside every policy, and below what each used.
        assert stats["shared_bound_mean"] == payload["shared_bound_mean"]
        assert stats["billed_gpu_hours"] >= stats["active_gpu_hours"] >= payload["shared_bound_gpu_hours"]
        assert stats["scale_up_s"] == 0.0 and stats["scale_down_delay_s"] == 60.0


def test_golden_slice_is_reproduced_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    """The simulator and the policies are deterministic: this slice's numbers are pinned. When a
    deliberate change moves them, regenerate the file with the command in its "command" field."""
    payload = simulate_json(capsys)
    golden = json.loads(GOLDEN.read_text())
    assert payload["policies"] == golden["policies"]
    for key in ("shared_bound_peak", "shared_bound_mean", "shared_bound_gpu_hours", "duration_s", "num_requests"):
        assert payload[key] == golden[key]


def test_scale_flags_reach_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    base = simulate_json(capsys, "--policies", "mell", "--scale-down-delay-s", "0")["policies"]
    slow = simulate_json(capsys, "--policies", "mell", "--scale-up-s", "60", "--scale-down-delay-s", "5")["policies"]
    assert isinstance(base, dict) and isinstance(slow, dict)
    assert (slow["mell"]["scale_up_s"], slow["mell"]["scale_down_delay_s"]) == (60.0, 5.0)
    # Without a delay a pod is billed exactly while its GPU is held; a 60 s start makes requests wait.
    assert base["mell"]["billed_gpu_hours"] == base["mell"]["active_gpu_hours"]
    assert slow["mell"]["queue_p99_s"] >= 60.0 > base["mell"]["queue_p99_s"]


def test_execution_and_floor_flags_reach_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    # With a 60 s pod start, best-fit's plans move nothing; carried out as the operator does, the requests
    # the router ran or queued elsewhere meanwhile are moved to their GPU once its pod is ready.
    flags = ["--policies", "bf", "--scale-up-s", "60"]
    planned = simulate_json(capsys, *flags)["policies"]
    operated = simulate_json(capsys, *flags, "--execution", "operator")["policies"]
    floored = simulate_json(capsys, *flags, "--execution", "operator", "--min-workers", "1")["policies"]
    assert isinstance(planned, dict) and isinstance(operated, dict) and isinstance(floored, dict)
    assert planned["bf"]["num_migrations"] == 0 < operated["bf"]["num_migrations"]
    # A floor worker is ready from the start: the first requests do not wait the 60 s for a pod.
    assert floored["bf"]["queue_p50_s"] < operated["bf"]["queue_p50_s"]


def test_lookahead_flag_reaches_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    # Told only the KV a request holds (0, as live workers report), best-fit packs tighter than when
    # told an epoch of growth ahead (the default 1): fewer GPUs on average, more preemptions.
    ahead = simulate_json(capsys, "--policies", "bf")["policies"]
    held = simulate_json(capsys, "--policies", "bf", "--lookahead-epochs", "0")["policies"]
    assert isinstance(ahead, dict) and isinstance(held, dict)
    assert held["bf"]["mean_gpus"] < ahead["bf"]["mean_gpus"]
    assert held["bf"]["num_preemptions"] > ahead["bf"]["num_preemptions"]


def test_table_csv_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path = tmp_path / "out.csv"
    code = main(["simulate", "--trace", str(CONV), "--window", "600:60", "--setup", "7b-4090",
                 "--policies", "mell,lb", "--no-progress", "--csv", str(csv_path), "--plot", str(tmp_path / "png")])
    assert code == 0
    out = capsys.readouterr().out
    assert "MELL" in out and "LB" in out and "peak_gpus" in out
    header = csv_path.read_text().splitlines()[0]
    assert header.startswith("setup,workload,policy,peak_gpus")
    assert {"billed_gpu_hours", "queue_p99_s", "tpot_p99_ms", "shared_lb_mean"} <= set(header.split(","))
    assert "billed_gpu_h" in out and "shared_lb_mean" in out
    pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert pngs[:3] == ["fig11_gpus.png", "fig12_migrations.png", "fig14_utilization.png"]
    assert any(p.startswith("fig15_timeline") for p in pngs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "/nonexistent.csv"], "no such file"),
        (["--policies", "mell,random"], "unknown policy"),
        (["--trace", str(CONV), "--max-context-tokens", "1000"], "exceed the model's context of 1000 tokens"),
        (["--trace", str(CONV), "--tpot-ms", "5"], "below one request's decode step"),
        (["--long-context", "0"], "rate must be positive"),
        (["--poisson", "-1"], "rate must be positive"),
        (["--trace", str(CONV), "--window", "abc"], "START:DURATION"),
        (["--trace", str(CONV), "--scale-up-s", "-1"], "--scale-up-s must be >= 0"),
        (["--trace", str(CONV), "--scale-down-delay-s", "-5"], "--scale-down-delay-s must be >= 0"),
        (["--trace", str(CONV), "--lookahead-epochs", "-1"], "--lookahead-epochs must be >= 0"),
        (["--trace", str(CONV), "--min-workers", "-1"], "--min-workers must be >= 0"),
        (["--trace", str(CONV), "--execution", "operator", "--no-batching"], "drop --no-batching"),
        (["--trace", str(CONV), "--max-workers", "4"], "--max-workers needs --execution operator"),
        (["--trace", str(CONV), "--report-lag-epochs", "1"], "--report-lag-epochs needs --execution operator"),
        (["--trace", str(CONV), "--execution", "operator", "--report-lag-epochs", "-1"], "must be >= 0"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["simulate", "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_without_batching_every_operation_moves_on_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    """MELL Fig. 13 on this slice: without request operation batching no move is cancelled, so the
    paper's MELL and load-balance move more; policies that never migrate are unchanged; C is never
    exceeded. The default policy moves less without batching on this slice (0.25 against 0.42 moves/s):
    batched, an epoch's arrivals are placed together and its consolidation, which tries the four least
    loaded GPUs, finds more to empty (0.37 with one candidate; before the per-request growth estimate,
    0.305 against 0.319).
    Pinned, like the golden: the load balancer rebalances once an epoch either way (were it run
    after every operation it would make about 5x its moves)."""
    batched = simulate_json(capsys)["policies"]
    unbatched = simulate_json(capsys, "--no-batching")["policies"]
    assert isinstance(batched, dict) and isinstance(unbatched, dict)
    assert all(stats["batching"] is True for stats in batched.values())
    assert all(stats["batching"] is False for stats in unbatched.values())
    moves = {p: (batched[p]["migrations_per_s"], unbatched[p]["migrations_per_s"]) for p in batched}
    assert moves == {"mell": (0.4184, 0.2535), "mell-paper": (0.8369, 0.8794), "bf": (0.0, 0.0), "wf": (0.0, 0.0),
                     "lb": (0.8201, 1.036)}
    assert all(stats["capacity_violations"] == 0 for stats in unbatched.values())
