"""bench/node_autoscaling.py runs end to end in its quick mode (a 2 s node boot, one warm request) and
ends with its JSON line (part of `make test`, so the measurement of a request that waits for a new
GPU node does not rot).

The claims asserted hold on any machine: a warm worker answers before either cold start, and the
new node's wait runs in order (NodeClaim, node Ready, worker Ready). A 2 s node boot is within the
noise of a worker's start on 2 cores, so pod start and new node are not ordered here.
"""

from __future__ import annotations

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "node_autoscaling.py"


def test_quick_run_measures_a_request_that_needs_a_new_node() -> None:
    run = run_bench(BENCH, "--quick", first_line="machine: ", timeout_s=600)
    summary = run.summary
    assert summary["bench"] == "node_autoscaling" and summary["node_boot_s"] == 2.0
    assert 0 < summary["rtft_warm_s"] < min(summary["rtft_pod_start_s"], summary["rtft_new_node_s"])
    breakdown = summary["new_node_breakdown_s"]
    assert breakdown["nodeclaim"] <= breakdown["node_ready"] <= breakdown["pod_ready"]
    assert any(line.startswith("new_node: first token") for line in run.lines)
