"""bench/engine.py runs end to end and ends with its JSON line (builtin engine only, small sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "engine.py"


def test_quick_run_ends_with_the_headline_figures(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--no-vllm", "--model-dir", str(tmp_path / "tiny")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("host: ")
    summary = json.loads(lines[-1])
    assert {"builtin_tokens_per_s", "vllm_tokens_per_s", "ratio", "report_writes_per_s"} <= set(summary)
    assert summary["builtin_tokens_per_s"] > 0 and summary["vllm_tokens_per_s"] is None
    # The reporter writes on arrivals and finishes, far less often than once per token.
    assert 0 < summary["report_writes_per_s"] < summary["per_token_writes_per_s"] / 5
