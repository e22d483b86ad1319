"""`make demo`: the main job on the embedded default.

A real local control plane with fake GPU nodes and kvfleet's CRDs; examples/llmpool.yaml applied and a
bad pool refused, shown the way a user sees it with kubectl; then the operator packing a burst of
requests with MELL: it adds workers, moves requests with KVMigrations, and drains the workers again
when the requests finish. The workers are the scripted stand-ins the e2e tests use (the engine-backed
worker and the router come with later issues), so the demo runs what the tests run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import sys
import time
import urllib.request
from typing import Any

from kvfleet_e2e.cluster import Cluster, local_cluster, scripted_pool, start_operator, wait_for
from kvfleet_e2e.controlplane import REPO_ROOT, stop_process

# C = 1 MB of KV per worker, so a dozen requests of every size class need several workers.
DEMO_POOL = scripted_pool("demo", capacity={"kvCapacityPerWorker": "1M"}, workers={"min": 1, "max": 5},
                          autoscaling={"scaleDownDelaySeconds": 2})


def show(cluster_kubectl: object, title: str, *args: str) -> None:
    comment = f"    # {title}" if title else ""
    print(f"\n$ kubectl {' '.join(args)}{comment}", flush=True)
    result = cluster_kubectl(*args, check=False)  # type: ignore[operator]
    print((result.stdout + result.stderr).rstrip(), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", action="store_true", help="keep the cluster running until Ctrl-C")
    args = parser.parse_args(argv)
    started = time.monotonic()
    print("starting a local control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)"
          " and a node agent with 3 fake GPU nodes ...", flush=True)
    with local_cluster(num_nodes=3, gpus_per_node=2, num_zones=2) as cluster:
        print(f"cluster up in {time.monotonic() - started:.1f}s; CRDs installed", flush=True)
        show(cluster.kubectl, "the fake GPU nodes", "get", "nodes",
             "-o", "custom-columns=NAME:.metadata.name,GPUS:.status.allocatable.nvidia\\.com/gpu,"
             "ZONE:.metadata.labels.topology\\.kubernetes\\.io/zone,READY:.status.conditions[?(@.type==\"Ready\")].status")
        show(cluster.kubectl, "a user applies a pool", "apply", "-f", str(REPO_ROOT / "examples" / "llmpool.yaml"))
        show(cluster.kubectl, "", "get", "llmpools")
        show(cluster.kubectl, "no migrations yet", "get", "kvmigrations")
        bad = cluster.kubectl("apply", "-f", "-", check=False, input_text=(
            "apiVersion: kvfleet.dev/v1alpha1\nkind: LLMPool\nmetadata: {name: broken}\n"
            "spec: {model: {name: m, path: /m}, capacity: {kvCapacityPerWorker: 10Gi}, workers: {min: 5, max: 2}}\n"))
        print("\n$ kubectl apply -f broken-pool.yaml    # min > max is refused by the API server itself")
        print(bad.stderr.rstrip(), flush=True)
        run_mell_story(cluster)
        if args.hold:
            print(f"\nexport KUBECONFIG={cluster.kubeconfig}\nholding the cluster; Ctrl-C to stop", flush=True)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            with contextlib.suppress(KeyboardInterrupt):
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
    print(f"\ndemo finished in {time.monotonic() - started:.1f}s; everything was torn down", flush=True)
    return 0


def send(cluster: Cluster, pod_name: str, body: dict[str, Any]) -> None:
    pod = cluster.get_json("pod", pod_name)
    request = urllib.request.Request(f"http://{pod['status']['podIP']}:8000/script/requests", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=5).close()


def live_table(cluster: Cluster, seconds: float, until: Any = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pool = cluster.kubectl("get", "llmpool", "demo", check=False).stdout.rstrip()
        migs = cluster.kubectl("get", "kvmigrations", check=False).stdout.rstrip().splitlines()
        print(f"\n[{time.strftime('%H:%M:%S')}] $ kubectl get llmpool demo; kubectl get kvmigrations | tail -4\n{pool}")
        print("\n".join(migs[:1] + migs[1:][-4:]) if migs else "No resources found.", flush=True)
        if until is not None and until():
            return
        time.sleep(3)


def run_mell_story(cluster: Cluster) -> None:
    print("\n--- the operator packs a burst of requests with MELL ---", flush=True)
    operator = start_operator(cluster, lease_duration_s=5)
    try:
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(DEMO_POOL))
        wait_for(lambda: (cluster.get_json("llmpool", "demo").get("status") or {}).get("readyWorkers") == 1,
                 "the pool's first worker", timeout_s=120)
        # Twelve requests of every size class (C = 1 MB of KV per worker), all sent to one worker, as
        # a router that ignores MELL would: MELL must add workers and move requests to pack them.
        rng = random.Random(3)
        for index in range(12):
            size = int(1_000_000 * rng.choice([0.15, 0.2, 0.3, 0.4, 0.6, 0.7]))
            send(cluster, "demo-worker-0", {"id": f"req-{index}", "kvBytes": size, "durationS": 20 + index})
        print("sent 12 requests (4.8 MB of KV in all) to demo-worker-0", flush=True)

        def pool_status() -> dict[str, Any]:
            return dict(cluster.get_json("llmpool", "demo").get("status") or {})

        wait_for(lambda: pool_status().get("gpusInUse", 0) > 0, "the operator to see the requests", timeout_s=30)
        live_table(cluster, 90, until=lambda: (st := pool_status()).get("gpusInUse") == 0 and st.get("workers") == 1)
        migs = cluster.get_json("kvmigrations")["items"]
        phases = [(m.get("status") or {}).get("phase", "Pending") for m in migs]
        failures = sorted({(m.get("status") or {}).get("message", "") for m in migs if (m.get("status") or {}).get("phase") == "Failed"})
        logs = "".join(p.read_text() for p in cluster.plane.work_dir.glob("agent/pods/default_demo-worker-*/worker.log"))
        finished = {line.split("request ", 1)[1].split()[0] for line in logs.splitlines() if line.endswith("finished")}
        print(f"\nmigrations: {len(migs)}: {phases.count('Succeeded')} succeeded, {phases.count('Failed')} failed"
              + (f" (why: {'; '.join(failures)}; a failed move leaves the request on its source)" if failures else ""))
        print(f"requests finished: {len(finished)} of 12; requests dropped by a deleted worker: {logs.count('LOST ')}")
        print(f"workers now: {pool_status().get('workers')} (the pool's floor is 1)", flush=True)
    finally:
        stop_process(operator)


if __name__ == "__main__":
    sys.exit(main())
