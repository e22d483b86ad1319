"""`kvfleet replay` on the real control plane, run as a user runs it: a short slice of the Azure
conversation trace through a pool of real workers (builtin engine, tiny model). Every stream must
come back whole, the record must be written, and its billed GPU-seconds must be the worker pods'
real lifetimes, checked against a watch of the API server kept by the test itself."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet.replay.observe import timestamp_s
from kvfleet.sim import bundled
from kvfleet.worker.model.tiny import make_tiny
from kvfleet_e2e.pools import ready

TRACE = bundled.trace_path(bundled.CONV)


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-replay-e2e")
    yield proc
    stop_process(proc)


class PodWatch:
    """The test's own view of the worker pods: creationTimestamp, and the first poll they were gone."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.created: dict[str, float] = {}  # uid -> Unix s
        self.gone: dict[str, float] = {}
        self.last_seen: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            before = time.time()
            pods = self.cluster.get_json("pods", "-n", self.namespace, "-l", "app.kubernetes.io/component=worker")["items"]
            after = time.time()
            uids = set()
            for pod in pods:
                uid = pod["metadata"]["uid"]
                uids.add(uid)
                self.created.setdefault(uid, timestamp_s(pod["metadata"]["creationTimestamp"]))
                self.last_seen[uid] = after
            for uid in self.created:
                if uid not in uids and uid not in self.gone:
                    self.gone[uid] = before


def test_replay_records_whole_streams_and_real_pod_lifetimes(cluster: Cluster, namespace: str, operator: Process,
                                                             tmp_path: Path) -> None:
    model_dir = make_tiny(tmp_path / "tiny")
    pool = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": "replayed"}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)}, "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": "1536Ki"},  # 768 tokens: a few requests fill a worker
        "workers": {"min": 1, "max": 4}, "scheduling": {"policy": "mell", "epochSeconds": 1},
        "autoscaling": {"scaleDownDelaySeconds": 3},
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "OMP_NUM_THREADS", "value": "1"},
                                                                  {"name": "KVFLEET_MIN_STEP_S", "value": "0.03"}]},
    }}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool))
    wait_for(lambda: any(ready(p) for p in cluster.get_json("pods", "-n", namespace, "-l", "kvfleet.dev/router=replayed")["items"]),
             "the router", timeout_s=180, interval_s=0.5)
    wait_for(lambda: any(ready(p) for p in cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=worker")["items"]),
             "the first worker", timeout_s=180, interval_s=0.5)
    watch = PodWatch(cluster, namespace)
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    out = tmp_path / "record"
    result = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", "replay", "--pool", "replayed", "-n", namespace,
         "--kubeconfig", str(cluster.kubeconfig), "--trace", str(TRACE), "--window", "0:12", "--every", "3",
         "--prompt-scale", "0.125", "--output-scale", "0.5", "--max-request-tokens", "752",
         "--drain-timeout-s", "60", "--out", str(out), "--json", "--no-progress"],
        capture_output=True, text=True, timeout=600)
    watch.stop.set()
    thread.join()
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    record = json.loads((out / "record.json").read_text())
    sent = list(csv.DictReader((out / "sent.csv").open()))
    assert figures["streams"] == record["streams"] == len(sent) > 5
    assert record["streamsWhole"] == record["streams"], record["notWhole"]
    assert record["ttftMs"]["p50"] is not None and record["perTokenMs"]["p50"] is not None
    # A stream's whole time is at least its first token's; the last one ended before the record did.
    assert record["jctMs"]["p99"] >= record["ttftMs"]["p50"] > 0
    assert max(float(r["timestamp"]) for r in sent) < record["lastStreamEndSeconds"] <= record["durationSeconds"]

    # The record's pods are the pods the API server had, created when the API server says.
    t0, end_s = record["startedAtUnixSeconds"], record["durationSeconds"]
    by_uid = {p["uid"]: p for p in record["pods"]}
    assert set(by_uid) == set(watch.created), (by_uid, watch.created)
    expected = 0.0
    for uid, created in watch.created.items():
        mine = by_uid[uid]
        assert mine["createdSeconds"] == pytest.approx(created - t0, abs=0.01)
        gone = watch.gone.get(uid)
        if gone is None:
            assert mine["goneSeconds"] is None or mine["goneSeconds"] > watch.last_seen[uid] - t0 - 1.0
        else:
            # Two pollers of the same API server: each places the disappearance within its own poll interval.
            assert mine["goneSeconds"] is not None and abs(mine["goneSeconds"] - (gone - t0)) < 1.5
        life_end = end_s if gone is None else min(gone - t0, end_s)
        expected += mine["gpus"] * max(0.0, life_end - max(0.0, created - t0))
    assert all(p["gpus"] == 1 for p in record["pods"])
    assert record["billedGpuSeconds"] == pytest.approx(expected, rel=0.05, abs=1.5)
    assert figures["billedGpuSeconds"] == record["billedGpuSeconds"]
    assert len(record["samples"]) >= end_s * 0.8  # one status sample a second
