"""bench/engine.py runs end to end and ends with its JSON line (builtin engine only, small sizes)."""

from __future__ import annotations

from pathlib import Path

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "engine.py"


def test_quick_run_ends_with_the_headline_figures(tmp_path: Path) -> None:
    summary = run_bench(BENCH, "--quick", "--no-vllm", "--model-dir", str(tmp_path / "tiny"), first_line="host: ").summary
    assert {"builtin_tokens_per_s", "vllm_tokens_per_s", "ratio", "report_writes_per_s"} <= set(summary)
    assert summary["builtin_tokens_per_s"] > 0 and summary["vllm_tokens_per_s"] is None
    # The reporter writes on arrivals and finishes, far less often than once per token.
    assert 0 < summary["report_writes_per_s"] < summary["per_token_writes_per_s"] / 5
