"""The router on the real control plane: the operator gives a pool of real workers (builtin engine, tiny
model) its router, which the node agent runs from the `kvfleet/router` image's entrypoint under its own
read-only ServiceAccount; it learns the workers from the API, serves completions through them, and
when the worker of a streaming request is killed (force-deleted: SIGKILL), the client's stream still
completes, equal to the unbroken greedy run."""

from __future__ import annotations

import base64
import http.client
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet.operator.resources import TOKEN_KEY
from kvfleet_e2e.pools import ready


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-router-e2e")
    yield proc
    stop_process(proc)


def post(ip: str, path: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://{ip}:8000{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as resp:
        return resp.status, json.loads(resp.read())


def get(ip: str, path: str, **headers: str) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(f"http://{ip}:8000{path}", headers=headers), timeout=30) as resp:
        return bytes(resp.read())


def test_router_serves_through_workers_and_survives_a_killed_worker(cluster: Cluster, namespace: str, operator: Process,
                                                                     model_dir: Path) -> None:
    started_s = time.monotonic()
    pool = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": "routed"}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": "16Mi"},
        "workers": {"min": 2, "max": 2},
        "scheduling": {"epochSeconds": 1},
        "workerTemplate": {"image": "kvfleet/worker:dev"},
    }}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool))

    def ready_pods(selector: str, count: int) -> list[dict[str, Any]] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = [p for p in cluster.get_json("pods", "-n", namespace, "-l", selector)["items"] if ready(p)]
        return pods if len(pods) >= count else None

    workers = wait_for(lambda: ready_pods("kvfleet.dev/pool=routed,app.kubernetes.io/component=worker", 2),
                       "two Ready workers", timeout_s=120, interval_s=0.5)
    router = wait_for(lambda: ready_pods("kvfleet.dev/router=routed", 1), "a Ready router", timeout_s=60, interval_s=0.5)[0]
    router_ip = router["status"]["podIP"]
    assert router["spec"]["serviceAccountName"] == "routed-router"
    service = cluster.get_json("service", "routed-router", "-n", namespace)
    assert service["spec"]["ports"][0]["port"] == 80 and service["spec"]["selector"] == {
        "kvfleet.dev/router": "routed", "app.kubernetes.io/component": "router"}
    wait_for(lambda: any(c["type"] == "RouterReady" and c["status"] == "True"
                         for c in cluster.get_json("llmpool", "routed", "-n", namespace).get("status", {}).get("conditions", [])),
             "RouterReady on the pool", timeout_s=30)

    # Completions through the router equal a worker's own answer (greedy).
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _, direct = post(workers[0]["status"]["podIP"], "/v1/completions", body)
    status, routed = post(router_ip, "/v1/completions", body)
    assert status == 200 and routed["choices"][0]["text"] == direct["choices"][0]["text"]
    assert routed["usage"] == direct["usage"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    _, direct_chat = post(workers[0]["status"]["podIP"], "/v1/chat/completions", chat)
    conn = http.client.HTTPConnection(router_ip, 8000, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({**chat, "stream": True}).encode(), {"Content-Type": "application/json"})
    streamed = [json.loads(line[6:]) for line in conn.getresponse().read().split(b"\n\n")
                if line.startswith(b"data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed) == direct_chat["choices"][0]["message"]["content"]

    # A long stream; its worker is force-deleted (SIGKILL by the node agent) a few chunks in.
    long_body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 600, "temperature": 0, "ignore_eos": True}
    _, unbroken = post(workers[1]["status"]["podIP"], "/v1/completions", long_body)
    secret = cluster.get_json("secret", "routed-token", "-n", namespace)
    token = base64.b64decode(secret["data"][TOKEN_KEY]).decode()
    conn = http.client.HTTPConnection(router_ip, 8000, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**long_body, "stream": True}).encode(),
                 {"Content-Type": "application/json", "X-Request-Id": "e2e-kill-1"})
    response = conn.getresponse()
    assert response.status == 200
    received = [response.readline() for _ in range(6)]

    def holder() -> dict[str, Any] | None:
        for pod in workers:
            held = json.loads(get(pod["status"]["podIP"], "/internal/requests", Authorization=f"Bearer {token}"))
            if any(r["id"] == "e2e-kill-1" for r in held["requests"]):
                return pod
        return None

    victim = wait_for(holder, "the worker holding e2e-kill-1", timeout_s=10, interval_s=0.05)
    cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", namespace, "--grace-period=0", "--force")
    raw = b"".join(received) + response.read()
    events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-400:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == unbroken["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    metrics = get(router_ip, "/metrics").decode()
    assert "kvfleet_router_resumes_total 1.0" in metrics, "the kill did not land mid-stream"
    logs = cluster.pod_dir(namespace, router["metadata"]["name"])
    assert "Traceback" not in (logs / "router.log").read_text()
    print(f"router e2e: {time.monotonic() - started_s:.0f} s from the pool's creation")
