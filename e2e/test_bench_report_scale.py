"""bench/report_scale.py runs end to end in its quick mode (N = 100, both channels, each on a local
control plane of its own) and ends with its JSON line (part of `make test`, so the measurement of
what KV-load reports cost the API server does not rot).

A smoke test of the machinery, with the one claim the KVLoad channel exists for: pod watchers get
fewer events when reports go to KVLoads than when they go to pod annotations. The absolute figures
of a 2-core machine are the bench's output, not asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench_testing import ROOT, run_bench
from kvfleet.localcluster.controlplane import cache_dir

BENCH = ROOT / "bench" / "report_scale.py"
NEEDED = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")


def test_quick_run_measures_both_report_channels(tmp_path: Path) -> None:
    # binaries_dir() would build a cold cache (many minutes); say what is missing instead.
    current = cache_dir() / "bin" / "current"
    missing = [b for b in NEEDED if not (current / b).exists()]
    if missing:
        pytest.skip(f"control-plane binaries not built ({', '.join(missing)} missing in {current}): run make controlplane")
    run = run_bench(BENCH, "--quick", "--out", str(tmp_path), first_line="machine: ", timeout_s=900)
    assert any(line.startswith("epoch over 100 workers") for line in run.lines)
    summary = run.summary
    assert summary["bench"] == "report_scale" and summary["epoch_s"] == 2.0
    figures = summary["workers"]["100"]
    for channel in ("annotation", "kvload"):
        f = figures[channel]
        assert "error" not in f, f"{channel}: {f.get('error')}"
        assert f["writes_per_s"] > 0 and f["offered_writes_per_s"] > 0, channel
        assert f["report_bytes"] > 0 and f["write_p99_ms"] is not None, channel
        assert f["epochs"] > 0 and f["operator_epoch_wall_ms"] is not None, channel
        assert f["apiserver_cpu_s_per_s"] > 0 and f["operator_rss_mib"] > 0, channel
    # The point of the KVLoad channel: a report write is no pod event.
    assert figures["annotation"]["pod_watch_events_per_s"] > figures["kvload"]["pod_watch_events_per_s"]
    assert set(figures["ratio"]) == {"apiserver_cpu", "watcher_events", "write_p99"}
