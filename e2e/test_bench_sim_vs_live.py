"""bench/sim_vs_live.py runs end to end in its quick mode on a local control plane of its own and ends
with its JSON line (part of `make test`, so the live-vs-simulated comparison does not rot).

A smoke test of the machinery, not of the targets: the bench prints those as PASS/MISS (10 s of trace
on two cores is one GPU's work, too little to judge the simulator by). It runs the stacks' arms
(`--stacks`: today's worst-fit pool at the static capacity, kvfleet's default policy at the elastic
one); the policy comparison runs the same live and simulated code with other arms, and its judging
is tested on figures in tests/unit/test_sim_vs_live_judging.py."""

from __future__ import annotations

import json
from pathlib import Path

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "sim_vs_live.py"


def test_quick_run_replays_both_stacks_live_and_simulated(tmp_path: Path) -> None:
    run = run_bench(BENCH, "--quick", "--stacks", "--out", str(tmp_path), first_line="machine: ", timeout_s=1200)
    assert any(line.startswith("targets: ") for line in run.lines)
    # Each live pool ran at its arm's capacity: the workers' own speed profiles say so.
    assert "arms: today = live worst-fit / simulated wf, C 768 tokens; kvfleet = live mell / simulated mell, C 784 tokens" in run.lines
    summary = run.summary
    assert summary["bench"] == "sim_vs_live" and summary["mode"] == "stacks" and summary["runs"] == 1
    assert [s["window"] for s in summary["slices"]] == ["0:10"]
    (figures,) = (s["policies"] for s in summary["slices"])
    assert set(figures) == {"today", "kvfleet"}
    for policy, f in figures.items():
        # Every stream came back whole through whatever the pool did, and both sides billed something.
        assert f["streams_whole"] == f["streams"] > 0, policy
        assert f["live_gpu_s"] > 0 and f["sim_gpu_s"] > 0 and f["sim_gpu_s_as_planned"] > 0
        assert set(f["migrations"]) == {"live", "live_failed", "simulated", "simulated_as_planned"}
        # Both sides' timing, to show where they part: every figure measured on each side.
        assert set(f["timing_s"]) == {"ttft_p90", "jct_p50", "jct_p90", "last_end"}
        assert all(t["live"] is not None and t["live"] > 0 and t["simulated"] > 0 for t in f["timing_s"].values())
        # The simulator replayed exactly what was sent, at the speed the workers measured.
        assert (tmp_path / "run0" / "slice0" / policy / "sent.csv").read_text().count("\n") == f["streams"] + 1
        speed_profile = tmp_path / "run0" / "slice0" / policy / "speed-profile.json"
        assert json.loads(speed_profile.read_text())["kind"] == "SpeedProfile"
        capacity = json.loads(speed_profile.read_text())["capacityBytes"]
        assert capacity == {"today": 768, "kvfleet": 784}[policy] * 2048
    assert figures["today"]["migrations"]["simulated_as_planned"] == 0  # worst-fit's plans never migrate
    assert summary["live_gpu_s_sum"] == {p: figures[p]["live_gpu_s"] for p in ("today", "kvfleet")}
    (ratio,) = (s["stack_ratio"] for s in summary["slices"])
    assert ratio["live"] == round(figures["kvfleet"]["live_gpu_s"] / figures["today"]["live_gpu_s"], 4)
    assert summary["stack_ratio"]["simulated"] == round(figures["kvfleet"]["sim_gpu_s"] / figures["today"]["sim_gpu_s"], 4)
    assert 0 <= summary["targets_met"] <= summary["targets"] == 2  # the slice's ratio and the sum's
