"""LLMPools the e2e tests build often (pools of the scripted stand-in worker, scripted_worker.py), and
what they ask of their pods."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def scripted_pool(name: str, **spec: Any) -> dict[str, Any]:
    """An LLMPool whose workers are the scripted stand-in (kvfleet_e2e.scripted_worker); `spec` overrides."""
    body: dict[str, Any] = {
        "model": {"name": "tiny", "path": "/models/tiny"},
        "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": "1Gi"},
        "workers": {"min": 2, "max": 3},
        "scheduling": {"epochSeconds": 1},
        "autoscaling": {"scaleDownDelaySeconds": 1},
        "workerTemplate": {"image": "kvfleet/scripted-worker:dev"},
    }
    body.update(spec)
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": name}, "spec": body}


def post(pod: dict[str, Any], path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST JSON to a pod's port 8000 (a scripted worker's /script/... endpoints); its JSON answer."""
    request = urllib.request.Request(f"http://{pod['status']['podIP']}:8000{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=5) as resp:
        return dict(json.loads(resp.read()))


def ready(pod: dict[str, Any]) -> bool:
    """Whether a pod (as `kubectl get -o json` gives it) has the condition Ready."""
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def metrics(ip: str) -> dict[str, float]:
    """A pod's Prometheus samples (a worker's or a router's, on port 8000), by name with its labels."""
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
