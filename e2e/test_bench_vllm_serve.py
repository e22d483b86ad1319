"""bench/vllm_bench_serve.py runs end to end in its quick mode on a local control plane of its own and ends
with its JSON line (part of `make test`, so `vllm bench serve`, the pinned vLLM's own client, keeps
working against kvfleet: issue 33's acceptance, through the router of a builtin pool and of a vLLM
pool and straight to their worker).

A smoke test of the machinery plus the one claim the bench exists for: no request fails. The
latency figures of a 2-core machine are the bench's output (docs/router.md), not asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench_testing import ROOT, run_bench
from kvfleet.localcluster.controlplane import cache_dir
from kvfleet_e2e.real_workers import require_vllm

BENCH = ROOT / "bench" / "vllm_bench_serve.py"
NEEDED = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")
CASES = {"random/completions", "random/chat", "sonnet/completions", "sonnet/chat"}


def test_quick_run_serves_every_vllm_bench_serve_request_through_both_pools(tmp_path: Path) -> None:
    require_vllm()  # the client is vLLM's, and so is one pool's engine
    current = cache_dir() / "bin" / "current"
    missing = [b for b in NEEDED if not (current / b).exists()]
    if missing:
        pytest.skip(f"control-plane binaries not built ({', '.join(missing)} missing in {current}): run make controlplane")
    run = run_bench(BENCH, "--quick", "--out", str(tmp_path), first_line="machine: ", timeout_s=600)
    summary = run.summary
    assert summary["bench"] == "vllm_bench_serve" and summary["quick"] is True and summary["vllm"]
    prompts = summary["sizes"]["prompts"] * summary["sizes"]["rounds"]
    assert set(summary["pools"]) == {"builtin", "vllm"}
    for engine, cases in summary["pools"].items():
        assert set(cases) == CASES, engine
        for case, figures in cases.items():
            for target in ("direct", "router"):
                f = figures[target]
                where = f"{engine} {case} {target}"
                assert "error" not in f, f"{where}: {f.get('error')}"
                assert f["failed"] == 0 and f["completed"] == prompts, f"{where}: {f.get('errors')} {f.get('probe')}"
                assert f["mean_ttft_ms"] > 0 and f["mean_tpot_ms"] > 0 and f["output_throughput"] > 0, where
                # Every request ran to its length (ignore_eos): the TPOT compared is over the same tokens.
                assert f["total_output_tokens"] == prompts * summary["sizes"]["output_len"], where
                assert len(f["rounds"]) == summary["sizes"]["rounds"], where
            assert set(figures["ratio"]) == {"mean_ttft", "median_ttft", "mean_tpot", "output_tok_s"}
    assert summary["failed_total"] == 0
    assert len(summary["commands"]) == 2 * 4 * 2 * summary["sizes"]["rounds"] and all(c.startswith("vllm bench serve ") for c in summary["commands"])
    assert any(line.startswith("failed requests PASS") for line in run.lines)
