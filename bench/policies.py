"""GPUs a cloud would bill under every policy, on every workload `kvfleet simulate` knows, and the targets.

    python bench/policies.py             # every scenario in full (about 5 minutes on 2 cores)
    python bench/policies.py --quick     # short slices of the same scenarios, for a smoke run
    python bench/policies.py --tpot-ms 60    # with a TPOT objective (slo.tpotMilliseconds)

Scenarios: both setups (LLaMA-2-13B on A100-40GB, LLaMA-2-7B on RTX 4090) x the Azure conv and code
traces, Poisson arrivals at 0.5 / 0.8 / 1.1 requests/s (MELL §VIII-B lengths x 10), and a generated
long-context workload (3 requests/s, prompts log-normal with mean 12K and p99 85K tokens, outputs
mean 350: about a quarter of the prompts exceed one GPU's C). Policies: kvfleet's default (`mell`),
MELL's Fig. 10 as written (`mell-paper`), and the baselines best-fit, worst-fit and load-balance, all
replayed in the same run with the LLMPool's defaults (60 s scale-down delay, pods ready at once).

The targets of the default policy (what it was built to reach), checked per scenario and printed as PASS or MISS with
the numbers: billed GPU-hours at most the larger of 0.90 x the best baseline's and 1.05 x the shared
bound's; peak GPUs at most the shared bound's peak + 1; no deferred migration, no capacity violation,
and migrations per second at most load-balance's; p99 queueing delay no worse than the best baseline's
(the lowest); with a TPOT objective, p99 TPOT within it. Beside the billed target is what even a perfect
packer of each run's KV would be billed (`own_bound_billed_gpu_hours`, the smallest over the runs): a
target below it is out of reach for any policy whose requests hold that KV.

Prints the machine first; the last line is one JSON object with every scenario's figures. No
assertions: the numbers are the output (tests/unit/test_bench_policies.py runs the quick mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from _machine import cpu_model  # noqa: E402

from kvfleet.mell.cluster import PolicyConfig  # noqa: E402
from kvfleet.mell.policy import policy_class, policy_config  # noqa: E402
from kvfleet.sim import bundled  # noqa: E402
from kvfleet.sim.cli import AZURE_TRACES, PAPER_RATES, SETUPS  # noqa: E402
from kvfleet.sim.result import RunResult  # noqa: E402
from kvfleet.sim.run import simulate  # noqa: E402
from kvfleet.sim.speed_model import Setup, make_setup, tpot_knobs  # noqa: E402
from kvfleet.sim.traces import (  # noqa: E402
    TraceRequest,
    long_context_workload,
    poisson_workload,
    read_trace,
    slice_trace,
)

POLICIES = ("mell", "mell-paper", "bf", "wf", "lb")
BASELINES = ("bf", "wf", "lb")
LONG_CONTEXT_RATE = 3.0
TRACES = bundled.trace_dir()


def workloads(quick: bool) -> list[tuple[str, list[TraceRequest]]]:
    """Full: whole traces, an hour of Poisson arrivals, half an hour of long-context ones. Quick: slices."""
    out: list[tuple[str, list[TraceRequest]]] = []
    for name in AZURE_TRACES:
        reqs = read_trace(TRACES / name)
        out.append((name.replace("AzureLLMInferenceTrace_", "azure-").removesuffix(".csv"),
                    slice_trace(reqs, 600.0, 180.0) if quick else reqs))
    duration_s = 240.0 if quick else 3600.0
    for rate in PAPER_RATES:
        out.append((f"poisson-{rate:g}", poisson_workload(rate, duration_s)))
    out.append(("long-context", long_context_workload(LONG_CONTEXT_RATE, 60.0 if quick else 1800.0)))
    return out


def config_for(setup: Setup, policy: str, tpot_ms: float | None, knobs: dict[str, object]) -> PolicyConfig:
    """`policy`'s config on `setup`: the `--set` knobs it has, and a TPOT objective as the default
    policy's load cap (the only policy that keeps one)."""
    config = policy_config(policy, setup.capacity_bytes)
    own = {f.name for f in dataclasses.fields(config)}
    config = dataclasses.replace(config, **{k: v for k, v in knobs.items() if k in own})  # type: ignore[arg-type]
    if tpot_ms is None or policy != "mell":
        return config
    return dataclasses.replace(config, **tpot_knobs(setup, tpot_ms))


