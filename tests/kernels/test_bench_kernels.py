"""bench/kernels.py runs end to end without a GPU: `--cpu-smoke` takes every code path of a GPU run
(except do_bench and the device queries) through the interpreter, and a plain run without CUDA ends
with the JSON line that says it skipped, instead of a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def _run(*args: str) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(BENCH), *args], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_cpu_smoke_ends_with_the_summary() -> None:
    lines, summary = _run("--cpu-smoke")
    assert any(line.startswith("host: ") for line in lines) and any(line.startswith("device: ") for line in lines)
    assert summary["device"] == "cpu-smoke"
    assert summary["num_rows"] == 4
    for key in ("hbm_fraction_of_peak", "merge_share", "speedup_vs_sdpa"):
        assert set(summary[key]) == {"64", "600"}, key
        assert all(v > 0 for v in summary[key].values()), key
    assert any(" 2 " in f" {line} " for line in lines if "600" in line), "no row used split-KV"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the bench would measure")
def test_without_cuda_it_says_so() -> None:
    lines, summary = _run("--quick")
    assert summary["device"] is None and summary["skipped"] == "no CUDA device"
    assert any("no CUDA device" in line for line in lines[:-1])
