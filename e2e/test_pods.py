"""Scheduling, process pods, deletion and garbage collection on the real control plane.

These are the behaviours the operator relies on: GPU requests are scheduled onto GPU nodes (or stay
Pending with the scheduler's reason), a pod is a running process with a real identity, deletion is
graceful, and deleting an owner deletes what it owns.
"""

from __future__ import annotations

import json
import os
import textwrap
import urllib.request
from typing import Any

from kvfleet.localcluster.cluster import Cluster, wait_for

# A pod process that proves its identity (the ServiceAccount token works), serves HTTP on its pod IP
# for the readiness probe, and says goodbye on SIGTERM.
SERVER = textwrap.dedent(
    """
    import http.server, json, os, signal, sys
    from kubernetes import client, config
    config.load_kube_config()
    review = client.AuthenticationV1Api().create_self_subject_review({"apiVersion": "authentication.k8s.io/v1",
                                                                     "kind": "SelfSubjectReview"})
    me = {"user": review.status.user_info.username, "pod": os.environ["POD_NAME"], "gpus": os.environ["GPUS"]}
    def bye(*_):
        print("got SIGTERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(me).encode()
            self.send_response(200); self.end_headers(); self.wfile.write(body)
    http.server.HTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
    """
)


def pod(name: str, *, gpus: int = 1, command: list[str] | None = None, image: str = "kvfleet/toolbox:dev",
        restart: str = "Always", grace_s: int = 30, owner: dict[str, Any] | None = None,
        probe: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": image,
        "command": command or ["python", "-c", "import time; time.sleep(1e9)"],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "GPUS", "value": str(gpus)},
        ],
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {},
        "ports": [{"name": "http", "containerPort": 8080}],
    }
    if probe:
        container["readinessProbe"] = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container], "restartPolicy": restart, "terminationGracePeriodSeconds": grace_s},
    }
    if owner:
        body["metadata"]["ownerReferences"] = [owner]
    return body


def create(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input_text=json.dumps(obj))


