"""bench/dgfm.py runs end to end and ends with its JSON line (quick sizes): its figures are sane, not timed."""

from __future__ import annotations

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "dgfm.py"


def test_quick_run_ends_with_throughput_over_time_for_dgfm_on_and_off() -> None:
    summary = run_bench(BENCH, "--quick", first_line="host: ").summary
    assert {"throughput_on_over_off", "second_half_on_over_off", "tokens", "swaps_found", "cycle_epochs", "epochs",
            "recalls", "recalled_bytes", "borrowed_kib_mean", "errors", "windows", "device"} <= set(summary)
    assert summary["quick"] and summary["runs_per_mode"] == 1 and summary["same_mode_spread"] is None
    # Both modes served the workload: tokens in every mode, and long requests borrowed (KV lived elsewhere).
    assert summary["tokens"]["off"] > 0 and summary["tokens"]["on"] > 0
    assert summary["borrowed_kib_mean"]["off"] > 0 and summary["borrowed_kib_mean"]["on"] > 0
    assert summary["throughput_on_over_off"] > 0
    # With DGFM off nothing is recalled; on, every recall brought whole blocks home. (Whether a cycle forms in
    # a 9-second quick run is up to timing: the full run counts them.)
    assert summary["recalled_bytes"] >= 0 and (summary["recalls"] > 0) == (summary["recalled_bytes"] > 0)
    assert summary["epochs"]["off"] > 10 and summary["epochs"]["on"] > 10
    assert 0 <= summary["cycle_epochs"]["on"] <= summary["epochs"]["on"]
    assert len(summary["windows"]) == 3 and all(w["tokens_per_s_off"] >= 0 for w in summary["windows"])
    # One swap alone: the request's KV at its creditor came home whole, and its output is one big worker's.
    swap = summary["one_swap"]
    assert swap["outputs_equal"] and swap["owed_bytes"] > 0 and swap["recalled_bytes"] == swap["owed_bytes"]
    assert 0 < swap["settled_bytes"] <= swap["recalled_bytes"]
    assert swap["with_swap_ms"] > 0 and swap["without_swap_ms"] > 0 and swap["rounds"] == 1
