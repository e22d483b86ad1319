"""bench/elastic.py runs end to end and ends with its JSON line (small sizes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from worker_testing import vllm_available

from bench_testing import ROOT, run_bench

BENCH = ROOT / "bench" / "elastic.py"


def test_quick_run_ends_with_the_headline_figures(tmp_path: Path) -> None:
    run = run_bench(BENCH, "--quick", "--model-dir", str(tmp_path / "tiny"), first_line="host: ", timeout_s=900)
    lines, summary = run.lines, run.summary
    assert {"static_max_batch", "elastic_max_batch", "batch_ratio", "goodput_ratio", "low_load_tpot_ratio",
            "context_tokens", "device", "max_batch", "low_load_tpot_ms", "gpu_chunk_map_us", "chunk_map_us"} <= set(summary)
    assert summary["complete"] is True and "errors" not in summary, summary.get("errors")
    assert summary["static_max_batch"] >= 1 and summary["elastic_max_batch"] >= 1
    # Two contexts, each with its batches and ratio.
    assert summary["context_tokens"] == [1024, 768]
    assert set(summary["max_batch"]) == set(summary["batch_ratio"]) == {"1024", "768"}
    assert all(b["static"] >= 1 and b["elastic"] >= 1 for b in summary["max_batch"].values())
    # Low load with eLLM §5.1's overlap and without it.
    assert set(summary["low_load_tpot_ms"]) == {"static", "elastic", "elastic_no_overlap"}
    assert summary["low_load_tpot_ratio"] > 0 and summary["low_load_tpot_ratio_no_overlap"] > 0
    # The elastic engines mapped ahead of need while steps computed; the backend's latency was measured.
    assert all(row["elastic"]["mapping"]["maps_ahead"] > 0 for row in summary["rows"])
    latency = summary["chunk_map_us"]
    assert latency["backend"] == ("cuda" if summary["device"] == "cuda" else "host")
    assert all(latency[k] > 0 for k in ("map", "unmap", "map_ahead", "unmap_deferred", "unmap_deferred_later"))
    assert (summary["gpu_chunk_map_us"] is None) == (summary["device"] == "cpu")
    # Every line of JSON before the last is a partial summary (a run stopped at a time limit keeps them).
    partial = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(partial) > 3 and all(p["complete"] is False for p in partial[:-1])
    # The vLLM rows: static and elastic vLLM on one budget, or the reason they were left out.
    if vllm_available():
        check_vllm_rows(summary["vllm"], lines)
    else:
        assert summary["vllm"]["skipped"].startswith("vllm is not importable")
        assert any(line.startswith("SKIP vLLM rows: vllm is not importable") for line in lines)
        if os.environ.get("KVFLEET_REQUIRE_VLLM") == "1":
            pytest.fail("KVFLEET_REQUIRE_VLLM=1 but vllm is not installed: the bench left its vLLM rows out")


def check_vllm_rows(vllm: dict[str, Any], lines: list[str]) -> None:
    """The quick run's vLLM figures have their shape (its toy context is 256 tokens; no longest context)."""
    assert "skipped" not in vllm
    assert vllm["contexts"] == [256]
    assert 0 < vllm["reserve_bytes"] < vllm["budget_bytes"]
    assert vllm["bound"] == pytest.approx(vllm["budget_bytes"] / (vllm["budget_bytes"] - vllm["reserve_bytes"]))
    # Both workloads' batches (vLLM's running gauge), their ratio and preemptions, at the context.
    assert set(vllm["batch"]) == set(vllm["batch_ratio"]) == set(vllm["preemptions"]) == {"256"}
    for workload in ("offline", "growth", "offline_warm"):
        batch = vllm["batch"]["256"][workload]
        assert batch["static"] >= 1 and batch["elastic"] >= 1, (workload, batch)
        assert vllm["batch_ratio"]["256"][workload] == pytest.approx(batch["elastic"] / batch["static"])
        assert set(vllm["preemptions"]["256"][workload]) == {"static", "elastic"}
    sessions = vllm["sessions"]["256"]
    assert all(sessions[name][w]["stalled"] is None for name in ("static", "elastic")
               for w in ("offline", "growth", "online", "offline_warm"))
    # Goodput, low-load TPOT, and the balloon's grows and shrinks (a set: one chunk in each of 2 layers).
    # Goodput counts the requests that met SLOs set from this run's own unloaded timings: on a 2-core
    # machine one slow burst can leave the static engine none, and then there is no ratio (None). That
    # is a timing, which a test does not judge; the bench's full run does.
    online = {name: sessions[name]["online"] for name in ("static", "elastic")}
    assert all(o["goodput_per_s"] >= 0 and o["finished"] >= 1 for o in online.values()), online
    ratio = vllm["goodput_ratio"]
    if online["static"]["goodput_per_s"]:
        assert ratio == pytest.approx(online["elastic"]["goodput_per_s"] / online["static"]["goodput_per_s"])
    else:
        assert ratio is None
    assert set(vllm["low_load_tpot_ms"]) == {"static", "elastic"} and vllm["low_load_tpot_ratio"] > 0
    assert vllm["slo"]["ttft_short_s"] > 0 and vllm["slo"]["tpot_s"] > 0
    assert vllm["maps"]["grows"] >= 1 and vllm["maps"]["chunks_per_set"] == 2 and vllm["grow_us"] > 0
    assert vllm["maps"]["chunk_maps"] == 2 * vllm["maps"]["grows"]
    # The elastic engine's books stayed right, and the bench said so.
    assert vllm["books"]["books_errors"] == 0 and vllm["books"]["violations"] >= 0
    assert any(line.startswith("PASS vLLM elastic books") for line in lines)
    assert {"vLLM goodput >= 1.3x static", "vLLM low-load TPOT <= 1.05x static",
            "vLLM elastic books right (books_errors == 0)"} <= set(vllm["targets"])
    assert all(set(t) == {"met", "value"} for t in vllm["targets"].values())


def test_the_gpu_preset_says_it_is_skipped_without_a_gpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the preset would run")
    run = run_bench(BENCH, "--gpu", "--model-dir", str(tmp_path / "m"), first_line="host: ", timeout_s=300)
    assert any(line.startswith("SKIP --gpu") for line in run.lines)
    summary = run.summary
    assert summary["skipped"] and summary["device"] == "cpu" and summary["context_tokens"] == [8192, 32768]
    assert not (tmp_path / "m").exists()  # nothing was built
