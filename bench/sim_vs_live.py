"""Does the simulator tell the truth about a live pool? The same trace slice, live and simulated.

    python bench/sim_vs_live.py            # 60 s of the Azure conversation trace (about 8 minutes on 2 cores)
    python bench/sim_vs_live.py --quick    # 20 s of it, for a smoke run (part of make test)

On the local control plane (kvfleet.localcluster: fake GPU nodes), a pool of builtin-engine workers
serving the tiny local model replays one slice of the Azure conversation trace through its router
(`kvfleet replay`, shrunk as `make demo` shrinks it), once under kvfleet's default policy and once
under best-fit, each on a fresh pool. Then `kvfleet simulate` replays exactly the requests that were
sent (the record's sent.csv) with the same C, epoch and scale-down delay, the pods' measured start
time, and the speed the workers measured during that run (the record's speed-profile.json); and once
more with pods ready at once, which shows how much of any gap is the pods' start (the simulator holds
a request for its new pod; the live pool queues it on a ready worker meanwhile).

Targets: simulated and live billed GPU-seconds within 10% of each other for both policies,
migrations within 20%; the live default policy at most best-fit's live GPU-seconds; failed moves at
most 5% of the live moves. Printed as PASS or MISS with the numbers; no assertions (the numbers are
the output; e2e/test_bench_sim_vs_live.py runs the quick mode, a smoke test of the machinery). The last line is one JSON
object: per policy `live_gpu_s`, `sim_gpu_s`, `ratio` (sim / live), and `migrations` live and simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from _machine import cpu_model  # noqa: E402

from kvfleet.demo.story import (  # noqa: E402
    EPOCH_S,
    KV_CAPACITY_TOKENS,
    OUTPUT_SCALE,
    PROMPT_SCALE,
    SCALE_DOWN_DELAY_S,
    TRACE,
    pool_manifest,
    ready,
)
from kvfleet.localcluster.cluster import Cluster, local_cluster, start_operator, wait_for  # noqa: E402
from kvfleet.localcluster.controlplane import REPO_ROOT, stop_process  # noqa: E402
from kvfleet.replay.cli import add_arguments as add_replay_arguments  # noqa: E402
from kvfleet.replay.cli import prepare, run_replay  # noqa: E402
from kvfleet.replay.observe import PoolObserver  # noqa: E402
from kvfleet.replay.record import Record, write_record  # noqa: E402
from kvfleet.replay.streams import Clock  # noqa: E402
from kvfleet.worker.model.tiny import make_tiny  # noqa: E402

POLICIES = ("mell", "bf")  # the simulator's names; an LLMPool spells them as below
POOL_POLICY = {"mell": "mell", "bf": "best-fit"}


def live_run(cluster: Cluster, model_dir: Path, policy: str, window: str, every: int, out: Path) -> Record:
    """A fresh pool under `policy`, the slice replayed through it, the pool deleted; the record."""
    name = f"svl-{policy}"
    manifest = pool_manifest(model_dir)
    manifest["metadata"]["name"] = name
    manifest["spec"]["scheduling"]["policy"] = POOL_POLICY[policy]
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))
    wait_for(lambda: any(ready(p) for p in cluster.get_json("pods", "-l", f"kvfleet.dev/router={name}")["items"]),
             f"{name}'s router", timeout_s=180, interval_s=0.5)
    wait_for(lambda: any(ready(p) for p in cluster.get_json(
        "pods", "-l", f"kvfleet.dev/pool={name},app.kubernetes.io/component=worker")["items"]),
        f"{name}'s first worker", timeout_s=180, interval_s=0.5)
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    args = parser.parse_args([
        "--pool", name, "--kubeconfig", str(cluster.kubeconfig), "--trace", str(TRACE), "--window", window,
        "--every", str(every), "--prompt-scale", f"{1 / PROMPT_SCALE:g}", "--output-scale", f"{1 / OUTPUT_SCALE:g}",
        "--max-request-tokens", str(KV_CAPACITY_TOKENS - 16), "--drain-timeout-s", "90", "--out", str(out),
        "--no-progress"])
    requests, trace = prepare(args)
    observer = PoolObserver(name, "default", Clock(), kubeconfig=str(cluster.kubeconfig))
    pool, router_url = observer.get_pool(), observer.find_router_url()
    assert pool is not None and router_url is not None
    print(f"# live {policy}: {len(requests)} streams of {window} s of the conversation trace", file=sys.stderr, flush=True)
    record, streams = run_replay(observer, pool, router_url, requests, trace, args)
    write_record(out, record, [(s.sent_s, s.request) for s in streams], observer.profiles)
    cluster.kubectl("delete", "llmpool", name, "--wait=true", "--timeout=120s")
    wait_for(lambda: not cluster.get_json("pods", "-l", f"kvfleet.dev/pool={name}")["items"],
             f"{name}'s pods to go", timeout_s=120, interval_s=0.5)
    return record


def simulated(policy: str, out: Path, scale_up_s: float) -> dict[str, Any]:
    """`kvfleet simulate` on the requests the live run sent, at the speed its workers measured."""
    cmd = [sys.executable, "-m", "kvfleet.cli", "simulate", "--trace", str(out / "sent.csv"),
           "--speed-profile", str(out / "speed-profile.json"), "--policies", policy, "--epoch-s", str(EPOCH_S),
           "--scale-down-delay-s", str(SCALE_DOWN_DELAY_S), "--scale-up-s", f"{scale_up_s:.3f}", "--json",
           "--no-progress"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return dict(json.loads(result.stdout.strip().splitlines()[-1])["policies"][policy])


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 s of the trace instead of 60 s")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "bench" / "sim_vs_live")
    args = parser.parse_args(argv)
    window, every = ("0:20", 3) if args.quick else ("0:60", 3)
    machine = f"{platform.node()} ({cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()})"
    print(f"machine: {machine}; local control plane, builtin workers (tiny model, 1 thread each, 30 ms minimum step)",
          flush=True)
    started = time.monotonic()
    records: dict[str, Record] = {}
    sims: dict[str, dict[str, Any]] = {}
    model_dir = make_tiny(REPO_ROOT / ".cache" / "models" / "tiny")
    with local_cluster(num_nodes=3, gpus_per_node=2, num_zones=2) as cluster:
        operator = start_operator(cluster, lease_duration_s=5)
        try:
            for policy in POLICIES:
                records[policy] = live_run(cluster, model_dir, policy, window, every, args.out / policy)
        finally:
            stop_process(operator)
    instant: dict[str, dict[str, Any]] = {}
    for policy in POLICIES:
        ready_s = records[policy].pod_ready_s.get("median") or 0.0
        sims[policy] = simulated(policy, args.out / policy, ready_s)
        # The same with pods ready at once: how much of the gap is the pods' start.
        instant[policy] = simulated(policy, args.out / policy, 0.0)

    print(f"\n{'policy':<6} {'live GPU-s':>10} {'sim GPU-s':>10} {'sim/live':>8} {'(pods ready at once)':>20} "
          f"{'pod start s':>11} {'live moves':>10} {'failed':>7} {'sim moves':>9} {'peak live/sim':>13} "
          f"{'streams whole':>13}")
    figures: dict[str, Any] = {}
    for policy in POLICIES:
        rec, sim = records[policy], sims[policy]
        sim_gpu_s = sim["billed_gpu_hours"] * 3600.0
        sim_moves = int(sim["num_migrations"])
        ratio = sim_gpu_s / rec.billed_gpu_seconds if rec.billed_gpu_seconds else float("nan")
        moves = rec.migrations
        instant_gpu_s = instant[policy]["billed_gpu_hours"] * 3600.0
        start_s = rec.pod_ready_s.get("median") or 0.0
        print(f"{policy:<6} {rec.billed_gpu_seconds:>10.1f} {sim_gpu_s:>10.1f} {ratio:>8.3f} {instant_gpu_s:>20.1f} "
              f"{start_s:>11.0f} {moves.total:>10} "
              f"{moves.failed:>7} {sim_moves:>9} {rec.peak_gpus_in_use:>6}/{sim['peak_gpus']:<6} "
              f"{rec.streams_whole:>6}/{rec.streams:<6}")
        figures[policy] = {"live_gpu_s": round(rec.billed_gpu_seconds, 1), "sim_gpu_s": round(sim_gpu_s, 1),
                           "ratio": round(ratio, 3), "sim_gpu_s_pods_ready_at_once": round(instant_gpu_s, 1),
                           "pod_start_s": start_s,
                           "migrations": {"live": moves.total, "live_failed": moves.failed, "simulated": sim_moves},
                           "moved_again_within_30s": moves.quick_removes,
                           "streams_whole": rec.streams_whole, "streams": rec.streams,
                           "peak_gpus": {"live": rec.peak_gpus_in_use, "simulated": sim["peak_gpus"]}}
    checks = []
    for policy in POLICIES:
        f = figures[policy]
        checks.append(f"{policy} GPU-s {verdict(abs(f['ratio'] - 1) <= 0.10)} sim/live {f['ratio']:.3f} within 10%")
        live_m, sim_m = f["migrations"]["live"], f["migrations"]["simulated"]
        close = abs(live_m - sim_m) <= 0.2 * max(live_m, sim_m) if max(live_m, sim_m) else True
        checks.append(f"{policy} migrations {verdict(close)} live {live_m} vs simulated {sim_m} within 20%")
    total = sum(figures[p]["migrations"]["live"] for p in POLICIES)
    failed = sum(figures[p]["migrations"]["live_failed"] for p in POLICIES)
    share = failed / total if total else 0.0
    checks.append(f"failed moves {verdict(share <= 0.05)} {failed}/{total} = {share:.1%} <= 5%")
    mell_s, bf_s = figures["mell"]["live_gpu_s"], figures["bf"]["live_gpu_s"]
    checks.append(f"live default vs best-fit {verdict(mell_s <= bf_s)} {mell_s:.1f} <= {bf_s:.1f} GPU-s")
    print("targets: " + "; ".join(checks))
    print(f"(records under {args.out}; {time.monotonic() - started:.0f} s)")
    print(json.dumps({"bench": "sim_vs_live", "window": window, "every": every, "policies": figures,
                      "failed_move_share": round(share, 4), "machine": machine}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
