"""Scale to zero and back on the real control plane: a pool with `workers.min: 0` runs no worker
when idle; a completion sent to its router then is held, the router's count on the LLMPool wakes the
operator at once, a worker starts, and the completion comes back whole; once idle for the scale-down
delay the pool is back at zero workers. The cold start (request sent to first token) is printed."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet_e2e.pools import ready

WORKERS = "kvfleet.dev/pool=sleepy,app.kubernetes.io/component=worker"


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-zero-e2e")
    yield proc
    stop_process(proc)


def test_an_idle_pool_runs_no_worker_and_a_request_wakes_it(cluster: Cluster, namespace: str, operator: Process,
                                                             model_dir: Path) -> None:
    pool = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": "sleepy"}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": "16Mi"},
        "workers": {"min": 0, "max": 2},
        "scheduling": {"epochSeconds": 1},
        "autoscaling": {"scaleDownDelaySeconds": 3},
        "workerTemplate": {"image": "kvfleet/worker:dev"},
    }}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool))

    def pods(selector: str) -> list[dict[str, Any]]:
        assert operator.popen.poll() is None, operator.tail(40)
        return list(cluster.get_json("pods", "-n", namespace, "-l", selector)["items"])

    router = wait_for(lambda: [p for p in pods("kvfleet.dev/router=sleepy") if ready(p)] or None, "a Ready router",
                      timeout_s=90, interval_s=0.5)[0]
    status = wait_for(lambda: (cluster.get_json("llmpool", "sleepy", "-n", namespace).get("status") or None),
                      "the pool's status", timeout_s=30)
    assert status["desiredWorkers"] == 0 and pods(WORKERS) == []

    body = {"model": "tiny", "prompt": "Wake up, the fleet", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    request = urllib.request.Request(f"http://{router['status']['podIP']}:8000/v1/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    sent_s = time.monotonic()
    first_token_s: float | None = None
    texts: list[str] = []
    finish = None
    with urllib.request.urlopen(request, timeout=240) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            if choice.get("text") and first_token_s is None:
                first_token_s = time.monotonic() - sent_s
            texts.append(choice.get("text", ""))
            finish = choice.get("finish_reason") or finish
    total_s = time.monotonic() - sent_s
    assert finish == "length" and "".join(texts), texts
    assert first_token_s is not None
    print(f"\ncold start: first token {first_token_s:.2f} s after the request (the whole completion {total_s:.2f} s)")

    woke = cluster.get_json("llmpool", "sleepy", "-n", namespace)["status"]
    assert woke.get("lastWokenAt"), woke
    events = cluster.get_json("events", "-n", namespace, "--field-selector", "reason=WakingUp")["items"]
    assert events and "the router holds" in events[0]["message"], events
    with urllib.request.urlopen(f"http://{router['status']['podIP']}:8000/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    assert 'kvfleet_router_hold_outcomes_total{outcome="released"} 1.0' in metrics, metrics

    # Idle again: back to zero workers after the scale-down delay (and the router's word goes stale).
    wait_for(lambda: pods(WORKERS) == [] or None, "zero workers again", timeout_s=120, interval_s=1)
    final = cluster.get_json("llmpool", "sleepy", "-n", namespace)["status"]
    assert final["desiredWorkers"] == 0 and final["heldRequests"] == 0
    cluster.kubectl("delete", "llmpool", "sleepy", "-n", namespace, "--wait=false")
