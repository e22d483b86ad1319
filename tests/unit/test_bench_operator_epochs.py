"""bench/operator_epochs.py runs end to end (its --quick sizes) and ends with its JSON line.

The benchmark drives the operator's real pass through kvfleet.operator.memory; running it here keeps
it from falling behind the reconcile unnoticed.
"""

from __future__ import annotations

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "operator_epochs.py"


def test_quick_run_ends_with_the_headline_figures() -> None:
    summary = run_bench(BENCH, "--quick", first_line="machine: ", timeout_s=300).summary
    assert {"machine", "writes_per_epoch", "changes_per_epoch", "writes_vs_rewrite_all", "epoch_cpu_ms"} <= set(summary)
    assert set(summary["writes_per_epoch"]) == {"10", "100"}
    assert all(cpu_ms > 0 for cpu_ms in summary["epoch_cpu_ms"].values())
    # The claim the benchmark exists for: an epoch writes far less than rewriting every worker would.
    assert summary["writes_vs_rewrite_all"]["100"] < 1
