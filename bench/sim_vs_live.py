"""Does the simulator tell the truth about a live pool? The same trace slices, live and simulated.

    python bench/sim_vs_live.py            # three 60 s slices of the Azure conversation trace (about 10 minutes on 2 cores)
    python bench/sim_vs_live.py --runs 3   # each slice live three times, judged on the means (about 30 minutes)
    python bench/sim_vs_live.py --quick    # one 10 s slice, for a smoke run (part of make test)
    python bench/sim_vs_live.py --from-records   # simulate again against the records the live runs left
    python bench/sim_vs_live.py --stacks --runs 3   # today's stack against kvfleet's, live and simulated

On the local control plane (kvfleet.localcluster: fake GPU nodes), a pool of builtin-engine workers
serving the tiny local model replays each slice of the Azure conversation trace through its router
(`kvfleet replay`, shrunk as `make demo` shrinks it), once under kvfleet's default policy and once
under best-fit, each on a fresh pool. Then `kvfleet simulate` replays exactly the requests that were
sent (the record's sent.csv) with the same C, epoch, floor and ceiling (workers.min, workers.max)
and scale-down delay, the pods' start and stop times measured in that run (a pod is billed from its
creation until it is gone: the delay, then its stop), and the speed its workers measured (the
record's speed-profile.json), carried out as the operator and router do (`--execution operator`: a request
whose GPU's pod is starting runs on a Ready worker and is moved later, a request about to finish is
not moved; the plan hears reports an epoch late, `--report-lag-epochs 1`, since a worker reports at
most once an epoch and the operator reads it at its next pass). Beside it, the same simulation carrying out each plan as written (`--execution plan`, as
MELL's simulator does: the request waits for its pod), which shows what modelling the operator buys.

A live run of a slice varies from run to run by about as much as the bands below (two cores shared by
the workers, the operator, the API server and the client: pod starts of 9 to 19 s, 9 to 14 moves for
the same slice), so `--runs N` replays each slice N times (each run's records under run<k>/) and
judges the means over the runs; `--from-records` reads every run<k>/ the last live runs left.

Targets, on every slice (means over the runs): simulated and live billed GPU-seconds within 10% of
each other for both policies, migrations within 20%; on the sum over slices, the live default policy at most best-fit's
live GPU-seconds; failed moves at most 5% of the live moves. Printed as PASS or MISS with the
numbers; no assertions (the numbers are the output; e2e/test_bench_sim_vs_live.py runs the quick
mode, a smoke test of the machinery). The last line is one JSON object: per slice and policy
`live_gpu_s`, `sim_gpu_s`, `ratio` (sim / live), `sim_gpu_s_as_planned`, and `migrations` live and
simulated (both ways).

`--stacks` replays the slices through the two stacks `kvfleet simulate --stack` compares (kvfleet.sim.stacks,
bench/fleet.py) instead of two policies, and judges what the fleet number rests on: the simulator's
ratio kvfleet / today of billed GPU-seconds against the live ratio, within 10% on every slice and on
their sum. **today**: worst-fit (the least-loaded router's placement), no migration, the static KV
capacity. **kvfleet**: the default policy with migration, at the elastic capacity the stacks give
13B on an A100 (C x 1.026, rounded down to whole 16-token blocks), as a fixed capacity. Two things of
the simulated stacks are not live here, and the docstring says so rather than approximate them: the
tiny CPU model's activations are about ten times its KV per token (a 13B model's are a tenth), so a
live elastic pool would gain far more than a GPU's 2.6% (the elastic C formula is checked against the
worker's activation model in tests/sim/test_stacks.py instead); and an HPA on KV usage needs a custom
metrics API the local control plane does not serve, so live today scales as an LLMPool does (a GPU
when a request fits on none, gone the delay after it empties) and the simulator's side runs `wf`
with the same scaling, not the `hpa` policy of the fleet number. Records go under
.cache/bench/sim_vs_live_stacks unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from _machine import cpu_model  # noqa: E402

from kvfleet.api.quantity import quantity_bytes  # noqa: E402
from kvfleet.demo.story import (  # noqa: E402
    EPOCH_S,
    KV_CAPACITY,
    KV_CAPACITY_TOKENS,
    MAX_WORKERS,
    MIN_WORKERS,
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
from kvfleet.sim.cli import SETUPS  # noqa: E402
from kvfleet.sim.stacks import capacity_setup  # noqa: E402
from kvfleet.worker.model.tiny import make_tiny  # noqa: E402


@dataclass(frozen=True)
class Arm:
    """One pool the slices are replayed through live, and what the simulator runs in its place."""

    name: str             # the records' directory and the figures' key
    pool_policy: str      # the LLMPool's spec.scheduling.policy
    sim_policy: str       # `kvfleet simulate --policies`
    capacity_tokens: int  # the pool's kvCapacityPerWorker, in the tiny model's tokens


BLOCK_TOKENS = 16  # the builtin engine's KV block
# The stacks' elastic capacity over their static one, for 13B on an A100 (kvfleet.sim.stacks: 1.026).
ELASTIC_GAIN = (capacity_setup("13b-a100", *SETUPS["13b-a100"], "elastic").capacity_bytes
                / capacity_setup("13b-a100", *SETUPS["13b-a100"], "static").capacity_bytes)
POLICY_ARMS = (Arm("mell", "mell", "mell", KV_CAPACITY_TOKENS), Arm("bf", "best-fit", "bf", KV_CAPACITY_TOKENS))
STACK_ARMS = (Arm("today", "worst-fit", "wf", KV_CAPACITY_TOKENS),
              Arm("kvfleet", "mell", "mell", int(KV_CAPACITY_TOKENS * ELASTIC_GAIN) // BLOCK_TOKENS * BLOCK_TOKENS))
KV_BYTES_PER_TOKEN = quantity_bytes(KV_CAPACITY) // KV_CAPACITY_TOKENS
# Where the slices start in the conversation trace (s): its start, and two later stretches of other load.
SLICE_STARTS_S = (0, 1200, 2400)
# How many epochs late the operator's plan hears a worker's report (simulate --report-lag-epochs): a
# worker writes at most once an epoch (reporter.py) and the operator reads it at its next pass.
REPORT_LAG_EPOCHS = 1


def live_run(cluster: Cluster, model_dir: Path, arm: Arm, window: str, every: int, out: Path, index: int) -> Record:
    """A fresh pool as `arm` says, the slice replayed through it, the pool deleted; the record."""
    name = f"svl-{arm.name}-{index}"
    manifest = pool_manifest(model_dir)
    manifest["metadata"]["name"] = name
    manifest["spec"]["scheduling"]["policy"] = arm.pool_policy
    manifest["spec"]["capacity"]["kvCapacityPerWorker"] = str(arm.capacity_tokens * KV_BYTES_PER_TOKEN)
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
        "--max-request-tokens", str(KV_CAPACITY_TOKENS - BLOCK_TOKENS), "--drain-timeout-s", "90", "--out", str(out),
        "--no-progress"])
    requests, trace = prepare(args)
    observer = PoolObserver(name, "default", Clock(), kubeconfig=str(cluster.kubeconfig))
    pool, router_url = observer.get_pool(), observer.find_router_url()
    assert pool is not None and router_url is not None
    print(f"# live {arm.name}: {len(requests)} streams of {window} s of the conversation trace", file=sys.stderr, flush=True)
    record, streams = run_replay(observer, pool, router_url, requests, trace, args)
    write_record(out, record, [(s.sent_s, s.request) for s in streams], observer.profiles)
    cluster.kubectl("delete", "llmpool", name, "--wait=true", "--timeout=120s")
    wait_for(lambda: not cluster.get_json("pods", "-l", f"kvfleet.dev/pool={name}")["items"],
             f"{name}'s pods to go", timeout_s=120, interval_s=0.5)
    return record


def simulated(policy: str, out: Path, scale_up_s: float, pod_stop_s: float, execution: str) -> dict[str, Any]:
    """`kvfleet simulate` on the requests the live run sent, at the speed its workers measured. A pod is
    billed from its creation until it is gone: the scale-down delay and then its measured stop."""
    cmd = [sys.executable, "-m", "kvfleet.cli", "simulate", "--trace", str(out / "sent.csv"),
           "--speed-profile", str(out / "speed-profile.json"), "--policies", policy, "--epoch-s", str(EPOCH_S),
           "--scale-down-delay-s", f"{SCALE_DOWN_DELAY_S + pod_stop_s:.3f}", "--scale-up-s", f"{scale_up_s:.3f}",
           "--min-workers", str(MIN_WORKERS), "--execution", execution, "--json", "--no-progress"]
    if execution == "operator":
        cmd += ["--max-workers", str(MAX_WORKERS), "--report-lag-epochs", str(REPORT_LAG_EPOCHS)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return dict(json.loads(result.stdout.strip().splitlines()[-1])["policies"][policy])


def compare(rec: dict[str, Any], operated: dict[str, Any], planned: dict[str, Any]) -> dict[str, Any]:
    """One policy on one slice: the live record (its record.json) against simulated (as operated, and as planned)."""
    sim_gpu_s = operated["billed_gpu_hours"] * 3600.0
    live_gpu_s, moves = rec["billedGpuSeconds"], rec["migrations"]
    return {"live_gpu_s": round(live_gpu_s, 1), "sim_gpu_s": round(sim_gpu_s, 1),
            "ratio": round(sim_gpu_s / live_gpu_s, 3) if live_gpu_s else None,
            "sim_gpu_s_as_planned": round(planned["billed_gpu_hours"] * 3600.0, 1),
            "pod_start_s": pod_start_s(rec), "pod_stop_s": pod_stop_s(rec),
            "migrations": {"live": moves["total"], "live_failed": moves["failed"],
                           "simulated": int(operated["num_migrations"]),
                           "simulated_as_planned": int(planned["num_migrations"])},
            "moved_again_within_30s": moves["movedAgainWithin30s"],
            "streams_whole": rec["streamsWhole"], "streams": rec["streams"],
            "peak_gpus": {"live": rec["peakGpusInUse"], "simulated": operated["peak_gpus"]},
            "timing_s": timing(rec, operated)}


def timing(rec: dict[str, Any], operated: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Where the simulated requests' times part from the live streams' (s): the first token at p90,
    the whole stream (send to last token) at p50 and p90, and when the last stream ended. A record from
    before these were measured gives None for the live side."""
    def ms(key: str, q: str) -> float | None:
        value = (rec.get(key) or {}).get(q)
        return None if value is None else round(value / 1000.0, 2)

    last = rec.get("lastStreamEndSeconds")
    return {"ttft_p90": {"live": ms("ttftMs", "p90"), "simulated": round(operated["ttft_p90_s"], 2)},
            "jct_p50": {"live": ms("jctMs", "p50"), "simulated": round(operated["jct_p50_s"], 2)},
            "jct_p90": {"live": ms("jctMs", "p90"), "simulated": round(operated["jct_p90_s"], 2)},
            "last_end": {"live": None if last is None else round(float(last), 2),
                         "simulated": round(operated["last_finish_s"], 2)}}


