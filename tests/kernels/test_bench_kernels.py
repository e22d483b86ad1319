"""bench/kernels.py runs end to end without a GPU: `--cpu-smoke` takes every code path of a GPU run
(except do_bench and the device queries) through the interpreter, and a plain run without CUDA ends
with the JSON line that says it skipped, instead of a traceback."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from bench_testing import ROOT, BenchRun, env_without, run_bench

BENCH = ROOT / "bench" / "kernels.py"


def _run(*args: str, **env: str) -> BenchRun:
    # The kernel tests' interpreter switch (conftest.py) is theirs: the bench sets its own where it needs it.
    return run_bench(BENCH, *args, first_line="host: ", env=env_without("TRITON_INTERPRET") | env)


def test_cpu_smoke_ends_with_the_summary() -> None:
    run = _run("--cpu-smoke")
    lines, summary = run.lines, run.summary
    assert any(line.startswith("device: ") for line in lines)
    assert summary["device"] == "cpu-smoke"
    assert summary["num_rows"] == 4
    for key in ("hbm_fraction_of_peak", "merge_share", "speedup_vs_sdpa"):
        assert set(summary[key]) == {"64", "600"}, key
        assert all(v > 0 for v in summary[key].values()), key
    assert any(" 2 " in f" {line} " for line in lines if "600" in line), "no row used split-KV"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the bench would measure")
def test_without_cuda_it_says_so() -> None:
    run = _run("--quick")
    lines, summary = run.lines, run.summary
    assert summary["device"] is None and summary["skipped"] == "no CUDA device"
    assert any("no CUDA device" in line for line in lines[:-1])


def _bench_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_64k_row_is_sliced_below_2_31_elements() -> None:
    """The row that crashed an H100 (context 65,536 x batch 32, heads 32/8/128): its contiguous caches
    hold exactly 2**31 elements; the bench's fills and SDPA take them in slices of at most 2**31 - 1."""
    bench = _bench_module()
    shape = (32, 8, 65536, 128)
    step = bench.rows_per_slice(shape)
    assert step == 31 and step * 8 * 65536 * 128 <= 2**31 - 1
    paged = (32 * 4096, 16, 8, 128)
    assert bench.rows_per_slice(paged) * 16 * 8 * 128 <= 2**31 - 1 < paged[0] * 16 * 8 * 128
    with pytest.raises(ValueError):
        bench.rows_per_slice((2, 2**31))


def test_sliced_fill_and_sdpa_equal_the_whole() -> None:
    bench = _bench_module()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 1, 16, generator=gen)
    k = torch.randn(5, 2, 33, 16, generator=gen)
    v = torch.randn(5, 2, 33, 16, generator=gen)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    limit = 2 * 2 * 33 * 16  # two sequences a slice: slices of 2, 2 and 1
    sliced = bench.chunked_sdpa(torch, q, k, v, limit)
    assert torch.allclose(sliced, whole, atol=1e-6)
    filled = bench.filled_normal(torch, (7, 3, 5), torch.float32, torch.device("cpu"), limit=20)
    assert bool(torch.isfinite(filled).all()) and float(filled.std()) > 0.5
    assert all(float(filled[i].abs().sum()) > 0 for i in range(7))  # every slice written


@pytest.mark.parametrize(("die_at", "ok_steps"), [(None, ("decode", "sdpa_sliced")), ("part_merge", ("stream", "sdpa_sliced"))],
                         ids=["every-step-answers", "goes-on-in-a-fresh-process-after-a-fatal-error"])
def test_crash_hunt(die_at: str | None, ok_steps: tuple[str, ...]) -> None:
    """Every step gets a verdict; a child that dies in a step (KVFLEET_HUNT_DIE_AT) fails that step only,
    and a fresh child takes the steps after it."""
    summary = _run("--crash-hunt", "--cpu-smoke", **({"KVFLEET_HUNT_DIE_AT": die_at} if die_at else {})).summary
    bench = _bench_module()
    assert list(summary["steps"]) == [*bench.HUNT_STEPS, *bench.RACE_STEPS]
    assert summary["failed"] == ([die_at] if die_at else [])
    if die_at:
        assert "process died" in summary["steps"][die_at]
    assert all(summary["steps"][step].startswith("ok") for step in ok_steps), summary["steps"]


def test_timing_waits_for_the_inputs_before_cuda_graph_timing_reads_them() -> None:
    """do_bench_cudagraph calls the kernel on a stream of its own; the row's inputs were queued on the
    default stream. Unsynchronised, the first call read a block table not yet written (recycled memory):
    the illegal memory access at 65,536 x 32 on the H100 and the H200 (docs/gpu.md)."""
    bench = _bench_module()
    calls: list[str] = []

    class Cuda:
        @staticmethod
        def synchronize() -> None:
            calls.append("synchronize")

    class Testing:
        @staticmethod
        def do_bench_cudagraph(fn: Any, rep: int, return_mode: str) -> float:
            calls.append("do_bench_cudagraph")
            fn()
            return 1.0

    timer = bench.Bench.__new__(bench.Bench)
    timer.cpu = False
    timer.args = type("Args", (), {"quick": True, "timing": "graph"})()
    timer.torch = type("Torch", (), {"cuda": Cuda})()
    timer.triton = type("Triton", (), {"testing": Testing})()
    assert timer.time_s(lambda: calls.append("kernel")) == 1e-3
    assert calls == ["synchronize", "do_bench_cudagraph", "kernel"]
