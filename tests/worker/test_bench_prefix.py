"""bench/prefix.py runs end to end and ends with its JSON line (a few sessions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prefix.py"


def test_quick_run_ends_with_the_headline_figures(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--model-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("host: ")
    summary = json.loads(lines[-1])
    setups = {"no-cache", "cache", "session", "prompt-tree"}
    assert set(summary["ttft_mean_ms"]) == setups and set(summary["prefilled_tokens"]) == setups
    assert summary["device"] == "cpu" and summary["ttft_cut_vs_no_cache"] is not None
    # The cache is real: every cached setup prefilled fewer tokens than the one without it (the
    # shared system prompt alone is most of every first turn), whatever the timing on this machine.
    assert all(summary["prefilled_tokens"][s] < summary["prefilled_tokens"]["no-cache"] for s in setups - {"no-cache"})
    assert all(v > 0 for v in summary["radix_match_us"].values())
