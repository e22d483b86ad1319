"""Request-to-first-token when the request needs a GPU node that does not exist yet, against a warm pool.

A pool that scales with demand pays for it in the first request's wait: with `workers.min: 0` the
router holds it, the operator starts a worker, and if no node has a free GPU the node autoscaler must
first add one. This bench measures the three cases in one run on the local cluster with Karpenter
(kvfleet.localcluster.karpenter), the builtin engine serving the tiny local model through the
pool's router:

- `warm`: a Ready worker serves the request (the baseline);
- `pod_start`: the pool is at zero workers and a node has a free GPU: worker pod + model start;
- `new_node`: the pool is at zero and the only node's GPU is taken: Karpenter's NodeClaim, the node
  (booted after `--node-boot-s`, the kwok provider's registration delay, standing in for a cloud's
  boot time), then the worker pod and the model.

Each case is a streamed completion sent to the router; request-to-first-token is from the send to
the first streamed token. For `new_node` the wait is broken down from the API's timestamps (1 s
resolution): NodeClaim created, node Ready, worker pod Ready. The node boot here is what the flag
says; on a cloud a GPU node takes minutes (add its boot time to `new_node` minus the boot used here).

    python bench/node_autoscaling.py                   # node boot 30 s, 3 warm requests
    python bench/node_autoscaling.py --node-boot-s 60
    python bench/node_autoscaling.py --quick           # node boot 2 s, 1 warm request (make test)

First line: the machine. One line per case. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402

from kvfleet.localcluster.cluster import Cluster, local_cluster, start_operator, wait_for  # noqa: E402
from kvfleet.localcluster.controlplane import REPO_ROOT, stop_process  # noqa: E402
from kvfleet.worker.model.tiny import make_tiny  # noqa: E402

POOL = "bench"
# The pool's scale-down delay while the cold and warm requests are measured: long enough that the
# worker the first request woke is still there for the warm one (with 3 s, a first request slowed by a
# busy machine outlived the delay and the "warm" request waited for a new pod); then a short one, so
# the pool goes back to zero quickly for the new-node request, which runs with the long one again (its
# worker, pod and node are read after it ends).
WARM_DELAY_S, IDLE_DELAY_S = 300, 1
WORKERS = f"kvfleet.dev/pool={POOL},app.kubernetes.io/component=worker"


def pool_manifest(model_dir: Path) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": POOL}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": "16Mi"},
        "workers": {"min": 0, "max": 2},
        "scheduling": {"epochSeconds": 1},
        "autoscaling": {"scaleDownDelaySeconds": WARM_DELAY_S},
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
    }}


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def stamp_s(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone


def first_token_s(router_ip: str, prompt: str) -> float:
    """Send one streamed completion to the router; seconds from the send to its first token."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(f"http://{router_ip}:8000/v1/completions", data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"})
    sent_s = time.monotonic()
    first: float | None = None
    with urllib.request.urlopen(request, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[len("data: "):])["choices"][0].get("text"):
                    first = time.monotonic() - sent_s
    if first is None:
        raise RuntimeError("the completion streamed no token")
    return first


def workers(cluster: Cluster) -> list[dict[str, Any]]:
    return [p for p in cluster.get_json("pods", "-l", WORKERS)["items"] if not p["metadata"].get("deletionTimestamp")]


def at_zero(cluster: Cluster) -> bool:
    return not workers(cluster) and (cluster.get_json("llmpool", POOL).get("status") or {}).get("desiredWorkers") == 0


