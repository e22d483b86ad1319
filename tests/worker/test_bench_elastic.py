"""bench/elastic.py runs end to end and ends with its JSON line (small sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "elastic.py"


def test_quick_run_ends_with_the_headline_figures(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--model-dir", str(tmp_path / "tiny")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("host: ")
    summary = json.loads(lines[-1])
    assert {"static_max_batch", "elastic_max_batch", "batch_ratio", "goodput_ratio", "low_load_tpot_ratio",
            "context_tokens", "device"} <= set(summary)
    assert summary["static_max_batch"] >= 1 and summary["elastic_max_batch"] >= 1
    assert summary["context_tokens"] == 1024
    assert summary["low_load_tpot_ratio"] > 0
