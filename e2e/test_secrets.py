"""The pool's Secret rotated under load, on the real control plane: a person deletes `<pool>-token`, the
operator makes it again with a fresh token and migration key, and the running worker and router pods
take the new values without a restart (kvfleet.serving.credentials). A stream through the router that
runs across the rotation comes back whole, a KV migration made after it (with the new migration key)
succeeds, the old token is still taken during the grace period, and no log holds a secret."""

from __future__ import annotations

import base64
import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet.serving.credentials import MIGRATION_KEY_KEY, TOKEN_KEY
from kvfleet.worker.text import Tokenizer
from kvfleet_e2e.pools import ready
from kvfleet_e2e.real_workers import greedy_outputs, seeded_prompt

POOL = "rotating"
PROMPT_TOKENS = 16


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-secrets-e2e")
    yield proc
    stop_process(proc)


def secret_values(cluster: Cluster, namespace: str) -> dict[str, str] | None:
    secret = cluster.get_json("secret", f"{POOL}-token", "-n", namespace, check=False)
    if not secret:
        return None
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def internal_status(pod: dict[str, Any], token: str) -> int:
    request = urllib.request.Request(f"http://{pod['status']['podIP']}:8000/internal/requests",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def holder_of(workers: list[dict[str, Any]], token: str, request_id: str) -> dict[str, Any] | None:
    for pod in workers:
        request = urllib.request.Request(f"http://{pod['status']['podIP']}:8000/internal/requests",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            if any(r["id"] == request_id for r in json.loads(resp.read())["requests"]):
                return pod
    return None


def test_deleting_the_secret_rotates_it_under_running_streams_and_migrations(cluster: Cluster, namespace: str,
                                                                             operator: Process, model_dir: Path) -> None:
    pool = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": POOL}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)}, "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": "16Mi"},
        "workers": {"min": 2, "max": 2}, "scheduling": {"epochSeconds": 1}, "migration": {"mode": "kv"},
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "KVFLEET_MIN_STEP_S", "value": "0.03"}]},
    }}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool))
    # The unmigrated, unrotated answer, from a plain engine in this process while the pool starts (a
    # worker paced at 30 ms a token would take 15 s or more for it).
    body = {"model": "tiny", "prompt": seeded_prompt(PROMPT_TOKENS, 0), "max_tokens": 500, "temperature": 0,
            "ignore_eos": True}
    reference: list[str] = []
    computing = threading.Thread(target=lambda: reference.append(Tokenizer(model_dir).completion_text(
        greedy_outputs(model_dir, [("r", PROMPT_TOKENS, 500)], 16 * 2**20)["r"])), daemon=True)
    computing.start()

    def ready_pods(selector: str, count: int) -> list[dict[str, Any]] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = [p for p in cluster.get_json("pods", "-n", namespace, "-l", selector)["items"] if ready(p)]
        return sorted(pods, key=lambda p: p["metadata"]["name"]) if len(pods) >= count else None

    workers = wait_for(lambda: ready_pods(f"kvfleet.dev/pool={POOL},app.kubernetes.io/component=worker", 2),
                       "two Ready workers", timeout_s=180, interval_s=0.5)
    router = wait_for(lambda: ready_pods(f"kvfleet.dev/router={POOL}", 1), "a Ready router", timeout_s=60, interval_s=0.5)[0]
    old = secret_values(cluster, namespace)
    assert old is not None and len(old[TOKEN_KEY]) == 64 and len(old[MIGRATION_KEY_KEY]) == 64
    assert old[TOKEN_KEY] != old[MIGRATION_KEY_KEY]

    # A stream through the router that runs across the rotation (500 tokens paced at 30 ms: 15 s or more).
    conn = http.client.HTTPConnection(router["status"]["podIP"], 8000, timeout=180)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json", "X-Request-Id": "across-rotation"})
    response = conn.getresponse()
    assert response.status == 200
    received = [response.readline() for _ in range(4)]
    source = wait_for(lambda: holder_of(workers, old[TOKEN_KEY], "across-rotation"), "the stream's worker",
                      timeout_s=15, interval_s=0.05)

    cluster.kubectl("delete", "secret", f"{POOL}-token", "-n", namespace)
    new = wait_for(lambda: (v := secret_values(cluster, namespace)) and v[TOKEN_KEY] != old[TOKEN_KEY] and v,
                   "the operator to make the Secret again", timeout_s=30, interval_s=0.2)
    assert new[MIGRATION_KEY_KEY] != old[MIGRATION_KEY_KEY]
    # Every running pod takes the new token (a value it does not know makes it re-read the Secret),
    # and the old one still, for the grace period, so peers that have not re-read it yet are not refused.
    for pod in workers:
        assert internal_status(pod, new[TOKEN_KEY]) == 200, pod["metadata"]["name"]
        assert internal_status(pod, old[TOKEN_KEY]) == 200, pod["metadata"]["name"]
        assert internal_status(pod, "not-the-token") == 401

    # A KV move of the running stream after the rotation: the handshake uses the new migration key.
    target = next(p for p in workers if p["metadata"]["name"] != source["metadata"]["name"])
    migration = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "KVMigration",
                 "metadata": {"name": "after-rotation", "labels": {"kvfleet.dev/pool": POOL}},
                 "spec": {"pool": POOL, "requestId": "across-rotation", "sourcePod": source["metadata"]["name"],
                          "targetPod": target["metadata"]["name"], "mode": "kv",
                          "reason": "Rebalance"}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(migration))
    done = wait_for(lambda: (st := (cluster.get_json("kvmigration", "after-rotation", "-n", namespace).get("status") or {}))
                    .get("phase") in ("Succeeded", "Failed") and st, "the move to finish", timeout_s=60, interval_s=0.2)
    assert done["phase"] == "Succeeded" and done["bytesMoved"] > 0, done

    raw = b"".join(received) + response.read()
    events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-400:]
    chunks = [json.loads(e) for e in events[:-1]]
    computing.join(120)
    assert reference, "the greedy reference was not computed"
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # Nothing secret in any log: the operator's, the workers', the router's, the node agent's.
    logs = [operator.log_path, *cluster.plane.work_dir.glob(f"agent/pods/{namespace}_*/*.log"),
            *cluster.plane.work_dir.glob("logs/*.log")]
    assert len(logs) >= 4
    for path in logs:
        text = path.read_text(errors="replace")
        for value in (*old.values(), *new.values()):
            assert value not in text, f"a secret of the pool is in {path}"
        if "agent/pods" in str(path):
            assert "Traceback" not in text, text[-3000:]