def parse_knobs(settings: list[str]) -> dict[str, object]:
    """`--set name=value` pairs as fields of the policies' configs, each value parsed as its field's
    type; each knob goes to the policies that have it."""
    defaults = {f.name: getattr(config, f.name) for config in (policy_config(p, 1) for p in POLICIES)
                for f in dataclasses.fields(config)}
    knobs: dict[str, object] = {}
    for setting in settings:
        name, sep, text = setting.partition("=")
        if not sep or name not in defaults or name == "capacity_bytes":
            raise SystemExit(f"--set {setting!r}: expected KNOB=VALUE with KNOB a field of a policy's config "
                             f"({', '.join(sorted({policy_class(p).config_type.__name__ for p in POLICIES}))})")
        default = defaults[name]
        if isinstance(default, bool):
            knobs[name] = text.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, str):
            knobs[name] = text
        elif isinstance(default, int) or default is None:
            knobs[name] = int(text)
        else:
            knobs[name] = float(text)
    return knobs


def figures(r: RunResult) -> dict[str, float | int]:
    return {
        "billed_gpu_hours": round(r.billed_gpu_hours, 4),
        "mean_gpus": round(r.mean_gpus, 3),
        "peak_gpus": r.peak_gpus,
        "migrations_per_s": round(r.migrations_per_s, 4),
        "preemptions_per_s": round(r.num_preemptions / r.duration_s, 4) if r.duration_s else 0.0,
        "deferred_migrations": r.num_deferred,
        "capacity_violations": r.num_capacity_violations,
        "queue_p99_s": round(r.queue_p99_s, 3),
        "tpot_p99_ms": round(r.tpot_p99_ms, 2),
        "own_bound_billed_gpu_hours": round(r.own_bound_billed_gpu_hours, 4),
        "own_bound_mean_gpus": round(r.lower_bound_mean, 3),
    }


