"""The real worker on the real control plane: a pool's worker Pod, run by the node agent from the
`kvfleet/worker` image's entrypoint, loads the tiny model with the builtin engine or vLLM, serves OpenAI
completions on its pod IP, and keeps its KV-load report on its Pod current as requests come and go,
written with its own ServiceAccount.

Then the official `openai` client through the router the operator gives the same pool: what users of
vLLM send every day (n, logprobs, top_logprobs, echo, seed, penalties, response_format, tools) is
answered, and bad values are refused with a 400 naming the field (the exercises:
kvfleet_e2e/openai_client.py). One pool serves both parts, so each engine's worker starts once (a vLLM
worker takes tens of seconds on 2 cores); the first part leaves it idle and serving."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvfleet.api.reports import KVLoadReport
from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet.operator.resources import TOKEN_KEY
from kvfleet_e2e import openai_client as exercises
from kvfleet_e2e.pools import ready
from kvfleet_e2e.real_workers import require_vllm
from kvfleet_e2e.reports import worker_report


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-worker-e2e")
    yield proc
    stop_process(proc)


def pool(name: str, model_dir: Path, engine: str) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": name}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": engine,
        "capacity": {"kvCapacityPerWorker": "16Mi"},
        "workers": {"min": 1, "max": 1},
        "scheduling": {"epochSeconds": 1},
        "workerTemplate": {"image": "kvfleet/worker:dev"},
    }}


def call(pod: dict[str, Any], path: str, body: dict[str, Any] | None = None, **headers: str) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://{pod['status']['podIP']}:8000{path}",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json", **headers},
                                     method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def report(cluster: Cluster, namespace: str, pod_name: str) -> KVLoadReport | None:
    return worker_report(cluster, namespace, pod_name)


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_worker_pod_serves_and_reports_its_load_and_the_openai_client_through_its_router(
        cluster: Cluster, namespace: str, operator: Process, model_dir: Path, engine: str) -> None:
    if engine == "vllm":
        require_vllm()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool("real", model_dir, engine)))

    def ready_pod(selector: str) -> dict[str, Any] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = [p for p in cluster.get_json("pods", "-n", namespace, "-l", selector)["items"] if ready(p)]
        return dict(pods[0]) if pods else None

    pod = wait_for(lambda: ready_pod("kvfleet.dev/pool=real,app.kubernetes.io/component=worker"), "a Ready worker pod",
                   timeout_s=240, interval_s=0.5)
    name = pod["metadata"]["name"]
    logs = cluster.pod_dir(namespace, name)

    # The first report: an empty worker with the capacity its engine really allocated (whole blocks of 16Mi).
    first = wait_for(lambda: report(cluster, namespace, name), f"the first report on {name}", timeout_s=30)
    assert first.requests == [] and first.used_bytes == 0
    assert 16 * 2**20 - 16 * 2048 < first.capacity_bytes <= 16 * 2**20

    status, body = call(pod, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5,
                                                 "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 5

    # A long request shows up in the report while it runs, and leaves it when it ends. It lasts a few
    # report intervals (the pool's 1 s epoch) on either engine, so a write falls inside it.
    results: list[tuple[int, Any]] = []
    long_request = threading.Thread(target=lambda: results.append(call(
        pod, "/v1/completions", {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 1500, "temperature": 0,
                                 "ignore_eos": True}, **{"X-Request-Id": "long-1"})))
    long_request.start()
    # A request can be listed queued (its KV reserved, none written yet) before its first step, so wait for
    # a report that shows it running.
    during = wait_for(lambda: (r := report(cluster, namespace, name))
                      and any(q.id == "long-1" and not q.queued for q in r.requests) and r,
                      "long-1 running in the report", timeout_s=60, interval_s=0.1)
    entry = next(q for q in during.requests if q.id == "long-1")
    assert entry.kv_bytes > 0 and entry.tokens > 0 and during.used_bytes >= entry.kv_bytes
    assert during.sequence > first.sequence
    long_request.join(180)
    assert results and results[0][0] == 200, results
    after = wait_for(lambda: (r := report(cluster, namespace, name)) and r.requests == [] and r.sequence > during.sequence
                     and r, "long-1 gone from the report", timeout_s=30)
    assert after.used_bytes == 0
    # 1,500 decode steps were written as a handful of reports, not one per token.
    assert after.sequence - first.sequence < 20

    # The pool's own components get in with the pool token, nobody else does.
    assert call(pod, "/internal/requests")[0] == 401
    secret = cluster.get_json("secret", "real-token", "-n", namespace)
    token = base64.b64decode(secret["data"][TOKEN_KEY]).decode()
    status, body = call(pod, "/internal/requests", Authorization=f"Bearer {token}")
    assert status == 200 and body["capacityBytes"] == first.capacity_bytes
    # Bad input is a 4xx, and the worker is still serving afterwards.
    status, body = call(pod, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    assert call(pod, "/healthz")[0] == 200
    assert "Traceback" not in (logs / "worker.log").read_text()

    # The official client through the pool's router, to the same worker.
    router = wait_for(lambda: ready_pod("kvfleet.dev/router=real"), "the pool's router", timeout_s=120, interval_s=0.5)
    client = openai.OpenAI(base_url=f"http://{router['status']['podIP']}:8000/v1", api_key="unused", max_retries=0,
                           timeout=120)
    exercises.everything(client, model_dir)
    assert "Traceback" not in (cluster.pod_dir(namespace, router["metadata"]["name"]) / "router.log").read_text()
    assert "Traceback" not in (logs / "worker.log").read_text()
