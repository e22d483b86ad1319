"""bench/distkv.py runs end to end and ends with its JSON line (quick sizes): its figures are sane, not timed."""

from __future__ import annotations

import importlib.util

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "distkv.py"


def test_quick_run_ends_with_context_step_and_wire_figures() -> None:
    summary = run_bench(BENCH, "--quick", first_line="host: ").summary
    assert {"max_context_tokens", "borrowed_over_local_step", "wire_bytes_query_over_kv", "device", "capacity_tokens",
            "targets_met"} <= set(summary)
    assert summary["capacity_tokens"] == 64
    context = summary["max_context_tokens"]
    assert set(context) == {"1", "2", "4"}
    # Borrowing makes more workers serve a longer context, and never more than they hold together.
    assert 0 < context["1"] < context["2"] < context["4"] <= 4 * summary["capacity_tokens"]
    assert summary["outputs_equal"]
    assert summary["borrowed_over_local_step"] > 0
    # Bytes, not time: shipping the query moves less than the remote KV it attends over.
    assert 0 < summary["wire_bytes_query_over_kv"] < 1
    assert set(summary["targets_met"]) == {"max_context", "borrowed_over_local_step", "vllm_lender_over_local_step",
                                           "wire_bytes_query_over_kv"}
    # Where vLLM is installed (make test installs it), the row borrowing from a vLLM lender is measured
    # too, and its greedy output is among those that must be equal.
    if importlib.util.find_spec("vllm") is not None:
        assert summary["vllm_lender_over_local_step"] > 0
        assert summary["decode_ms_per_token"]["borrowed_vllm_lender"] > 0
        # vLLM workers borrowing: two of them serve a longer context than one, each output equal to one
        # big worker's, and the query shipped per step is less than the remote KV.
        workers = summary["vllm_workers"]
        assert 0 < workers["max_context_tokens"]["1"] < workers["max_context_tokens"]["2"] <= 2 * workers["capacity_tokens"]
        assert workers["outputs_equal"]
        assert 0 < workers["wire_bytes_query_over_kv"] < 1 and workers["borrowed_over_local_step"] > 0
    else:
        assert summary["vllm_workers"] is None
