"""bench/migration.py runs end to end (--quick) and ends with its JSON line of headline figures, the vLLM
section's too where vllm is installed (its workers' KV moves through kvfleet's connector).

The two-process form (`--processes`, the GPU form's path) runs as a part of bench/gpu.py's dry run, and
tests/worker/test_bench_gpu.py checks it there: one start of its two worker processes, not two."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from bench_testing import ROOT, bench_process, run_bench

BENCH = ROOT / "bench" / "migration.py"


def assert_builtin_figures(summary: dict[str, Any], processes: int) -> None:
    """The CPU run times a move of each length in both modes on float32 workers."""
    assert (summary["device"], summary["processes"], summary["dtype"]) == ("cpu", processes, "float32")
    assert set(summary["kv_downtime_ms"]) == set(summary["token_downtime_ms"]) == {"64", "256"}
    assert all(v > 0 for v in [*summary["kv_downtime_ms"].values(), *summary["token_downtime_ms"].values()])
    assert summary["kv_flatness"] > 0 and set(summary["kv_below_token"]) == {"64", "256"}


def test_quick_run_ends_with_the_headline_figures(tmp_path: Path) -> None:
    summary = run_bench(BENCH, "--quick", "--model-dir", str(tmp_path / "tiny"), first_line="host: ").summary
    assert_builtin_figures(summary, processes=1)
    assert summary["shape"] == "tiny"
    # No timing bounds here (a shared machine decides them): only that the figures are sane.
    assert 0 < summary["throughput_ratio_vs_socket"] < 10
    vllm_keys = ["vllm_kv_downtime_ms", "vllm_token_downtime_ms", "vllm_builtin_kv_downtime_ms",
                 "vllm_builtin_token_downtime_ms", "vllm_kv_flatness", "vllm"]
    if importlib.util.find_spec("vllm") is None:
        assert all(summary[key] is None for key in vllm_keys), summary
        return
    by_length = [summary["vllm_kv_downtime_ms"], summary["vllm_token_downtime_ms"],
                 *summary["vllm_builtin_kv_downtime_ms"].values(), *summary["vllm_builtin_token_downtime_ms"].values()]
    assert set(summary["vllm_builtin_kv_downtime_ms"]) == set(summary["vllm_builtin_token_downtime_ms"]) == \
        {"vllm-to-builtin", "builtin-to-vllm"}
    for downtime_ms in by_length:
        assert set(downtime_ms) == {"64", "256"}
        assert all(v > 0 for v in downtime_ms.values())
    assert summary["vllm_kv_flatness"] > 0
    assert isinstance(summary["vllm"], str) and summary["vllm"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, --gpu runs the GPU form")
def test_gpu_form_says_plainly_that_there_is_no_gpu() -> None:
    result = bench_process(BENCH, "--gpu", timeout_s=300)
    assert result.returncode == 2, result.stderr[-4000:]
    assert "--device cuda" in result.stderr and "no CUDA device" in result.stderr
