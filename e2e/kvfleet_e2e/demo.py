"""`make demo`: the main job on the embedded default.

Today that is the foundation: a real local control plane with fake GPU nodes, kvfleet's CRDs, and
examples/llmpool.yaml applied, shown the way a user sees it with kubectl. Later steps (operator,
workers, router, trace replay) extend this same script, so the demo always runs what the e2e tests run.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time

from kvfleet_e2e.cluster import local_cluster
from kvfleet_e2e.controlplane import REPO_ROOT


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
        if args.hold:
            print(f"\nexport KUBECONFIG={cluster.kubeconfig}\nholding the cluster; Ctrl-C to stop", flush=True)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            with contextlib.suppress(KeyboardInterrupt):
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
    print(f"\ndemo finished in {time.monotonic() - started:.1f}s; everything was torn down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
