"""`make demo`: the whole story on the embedded default, on the CPU.

A real local control plane with fake GPU nodes and kvfleet's CRDs; a bad pool refused by the API
server; then a pool of real workers (the builtin engine serving a tiny local model) with its router,
both created by the operator. `kvfleet replay` sends a slice of the Azure LLM conversation trace
through the router at scaled speed while a live table shows the workers and the KVMigrations MELL
orders; the run ends with the replay's record: billed GPU-seconds, GPUs in use against the fluid
bound (a PNG), migrations by mode and outcome, latency, and how many client streams completed whole.
It runs what the e2e tests run.

With `--karpenter` (`make demo KARPENTER=1`) the cluster starts with one node and Karpenter adds GPU
nodes as MELL's workers need them and removes the ones MELL empties: the live table lists the nodes,
the PNG adds the GPUs on nodes over time, and the summary compares the node GPU-seconds billed (a
node is billed from its creation to its deletion, idle or not) with the fixed three-node cluster's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet.localcluster.cluster import Cluster, local_cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import REPO_ROOT, stop_process
from kvfleet.mell.policy import policy_config
from kvfleet.replay.cli import Progress, prepare, run_replay
from kvfleet.replay.cli import add_arguments as add_replay_arguments
from kvfleet.replay.cli import summary as replay_summary
from kvfleet.replay.observe import PoolObserver
from kvfleet.replay.record import Record, write_record
from kvfleet.replay.streams import Clock
from kvfleet.sim import bundled
from kvfleet.sim.profile import load_profile
from kvfleet.sim.result import RunResult
from kvfleet.sim.run import simulate
from kvfleet.sim.speed_model import profile_setup
from kvfleet.sim.traces import read_trace
from kvfleet.worker.model.tiny import make_tiny

# The shipped Azure conversation trace ($KVFLEET_TRACES chooses another folder).
TRACE = bundled.trace_path(bundled.CONV)
POOL = "demo"
# One worker holds 768 tokens of the tiny model's KV (2 KiB a token), so the slice's ~230-token
# requests come in every MELL size class and a handful of them fill a worker.
KV_CAPACITY = "1536Ki"
KV_CAPACITY_TOKENS = 768
EPOCH_S = 1.0
SCALE_DOWN_DELAY_S = 3
# The trace's requests, shrunk to the tiny model and a 2-core machine: prompts / 8, outputs / 2.
PROMPT_SCALE, OUTPUT_SCALE = 8, 2
# The pool's workers.min and workers.max: the floor worker is up before the replay starts, and the
# simulated comparison starts from it too (kvfleet.sim.run, min_workers).
MIN_WORKERS, MAX_WORKERS = 1, 6
# The plain demo's cluster; with --karpenter it starts from one such node.
FIXED_NODES, FIXED_GPUS_PER_NODE = 3, 2
# With --karpenter: how long the "cloud" takes to boot a node (a real GPU node: minutes).
NODE_BOOT_S = 5.0


def pool_manifest(model_dir: Path) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": POOL}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": KV_CAPACITY},
        "workers": {"min": MIN_WORKERS, "max": MAX_WORKERS},
        "scheduling": {"policy": "mell", "epochSeconds": EPOCH_S},
        "migration": {"mode": "adaptive"},
        "autoscaling": {"scaleDownDelaySeconds": SCALE_DOWN_DELAY_S},
        # Up to six workers share this machine's cores: one thread each, as a pod with a CPU limit of one
        # would have (torch's default, a thread per core spinning between steps, starves the others),
        # and a decoding step of at least 30 ms, about a 13B model's on a GPU, so a request lives for
        # seconds (several epochs) as on a real pool instead of the tiny model's milliseconds.
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "OMP_NUM_THREADS", "value": "1"},
                                                                  {"name": "KVFLEET_MIN_STEP_S", "value": "0.03"}]},
    }}


@dataclass
class NodeLife:
    name: str
    gpus: int
    instance_type: str
    first_s: float
    last_s: float
    gone: bool = False


@dataclass
class NodeLog:
    """The cluster's nodes, sampled every second on the replay's clock: what a cloud bills."""

    clock: Clock
    nodes: dict[str, NodeLife] = field(default_factory=dict)
    samples: list[tuple[float, int]] = field(default_factory=list)  # (s, GPUs on nodes)
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self, cluster: Cluster) -> None:
        now_s = self.clock.now_s()
        items = (cluster.get_json("nodes", check=False) or {}).get("items", [])
        seen = set()
        for node in items:
            name = node["metadata"]["name"]
            seen.add(name)
            gpus = int((node["status"].get("allocatable") or {}).get("nvidia.com/gpu", 0))
            life = self.nodes.setdefault(name, NodeLife(name, gpus, node["metadata"].get("labels", {}).get(
                "node.kubernetes.io/instance-type", "fixed"), now_s, now_s))
            life.last_s, life.gpus = now_s, gpus
        for life in self.nodes.values():
            life.gone = life.name not in seen
        self.samples.append((now_s, sum(n.gpus for n in self.nodes.values() if not n.gone)))

    def run(self, cluster: Cluster) -> None:
        while not self.stop.wait(1.0):
            with contextlib.suppress(Exception):  # a sample missed is a second less resolution
                self.sample(cluster)

    def gpu_seconds(self, start_s: float, end_s: float) -> float:
        """GPU-seconds of the nodes that existed in [start_s, end_s] (each from first to last sighting)."""
        return sum(n.gpus * max(0.0, min(n.last_s, end_s) - max(n.first_s, start_s)) for n in self.nodes.values())

    def peak_gpus(self) -> int:
        return max((g for _, g in self.samples), default=0)


def show(cluster: Cluster, title: str, *args: str, input_text: str | None = None) -> None:
    comment = f"    # {title}" if title else ""
    print(f"\n$ kubectl {' '.join(args)}{comment}", flush=True)
    result = cluster.kubectl(*args, check=False, input_text=input_text)
    print((result.stdout + result.stderr).rstrip(), flush=True)


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def live_table(cluster: Cluster, progress: Progress, nodes: NodeLog | None = None) -> None:
    pods = cluster.get_json("pods", "-l", f"kvfleet.dev/pool={POOL},app.kubernetes.io/component=worker")["items"]
    rows = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        report = json.loads((pod["metadata"].get("annotations") or {}).get("kvfleet.dev/kv-load") or "{}")
        used = report.get("usedBytes", 0) / max(1, report.get("capacityBytes", 1))
        classes = "".join(sorted(r["sizeClass"][0] for r in report.get("requests", [])))
        state = "Ready" if ready(pod) else pod["status"].get("phase", "?")
        if pod["metadata"].get("deletionTimestamp"):
            state = "Terminating"
        rows.append(f"  {pod['metadata']['name']:<16} {state:<11} KV {used:4.0%} {'#' * round(used * 20):<20} {classes}")
    migs = cluster.kubectl("get", "kvmigrations", "--sort-by=.metadata.creationTimestamp", check=False).stdout.rstrip().splitlines()
    done = sum(1 for s in progress.streams if s.done.is_set())
    sample = progress.observer.samples[-1] if progress.observer.samples else None
    print(f"\n[{progress.clock.now_s():5.0f}s] streams sent {len(progress.streams)}/{progress.total}, finished {done}; "
          f"GPUs in use {sample.gpus_in_use if sample else 0} (lower bound {sample.lower_bound_gpus if sample else 0}), "
          f"workers {sample.workers if sample else 0}" + ("; draining to the floor" if progress.draining else ""))
    print("\n".join(rows) or "  (no workers)")
    if nodes is not None:
        up = sorted((n for n in nodes.nodes.values() if not n.gone), key=lambda n: n.first_s)
        print(f"  nodes: {len(up)} with {sum(n.gpus for n in up)} GPUs: "
              + ", ".join(f"{n.instance_type} ({n.gpus} GPU, up {nodes.clock.now_s() - n.first_s:.0f}s)" for n in up))
    if len(migs) > 1:
        print("  $ kubectl get kvmigrations | tail -4")
        print("\n".join("  " + line for line in migs[:1] + migs[1:][-4:]), flush=True)


SIMULATED = ("mell", "bf")


def simulate_slice(out: Path, record: Record) -> dict[str, RunResult]:
    """The slice the replay sent, simulated under the default policy and best-fit at the speed the
    workers measured, with the pool's C, epoch, floor, ceiling and scale-down delay and the pods' measured
    start and stop,
    carried out as the operator and router do (kvfleet.sim.run, execution="operator")."""
    profile_path = out / "speed-profile.json"
    if not profile_path.exists():
        print("(the workers measured no speed: no simulated comparison)")
        return {}
    setup = profile_setup(load_profile(profile_path))
    requests = read_trace(out / "sent.csv")
    scale_up_s = record.pod_ready_s.get("median") or 0.0
    # A pod is billed until it is gone: the scale-down delay, then its measured stop.
    delay_s = SCALE_DOWN_DELAY_S + (record.pod_stop_s.get("median") or 0.0)
    return {policy: simulate(requests, setup, policy, EPOCH_S, policy_config(policy, setup.capacity_bytes),
                             scale_up_s=scale_up_s, scale_down_delay_s=delay_s, execution="operator",
                             min_workers=MIN_WORKERS, max_workers=MAX_WORKERS) for policy in SIMULATED}


def comparison(record: Record, sims: dict[str, RunResult]) -> str:
    lines = [f"live ({record.policy}): {record.billed_gpu_seconds:.0f} GPU-seconds billed, peak {record.peak_gpus_in_use} "
             f"GPUs in use; fluid lower bound mean {record.mean_lower_bound_gpus:.2f} GPUs"]
    names = {"mell": "kvfleet default", "bf": "best-fit"}
    for policy, run in sims.items():
        lines.append(f"simulated {names[policy]} on the same requests at the measured speed: "
                     f"{run.billed_gpu_hours * 3600:.0f} GPU-seconds billed, peak {run.peak_gpus} GPUs, "
                     f"{run.num_migrations} migrations")
    return "\n".join(lines)


def plot(record: Record, path: Path, sims: dict[str, RunResult] | None = None, nodes: NodeLog | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.at_s for s in record.samples]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(t, [s.gpus_in_use for s in record.samples], where="post", label=f"GPUs in use ({record.policy})")
    ax.step(t, [s.workers for s in record.samples], where="post", label="worker pods", linestyle="--")
    ax.step(t, [s.lower_bound_gpus for s in record.samples], where="post", label="fluid lower bound", linestyle=":")
    if nodes is not None and nodes.samples:
        ax.step([at for at, _ in nodes.samples], [g for _, g in nodes.samples], where="post", color="black", alpha=0.6,
                label="GPUs on nodes (Karpenter)")
    for policy, run in (sims or {}).items():
        if policy != record.policy:  # the live run's own policy is the solid line
            ax.step([(k + 1) * EPOCH_S for k in range(len(run.gpus))], run.gpus, where="post", alpha=0.7,
                    label=f"GPUs in use, {policy} (simulated, measured speed)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("GPUs / pods")
    ax2 = ax.twinx()
    ax2.plot(t, [s.streams_in_flight for s in record.samples], color="grey", alpha=0.5, label="streams in flight")
    ax2.set_ylabel("streams in flight")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], loc="upper left", fontsize="small")
    ax.set_title("kvfleet demo: Azure conversation trace slice through the router")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def replay_args(args: argparse.Namespace, cluster: Cluster, out: Path) -> argparse.Namespace:
    """`kvfleet replay`'s arguments for the demo's slice, shrunk to the tiny model and one worker's KV."""
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    return parser.parse_args([
        "--pool", POOL, "--kubeconfig", str(cluster.kubeconfig), "--trace", str(TRACE),
        "--window", f"{args.trace_start:g}:{args.seconds:g}", "--time-scale", f"{args.speedup:g}",
        "--every", str(args.every), "--prompt-scale", f"{1 / PROMPT_SCALE:g}", "--output-scale", f"{1 / OUTPUT_SCALE:g}",
        "--max-request-tokens", str(KV_CAPACITY_TOKENS - 16), "--drain-timeout-s", "90", "--out", str(out),
        "--no-progress"])


