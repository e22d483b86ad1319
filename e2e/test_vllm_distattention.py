"""vLLM workers attending through kvfleet's DistAttention, on the real control plane.

A pool of one vLLM worker (the tiny model, float32 on the CPU) with `spec.attention: distattention`
and elastic memory: the operator gives the pod KVFLEET_ATTENTION=distattention, the worker's vLLM
builds its layers with kvfleet's backend (engines/vllm/attention.py, registered in its EngineCore by
the `vllm.general_plugins` entry point; the worker would refuse to start otherwise) over the elastic
KV cache, and streams sent at once come back whole and equal to the greedy output of a plain vLLM
engine with vLLM's own attention.
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

MIB = 2**20
# (request id, prompt tokens, output tokens): prompts across several of vLLM's 128-token blocks.
REQUESTS = [("dist-a", 700, 40), ("dist-b", 260, 40), ("dist-c", 1300, 40)]


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-vllm-distattention-e2e")
    yield proc
    stop_process(proc)


def pool(model_dir: Path) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": "dist-vllm"}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "vllm",
        "attention": "distattention",
        "capacity": {"kvCapacityPerWorker": "64Mi", "gpuMemory": "640Mi", "activationReserveFraction": 0.1},
        "elasticMemory": {"enabled": True},
        "workers": {"min": 1, "max": 1},
        "scheduling": {"epochSeconds": 1},
        "workerTemplate": {"image": "kvfleet/worker:dev"},
    }}


def test_a_vllm_pool_with_distattention_serves_vllms_greedy_output(
        cluster: Cluster, namespace: str, operator: Process, model_dir: Path) -> None:
    require_vllm()
    reference = greedy_outputs(model_dir, REQUESTS, 64 * MIB, "vllm")
    tokenizer = Tokenizer(model_dir)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool(model_dir)))

    def ready_worker() -> dict[str, Any] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = cluster.get_json("pods", "-n", namespace, "-l", "kvfleet.dev/pool=dist-vllm")["items"]
        return next((p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                            for c in p["status"].get("conditions", []))), None)

    worker = wait_for(ready_worker, "a Ready vLLM worker with DistAttention", timeout_s=240, interval_s=0.5)
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env["KVFLEET_ATTENTION"] == "distattention" and "KVFLEET_DISTKV" not in env
    results = stream_all(worker["status"]["podIP"], REQUESTS, direct=True)
    for rid, _, max_tokens in REQUESTS:
        text, tokens, finish = results[rid]
        assert tokens == max_tokens and finish == "length", (rid, tokens, finish)
        assert text == tokenizer.completion_text(reference[rid]), f"{rid}: differs from vLLM's own attention"
    logs = "".join(p.read_text() for p in cluster.plane.work_dir.glob(f"agent/pods/{namespace}_dist-vllm-worker-*/worker.log"))
    assert "Traceback" not in logs, logs[-4000:]
    assert "CPU decode attention runs on the torch backend" not in logs, "the C decode kernel was not built"
