"""bench/mell.py runs end to end in its quick mode and ends with its JSON line (part of `make test`)."""

from __future__ import annotations

import pytest

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "mell.py"


def test_quick_run_prints_the_machine_and_ends_with_the_headline_figures() -> None:
    summary = run_bench(BENCH, "--quick", first_line="machine: ").summary
    assert {"machine", "cpu", "mell_ops_per_s", "bf_ops_per_s", "mell_over_bf", "epoch_live_requests", "epoch_gpus",
            "epoch_s"} <= set(summary)
    assert summary["machine"]
    # The ratio printed is the two rates' quotient (a rate of 0 or a stale ratio fails here).
    assert summary["mell_over_bf"] == pytest.approx(summary["mell_ops_per_s"] / summary["bf_ops_per_s"], rel=0.01)
    # A tenth of the full size: 100,000 live requests in the one timed epoch.
    assert summary["epoch_live_requests"] == 100_000 and summary["epoch_gpus"] > 0
