"""bench/load.py runs end to end and ends with its JSON line (100 requests against a router that
admits 32 at once, so the 429-and-retry path is the one taken)."""

from __future__ import annotations

from pathlib import Path

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "load.py"


def test_quick_run_serves_every_request_without_an_error(tmp_path: Path) -> None:
    summary = run_bench(BENCH, "--quick", "--model-dir", str(tmp_path), first_line="host: ").summary
    assert {"requests", "errors", "refused_429", "retries", "ttft_p50_ms", "ttft_p99_ms", "tokens_per_s",
            "router_rss_mib_before", "router_rss_mib_peak", "router_rss_bytes_per_in_flight"} <= set(summary)
    assert summary["device"] == "cpu" and summary["requests"] == 100
    # Every request served: a 429 is waited out and retried (never given up), nothing else fails.
    assert summary["errors"] == 0 and summary["all_admitted_errors"] == 0 and summary["direct_errors"] == 0
    assert summary["retries"] == summary["refused_429"]
    assert summary["tokens_per_s"] > 0 and summary["direct_3_workers_tokens_per_s"] > 0
    assert 0 < summary["router_rss_mib_before"] <= summary["router_rss_mib_peak"]
    # The router's per-request state is gone once its requests are: nothing in flight, reserved or queued.
    after = summary["router_state_after"]
    assert after["in_flight"] == 0 and after["reservations"] == 0 and after["prefix_queued"] == 0
    assert summary["router_peak_in_flight"] <= summary["max_in_flight"]
    # Where the CPU goes, per token: the router's relaying and the workers' generating, both measured.
    assert summary["router_cpu_us_per_token"] > 0 and summary["worker_cpu_us_per_token"] > 0