def wait_for_karpenter_nodes_gone(nodes: NodeLog, timeout_s: float = 120) -> None:
    """After the replay the nodes Karpenter added are still billed until it removes them: wait for that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [n for n in nodes.nodes.values() if n.instance_type != "fixed" and not n.gone]
        if not left:
            return
        print(f"[{nodes.clock.now_s():5.0f}s] waiting for Karpenter to remove {len(left)} empty node(s) "
              f"({sum(n.gpus for n in left)} GPUs still billed)", flush=True)
        time.sleep(5)
    print(f"Karpenter left nodes after {timeout_s:.0f} s; they are billed to here", flush=True)


def node_comparison(nodes: NodeLog, record: Record, fixed_gpus: int) -> str:
    """Node GPU-seconds from the replay's start until Karpenter removed the last node it added (or the
    replay's end, if later), against the fixed cluster's GPUs over the same time."""
    start_s = record.samples[0].at_s if record.samples else 0.0
    end_s = max([start_s + record.duration_s] + [n.last_s for n in nodes.nodes.values() if n.instance_type != "fixed"])
    karpenter = nodes.gpu_seconds(start_s, end_s)
    fixed = fixed_gpus * (end_s - start_s)
    made = sorted(n.name for n in nodes.nodes.values() if n.instance_type != "fixed")
    return (f"nodes (Karpenter, from one node, {NODE_BOOT_S:g} s boot): {karpenter:.0f} node GPU-seconds billed over "
            f"{end_s - start_s:.0f} s (the replay and Karpenter's removal of its nodes), peak {nodes.peak_gpus()} GPUs on "
            f"nodes, {len(made)} nodes created by Karpenter, {sum(n.gone for n in nodes.nodes.values())} removed; "
            f"the fixed cluster ({fixed_gpus} GPUs, idle ones billed too) bills {fixed:.0f} over the same time: "
            f"{karpenter / fixed:.2f}x")


def run_story(cluster: Cluster, args: argparse.Namespace) -> int:
    cache = Path(os.environ.get("KVFLEET_CACHE", REPO_ROOT / ".cache"))
    model_dir = make_tiny(cache / "models" / "tiny")
    print(f"\nthe model: {model_dir} (kvfleet model make-tiny: a 2-layer Llama, random weights, local tokenizer)")
    operator = start_operator(cluster, lease_duration_s=5)
    try:
        manifest = json.dumps(pool_manifest(model_dir))
        show(cluster, "a pool of builtin-engine workers, packed by MELL", "apply", "-f", "-", input_text=manifest)
        wait_for(lambda: next((p for p in cluster.get_json("pods", "-l", f"kvfleet.dev/router={POOL}")["items"]
                               if ready(p)), None), "the pool's router", timeout_s=180, interval_s=0.5)
        wait_for(lambda: any(ready(p) for p in cluster.get_json(
            "pods", "-l", f"kvfleet.dev/pool={POOL},app.kubernetes.io/component=worker")["items"]),
            "the pool's first worker", timeout_s=180, interval_s=0.5)
        show(cluster, "", "get", "llmpools,pods")
        rargs = replay_args(args, cluster, cache / "demo" / "replay")
        requests, trace = prepare(rargs)
        observer = PoolObserver(POOL, "default", Clock(), kubeconfig=str(cluster.kubeconfig))
        pool, router_url = observer.get_pool(), observer.find_router_url()
        assert pool is not None and router_url is not None
        print(f"\n--- kvfleet replay: {args.seconds:.0f} s of the Azure conversation trace (every {args.every}. request: "
              f"{len(requests)} streams, {sum(r.prompt_tokens for r in requests)} prompt and "
              f"{sum(r.output_tokens for r in requests)} output tokens) through the router at {args.speedup}x ---",
              flush=True)
        nodes: NodeLog | None = None
        if args.karpenter:
            nodes = NodeLog(observer.clock)
            nodes.sample(cluster)
            threading.Thread(target=nodes.run, args=(cluster,), daemon=True, name="nodes").start()
        try:
            record, streams = run_replay(observer, pool, router_url, requests, trace, rargs,
                                         on_tick=lambda p: live_table(cluster, p, nodes))
            if nodes is not None:
                wait_for_karpenter_nodes_gone(nodes)
        finally:
            if nodes is not None:
                nodes.stop.set()
        written = write_record(rargs.out, record, [(s.sent_s, s.request) for s in streams], observer.profiles)
        print("\n=== summary (kvfleet replay's record: " + ", ".join(str(p) for p in written) + ") ===")
        print(replay_summary(record))
        sims = simulate_slice(rargs.out, record)
        print(comparison(record, sims))
        if nodes is not None:
            print(node_comparison(nodes, record, FIXED_NODES * FIXED_GPUS_PER_NODE))
        png = cache / "demo" / "gpus-over-time.png"
        plot(record, png, sims, nodes)
        print(f"plot: {png}")
        return 0 if record.streams_whole == record.streams else 1
    finally:
        stop_process(operator)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", action="store_true", help="keep the cluster running until Ctrl-C")
    parser.add_argument("--seconds", type=float, default=60, help="trace window replayed")
    parser.add_argument("--trace-start", type=float, default=0, help="where in the trace the window starts, s")
    parser.add_argument("--every", type=int, default=3, help="replay every n-th request of the window")
    parser.add_argument("--speedup", type=float, default=1.0, help="replay speed against the trace's clock")
    parser.add_argument("--karpenter", action="store_true",
                        help="start from one node; Karpenter adds and removes GPU nodes (make demo KARPENTER=1)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    num_nodes = 1 if args.karpenter else FIXED_NODES
    print("starting a local control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)"
          f" and a node agent with {num_nodes} fake GPU node(s)" + (", and Karpenter" if args.karpenter else "") + " ...",
          flush=True)
    with local_cluster(num_nodes=num_nodes, gpus_per_node=FIXED_GPUS_PER_NODE, num_zones=2, karpenter=args.karpenter,
                       node_registration_delay_s=NODE_BOOT_S) as cluster:
        print(f"cluster up in {time.monotonic() - started:.1f}s; CRDs installed", flush=True)
        show(cluster, "the fake GPU nodes", "get", "nodes",
             "-o", "custom-columns=NAME:.metadata.name,GPUS:.status.allocatable.nvidia\\.com/gpu,"
             "ZONE:.metadata.labels.topology\\.kubernetes\\.io/zone,READY:.status.conditions[?(@.type==\"Ready\")].status")
        show(cluster, "min > max is refused by the API server itself", "apply", "-f", "-", input_text=(
            "apiVersion: kvfleet.dev/v1alpha1\nkind: LLMPool\nmetadata: {name: broken}\n"
            "spec: {model: {name: m, path: /m}, capacity: {kvCapacityPerWorker: 10Gi}, workers: {min: 5, max: 2}}\n"))
        code = run_story(cluster, args)
        if args.hold:
            print(f"\nexport KUBECONFIG={cluster.kubeconfig}\nholding the cluster; Ctrl-C to stop", flush=True)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            with contextlib.suppress(KeyboardInterrupt):
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
    print(f"\ndemo finished in {time.monotonic() - started:.1f}s; everything was torn down", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