def get_pod(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    result: dict[str, Any] | None = cluster.get_json("pod", name, "-n", namespace, check=False)
    return result


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in (obj or {}).get("status", {}).get("conditions", []):
        if cond["type"] == type_:
            return dict(cond)
    return {}


def pid_of(obj: dict[str, Any]) -> int:
    return int(obj["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waiting to be reaped counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_gpu_nodes_are_registered_with_zones(cluster: Cluster) -> None:
    nodes = cluster.get_json("nodes", "-l", "kvfleet.dev/node-agent=true")["items"]
    assert len(nodes) == 3
    assert {n["status"]["allocatable"]["nvidia.com/gpu"] for n in nodes} == {"2"}
    assert {n["metadata"]["labels"]["topology.kubernetes.io/zone"] for n in nodes} == {"zone-0", "zone-1"}
    assert all(condition(n, "Ready")["status"] == "True" for n in nodes)


def test_gpu_pod_is_scheduled_and_runs_as_a_process(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, pod("server", command=["python", "-c", SERVER], probe=True))
    ready = wait_for(lambda: (p := get_pod(cluster, namespace, "server")) and condition(p, "Ready").get("status") == "True" and p,
                     "the pod to become Ready", timeout_s=90)
    assert ready["spec"]["nodeName"].startswith("gpu-node-")
    pod_ip = ready["status"]["podIP"]
    assert pod_ip.startswith("127.") and not pod_ip.startswith("127.0.0.")
    assert alive(pid_of(ready))
    with urllib.request.urlopen(f"http://{pod_ip}:8080/", timeout=5) as resp:
        identity = json.loads(resp.read())
    # The process authenticated with its own bound ServiceAccount token, not the admin's certificate.
    assert identity == {"user": f"system:serviceaccount:{namespace}:default", "pod": "server", "gpus": "1"}


def test_pod_asking_for_more_gpus_than_any_node_stays_pending(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, pod("greedy", gpus=4))
    scheduled = wait_for(lambda: condition(get_pod(cluster, namespace, "greedy"), "PodScheduled") or None,
                         "the scheduler's verdict")
    assert scheduled["status"] == "False"
    assert scheduled["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in scheduled["message"]
    assert get_pod(cluster, namespace, "greedy")["status"]["phase"] == "Pending"  # type: ignore[index]


def test_foreign_image_stays_pending_with_an_event(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, pod("nginx", gpus=0, image="nginx:1.27"))

    def event() -> dict[str, Any] | None:
        items = cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=nginx")["items"]
        return next((e for e in items if e["reason"] == "ImageNotRunnable"), None)

    found = wait_for(event, "the ImageNotRunnable event")
    assert "nginx:1.27" in found["message"] and found["type"] == "Warning"
    assert get_pod(cluster, namespace, "nginx")["status"]["phase"] == "Pending"  # type: ignore[index]


def test_deletion_is_graceful_then_forced(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, pod("polite", gpus=0, command=["python", "-c", SERVER]))
    create(cluster, namespace, pod("stubborn", gpus=0, grace_s=1, command=[
        "python", "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1e9)"]))
    running = {n: wait_for(lambda n=n: (p := get_pod(cluster, namespace, n)) and p["status"].get("phase") == "Running" and p,
                           f"{n} to run") for n in ("polite", "stubborn")}
    cluster.kubectl("delete", "pod", "polite", "stubborn", "-n", namespace, "--wait=true", timeout_s=60)
    for name, obj in running.items():
        assert not alive(pid_of(obj)), f"{name}'s process survived its pod"
    log = (cluster.pod_dir(namespace, "polite") / "main.log").read_text()
    assert "got SIGTERM" in log


def test_restart_policy_and_exit_codes(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, pod("fails", gpus=0, restart="Never", command=["python", "-c", "raise SystemExit(3)"]))
    create(cluster, namespace, pod("done", gpus=0, restart="OnFailure", command=["python", "-c", "print('ok')"]))
    create(cluster, namespace, pod("crashy", gpus=0, restart="Always", command=["python", "-c", "raise SystemExit(1)"]))
    failed = wait_for(lambda: (p := get_pod(cluster, namespace, "fails")) and p["status"].get("phase") == "Failed" and p,
                      "fails to be Failed")
    assert failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    wait_for(lambda: (p := get_pod(cluster, namespace, "done")) and p["status"].get("phase") == "Succeeded", "done to succeed")
    restarted = wait_for(lambda: (p := get_pod(cluster, namespace, "crashy"))
                         and p["status"].get("containerStatuses", [{}])[0].get("restartCount", 0) >= 2 and p,
                         "crashy to be restarted twice")
    assert restarted["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 1


def test_deleting_the_owner_garbage_collects_its_pods(cluster: Cluster, namespace: str) -> None:
    pool = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "LLMPool",
        "metadata": {"name": "owner"},
        "spec": {"model": {"name": "tiny", "path": "/models/tiny"}, "capacity": {"kvCapacityPerWorker": "1Gi"}},
    }
    create(cluster, namespace, pool)
    uid = cluster.get_json("llmpool", "owner", "-n", namespace)["metadata"]["uid"]
    ref = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "name": "owner", "uid": uid,
           "controller": True, "blockOwnerDeletion": True}
    for index in range(2):
        create(cluster, namespace, pod(f"owner-worker-{index}", owner=ref))
    pids = [pid_of(wait_for(lambda i=index: (p := get_pod(cluster, namespace, f"owner-worker-{i}"))
                            and p["status"].get("phase") == "Running" and p, "workers to run")) for index in range(2)]
    cluster.kubectl("delete", "llmpool", "owner", "-n", namespace)
    wait_for(lambda: not cluster.get_json("pods", "-n", namespace)["items"], "the garbage collector to delete the pods",
             timeout_s=90)
    assert not any(alive(pid) for pid in pids)
