"""bench/attention.py runs end to end and ends with its JSON line (quick sizes)."""

from __future__ import annotations

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "attention.py"


def test_quick_run_ends_with_both_paths_timed() -> None:
    cases = run_bench(BENCH, "--quick", first_line="host: ").summary["cases"]
    assert set(cases) == {"batch1_context64", "batch4_context64"}
    assert all(c["sdpa_ms"] > 0 and c["distattention_ms"] > 0 for c in cases.values())
