"""Elastic memory on the real control plane: builtin workers share one pool between KV and activations,
and the capacity MELL plans with follows what they report.

A pool of one real worker (builtin engine, the tiny model, float32 on the CPU) with
`spec.elasticMemory` on: its memory pool is the 64 MiB KV capacity plus the 64 MiB activation reserve
a static split would keep (10% of a 640 MiB "GPU"), and a 64 MiB CPU buffer. Long prompts go to it
directly. At rest it reports about 106 MiB of KV room; a 1,800-token prefill holds about 60 MiB of
activations, so its report drops by more than 5% and the operator re-plans with the smaller
capacity (status, Event), then climbs back once the long prefills leave its window of recent steps.
Every stream comes back whole and equal to the greedy output of the engine without elastic memory.

Then the same on vLLM workers (engines/vllm/elastic.py): two of them with elastic memory, whose reported
capacity the operator plans with, and a running stream moved from one to the other by its KV.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet.worker.text import Tokenizer
from kvfleet_e2e.real_workers import greedy_outputs, require_vllm, seeded_prompt, stream_completion
from kvfleet_e2e.reports import worker_report

MIB = 2**20
# (request id, prompt tokens, output tokens): long prompts whose prefills need tens of MiB of
# activations each, decoding long enough (30 ms steps) for several epochs to see them.
REQUESTS = [("long-a", 1800, 60), ("long-b", 1500, 60), ("long-c", 1200, 60)]


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-elastic-e2e")
    yield proc
    stop_process(proc)


def greedy_reference(model_dir: Path) -> dict[str, list[int]]:
    """What each request generates on the engine without elastic memory."""
    return greedy_outputs(model_dir, REQUESTS, 64 * MIB)


def pool(model_dir: Path) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": "elastic"}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": "64Mi", "gpuMemory": "640Mi", "activationReserveFraction": 0.1},
        "elasticMemory": {"enabled": True, "cpuBuffer": "64Mi"},
        "workers": {"min": 1, "max": 1},
        "scheduling": {"epochSeconds": 1},
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "KVFLEET_MIN_STEP_S", "value": "0.03"}]},
    }}


def complete(pod_ip: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"http://{pod_ip}:8000/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    with urllib.request.urlopen(request, timeout=300) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def test_elastic_workers_serve_long_prompts_and_the_planned_capacity_follows_their_reports(
        cluster: Cluster, namespace: str, operator: Process, model_dir: Path) -> None:
    reference = greedy_reference(model_dir)
    tokenizer = Tokenizer(model_dir)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool(model_dir)))

    def ready_worker() -> dict[str, Any] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = cluster.get_json("pods", "-n", namespace, "-l", "kvfleet.dev/pool=elastic")["items"]
        ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                        for c in p["status"].get("conditions", []))]
        return ready[0] if ready else None

    worker = wait_for(ready_worker, "a Ready elastic worker", timeout_s=180, interval_s=0.5)
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert (env["KVFLEET_ELASTIC_MEMORY"], env["KVFLEET_MEMORY_BUDGET_BYTES"]) == ("1", str(128 * MIB))

    def planned() -> int | None:
        status = cluster.get_json("llmpool", "elastic", "-n", namespace).get("status") or {}
        return status.get("kvCapacityPerWorkerBytes") or None

    def from_report() -> int | None:
        value = planned()  # the spec's 64 MiB until the worker's first report re-plans the pool
        return value if value is not None and value != 64 * MIB else None

    at_rest = wait_for(from_report, "a planned capacity from the worker's report", timeout_s=60)
    assert 100 * MIB < at_rest < 128 * MIB  # the pool less what any step holds: more than the 64 MiB static KV

    results: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []
    seen_planned: list[int] = [at_rest]
    seen_reported: list[int] = []
    done = threading.Event()

    def client(i: int, rid: str, length: int, max_tokens: int) -> None:
        try:
            results[rid] = complete(worker["status"]["podIP"], rid, {"model": "tiny", "prompt": seeded_prompt(length, i),
                                                                     "max_tokens": max_tokens, "temperature": 0,
                                                                     "ignore_eos": True})
        except BaseException as err:  # reported on the main thread
            errors.append(err)

    def watch() -> None:
        while not done.is_set():
            report = worker_report(cluster, namespace, worker["metadata"]["name"])
            if report is not None:
                seen_reported.append(report.capacity_bytes)
            value = planned()
            if value is not None:
                seen_planned.append(value)
            time.sleep(0.3)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=client, args=(i, *r)) for i, r in enumerate(REQUESTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    # Short requests push the long prefills out of the worker's window of recent steps.
    for i in range(3):
        complete(worker["status"]["podIP"], f"short-{i}", {"model": "tiny", "prompt": seeded_prompt(8, 100 + i),
                                                           "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    wait_for(lambda: planned() == at_rest or None, "the planned capacity back at rest", timeout_s=60)
    done.set()
    watcher.join(30)
    assert not errors, errors
    for rid, _, max_tokens in REQUESTS:
        choice = results[rid]["choices"][0]
        assert results[rid]["usage"]["completion_tokens"] == max_tokens and choice["finish_reason"] == "length"
        assert choice["text"] == tokenizer.completion_text(reference[rid]), f"{rid}: the text differs from the engine without elastic memory"

    # The worker reported less room while long prefills held activations, and MELL planned with it
    # (Events: the first report, the drop, the climb back).
    assert min(seen_reported) < 0.9 * at_rest, seen_reported
    assert min(seen_planned) < 0.9 * at_rest, seen_planned
    events = cluster.get_json("events", "-n", namespace, "--field-selector", "reason=CapacityChanged")["items"]
    assert len(events) >= 3 and all("the smallest the workers report" in e["message"] for e in events), events
    logs = "".join(p.read_text() for p in cluster.plane.work_dir.glob(f"agent/pods/{namespace}_elastic-worker-*/worker.log"))
    assert "Traceback" not in logs, logs[-4000:]


def vllm_pool(model_dir: Path) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": "elastic-vllm"}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "vllm",
        # A 128 MiB pool per worker: room for a 2,048-token prefill step's activations (about 33 MiB for
        # the tiny model in float32) beside the KV.
        "capacity": {"kvCapacityPerWorker": "64Mi", "gpuMemory": "640Mi", "activationReserveFraction": 0.1},
        "elasticMemory": {"enabled": True},
        "workers": {"min": 2, "max": 2},
        "scheduling": {"epochSeconds": 1},
        "migration": {"mode": "kv"},
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "KVFLEET_MIN_STEP_S", "value": "0.03"}]},
    }}


def test_elastic_vllm_workers_lend_their_capacity_to_mell_and_migrate_by_kv(
        cluster: Cluster, namespace: str, operator: Process, model_dir: Path) -> None:
    """vLLM workers with elastic memory (engines/vllm/elastic.py): the operator plans with the capacity
    they report, not the spec's, and a KVMigration moves a running stream between them by its KV."""
    require_vllm()
    request = ("moved", 300, 400)
    reference = greedy_outputs(model_dir, [request], 8 * MIB, "vllm")[request[0]]
    tokenizer = Tokenizer(model_dir)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(vllm_pool(model_dir)))

    def ready_workers() -> list[dict[str, Any]] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = cluster.get_json("pods", "-n", namespace, "-l", "kvfleet.dev/pool=elastic-vllm")["items"]
        ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                        for c in p["status"].get("conditions", []))]
        return sorted(ready, key=lambda p: p["metadata"]["name"]) if len(ready) == 2 else None

    source, target = wait_for(ready_workers, "two Ready elastic vLLM workers", timeout_s=240, interval_s=0.5)
    env = {e["name"]: e.get("value") for e in source["spec"]["containers"][0]["env"]}
    assert (env["KVFLEET_ELASTIC_MEMORY"], env["KVFLEET_MEMORY_BUDGET_BYTES"]) == ("1", str(128 * MIB))
    assert "KVFLEET_KV_CAPACITY_BYTES" not in env

    def from_reports() -> int | None:
        status = cluster.get_json("llmpool", "elastic-vllm", "-n", namespace).get("status") or {}
        value = status.get("kvCapacityPerWorkerBytes")
        return value if value and value != 64 * MIB else None

    # MELL plans with what the workers report: the pool less the activations of their recent steps,
    # more than the 64 MiB a static split would keep for KV.
    planned = wait_for(from_reports, "a planned capacity from the vLLM workers' reports", timeout_s=90)
    assert 64 * MIB < planned <= 128 * MIB, planned
    report = wait_for(lambda: worker_report(cluster, namespace, source["metadata"]["name"]), "the source's report", timeout_s=30)
    assert 64 * MIB < report.capacity_bytes <= 128 * MIB, report

    result: dict[str, tuple[str, int, str | None]] = {}
    errors: list[BaseException] = []

    def client() -> None:
        try:
            body = {"model": "tiny", "prompt": seeded_prompt(request[1], 0), "max_tokens": request[2], "temperature": 0,
                    "ignore_eos": True}
            result["moved"] = stream_completion(source["status"]["podIP"], "moved", body, direct=True)
        except BaseException as err:  # reported on the main thread
            errors.append(err)

    thread = threading.Thread(target=client)
    thread.start()
    wait_for(lambda: (r := worker_report(cluster, namespace, source["metadata"]["name"])) is not None
             and any(q.id == "moved" for q in r.requests) or None, "the request running at the source",
             timeout_s=60, interval_s=0.2)
    migration = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "KVMigration",
                 "metadata": {"name": "elastic-move", "labels": {"kvfleet.dev/pool": "elastic-vllm"}},
                 "spec": {"pool": "elastic-vllm", "requestId": "moved", "sourcePod": source["metadata"]["name"],
                          "targetPod": target["metadata"]["name"], "mode": "kv", "reason": "Rebalance"}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(migration))
    done = wait_for(lambda: (st := (cluster.get_json("kvmigration", "elastic-move", "-n", namespace).get("status") or {}))
                    .get("phase") in ("Succeeded", "Failed") and st, "the move to finish", timeout_s=90, interval_s=0.2)
    thread.join(240)
    assert not errors, errors
    assert done["phase"] == "Succeeded" and done["bytesMoved"] > 0, done
    assert done["message"].endswith("in kv mode") and "as tokens" not in done["message"], done
    text, tokens, finish = result["moved"]
    assert tokens == request[2] and finish == "length"
    assert text == tokenizer.completion_text(reference), "the moved stream differs from the unmoved greedy output"
    logs = "".join(p.read_text() for p in cluster.plane.work_dir.glob(f"agent/pods/{namespace}_elastic-vllm-worker-*/worker.log"))
    assert "Traceback" not in logs, logs[-4000:]
