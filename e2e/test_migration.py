"""Live migration on the real control plane: the operator plans KVMigrations, real workers carry them out.

A pool of real workers (builtin engine, the tiny model, float32 on the CPU) has a KV capacity of 4 MiB
per worker: 2,048 tokens, so MELL's size classes are a few hundred tokens wide and requests cross
them while they decode. The pool runs MELL's Fig. 10 (`mell-paper`), whose class rules move requests
that cross classes (the default policy leaves two requests that fit one worker where they are). Two
requests are sent straight to one worker (a careless client, no router); MELL places them by class
as their reports show them arrive and grow, and every request reported
somewhere other than where MELL wants it becomes a KVMigration that the source worker executes
(watcher, KV copy, hand-off). The clients are direct: the source relays the continuation, so each
client's stream must come back whole and equal to the unmigrated greedy output, computed here with
the same engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet.worker.text import Tokenizer
from kvfleet_e2e.real_workers import greedy_outputs, require_vllm, stream_all

# 4 MiB = 128 blocks of 16 tokens x 2 KiB: C/8 = 256 tokens, C/4 = 512, C/3 = 683, C/2 = 1,024.
KV_CAPACITY = "4Mi"
# (request id, prompt tokens, output tokens): "grows" starts as a T-request and crosses into S, M and L
# while it decodes; "stays" is a T-request throughout. Together they never exceed the capacity. The
# workers pace their steps to 30 ms (KVFLEET_MIN_STEP_S), so "grows" decodes for at least 27 s and
# "stays" for 6 s, several epochs, however fast the machine: the control loop gets time to act, and a
# move of either is ordered while its worker does not yet report it finishing (within two epochs).
REQUESTS = [("grows", 480, 900), ("stays", 270, 200)]


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-migration-e2e")
    yield proc
    stop_process(proc)


def pool(model_dir: Path, engine: str) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": "moving"}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": engine,
        "capacity": {"kvCapacityPerWorker": KV_CAPACITY},
        "workers": {"min": 2, "max": 3},
        "scheduling": {"policy": "mell-paper", "epochSeconds": 1},
        "migration": {"mode": "kv"},
        "autoscaling": {"scaleDownDelaySeconds": 30},
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "KVFLEET_MIN_STEP_S", "value": "0.03"}]},
    }}


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_operator_planned_migrations_keep_every_client_stream_whole(cluster: Cluster, namespace: str, operator: Process,
                                                                    model_dir: Path, engine: str) -> None:
    if engine == "vllm":
        require_vllm()
    # What each request generates unmigrated, on the same engine, one at a time.
    reference = greedy_outputs(model_dir, REQUESTS, 8 * 2**20, engine)
    tokenizer = Tokenizer(model_dir)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool(model_dir, engine)))

    def ready_workers() -> list[dict[str, Any]] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = cluster.get_json("pods", "-n", namespace, "-l", "kvfleet.dev/pool=moving")["items"]
        ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                        for c in p["status"].get("conditions", []))]
        return sorted(ready, key=lambda p: p["metadata"]["name"]) if len(ready) >= 2 else None

    first = wait_for(ready_workers, "two Ready workers", timeout_s=180, interval_s=0.5)[0]
    results = stream_all(first["status"]["podIP"], REQUESTS, direct=True)
    for rid, _, max_tokens in REQUESTS:
        text, tokens, finish = results[rid]
        assert tokens == max_tokens and finish == "length", (rid, tokens, finish)
        assert text == tokenizer.completion_text(reference[rid]), f"{rid}: the client's text differs from the unmigrated output"

    migrations = cluster.get_json("kvmigrations", "-n", namespace)["items"]
    succeeded = [m for m in migrations if (m.get("status") or {}).get("phase") == "Succeeded"]
    assert succeeded, json.dumps(migrations, indent=1)[-4000:]
    for m in succeeded:
        st = m["status"]
        # Moved by KV, vLLM's through kvfleet's connector, not re-prefilled.
        assert st["message"].endswith("in kv mode") and "as tokens" not in st["message"], st
        assert st["bytesMoved"] > 0 and st["tokensMoved"] > 0, st
        assert st["downtimeSeconds"] >= 0 and st["downtime"], st
        assert st["startTime"] and st["completionTime"], st
    # Every migration ended one way or the other, and a failed one says why.
    wait_for(lambda: all((m.get("status") or {}).get("phase") in ("Succeeded", "Failed")
                         for m in cluster.get_json("kvmigrations", "-n", namespace)["items"]),
             "every KVMigration finished", timeout_s=60)
    for m in cluster.get_json("kvmigrations", "-n", namespace)["items"]:
        assert m["status"]["phase"] == "Succeeded" or m["status"]["message"], m
    logs = "".join(p.read_text() for p in cluster.plane.work_dir.glob(f"agent/pods/{namespace}_moving-worker-*/worker.log"))
    assert "Traceback" not in logs, logs[-4000:]
