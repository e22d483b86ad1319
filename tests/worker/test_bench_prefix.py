"""bench/prefix.py runs end to end and ends with its JSON line (a few sessions)."""

from __future__ import annotations

from pathlib import Path

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "prefix.py"


def test_quick_run_ends_with_the_headline_figures(tmp_path: Path) -> None:
    summary = run_bench(BENCH, "--quick", "--model-dir", str(tmp_path), first_line="host: ", timeout_s=900).summary
    setups = {"no-cache", "cache", "session", "prompt-tree"}
    assert set(summary["ttft_mean_ms"]) == setups and set(summary["prefilled_tokens"]) == setups
    assert summary["device"] == "cpu" and summary["ttft_cut_vs_no_cache"] is not None
    # The cache is real: every cached setup prefilled fewer tokens than the one without it (the
    # shared system prompt alone is most of every first turn), whatever the timing on this machine.
    assert all(summary["prefilled_tokens"][s] < summary["prefilled_tokens"]["no-cache"] for s in setups - {"no-cache"})
    assert all(v > 0 for v in summary["radix_match_us"].values())
