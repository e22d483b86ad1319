"""bench/placement.py runs end to end in its quick mode and ends with its JSON line (part of `make test`)."""

from __future__ import annotations

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "placement.py"


def test_quick_run_places_like_the_replaying_router_and_prints_both_costs() -> None:
    summary = run_bench(BENCH, "--quick", first_line="machine: ").summary
    assert summary["machine"] and (summary["workers"], summary["in_flight"], summary["placements"]) == (20, 200, 300)
    # Every placement where the replaying router put it (the bench exits 1 otherwise, too).
    assert summary["decisions_differ"] == 0
    assert sum(summary["rules"].values()) == 300
    for name in ("totals", "rebuild"):
        assert 0 < summary[f"{name}_p50_ms"] <= summary[f"{name}_p99_ms"]
    assert summary["rebuild_over_totals_p99"] > 0
