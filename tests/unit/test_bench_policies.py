"""bench/policies.py runs end to end in its quick mode and ends with its JSON line (part of `make test`)."""

from __future__ import annotations

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "policies.py"


def test_quick_run_prints_the_machine_every_scenario_and_the_targets() -> None:
    summary = run_bench(BENCH, "--quick", first_line="machine: ").summary
    assert summary["bench"] == "policies" and summary["quick"] is True and summary["machine"]
    scenarios = summary["scenarios"]
    # Both setups x (two Azure traces, three Poisson rates, the long-context workload).
    assert [(s["setup"], s["workload"]) for s in scenarios][:6] == [
        ("13b-a100", "azure-conv"), ("13b-a100", "azure-code"), ("13b-a100", "poisson-0.5"),
        ("13b-a100", "poisson-0.8"), ("13b-a100", "poisson-1.1"), ("13b-a100", "long-context")]
    assert len(scenarios) == 12
    keys = {"billed_gpu_hours", "mean_gpus", "peak_gpus", "migrations_per_s", "deferred_migrations", "queue_p99_s",
            "tpot_p99_ms", "own_bound_billed_gpu_hours"}
    for sc in scenarios:
        assert set(sc["policies"]) == {"mell", "mell-paper", "bf", "wf", "lb"}
        assert all(keys <= set(figures) for figures in sc["policies"].values())
        assert sc["shared_bound_gpu_hours"] > 0 and sc["shared_bound_peak"] > 0
        checks = sc["targets"]
        assert set(checks) == {"billed", "peak", "deferred", "violations", "migrations", "queue_p99"}
        # What holds by construction, whatever the workload: the default plans only moves its links carry
        # and never packs a GPU past C.
        assert checks["deferred"]["ok"] and checks["violations"]["ok"]
        for policy, figures in sc["policies"].items():
            # A run is never billed less than its own fluid bound, as a cloud bills it.
            assert figures["billed_gpu_hours"] >= figures["own_bound_billed_gpu_hours"], (sc["workload"], policy)
    assert summary["targets_total"] == 12 * 6 and 0 <= summary["targets_met"] <= summary["targets_total"]
