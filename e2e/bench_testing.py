"""The quick runs of the benchmarks under bench/, shared by their smoke tests in tests/ and e2e/.

Every benchmark keeps one contract its readers rely on: it exits 0, its first line says what machine
it ran on (`machine: `, `host: ` or `device: `), and its LAST line is one JSON object, the figures a
reader or a later script takes. `run_bench` runs one in a subprocess with a timeout, checks that
contract and hands back the parsed summary, so each smoke test is its arguments plus the assertions
only that benchmark has.

This module sits in e2e/ because that folder is on pytest's pythonpath (pyproject.toml), so the tests
in tests/ and in e2e/ import it alike without touching sys.path. A test names its benchmark as
`ROOT / "bench" / "<name>.py"`: tests/unit/test_benchmarks.py looks for that expression to know that
every benchmark has a quick run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "bench"


@dataclass(frozen=True)
class BenchRun:
    """What a benchmark printed: its stdout lines, the parsed last line, and its stderr."""

    lines: list[str]
    summary: dict[str, Any]
    stderr: str


def bench_process(bench: Path, *args: str, timeout_s: float = 600,
                  env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run bench/<name>.py with `args` from the repository root and return the finished process, whatever
    its exit status (for the runs that must refuse: run_bench checks the contract of the ones that work)."""
    assert bench.parent == BENCH_DIR and bench.is_file(), f"not a benchmark under bench/: {bench}"
    return subprocess.run([sys.executable, str(bench), *args], cwd=ROOT, env=dict(env) if env is not None else None,
                          capture_output=True, text=True, timeout=timeout_s)


def run_bench(bench: Path, *args: str, first_line: str, timeout_s: float = 600,
              env: Mapping[str, str] | None = None) -> BenchRun:
    """Run a benchmark and check its contract: exit 0, a first line starting with `first_line` (the
    machine it ran on), a last line that is one JSON object. Returns the lines and that object."""
    result = bench_process(bench, *args, timeout_s=timeout_s, env=env)
    where = f"{bench.name} {' '.join(args)}"
    tails = f"\n--- stdout:\n{result.stdout[-3000:]}\n--- stderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"{where} exited {result.returncode}{tails}"
    lines = result.stdout.strip().splitlines()
    assert lines, f"{where} printed nothing{tails}"
    assert lines[0].startswith(first_line), f"{where}: first line {lines[0]!r} does not start with {first_line!r}"
    try:
        summary = json.loads(lines[-1])
    except json.JSONDecodeError as err:
        raise AssertionError(f"{where}: its last line is not JSON ({err}): {lines[-1][:500]!r}") from None
    assert isinstance(summary, dict), f"{where}: its last line is JSON but not an object: {lines[-1][:500]!r}"
    return BenchRun(lines, summary, result.stderr)


def env_without(*names: str) -> dict[str, str]:
    """This process's environment less `names` (e.g. a switch a test session set for itself)."""
    return {k: v for k, v in os.environ.items() if k not in names}
