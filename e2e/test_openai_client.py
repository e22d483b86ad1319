"""The official `openai` client against real pools on the local control plane: a pool of builtin workers
and a pool of vLLM workers, each behind the router the operator gives it, answer what users of vLLM
send every day (n, logprobs, top_logprobs, echo, seed, penalties, response_format, tools) and refuse
bad values with a 400 naming the field (the exercises: kvfleet_e2e/openai_client.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet_e2e import openai_client as exercises
from kvfleet_e2e.pools import ready
from kvfleet_e2e.real_workers import require_vllm


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-openai-client-e2e")
    yield proc
    stop_process(proc)


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_the_openai_client_through_a_pools_router(cluster: Cluster, namespace: str, operator: Process, model_dir: Path,
                                                   engine: str) -> None:
    if engine == "vllm":
        require_vllm()
    name = f"oai-{engine}"
    pool = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": name}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": engine,
        "capacity": {"kvCapacityPerWorker": "16Mi"},
        "workers": {"min": 1, "max": 1},
        "scheduling": {"epochSeconds": 1},
        "workerTemplate": {"image": "kvfleet/worker:dev"},
    }}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool))

    def ready_pod(selector: str) -> dict[str, Any] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = [p for p in cluster.get_json("pods", "-n", namespace, "-l", selector)["items"] if ready(p)]
        return pods[0] if pods else None

    wait_for(lambda: ready_pod(f"kvfleet.dev/pool={name},app.kubernetes.io/component=worker"), f"{name}'s worker",
             timeout_s=240, interval_s=0.5)
    router = wait_for(lambda: ready_pod(f"kvfleet.dev/router={name}"), f"{name}'s router", timeout_s=120, interval_s=0.5)
    client = openai.OpenAI(base_url=f"http://{router['status']['podIP']}:8000/v1", api_key="unused", max_retries=0,
                           timeout=120)
    exercises.everything(client, model_dir)
    logs = cluster.pod_dir(namespace, router["metadata"]["name"])
    assert "Traceback" not in (logs / "router.log").read_text()
