"""bench/migration.py runs end to end (--quick) and ends with its JSON line of headline figures, the vLLM
section's too where vllm is installed (its workers' KV moves through kvfleet's connector)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "migration.py"


def test_quick_run_ends_with_the_headline_figures(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--model-dir", str(tmp_path / "tiny")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("host: ")
    summary = json.loads(lines[-1])
    assert set(summary["kv_downtime_ms"]) == set(summary["token_downtime_ms"]) == {"64", "256"}
    assert all(v > 0 for v in [*summary["kv_downtime_ms"].values(), *summary["token_downtime_ms"].values()])
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