def targets(runs: dict[str, dict[str, float | int]], shared_gpu_hours: float, shared_peak: int,
            tpot_ms: float | None) -> dict[str, dict[str, object]]:
    """Each target of the default policy: the figure, the limit, and whether it holds."""
    mine = runs["mell"]
    baselines = [b for b in BASELINES if b in runs]
    best_billed = min(float(runs[b]["billed_gpu_hours"]) for b in baselines)
    reach = min(float(r["own_bound_billed_gpu_hours"]) for r in runs.values())
    out: dict[str, dict[str, object]] = {
        "billed": {"value": mine["billed_gpu_hours"], "limit": round(max(0.9 * best_billed, 1.05 * shared_gpu_hours), 4),
                   "best_baseline": best_billed, "vs_best_baseline": round(float(mine["billed_gpu_hours"]) / best_billed, 4),
                   "perfect_packing": reach},
        "peak": {"value": mine["peak_gpus"], "limit": shared_peak + 1},
        "deferred": {"value": mine["deferred_migrations"], "limit": 0},
        "violations": {"value": mine["capacity_violations"], "limit": 0},
        "migrations": {"value": mine["migrations_per_s"], "limit": runs["lb"]["migrations_per_s"]},
        "queue_p99": {"value": mine["queue_p99_s"], "limit": min(float(runs[b]["queue_p99_s"]) for b in baselines)},
    }
    if tpot_ms is not None:
        out["tpot_p99"] = {"value": mine["tpot_p99_ms"], "limit": tpot_ms}
    for check in out.values():
        check["ok"] = float(check["value"]) <= float(check["limit"])  # type: ignore[arg-type]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short slices of every scenario (a smoke run)")
    parser.add_argument("--tpot-ms", type=float, default=None, help="a TPOT objective for every policy")
    parser.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help="a policy knob for every run that has it (e.g. consolidate=false), to measure a rule")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated ({','.join(POLICIES)})")
    args = parser.parse_args()
    knobs = parse_knobs(args.set)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or "mell" not in policies or "lb" not in policies:
        parser.error(f"--policies: mell and lb are needed for the targets, known: {','.join(POLICIES)}")
    machine = f"{platform.node()} ({cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()})"
    print(f"machine: {machine}", flush=True)
    started = time.perf_counter()
    scenarios: list[dict[str, object]] = []
    header = (f"{'setup':9} {'workload':13} {'policy':10} {'billed_h':>9} {'mean':>7} {'peak':>5} {'mig/s':>6} "
              f"{'pre/s':>6} {'defer':>5} {'viol':>4} {'q_p99_s':>7} {'tpot99':>7} {'perfect_h':>9}")
    loads = workloads(args.quick)
    for setup_name, (model, gpu) in SETUPS.items():
        setup = make_setup(setup_name, model, gpu)
        configs = {policy: config_for(setup, policy, args.tpot_ms, knobs) for policy in policies}
        for workload, reqs in loads:
            runs: dict[str, dict[str, float | int]] = {}
            shared = None
            for policy in policies:
                result = simulate(reqs, setup, policy, config=configs[policy])
                runs[policy] = figures(result)
                shared = result.shared_bound
            assert shared is not None
            print(f"\n# {setup_name} {workload}: {len(reqs)} requests, shared bound {shared.gpu_hours:.3f} GPU-h, "
                  f"peak {shared.peak}\n{header}", flush=True)
            for policy, f in runs.items():
                print(f"{setup_name:9} {workload:13} {policy:10} {f['billed_gpu_hours']:9.3f} {f['mean_gpus']:7.2f} "
                      f"{f['peak_gpus']:5d} {f['migrations_per_s']:6.3f} {f['preemptions_per_s']:6.3f} "
                      f"{f['deferred_migrations']:5d} {f['capacity_violations']:4d} {f['queue_p99_s']:7.2f} "
                      f"{f['tpot_p99_ms']:7.1f} {f['own_bound_billed_gpu_hours']:9.3f}")
            checks = targets(runs, shared.gpu_hours, shared.peak, args.tpot_ms)
            print("targets: " + "; ".join(f"{name} {'PASS' if c['ok'] else 'MISS'} {c['value']} <= {c['limit']}"
                                          for name, c in checks.items())
                  + f" (billed {checks['billed']['vs_best_baseline']:.3f} x the best baseline's; perfect packing of "
                    f"these runs: {checks['billed']['perfect_packing']} GPU-h)")
            scenarios.append({"setup": setup_name, "workload": workload, "num_requests": len(reqs),
                              "shared_bound_gpu_hours": round(shared.gpu_hours, 4), "shared_bound_peak": shared.peak,
                              "policies": runs, "targets": checks})
    total_checks = [c for sc in scenarios for c in sc["targets"].values()]  # type: ignore[attr-defined]
    summary = {
        "bench": "policies",
        "machine": machine,
        "quick": args.quick,
        "tpot_ms": args.tpot_ms,
        "knobs": knobs,
        "wall_s": round(time.perf_counter() - started, 1),
        "targets_met": sum(1 for c in total_checks if c["ok"]),
        # The headline ratio: the default's billed GPU-hours over the best baseline's, summed over scenarios.
        "billed_vs_best_baseline": round(
            sum(float(sc["policies"]["mell"]["billed_gpu_hours"]) for sc in scenarios)  # type: ignore[index]
            / sum(float(sc["targets"]["billed"]["best_baseline"]) for sc in scenarios), 4),  # type: ignore[index]
        "targets_total": len(total_checks),
        "scenarios": scenarios,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
