"""bench/attention.py runs end to end and ends with its JSON line (quick sizes)."""

from __future__ import annotations

import os

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "attention.py"


def test_quick_run_ends_with_both_paths_timed() -> None:
    summary = run_bench(BENCH, "--quick", first_line="host: ").summary
    cases = summary["cases"]
    assert set(cases) == {"batch1_context64", "batch4_context64"}
    assert all(c["sdpa_ms"] > 0 and c["distattention_ms"] > 0 for c in cases.values())
    if "vllm" in summary or os.environ.get("KVFLEET_REQUIRE_VLLM") == "1":   # `make test` installs vLLM
        row = summary["vllm"]["batch4_context128"]
        assert row["vllm_ms"] > 0 and row["distattention_ms"] > 0
        assert abs(row["ratio"] - row["distattention_ms"] / row["vllm_ms"]) < 0.01
        op = summary["cpu_decode_op"]
        assert op["vllm_kernel_ms"] > 0 and op["torch_backend_ms"] > 0
