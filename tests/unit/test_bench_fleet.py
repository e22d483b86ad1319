"""bench/fleet.py runs end to end in its quick mode and ends with its JSON line (part of `make test`)."""

from __future__ import annotations

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "fleet.py"


def test_quick_run_prints_both_stacks_every_ablation_and_the_target() -> None:
    summary = run_bench(BENCH, "--quick", "--hpa-targets", "0.8,1.0", first_line="machine: ").summary
    assert summary["bench"] == "fleet" and summary["quick"] is True and summary["machine"]
    scenarios = summary["scenarios"]
    assert len(scenarios) == 14  # both setups x (the scenarios of bench/policies.py and Mooncake's trace)
    expected = {"today@0.8", "today@1", "today+elastic", "kvfleet-static", "kvfleet-no-migration",
                "kvfleet-no-prompt-tree", "kvfleet+budgets", "kvfleet"}
    for sc in scenarios:
        # Only the Mooncake trace carries prompt hashes: its scenarios run with a prefix cache and find hits.
        hits = [stacks_f.get("prefix_hit_ratio") for stacks_f in sc["stacks"].values()]
        if sc["workload"] == "mooncake-conv":
            assert all(isinstance(h, float) for h in hits) and max(hits) > 0
        else:
            assert hits == [None] * len(hits)
        stacks = sc["stacks"]
        assert set(stacks) == expected
        assert sc["today_at"] in ("today@0.8", "today@1")
        # Judged against the strongest today: the cheapest target that meets the objective.
        meeting = [n for n in ("today@0.8", "today@1") if stacks[n]["meets_tpot"]] or ["today@0.8", "today@1"]
        assert stacks[sc["today_at"]]["billed_gpu_hours"] == min(stacks[n]["billed_gpu_hours"] for n in meeting)
        assert stacks[sc["today_at"]]["vs_today"] == 1.0
        assert sc["kvfleet_vs_today"] == stacks["kvfleet"]["vs_today"]
        # Today never migrates; elastic memory gives a GPU more KV than vLLM's static split.
        assert stacks["today@0.8"]["migrations_per_s"] == 0
        assert stacks["kvfleet"]["capacity_gib"] > stacks["kvfleet-static"]["capacity_gib"]
    assert 0 <= summary["targets_met"] <= summary["targets_total"] == 14
    assert summary["kvfleet_vs_today"] > 0