def pod_start_s(rec: dict[str, Any]) -> float:
    return float((rec.get("podReadySeconds") or {}).get("median") or 0.0)


def pod_stop_s(rec: dict[str, Any]) -> float:
    """The median pod's stop (delete call to gone); 0 for a record that did not measure it."""
    return float((rec.get("podStopSeconds") or {}).get("median") or 0.0)


TIMING = ("ttft_p90", "jct_p50", "jct_p90", "last_end")


def run_dirs(out: Path) -> list[Path]:
    """The live runs' record directories under `out` (run0, run1, ...); `out` itself for records written
    before runs were numbered."""
    numbered = sorted((d for d in out.glob("run*") if d.name[3:].isdigit()), key=lambda d: int(d.name[3:]))
    return numbered or ([out] if (out / "slice0").is_dir() else [])


def print_row(label: str, arm: str, f: dict[str, Any]) -> None:
    moves = f["migrations"]
    pods = f"{f['pod_start_s']:.0f}/{f['pod_stop_s']:.1f}"
    print(f"{label:<12} {arm:<7} {f['live_gpu_s']:>10.1f} {f['sim_gpu_s']:>10.1f} {f['ratio'] or float('nan'):>8.3f} "
          f"{f['sim_gpu_s_as_planned']:>12.1f} {pods:>16} {moves['live']:>10g} "
          f"{moves['live_failed']:>7g} {moves['simulated']:>9g} {moves['simulated_as_planned']:>12g} "
          f"{f['peak_gpus']['live']:>6}/{f['peak_gpus']['simulated']:<6} {f['streams_whole']:>6}/{f['streams']:<6}")