def blocker() -> dict[str, Any]:
    """A pod holding the fixed node's one GPU, so the next worker needs a new node."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu-taken"}, "spec": {
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "hold", "image": "registry.k8s.io/pause:3.10", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cache = Path(os.environ.get("KVFLEET_CACHE", REPO_ROOT / ".cache"))
    model_dir = make_tiny(cache / "models" / "tiny")
    with local_cluster(num_nodes=1, gpus_per_node=1, num_zones=1, karpenter=True,
                       node_registration_delay_s=args.node_boot_s, consolidate_after_s=2) as cluster:
        cluster.wait_default_service_account("default")
        operator = start_operator(cluster, "operator-bench")
        try:
            cluster.apply_json(pool_manifest(model_dir), "default")
            router = wait_for(lambda: next((p for p in cluster.get_json("pods", "-l", f"kvfleet.dev/router={POOL}")["items"]
                                            if ready(p)), None), "the pool's router", timeout_s=180, interval_s=0.5)
            router_ip = router["status"]["podIP"]
            wait_for(lambda: at_zero(cluster), "the pool at zero workers", timeout_s=60, interval_s=0.5)

            # A free GPU on an existing node: the worker pod and the model start.
            pod_start_s = first_token_s(router_ip, "Wake the fleet")
            print(f"pod_start: first token {pod_start_s:.2f} s (pool at zero, a node with a free GPU)", flush=True)
            warm = [first_token_s(router_ip, f"Warm request {i}") for i in range(args.warm_requests)]
            warm_s = statistics.median(warm)
            print(f"warm: first token {warm_s:.3f} s (median of {len(warm)}; a Ready worker)", flush=True)

            # Back to zero; the only GPU taken: the next worker waits for a node from Karpenter.
            cluster.kubectl("patch", "llmpool", POOL, "--type=merge",
                            "-p", json.dumps({"spec": {"autoscaling": {"scaleDownDelaySeconds": IDLE_DELAY_S}}}))
            # Gone, not only deleted: a terminating worker still holds the GPU for the scheduler, and the
            # blocker, pending meanwhile, could get a node from Karpenter that the next worker then finds
            # ready (seen on a loaded machine: NodeClaim 0 s, node Ready 0 s).
            wait_for(lambda: at_zero(cluster) and not cluster.get_json("pods", "-l", WORKERS)["items"],
                     "the pool back at zero, its last worker gone", timeout_s=120, interval_s=0.5)
            cluster.kubectl("patch", "llmpool", POOL, "--type=merge",
                            "-p", json.dumps({"spec": {"autoscaling": {"scaleDownDelaySeconds": WARM_DELAY_S}}}))
            cluster.apply_json(blocker(), "default")
            wait_for(lambda: ready(cluster.get_json("pod", "gpu-taken")), "the blocker", timeout_s=60)
            new_node_s = first_token_s(router_ip, "A node for the fleet")
            pod = workers(cluster)[0]
            claims = cluster.get_json("nodeclaims")["items"]
            node = cluster.get_json("node", pod["spec"]["nodeName"])
            sent_s = stamp_s(pod["metadata"]["creationTimestamp"])
            # The API's timestamps have whole seconds: a NodeClaim made in the pod's second may read -1 s.
            claim_s = max(0.0, min(stamp_s(c["metadata"]["creationTimestamp"]) for c in claims) - sent_s)
            node_ready_s = stamp_s(next(c["lastTransitionTime"] for c in node["status"]["conditions"] if c["type"] == "Ready")) - sent_s
            pod_ready_s = stamp_s(next(c["lastTransitionTime"] for c in pod["status"]["conditions"] if c["type"] == "Ready")) - sent_s
            print(f"new_node: first token {new_node_s:.2f} s (pool at zero, no free GPU; node boot {args.node_boot_s:g} s); "
                  f"from the worker pod's creation: NodeClaim {claim_s:.0f} s, node Ready {node_ready_s:.0f} s, "
                  f"pod Ready {pod_ready_s:.0f} s", flush=True)
        finally:
            stop_process(operator)
    return {
        "bench": "node_autoscaling", "node_boot_s": args.node_boot_s, "warm_requests": args.warm_requests,
        "rtft_warm_s": round(warm_s, 4), "rtft_pod_start_s": round(pod_start_s, 3), "rtft_new_node_s": round(new_node_s, 3),
        "new_node_over_warm": round(new_node_s / warm_s, 1), "new_node_minus_pod_start_s": round(new_node_s - pod_start_s, 2),
        "new_node_breakdown_s": {"nodeclaim": claim_s, "node_ready": node_ready_s, "pod_ready": pod_ready_s},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node-boot-s", type=float, default=30.0, help="the kwok provider's node registration delay")
    parser.add_argument("--warm-requests", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="node boot 2 s, one warm request")
    args = parser.parse_args(argv)
    if args.quick:
        args.node_boot_s, args.warm_requests = 2.0, 1
    print(f"machine: {platform.node()} {os.cpu_count()} cores ({cpu_model()}), Python {platform.python_version()}", flush=True)
    summary = run(args)
    print(f"a request that needs a new node waits {summary['new_node_over_warm']}x a warm pool's first token "
          f"({summary['rtft_new_node_s']:.1f} s against {summary['rtft_warm_s']:.3f} s)")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
