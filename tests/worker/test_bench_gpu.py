"""The GPU benchmarks run end to end on the CPU at toy sizes, so a GPU lease is spent measuring, not
debugging: bench/gpu.py's dry run of every part, and in it bench/gpu_engine.py's quick form and
bench/migration.py's two-process form.

The dry run runs each part as its own process with the arguments a standalone quick run would take
(gpu.py's `parts`), and its log keeps each part's output. The engine and two-process tests read their
part there rather than run the same command a second time (about 30 s of `make test` on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench_testing import ROOT, run_bench

GPU = ROOT / "bench" / "gpu.py"
GPU_ENGINE = ROOT / "bench" / "gpu_engine.py"
MIGRATION = ROOT / "bench" / "migration.py"


class DryRun:
    """bench/gpu.py --dry-run's summary and its log, split into each part's lines."""

    def __init__(self, summary: dict[str, Any], out: Path) -> None:
        self.summary = summary
        self.out = out
        self.log = (out / "gpu.log").read_text()

    def part_lines(self, name: str) -> list[str]:
        """What the part printed (stdout and stderr, as gpu.py merges them), without gpu.py's header."""
        part: list[str] | None = None
        for line in self.log.splitlines():
            if line.startswith("== "):
                if part is not None:
                    break
                if line.startswith(f"== {name}: "):
                    part = []
            elif part is not None:
                part.append(line)
        assert part is not None, f"no part {name} in gpu.log"
        return part

    def part_run(self, name: str, bench: Path, *args: str, first_line: str) -> tuple[list[str], dict[str, Any]]:
        """The part's lines and last JSON line, after checking what run_bench checks of a standalone run: the
        arguments it ran with, its exit 0, its first line and its last line a JSON object."""
        log_header = next(line for line in self.log.splitlines() if line.startswith(f"== {name}: "))
        assert f"bench/{bench.name} {' '.join(args)} (limit" in log_header, log_header
        part = self.summary["parts"][name]
        lines = self.part_lines(name)
        assert part["status"] == "ok", (part, lines[-20:])
        assert lines and lines[0].startswith(first_line), lines[:3]
        summary = json.loads(lines[-1])
        assert isinstance(summary, dict) and summary == part["summary"]
        return lines, summary


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> DryRun:
    out = tmp_path_factory.mktemp("gpu")
    summary = run_bench(GPU, "--dry-run", "--out", str(out), first_line="device: cpu (dry run", timeout_s=900).summary
    return DryRun(summary, out)


def test_engine_bench_checks_greedy_against_transformers_and_times_both_paths(dry_run: DryRun) -> None:
    _, summary = dry_run.part_run("engine", GPU_ENGINE, "--quick", first_line="host: ")
    for path in ("sdpa", "distattention"):
        greedy = summary["greedy"]["float32"][path]
        assert greedy["equal_prompts"] == greedy["prompts"] == 2  # float32 on the CPU: token for token
    assert set(summary["decode"]) == {"1", "4"} and set(summary["prefill"]) == {"48"}
    for batch in summary["decode"].values():
        assert batch["sdpa"]["tokens_per_s"] > 0 and batch["distattention"]["tokens_per_s"] > 0
    assert summary["targets"]["greedy_float32_equal"] is True


def test_two_worker_processes_move_requests_through_the_executor(dry_run: DryRun) -> None:
    """The GPU form's path on the CPU (small model, short prompts): two worker processes started as pods
    start them, every move asked of the source's migrate endpoint; a deadline already past when the first
    round ends cuts the second round and the throughput section (as the GPU form's deadline may)."""
    lines, summary = dry_run.part_run("migration", MIGRATION, "--quick", "--processes", "--no-vllm", "--repeat", "2",
                                      "--deadline-s", "1", first_line="host: ")
    # The workers log to stderr (in the part's lines here): a request they failed to serve would show there.
    assert not any("Traceback" in line for line in lines), "\n".join(lines[-60:])
    assert (summary["device"], summary["processes"], summary["dtype"]) == ("cpu", 2, "float32")
    assert set(summary["kv_downtime_ms"]) == set(summary["token_downtime_ms"]) == {"64", "256"}
    assert all(v > 0 for v in [*summary["kv_downtime_ms"].values(), *summary["token_downtime_ms"].values()])
    assert summary["kv_flatness"] > 0 and set(summary["kv_below_token"]) == {"64", "256"}
    assert summary["failures"] == []
    assert summary["kv_samples"] == summary["token_samples"] == {"64": 1, "256": 1}
    assert any("stopped in round 2 of 2" in line for line in lines)
    assert summary["throughput_ratio_vs_socket"] is None
    assert summary["goals"]["kv_below_token"] is None  # no length above 512 tokens
    # Printed as measured, in the order the goals need them: KV and token at the longest length first.
    rows = [line.split(": ", 1)[1] for line in lines if line.lstrip().startswith("builtin round")]
    assert [" ".join(row.split()[:4]) for row in rows] == ["kv mode, 256 tokens:", "token mode, 256 tokens:",
                                                           "kv mode, 64 tokens:", "token mode, 64 tokens:"]


def test_dry_run_takes_every_part_and_writes_its_summary(dry_run: DryRun) -> None:
    summary = dry_run.summary
    parts = summary["parts"]
    assert list(parts) == ["kernel_tests", "crash_hunt", "kernels", "engine", "elastic", "distkv", "migration"]
    not_ok = {name: part for name, part in parts.items() if part["status"] != "ok"}
    assert not not_ok, not_ok
    assert all(isinstance(part["summary"], dict) for part in parts.values())
    assert parts["kernel_tests"]["summary"]["passed"] >= 1
    assert parts["crash_hunt"]["summary"]["failed"] == []
    assert summary["targets"]["crash_hunt_failed_ops"] == []
    assert json.loads((dry_run.out / "gpu.json").read_text())["parts"].keys() == parts.keys()
    log = dry_run.log
    assert all(f"== {name}: " in log for name in parts)
