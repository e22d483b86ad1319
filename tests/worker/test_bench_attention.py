"""bench/attention.py runs end to end and ends with its JSON line (quick sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "attention.py"


def test_quick_run_ends_with_both_paths_timed() -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("host: ")
    cases = json.loads(lines[-1])["cases"]
    assert set(cases) == {"batch1_context64", "batch4_context64"}
    assert all(c["sdpa_ms"] > 0 and c["distattention_ms"] > 0 for c in cases.values())
