"""`make demo`: the whole story on the embedded default, on the CPU.

A real local control plane with fake GPU nodes and kvfleet's CRDs; a bad pool refused by the API
server; then a pool of real workers (the builtin engine serving a tiny local model) with its router,
both created by the operator. A slice of the Azure LLM conversation trace is replayed through the
router at scaled speed while a live table shows the workers and the KVMigrations MELL orders; the
run ends with a summary: GPUs over time (a PNG), migrations by mode and outcome, and how many client
streams completed whole. It runs what the e2e tests run.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet.localcluster.cluster import Cluster, local_cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import REPO_ROOT, stop_process
from kvfleet.sim.traces import TraceRequest, read_csv, slice_trace
from kvfleet.worker.model.tiny import make_tiny

TRACE = REPO_ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
POOL = "demo"
# One worker holds 768 tokens of the tiny model's KV (2 KiB a token), so the slice's ~230-token
# requests come in every MELL size class and a handful of them fill a worker.
KV_CAPACITY = "1536Ki"
KV_CAPACITY_TOKENS = 768
# The trace's requests, shrunk to the tiny model and a 2-core machine: prompts / 8, outputs / 2.
PROMPT_SCALE, OUTPUT_SCALE = 8, 2


def pool_manifest(model_dir: Path) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": POOL}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": KV_CAPACITY},
        "workers": {"min": 1, "max": 6},
        "scheduling": {"policy": "mell", "epochSeconds": 1},
        "migration": {"mode": "adaptive"},
        "autoscaling": {"scaleDownDelaySeconds": 3},
        # Up to six workers share this machine's cores: one thread each, as a pod with a CPU limit of one
        # would have (torch's default, a thread per core spinning between steps, starves the others),
        # and a decoding step of at least 30 ms, about a 13B model's on a GPU, so a request lives for
        # seconds (several epochs) as on a real pool instead of the tiny model's milliseconds.
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "OMP_NUM_THREADS", "value": "1"},
                                                                  {"name": "KVFLEET_MIN_STEP_S", "value": "0.03"}]},
    }}


def show(cluster: Cluster, title: str, *args: str, input_text: str | None = None) -> None:
    comment = f"    # {title}" if title else ""
    print(f"\n$ kubectl {' '.join(args)}{comment}", flush=True)
    result = cluster.kubectl(*args, check=False, input_text=input_text)
    print((result.stdout + result.stderr).rstrip(), flush=True)


@dataclass
class Stream:
    """One client of the router: a streamed completion, checked for wholeness when it ends."""

    request: TraceRequest
    max_tokens: int
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def whole(self) -> bool:
        return self.error is None and self.finish_reason == "length" and self.tokens == self.max_tokens


def run_stream(router_ip: str, stream: Stream) -> None:
    rng = random.Random(stream.request.request_id)  # the same prompts every run
    prompt = [1] + [rng.randrange(3, 1900) for _ in range(stream.request.prompt_tokens - 1)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": stream.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        conn = http.client.HTTPConnection(router_ip, 8000, timeout=300)
        conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json", "X-Request-Id": f"conv-{stream.request.request_id}"})
        response = conn.getresponse()
        if response.status != 200:
            stream.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk:
                stream.error = chunk["error"].get("message", "error")
            if chunk.get("usage"):
                stream.tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    except Exception as err:  # the summary counts it; the demo goes on
        stream.error = f"{type(err).__name__}: {err}"
    finally:
        stream.done.set()


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


class Sampler:
    """GPUs in use, workers and streams in flight, once a second, for the live table and the PNG."""

    def __init__(self, cluster: Cluster, streams: list[Stream]) -> None:
        self.cluster = cluster
        self.streams = streams
        self.samples: list[tuple[float, int, int, int]] = []  # (s, gpus in use, workers, streams in flight)
        self.started = time.monotonic()
        self.stop = threading.Event()

    def status(self) -> dict[str, Any]:
        return dict((self.cluster.get_json("llmpool", POOL, check=False) or {}).get("status") or {})

    def run(self) -> None:
        while not self.stop.wait(1.0):
            st = self.status()
            in_flight = sum(1 for s in list(self.streams) if not s.done.is_set())
            self.samples.append((time.monotonic() - self.started, int(st.get("gpusInUse", 0)), int(st.get("workers", 0)),
                                 in_flight))


def live_table(cluster: Cluster, sampler: Sampler, streams: list[Stream], total: int) -> None:
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
    done = sum(1 for s in streams if s.done.is_set())
    st = sampler.status()
    print(f"\n[{time.monotonic() - sampler.started:5.0f}s] streams sent {len(streams)}/{total}, finished {done}; "
          f"GPUs in use {st.get('gpusInUse', 0)} (lower bound {st.get('lowerBoundGpus', 0)}), workers {st.get('workers', 0)}")
    print("\n".join(rows) or "  (no workers)")
    if len(migs) > 1:
        print("  $ kubectl get kvmigrations | tail -4")
        print("\n".join("  " + line for line in migs[:1] + migs[1:][-4:]), flush=True)


def plot(samples: list[tuple[float, int, int, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(t, [s[1] for s in samples], where="post", label="GPUs in use (MELL)")
    ax.step(t, [s[2] for s in samples], where="post", label="worker pods", linestyle="--")
    ax.set_xlabel("seconds")
    ax.set_ylabel("GPUs / pods")
    ax2 = ax.twinx()
    ax2.plot(t, [s[3] for s in samples], color="grey", alpha=0.5, label="streams in flight")
    ax2.set_ylabel("streams in flight")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], loc="upper left", fontsize="small")
    ax.set_title("kvfleet demo: Azure conversation trace slice through the router")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def replay(cluster: Cluster, router_ip: str, requests: list[TraceRequest], speedup: float) -> tuple[list[Stream], Sampler]:
    streams: list[Stream] = []
    sampler = Sampler(cluster, streams)
    threading.Thread(target=sampler.run, daemon=True).start()
    began = time.monotonic()
    last_table = 0.0
    for request in requests:
        while (wait_s := request.arrival_s / speedup - (time.monotonic() - began)) > 0:
            time.sleep(min(wait_s, 0.2))
            if time.monotonic() - last_table > 4:
                live_table(cluster, sampler, streams, len(requests))
                last_table = time.monotonic()
        stream = Stream(request, max_tokens=request.output_tokens)
        streams.append(stream)
        threading.Thread(target=run_stream, args=(router_ip, stream), daemon=True).start()
    while not all(s.done.is_set() for s in streams):
        time.sleep(0.2)
        if time.monotonic() - last_table > 4:
            live_table(cluster, sampler, streams, len(requests))
            last_table = time.monotonic()
    return streams, sampler


def scaled_slice(start_s: float, duration_s: float, every: int) -> list[TraceRequest]:
    """The trace's window, every n-th request, shrunk to fit the tiny model and one worker's KV."""
    picked = slice_trace(read_csv(TRACE), start_s, duration_s)[::every]
    out = []
    for r in picked:
        prompt = max(4, r.prompt_tokens // PROMPT_SCALE)
        output = max(8, r.output_tokens // OUTPUT_SCALE)
        prompt = min(prompt, KV_CAPACITY_TOKENS // 2)
        output = min(output, KV_CAPACITY_TOKENS - 16 - prompt)
        out.append(TraceRequest(r.request_id, r.arrival_s, prompt, output))
    return out


def run_story(cluster: Cluster, args: argparse.Namespace) -> int:
    cache = Path(os.environ.get("KVFLEET_CACHE", REPO_ROOT / ".cache"))
    model_dir = make_tiny(cache / "models" / "tiny")
    print(f"\nthe model: {model_dir} (kvfleet model make-tiny: a 2-layer Llama, random weights, local tokenizer)")
    operator = start_operator(cluster, lease_duration_s=5)
    try:
        manifest = json.dumps(pool_manifest(model_dir))
        show(cluster, "a pool of builtin-engine workers, packed by MELL", "apply", "-f", "-", input_text=manifest)
        router = wait_for(lambda: next((p for p in cluster.get_json("pods", "-l", f"kvfleet.dev/router={POOL}")["items"]
                                        if ready(p)), None), "the pool's router", timeout_s=180, interval_s=0.5)
        wait_for(lambda: any(ready(p) for p in cluster.get_json(
            "pods", "-l", f"kvfleet.dev/pool={POOL},app.kubernetes.io/component=worker")["items"]),
            "the pool's first worker", timeout_s=180, interval_s=0.5)
        show(cluster, "", "get", "llmpools,pods")
        requests = scaled_slice(args.trace_start, args.seconds, args.every)
        prompt_tokens = sum(r.prompt_tokens for r in requests)
        output_tokens = sum(r.output_tokens for r in requests)
        print(f"\n--- replaying {args.seconds:.0f} s of the Azure conversation trace (every {args.every}. request: "
              f"{len(requests)} streams, {prompt_tokens} prompt and {output_tokens} output tokens) through the router "
              f"at {args.speedup}x ---", flush=True)
        streams, sampler = replay(cluster, router["status"]["podIP"], requests, args.speedup)
        print("\nall streams ended; waiting for the pool to drain to its floor ...", flush=True)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: (st := sampler.status()).get("gpusInUse") == 0 and st.get("workers") == 1,
                     "the drain", timeout_s=90, interval_s=1)
        sampler.stop.set()
        live_table(cluster, sampler, streams, len(requests))
        return summary(cluster, streams, sampler, cache / "demo" / "gpus-over-time.png")
    finally:
        stop_process(operator)


def summary(cluster: Cluster, streams: list[Stream], sampler: Sampler, png: Path) -> int:
    migs = cluster.get_json("kvmigrations")["items"]
    by_mode = Counter((m["spec"].get("mode", "?"), (m.get("status") or {}).get("phase", "Pending")) for m in migs)
    downtimes = sorted(float((m.get("status") or {}).get("downtimeSeconds", 0)) * 1000 for m in migs
                       if (m.get("status") or {}).get("phase") == "Succeeded")
    whole = sum(1 for s in streams if s.whole)
    plot(sampler.samples, png)
    peak = max((s[1] for s in sampler.samples), default=0)
    gpu_seconds = sum(s[1] for s in sampler.samples)
    print("\n=== summary ===")
    print(f"streams completed whole: {whole} of {len(streams)}")
    for s in streams:
        if not s.whole:
            print(f"  conv-{s.request.request_id}: {s.tokens}/{s.max_tokens} tokens, finish {s.finish_reason}, {s.error}")
    print(f"GPUs in use: peak {peak}, {gpu_seconds} GPU-seconds over {len(sampler.samples)} s (plot: {png})")
    print(f"migrations: {len(migs)} " + (", ".join(f"{mode}/{phase}: {n}" for (mode, phase), n in sorted(by_mode.items()))
                                         or "(none)"))
    if downtimes:
        print(f"  downtime of succeeded moves: median {downtimes[len(downtimes) // 2]:.0f} ms, max {downtimes[-1]:.0f} ms")
    why_failed = Counter((m.get("status") or {}).get("message", "")[:140] for m in migs
                         if (m.get("status") or {}).get("phase") == "Failed")
    for message, count in why_failed.most_common(3):
        print(f"  failed x{count}: {message} (a failed move leaves the request where it was; MELL orders it again)")
    return 0 if whole == len(streams) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", action="store_true", help="keep the cluster running until Ctrl-C")
    parser.add_argument("--seconds", type=float, default=60, help="trace window replayed")
    parser.add_argument("--trace-start", type=float, default=0, help="where in the trace the window starts, s")
    parser.add_argument("--every", type=int, default=3, help="replay every n-th request of the window")
    parser.add_argument("--speedup", type=float, default=1.0, help="replay speed against the trace's clock")
    args = parser.parse_args(argv)
    started = time.monotonic()
    print("starting a local control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)"
          " and a node agent with 3 fake GPU nodes ...", flush=True)
    with local_cluster(num_nodes=3, gpus_per_node=2, num_zones=2) as cluster:
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