def mean_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One slice and policy over the live runs: the means the targets judge (the ratio is of the
    means), every stream of every run, the highest peaks; each run's GPU-seconds and moves beside."""
    if len(runs) == 1:
        return {**runs[0], "runs": 1}

    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 1)

    def mean_or_none(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return round(sum(known) / len(known), 2) if len(known) == len(values) else None

    live, sim = mean([f["live_gpu_s"] for f in runs]), mean([f["sim_gpu_s"] for f in runs])
    return {"live_gpu_s": live, "sim_gpu_s": sim, "ratio": round(sim / live, 3) if live else None,
            "sim_gpu_s_as_planned": mean([f["sim_gpu_s_as_planned"] for f in runs]),
            "pod_start_s": mean([f["pod_start_s"] for f in runs]), "pod_stop_s": mean([f["pod_stop_s"] for f in runs]),
            "migrations": {k: mean([f["migrations"][k] for f in runs]) for k in runs[0]["migrations"]},
            "moved_again_within_30s": mean([f["moved_again_within_30s"] for f in runs]),
            "streams_whole": sum(f["streams_whole"] for f in runs), "streams": sum(f["streams"] for f in runs),
            "peak_gpus": {side: max(f["peak_gpus"][side] for f in runs) for side in ("live", "simulated")},
            "timing_s": {k: {side: mean_or_none([f["timing_s"][k][side] for f in runs]) for side in ("live", "simulated")}
                         for k in TIMING},
            "runs": len(runs),
            "per_run": [{"live_gpu_s": f["live_gpu_s"], "sim_gpu_s": f["sim_gpu_s"], "migrations": f["migrations"]}
                        for f in runs]}


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def within(a: float, b: float, share: float) -> bool:
    return abs(a - b) <= share * max(a, b) if max(a, b) else True


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def policy_checks(slices: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The policy comparison's targets (module docstring) and its figures for the JSON line."""
    checks: list[str] = []
    for sl in slices:
        for policy, f in sl["policies"].items():
            moves = f["migrations"]
            ratio = f["ratio"] if f["ratio"] is not None else float("nan")
            checks.append(f"{sl['window']} {policy} GPU-s {verdict(abs(ratio - 1) <= 0.10)} sim/live {ratio:.3f} within 10%")
            checks.append(f"{sl['window']} {policy} migrations {verdict(within(moves['live'], moves['simulated'], 0.2))} "
                          f"live {moves['live']:g} vs simulated {moves['simulated']:g} within 20%")
    names = [arm.name for arm in POLICY_ARMS]
    total = sum(sl["policies"][p]["migrations"]["live"] for sl in slices for p in names)
    failed = sum(sl["policies"][p]["migrations"]["live_failed"] for sl in slices for p in names)
    share = failed / total if total else 0.0
    checks.append(f"failed moves {verdict(share <= 0.05)} {failed:g}/{total:g} = {share:.1%} <= 5%")
    live_sum = {p: round(sum(sl["policies"][p]["live_gpu_s"] for sl in slices), 1) for p in names}
    checks.append(f"live default vs best-fit over the slices {verdict(live_sum['mell'] <= live_sum['bf'])} "
                  f"{live_sum['mell']:.1f} <= {live_sum['bf']:.1f} GPU-s")
    return checks, {"live_gpu_s_sum": live_sum, "failed_move_share": round(share, 4)}


def stack_ratio(live_today: float, live_kvfleet: float, sim_today: float, sim_kvfleet: float) -> dict[str, float | None]:
    """kvfleet's billed GPU-seconds over today's, live and simulated, and the one over the other."""
    live = live_kvfleet / live_today if live_today else None
    sim = sim_kvfleet / sim_today if sim_today else None
    return {"live": None if live is None else round(live, 4), "simulated": None if sim is None else round(sim, 4),
            "sim_over_live": None if live is None or sim is None else round(sim / live, 4)}


def stack_checks(slices: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The stacks' target: the simulated ratio kvfleet / today within 10% of the live one, on every
    slice (means over the runs) and on the sum over the slices."""
    checks: list[str] = []

    def check(label: str, ratio: dict[str, float | None]) -> None:
        r = ratio["sim_over_live"]
        ok = r is not None and abs(r - 1) <= 0.10
        checks.append(f"{label} kvfleet/today {verdict(ok)} simulated {ratio['simulated']} vs live {ratio['live']} "
                      f"({'-' if r is None else f'{r:.3f}'}) within 10%")

    for sl in slices:
        today, kvfleet = sl["policies"]["today"], sl["policies"]["kvfleet"]
        sl["stack_ratio"] = stack_ratio(today["live_gpu_s"], kvfleet["live_gpu_s"], today["sim_gpu_s"], kvfleet["sim_gpu_s"])
        check(sl["window"], sl["stack_ratio"])
    sums = {side: {arm: sum(sl["policies"][arm][f"{side}_gpu_s"] for sl in slices) for arm in ("today", "kvfleet")}
            for side in ("live", "sim")}
    overall = stack_ratio(sums["live"]["today"], sums["live"]["kvfleet"], sums["sim"]["today"], sums["sim"]["kvfleet"])
    check("all slices", overall)
    return checks, {"stack_ratio": overall,
                    "live_gpu_s_sum": {arm: round(v, 1) for arm, v in sums["live"].items()},
                    "sim_gpu_s_sum": {arm: round(v, 1) for arm, v in sums["sim"].items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 10 s slice instead of three of 60 s")
    parser.add_argument("--stacks", action="store_true",
                        help="today's stack against kvfleet's (module docstring) instead of the default policy against best-fit")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the records go (.cache/bench/sim_vs_live, or sim_vs_live_stacks with --stacks)")
    parser.add_argument("--from-records", action="store_true",
                        help="no live runs: simulate again against the records the last live runs left under --out")
    parser.add_argument("--runs", type=int, default=1,
                        help="replay each slice this many times live and judge the means (1; a run varies by about "
                             "the bands judged)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    arms = STACK_ARMS if args.stacks else POLICY_ARMS
    out_dir: Path = args.out or REPO_ROOT / ".cache" / "bench" / ("sim_vs_live_stacks" if args.stacks else "sim_vs_live")
    every = 3
    windows = ["0:10"] if args.quick else [f"{start}:60" for start in SLICE_STARTS_S]
    machine = f"{platform.node()} ({cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()})"
    print(f"machine: {machine}; local control plane, builtin workers (tiny model, 1 thread each, 30 ms minimum step)",
          flush=True)
    print("arms: " + "; ".join(f"{a.name} = live {a.pool_policy} / simulated {a.sim_policy}, C {a.capacity_tokens} tokens"
                               for a in arms), flush=True)
    started = time.monotonic()
    if not args.from_records:
        for stale in run_dirs(out_dir):  # the records of earlier live runs: these runs replace them
            if stale != out_dir:
                shutil.rmtree(stale)
        model_dir = make_tiny(REPO_ROOT / ".cache" / "models" / "tiny")
        with local_cluster(num_nodes=3, gpus_per_node=2, num_zones=2) as cluster:
            operator = start_operator(cluster, lease_duration_s=5)
            try:
                for run in range(args.runs):
                    for index, window in enumerate(windows):
                        for arm in arms:
                            out = out_dir / f"run{run}" / f"slice{index}" / arm.name
                            live_run(cluster, model_dir, arm, window, every, out, index)
            finally:
                stop_process(operator)
    runs = run_dirs(out_dir)
    if not runs:
        print(f"no records under {out_dir}: run without --from-records first", file=sys.stderr)
        return 2
    print(f"{len(runs)} live run(s) of each slice under {out_dir}", flush=True)

    slices: list[dict[str, Any]] = []
    print(f"\n{'slice':<12} {'arm':<7} {'live GPU-s':>10} {'sim GPU-s':>10} {'sim/live':>8} {'(as planned)':>12} "
          f"{'pod start/stop s':>16} {'live moves':>10} {'failed':>7} {'sim moves':>9} {'(as planned)':>12} "
          f"{'peak live/sim':>13} {'streams whole':>13}")
    for index, window in enumerate(windows):
        figures: dict[str, Any] = {}
        for arm in arms:
            per_run = []
            for k, run_dir in enumerate(runs):
                out = run_dir / f"slice{index}" / arm.name
                rec = json.loads((out / "record.json").read_text())
                start_s, stop_s = pod_start_s(rec), pod_stop_s(rec)
                per_run.append(compare(rec, simulated(arm.sim_policy, out, start_s, stop_s, "operator"),
                                       simulated(arm.sim_policy, out, start_s, stop_s, "plan")))
                if len(runs) > 1:
                    print_row(f"{window} r{k}", arm.name, per_run[-1])
            figures[arm.name] = mean_figures(per_run)
            print_row(window if len(runs) == 1 else f"{window} mean", arm.name, figures[arm.name])
        slices.append({"window": window, "policies": figures})
    print(f"\n{'slice':<8} {'arm':<7} " + " ".join(f"{name + ' live/sim s':>20}" for name in TIMING))
    for sl in slices:
        for name, f in sl["policies"].items():
            cells = [f"{fmt(f['timing_s'][k]['live'])}/{fmt(f['timing_s'][k]['simulated'])}" for k in TIMING]
            print(f"{sl['window']:<8} {name:<7} " + " ".join(f"{c:>20}" for c in cells))
    checks, totals = stack_checks(slices) if args.stacks else policy_checks(slices)
    misses = sum(1 for c in checks if " MISS " in c)
    print("targets: " + "; ".join(checks))
    print(f"{len(checks) - misses} of {len(checks)} targets met (records under {out_dir}; {time.monotonic() - started:.0f} s)")
    print(json.dumps({"bench": "sim_vs_live", "mode": "stacks" if args.stacks else "policies", "every": every,
                      "runs": len(runs), "slices": slices, **totals, "targets_met": len(checks) - misses,
                      "targets": len(checks), "machine": machine}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
