"""The GPU benchmarks run end to end on the CPU at toy sizes, so a GPU lease is spent measuring, not
debugging: bench/gpu_engine.py's quick form, and bench/gpu.py's dry run of every part."""

from __future__ import annotations

import json
from pathlib import Path

from bench_testing import ROOT, run_bench

GPU = ROOT / "bench" / "gpu.py"
GPU_ENGINE = ROOT / "bench" / "gpu_engine.py"


def test_engine_bench_checks_greedy_against_transformers_and_times_both_paths() -> None:
    summary = run_bench(GPU_ENGINE, "--quick", first_line="host: ", timeout_s=900).summary
    for path in ("sdpa", "distattention"):
        greedy = summary["greedy"]["float32"][path]
        assert greedy["equal_prompts"] == greedy["prompts"] == 2  # float32 on the CPU: token for token
    assert set(summary["decode"]) == {"1", "4"} and set(summary["prefill"]) == {"48"}
    for batch in summary["decode"].values():
        assert batch["sdpa"]["tokens_per_s"] > 0 and batch["distattention"]["tokens_per_s"] > 0
    assert summary["targets"]["greedy_float32_equal"] is True


def test_dry_run_takes_every_part_and_writes_its_summary(tmp_path: Path) -> None:
    summary = run_bench(GPU, "--dry-run", "--out", str(tmp_path), first_line="device: cpu (dry run", timeout_s=900).summary
    parts = summary["parts"]
    assert list(parts) == ["kernel_tests", "crash_hunt", "kernels", "engine", "elastic", "distkv", "migration"]
    not_ok = {name: part for name, part in parts.items() if part["status"] != "ok"}
    assert not not_ok, not_ok
    assert all(isinstance(part["summary"], dict) for part in parts.values())
    assert parts["kernel_tests"]["summary"]["passed"] >= 1
    assert parts["crash_hunt"]["summary"]["failed"] == []
    assert summary["targets"]["crash_hunt_failed_ops"] == []
    assert json.loads((tmp_path / "gpu.json").read_text())["parts"].keys() == parts.keys()
    log = (tmp_path / "gpu.log").read_text()
    assert all(f"== {name}: " in log for name in parts)
