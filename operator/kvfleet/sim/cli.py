"""`kvfleet simulate`: replay workloads under MELL and the baselines and say how many GPUs each needs.

Without workload flags it runs the paper's evaluation (§VIII): both Azure traces and Poisson arrivals
at lambda 0.5 / 0.8 / 1.1 with LMSYS/WildChat-like lengths scaled x10, on both setups (LLaMA-2-13B on
A100-40GB, LLaMA-2-7B on RTX 4090-24GB), under MELL, BF, WF and LB. With `--disaggregation 1P2D,...` it
replays each workload on disaggregated prefill/decode pools beside colocated serving instead
(kvfleet.sim.disaggregation, kvfleet.sim.pd_report).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.mell.cluster import PolicyConfig
from kvfleet.mell.mell_default import MellDefaultConfig
from kvfleet.mell.policy import policy_config
from kvfleet.sim import bundled, pd_report
from kvfleet.sim.bundled import AZURE_TRACES
from kvfleet.sim.disaggregation import DEFAULT_LINK_GBPS, PdCaching, PdSplit, simulate_disaggregated
from kvfleet.sim.hardware import A100_40GB, GIB, LLAMA2_7B, LLAMA2_13B, RTX4090_24GB
from kvfleet.sim.pd_report import PdComparison
from kvfleet.sim.prefix_cache import PrefixCacheSpec
from kvfleet.sim.profile import ProfileError, ProfileSpeed, load_profile
from kvfleet.sim.report import Scenario, plot, table, to_csv
from kvfleet.sim.result import RunResult
from kvfleet.sim.run import DEFAULT_SCALE_DOWN_DELAY_S, EXECUTIONS, simulate
from kvfleet.sim.speed_model import Setup, make_setup, profile_setup, tpot_knobs
from kvfleet.sim.stacks import DEFAULT_HPA_TARGET, STACKS, Stack, StackRun, parse_stacks, prepare
from kvfleet.sim.traces import (
    DEFAULT_HASH_BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    long_context_workload,
    poisson_workload,
    read_trace,
    slice_trace,
)

POLICY_NAMES = ("mell", "mell-paper", "bf", "wf", "lb")
SETUPS = {
    "13b-a100": (LLAMA2_13B, A100_40GB),
    "7b-4090": (LLAMA2_7B, RTX4090_24GB),
}
PAPER_RATES = (0.5, 0.8, 1.1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    wl = parser.add_argument_group("workloads (default: both Azure traces and Poisson 0.5/0.8/1.1)")
    wl.add_argument("--trace", action="append", type=Path, default=[], metavar="FILE",
                    help="an Azure-format CSV, a CSV with timestamp/prompt/output columns, or JSONL "
                         "with timestamp (ms), input_length, output_length and optionally hash_ids (Mooncake's "
                         "prompt block hashes); repeatable")
    wl.add_argument("--hash-block-tokens", type=int, default=DEFAULT_HASH_BLOCK_TOKENS, metavar="N",
                    help=f"prompt tokens per hash_ids block of JSONL traces ({DEFAULT_HASH_BLOCK_TOKENS}, as Mooncake's)")
    wl.add_argument("--azure", action="store_true", help="both Azure traces from --trace-dir")
    wl.add_argument("--mooncake", action="store_true",
                    help="Mooncake's conversation trace (kvfleet ships it: an hour, 12,031 requests, with the prompt "
                         "block hashes --prefix-cache matches)")
    wl.add_argument("--trace-dir", type=Path, default=None,
                    help="where the Azure traces are (default: $KVFLEET_TRACES, else the copies kvfleet ships)")
    wl.add_argument("--poisson", action="append", type=float, default=[], metavar="RATE",
                    help="Poisson arrivals at RATE requests/s; repeatable")
    wl.add_argument("--duration-s", type=float, default=3600.0, help="length of Poisson workloads (3600)")
    wl.add_argument("--lengths", choices=("mixed", "lmsys", "wildchat"), default="mixed",
                    help="length distribution of Poisson workloads (mixed)")
    wl.add_argument("--length-scale", type=float, default=10.0,
                    help="multiply Poisson lengths by this (10, as MELL §VIII-B)")
    wl.add_argument("--trace-length-scale", type=float, default=1.0,
                    help="multiply trace lengths by this (1: real lengths)")
    wl.add_argument("--window", default=None, metavar="START:DURATION",
                    help="replay only this window of each trace, in seconds")
    wl.add_argument("--seed", type=int, default=0, help="seed of the synthetic workloads (0)")
    wl.add_argument("--max-context-tokens", type=int, default=None, metavar="N",
                    help="refuse a trace with a request whose prompt + output exceed N tokens (the model's context); "
                         "by default any length is replayed, requests larger than C spanning GPUs")
    wl.add_argument("--long-context", action="append", type=float, default=[], metavar="RATE",
                    help="generated long-context arrivals at RATE requests/s (prompts mean 12K, p99 85K tokens); "
                         "repeatable")
    parser.add_argument("--setup", action="append", choices=(*SETUPS, "all"), default=[],
                        help="model on GPU; repeatable (default: all)")
    parser.add_argument("--activation-reserve-gib", type=float, default=None,
                        help="memory kept for activations (default: 10%% of GPU memory)")
    parser.add_argument("--speed-profile", type=Path, default=None, metavar="FILE",
                        help="replay at the speed workers measured (a SpeedProfile JSON, as `kvfleet replay` "
                             "writes it) instead of a --setup's GPU model: one setup, profile-<model>, with the "
                             "profile's C")
    parser.add_argument("--policies", default=None,
                        help=f"comma-separated, from {','.join(POLICY_NAMES)} (all; mell with --disaggregation): mell "
                             "is kvfleet's default, mell-paper MELL's Fig. 10 as written")
    parser.add_argument("--stack", default=None, metavar="STACKS",
                        help=f"replay whole serving stacks instead of policies, comma-separated from {','.join(STACKS)} "
                             "(e.g. today,kvfleet): each a policy, a KV capacity (vLLM's static split or elastic "
                             "memory) and a scaling rule; docs/simulator.md, 'Two stacks'")
    parser.add_argument("--hpa-target", type=float, default=DEFAULT_HPA_TARGET,
                        help="with --stack today: the KV-usage target its HorizontalPodAutoscaler keeps "
                             f"({DEFAULT_HPA_TARGET:g})")
    parser.add_argument("--epoch-s", type=float, default=1.0, help="scheduling epoch (1.0 s)")
    parser.add_argument("--paper-strict", action="store_true",
                        help="run MELL exactly as Fig. 10 (mell-paper) in place of kvfleet's default (mell)")
    parser.add_argument("--headroom", type=float, default=None,
                        help="share of C the default policy keeps free for growth "
                             f"({MellDefaultConfig.headroom_fraction:g})")
    parser.add_argument("--scale-up-s", type=float, default=0.0,
                        help="seconds a new worker pod takes to be ready (0); set it to your cloud's node + pod "
                             "start, e.g. 60")
    parser.add_argument("--min-workers", type=int, default=0,
                        help="the LLMPool's workers.min: pods that run, ready and billed, from start to end (0)")
    parser.add_argument("--max-workers", type=int, default=None,
                        help="the LLMPool's workers.max: no more pods than this (with --execution operator)")
    parser.add_argument("--scale-down-delay-s", type=float, default=DEFAULT_SCALE_DOWN_DELAY_S,
                        help="seconds an emptied worker pod stays, warm and billed, before it is deleted "
                             f"({DEFAULT_SCALE_DOWN_DELAY_S:g}, the LLMPool default)")
    parser.add_argument("--tpot-ms", type=float, default=None,
                        help="a TPOT objective (the LLMPool's slo.tpotMilliseconds): the default policy never packs "
                             "a GPU past the load whose decode step would break it")
    parser.add_argument("--lookahead-epochs", type=float, default=1.0,
                        help="what the scheduler is told a request holds: its KV blocks plus what it can write in "
                             "this many epochs at the fastest decode speed (1; 0 is what a live pool's workers "
                             "report, the KV they hold)")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="model a prefix cache on every worker (MemServe §4): the prompt blocks (trace hash_ids) of "
                             "finished requests stay in free KV memory, and a request prefills only the leading blocks "
                             "its GPU does not hold; reports the hit ratio and prefill tokens saved")
    parser.add_argument("--prefix-host-gib", type=float, default=0.0, metavar="GIB",
                        help="with --prefix-cache: host memory per worker for blocks evicted from the GPU (MemServe's "
                             "swap_out/swap_in; the builtin engine's CPU buffer); a hit there is copied back at "
                             "--host-link-gbps instead of prefilled (0: none)")
    parser.add_argument("--host-link-gbps", type=float, default=200.0,
                        help="the host link a host-tier hit is copied back over, Gb/s (200: PCIe 4.0 x16's 25 GB/s)")
    parser.add_argument("--prefix-routing", choices=("none", "prompt-tree"), default="none",
                        help="with --prefix-cache: none (default), placement does not know the caches; prompt-tree, "
                             "a request goes to the GPU holding the longest prefix of its prompt that has room for it "
                             "(a pool router's MemServe §6 routing; the default policy only, --execution plan)")
    parser.add_argument("--execution", choices=EXECUTIONS, default="plan",
                        help="plan (default): carry out each plan as written, as MELL's simulator does (a request "
                             "whose GPU's pod starts waits for it); operator: as kvfleet's router and operator do (it "
                             "runs on a Ready worker meanwhile and is moved once the pod is ready, a request about to "
                             "finish is not moved, a worker that still holds requests is kept); with --scale-up-s, "
                             "operator is what a live pool bills")
    parser.add_argument("--report-lag-epochs", type=int, default=0,
                        help="with --execution operator: the plan hears each epoch's arrivals, growths and finishes "
                             "this many epochs late, as a live operator reads workers' reports (1 there: one report "
                             "a worker an epoch, read at the next pass); the router places new requests meanwhile (0)")
    parser.add_argument("--no-batching", action="store_true",
                        help="schedule every request operation on its own, without MELL's request operation "
                             "batching (Fig. 13): run once with and once without to see the moves it saves")
    pd = parser.add_argument_group("disaggregated prefill/decode pools (MemServe §5)")
    pd.add_argument("--disaggregation", default=None, metavar="SPLITS",
                    help="replay each workload on disaggregated pools, e.g. 1P2D (1 prefill, 2 decode GPUs) or a "
                         "comma list 1P2D,2P2D, beside colocated serving of the same trace; one policy (mell unless "
                         "--policies names another) packs the decode GPUs and the colocated ones")
    pd.add_argument("--pd-caching", choices=(*(m.value for m in PdCaching), "all"), default=None,
                    help="what each role caches over the trace's hash_ids: none (PD-Basic), prefill (at the prefill "
                         "GPU), decode (also at the decode GPU: only blocks it lacks are sent), full (also the answer "
                         "sent back to the prefill GPU), all (a row each); default none")
    pd.add_argument("--link-gbps", type=float, default=None,
                    help=f"prefill-to-decode link speed in Gb/s ({DEFAULT_LINK_GBPS:g}: one 200 Gb/s NIC per GPU, as a "
                         "DGX A100 has)")
    out = parser.add_argument_group("output")
    out.add_argument("--csv", type=Path, default=None, metavar="FILE", help="write the table as CSV ('-': stdout)")
    out.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write Fig. 11/12/14/15-style PNGs")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def _workloads(args: argparse.Namespace) -> list[tuple[str, list[TraceRequest]]]:
    traces: list[Path] = list(args.trace)
    rates: list[float] = list(args.poisson)
    long_rates: list[float] = list(args.long_context)
    if args.azure or (not traces and not rates and not long_rates and not args.mooncake):
        trace_dir = args.trace_dir or bundled.trace_dir()
        traces += [trace_dir / name for name in AZURE_TRACES]
    if args.mooncake:
        traces.append(bundled.mooncake_conversation())
    if not args.trace and not args.poisson and not args.azure and not long_rates and not args.mooncake:
        rates = list(PAPER_RATES)
    window: tuple[float, float] | None = None
    if args.window:
        try:
            start, dur = (float(x) for x in args.window.split(":"))
        except ValueError:
            raise TraceError(f"--window {args.window!r}: expected START:DURATION in seconds") from None
        window = (start, dur)
    out: list[tuple[str, list[TraceRequest]]] = []
    if args.max_context_tokens is not None and args.max_context_tokens <= 0:
        raise TraceError(f"--max-context-tokens {args.max_context_tokens}: must be positive")
    if args.hash_block_tokens <= 0:
        raise TraceError(f"--hash-block-tokens {args.hash_block_tokens}: must be positive")
    if args.prefix_cache and args.trace_length_scale != 1.0:
        # Scaled lengths no longer match the blocks the trace hashed.
        raise TraceError("--trace-length-scale cannot be used with --prefix-cache: hash_ids describe the real prompts")
    if args.pd_caching not in (None, "none") and args.trace_length_scale != 1.0:
        raise TraceError("--trace-length-scale cannot be used with --pd-caching: hash_ids describe the real prompts")
    for path in traces:
        reqs = read_trace(path, args.max_context_tokens, args.hash_block_tokens)
        if window:
            reqs = slice_trace(reqs, *window)
            if not reqs:
                raise TraceError(f"{path}: no requests in window {args.window}")
        if args.trace_length_scale != 1.0:
            k = args.trace_length_scale
            reqs = [TraceRequest(r.request_id, r.arrival_s, max(1, round(r.prompt_tokens * k)),
                                 max(1, round(r.output_tokens * k))) for r in reqs]
        name = ("mooncake-conv" if path == bundled.mooncake_conversation()
                else path.stem.replace("AzureLLMInferenceTrace_", "azure-"))
        out.append((name, reqs))
    for rate in rates:
        if rate <= 0:
            raise TraceError(f"--poisson {rate}: the rate must be positive")
        reqs = poisson_workload(rate, args.duration_s, args.lengths, args.length_scale, args.seed)
        out.append((f"poisson-{rate:g}", reqs))
    for rate in long_rates:
        if rate <= 0:
            raise TraceError(f"--long-context {rate}: the rate must be positive")
        out.append((f"long-context-{rate:g}", long_context_workload(rate, args.duration_s, args.seed)))
    return out


class _UsageError(ValueError):
    """A flag the simulator cannot run with; `run` prints it and exits 2, as argparse would."""


def run(args: argparse.Namespace) -> int:
    try:
        workloads = _workloads(args)
        stacks = _stacks(args)
        policies = _policies(args)
        setups = _setups(args)
        if args.epoch_s <= 0:
            raise _UsageError("--epoch-s must be positive")
        if not args.lookahead_epochs >= 0:
            raise _UsageError("--lookahead-epochs must be >= 0")
        if not args.scale_up_s >= 0:  # written so that NaN is refused too
            raise _UsageError("--scale-up-s must be >= 0")
        if not args.scale_down_delay_s >= 0:
            raise _UsageError("--scale-down-delay-s must be >= 0")
        if args.min_workers < 0:
            raise _UsageError("--min-workers must be >= 0")
        if args.max_workers is not None and (args.execution != "operator" or args.max_workers < max(1, args.min_workers)):
            raise _UsageError("--max-workers needs --execution operator and at least max(1, --min-workers)")
        if args.report_lag_epochs < 0 or (args.report_lag_epochs and args.execution != "operator"):
            raise _UsageError("--report-lag-epochs needs --execution operator and must be >= 0")
        if args.execution == "operator" and args.no_batching:
            raise _UsageError("--execution operator schedules each epoch as one batch, as the operator does: "
                              "drop --no-batching")
        if not args.prefix_host_gib >= 0 or not args.host_link_gbps > 0:
            raise _UsageError("--prefix-host-gib must be >= 0 and --host-link-gbps positive")
        if args.prefix_host_gib and not args.prefix_cache:
            raise _UsageError("--prefix-host-gib needs --prefix-cache")
        if args.prefix_routing != "none":
            if not args.prefix_cache:
                raise _UsageError("--prefix-routing needs --prefix-cache")
            if args.execution != "plan":
                raise _UsageError("--prefix-routing prompt-tree is modelled with --execution plan only")
            if stacks:
                raise _UsageError("--stack sets each stack's routing: drop --prefix-routing")
        disaggregation = _disaggregation(args, policies)
        # Before any replay, so a TPOT objective no GPU can meet is refused at once.
        configs = [_policy_configs(args, setup, policies) for setup in setups]
    except (TraceError, _UsageError) as err:
        print(f"kvfleet simulate: error: {err}", file=sys.stderr)
        return 2
    if disaggregation is not None:
        _run_disaggregation(args, disaggregation, setups, configs, workloads)
        return 0
    if stacks:
        try:
            runs = [_stack_run(args, setup.name, stack) for setup in setups for stack in stacks]
        except _UsageError as err:
            print(f"kvfleet simulate: error: {err}", file=sys.stderr)
            return 2
        bar = None if args.no_progress else _progress_bar(args.epoch_s, workloads, len(runs) // len(setups))
        _write_outputs(args, _run_stacks(args, runs, setups, workloads, bar))
        if bar is not None:
            bar.close()
        return 0
    bar = None if args.no_progress else _progress_bar(args.epoch_s, workloads, len(setups) * len(policies))
    scenarios = [scenario for setup, config in zip(setups, configs)
                 for scenario in _run_setup(args, setup, config, workloads, policies, bar)]
    if bar is not None:
        bar.close()
    _write_outputs(args, scenarios)
    return 0


@dataclass(frozen=True)
class _PdPlan:
    """What `--disaggregation` asks for: the splits, the caching modes (a row each) and the link."""

    splits: tuple[PdSplit, ...]
    modes: tuple[PdCaching, ...]
    link_bytes_per_s: float


def _disaggregation(args: argparse.Namespace, policies: list[str]) -> _PdPlan | None:
    """The --disaggregation run asked for, checked before any replay; None without the flag."""
    if args.disaggregation is None:
        for flag, value in (("--pd-caching", args.pd_caching), ("--link-gbps", args.link_gbps)):
            if value is not None:
                raise _UsageError(f"{flag} needs --disaggregation")
        return None
    try:
        splits = tuple(dict.fromkeys(PdSplit.parse(x) for x in args.disaggregation.split(",") if x.strip()))
    except ValueError as err:
        raise _UsageError(f"--disaggregation: {err}") from None
    if not splits:
        raise _UsageError("--disaggregation: name at least one split, e.g. 1P2D")
    if len(policies) != 1:
        raise _UsageError("--disaggregation packs the decode GPUs with one policy: give one with --policies (e.g. mell)")
    for flag, given in (("--prefix-cache", args.prefix_cache), ("--no-batching", args.no_batching),
                        ("--plot", args.plot is not None)):
        if given:
            raise _UsageError(f"{flag} cannot be used with --disaggregation"
                              + (" (--pd-caching sets the caching of both)" if flag == "--prefix-cache" else ""))
    link_gbps = DEFAULT_LINK_GBPS if args.link_gbps is None else args.link_gbps
    if not link_gbps > 0:
        raise _UsageError("--link-gbps must be positive")
    mode = args.pd_caching or "none"
    modes = tuple(PdCaching) if mode == "all" else (PdCaching(mode),)
    return _PdPlan(splits, modes, link_gbps * 1e9 / 8)


def _run_disaggregation(args: argparse.Namespace, pd: _PdPlan, setups: list[Setup],
                        configs: list[dict[str, PolicyConfig]], workloads: list[tuple[str, list[TraceRequest]]]) -> None:
    """Each workload on each setup: the colocated replay (without, and where a mode caches with, the
    prefix cache model) and every split under every caching mode; one table (or JSON object)."""
    comparisons: list[PdComparison] = []
    for setup, config in zip(setups, configs):
        if not args.json:
            print(_capacity_line(setup), file=sys.stderr)
        (policy, cfg), = config.items()  # `_disaggregation` allowed one policy
        for wname, reqs in workloads:
            colocated: list[RunResult] = []
            caches = [False] * (PdCaching.NONE in pd.modes) + [True] * any(m.caches_at_prefill for m in pd.modes)
            for cache in caches:
                colocated.append(simulate(reqs, setup, policy, args.epoch_s, cfg, lookahead_epochs=args.lookahead_epochs,
                                          scale_up_s=args.scale_up_s, scale_down_delay_s=args.scale_down_delay_s,
                                          prefix_cache=PrefixCacheSpec(args.hash_block_tokens) if cache else None,
                                          execution=args.execution, min_workers=args.min_workers,
                                          max_workers=args.max_workers, report_lag_epochs=args.report_lag_epochs))
            runs = [simulate_disaggregated(reqs, setup, split, mode, pd.link_bytes_per_s, policy, args.epoch_s, cfg,
                                           args.lookahead_epochs, args.hash_block_tokens)
                    for split in pd.splits for mode in pd.modes]
            comparisons.append(PdComparison(setup.name, wname, len(reqs), tuple(colocated), tuple(runs)))
    if args.json:
        print(json.dumps(pd_report.to_json(comparisons)))
    else:
        print(pd_report.table(comparisons))
    if args.csv is not None:
        text = pd_report.to_csv(comparisons)
        if str(args.csv) == "-":
            sys.stdout.write(text)
        else:
            args.csv.write_text(text)


def _stacks(args: argparse.Namespace) -> list[Stack]:
    """The --stack choices, checked before any replay; [] without the flag."""
    if args.stack is None:
        return []
    for flag, given in (("--policies", args.policies is not None), ("--paper-strict", args.paper_strict),
                        ("--disaggregation", args.disaggregation is not None),
                        ("--speed-profile", args.speed_profile is not None),
                        ("--activation-reserve-gib", args.activation_reserve_gib is not None),
                        ("--headroom", args.headroom is not None)):
        if given:
            raise _UsageError(f"--stack sets each stack's policy and capacity: drop {flag}")
    if not 0 < args.hpa_target <= 1:
        raise _UsageError("--hpa-target must be in (0, 1]")
    try:
        return parse_stacks(args.stack)
    except ValueError as err:
        raise _UsageError(f"--stack: {err}") from None


def _stack_run(args: argparse.Namespace, setup_name: str, stack: Stack) -> StackRun:
    model, gpu = SETUPS[setup_name]
    try:
        return prepare(stack, setup_name, model, gpu, scale_down_delay_s=args.scale_down_delay_s,
                       hpa_target=args.hpa_target, tpot_ms=args.tpot_ms)
    except ValueError as err:
        raise _UsageError(str(err)) from None


def _run_stacks(args: argparse.Namespace, runs: list[StackRun], setups: list[Setup],
                workloads: list[tuple[str, list[TraceRequest]]], bar: Any) -> list[Scenario]:
    """Every workload under every stack on each setup: one scenario per (setup, workload), a result per
    stack, named after it."""
    scenarios: list[Scenario] = []
    for setup in setups:
        mine = [run for run in runs if run.setup.name == setup.name]
        if not args.json:
            for run in mine:
                print(f"{_capacity_line(run.setup)} ({run.stack.name}: {run.stack.description})", file=sys.stderr)
        for wname, reqs in workloads:
            results: list[RunResult] = []
            for run in mine:
                if bar is not None:
                    bar.set_description(f"{setup.name} {wname} {run.stack.name}")
                result = _simulate_with_progress(reqs, run.setup, run.stack.policy, args, run.config, bar,
                                                 scale_down_delay_s=run.scale_down_delay_s,
                                                 prompt_tree=run.stack.prompt_tree)
                result.policy = run.stack.name
                results.append(result)
            scenarios.append(Scenario(setup.name, wname, mine[-1].setup.capacity_bytes, tuple(results)))
    return scenarios


def _policies(args: argparse.Namespace) -> list[str]:
    # A disaggregated run packs its decode GPUs with one policy: kvfleet's default unless one is named.
    default = ",".join(POLICY_NAMES) if args.disaggregation is None else "mell"
    policies = [p.strip() for p in (args.policies or default).split(",") if p.strip()]
    for p in policies:
        if p not in POLICY_NAMES:
            raise _UsageError(f"unknown policy {p!r} ({', '.join(POLICY_NAMES)})")
    if args.paper_strict:
        policies = list(dict.fromkeys("mell-paper" if p == "mell" else p for p in policies))
    return policies


def _setups(args: argparse.Namespace) -> list[Setup]:
    """The --setup choices, in the order given, each once, or the --speed-profile's one setup;
    checked before any replay starts."""
    if args.speed_profile is not None:
        if args.setup:
            raise _UsageError("--speed-profile replaces --setup: give one or the other")
        if args.activation_reserve_gib is not None:
            raise _UsageError("--activation-reserve-gib does not apply with --speed-profile: C is the profile's")
        try:
            return [profile_setup(load_profile(args.speed_profile))]
        except ProfileError as err:
            raise _UsageError(str(err)) from None
    names = list(SETUPS) if not args.setup or "all" in args.setup else list(dict.fromkeys(args.setup))
    reserve = None if args.activation_reserve_gib is None else int(args.activation_reserve_gib * GIB)
    setups: list[Setup] = []
    try:
        for name in names:
            model, gpu = SETUPS[name]
            setups.append(make_setup(name, model, gpu, reserve))
    except ValueError as err:  # a model that does not fit on the GPU
        raise _UsageError(str(err)) from None
    return setups


def _num_epochs(reqs: list[TraceRequest], epoch_s: float) -> int:
    """Epochs until the last arrival: what the bar counts for one run (draining takes longer, uncounted)."""
    return int(max((r.arrival_s for r in reqs), default=0.0) / epoch_s) + 1


def _progress_bar(epoch_s: float, workloads: list[tuple[str, list[TraceRequest]]], runs_per_workload: int) -> Any:
    """A tqdm bar over all runs' epochs on stderr, or None where tqdm is not installed."""
    try:
        # Imported by name: tqdm ships no type stubs and the sim extra does not pull them in.
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        return None
    total = sum(_num_epochs(reqs, epoch_s) for _, reqs in workloads) * runs_per_workload
    return tqdm(total=total, unit="epoch", file=sys.stderr, dynamic_ncols=True, leave=False)


def _policy_configs(args: argparse.Namespace, setup: Setup, policies: list[str]) -> dict[str, PolicyConfig]:
    """Each policy's config on `setup`: C, and for the default policy the --headroom and --tpot-ms knobs
    (the only policy that has them). The TPOT cap is checked whichever policies run, so a flag no GPU
    can meet is refused the same way every time."""
    default_knobs: dict[str, object] = {}
    if args.headroom is not None:
        default_knobs["headroom_fraction"] = args.headroom
    if args.tpot_ms is not None:
        try:
            default_knobs.update(tpot_knobs(setup, args.tpot_ms))
        except ValueError as err:
            raise _UsageError(str(err)) from None
    return {policy: policy_config(policy, setup.capacity_bytes, **(default_knobs if policy == "mell" else {}))
            for policy in policies}


def _capacity_line(setup: Setup) -> str:
    """Where C (and the speed) of a setup come from, for the person reading the table."""
    cap = setup.capacity
    if cap is not None:
        return (f"# {setup.name}: C = {cap.memory_bytes / GIB:.1f} GiB memory - {cap.weight_bytes / GIB:.2f} GiB "
                f"weights - {cap.activation_reserve_bytes / GIB:.2f} GiB activation reserve = "
                f"{cap.capacity_bytes / GIB:.2f} GiB = {cap.capacity_tokens} tokens of {cap.kv_bytes_per_token} B")
    line = (f"# {setup.name}: C = {setup.capacity_bytes / GIB:.2f} GiB from the speed profile = "
            f"{setup.capacity_bytes // setup.kv_bytes_per_token} tokens of {setup.kv_bytes_per_token} B")
    if isinstance(setup.speed, ProfileSpeed):
        speed = setup.speed
        line += (f"; speed measured by {speed.engine} over {speed.num_samples} samples "
                 f"({len(speed.decode_points)} decode, {len(speed.prefill.xs)} prefill points)")
    return line


def _run_setup(
    args: argparse.Namespace,
    setup: Setup,
    configs: dict[str, PolicyConfig],
    workloads: list[tuple[str, list[TraceRequest]]],
    policies: list[str],
    bar: Any,
) -> list[Scenario]:
    """Every workload under every policy on one setup: one scenario per workload."""
    if not args.json:
        print(_capacity_line(setup), file=sys.stderr)
    scenarios: list[Scenario] = []
    for wname, reqs in workloads:
        results: list[RunResult] = []
        for pol in policies:
            if bar is not None:
                bar.set_description(f"{setup.name} {wname} {pol}")
            results.append(_simulate_with_progress(reqs, setup, pol, args, configs[pol], bar))
        scenarios.append(Scenario(setup.name, wname, setup.capacity_bytes, tuple(results)))
    return scenarios


def _simulate_with_progress(
    reqs: list[TraceRequest], setup: Setup, policy: str, args: argparse.Namespace, config: PolicyConfig, bar: Any,
    scale_down_delay_s: float | None = None, prompt_tree: bool | None = None,
) -> RunResult:
    """One replay with the flags' settings; `scale_down_delay_s` in place of --scale-down-delay-s and
    `prompt_tree` in place of --prefix-routing where given (a stack's own)."""
    # The bar advances one step per epoch up to the last arrival, then jumps to the end of this run,
    # so its total is known before the run (how long the drain takes is not).
    limit = _num_epochs(reqs, args.epoch_s)
    seen = [0]

    def tick(epoch: int) -> None:
        if bar is not None and seen[0] < limit:
            seen[0] += 1
            bar.update(1)

    if prompt_tree is None:
        prompt_tree = args.prefix_routing == "prompt-tree"
    prefix_cache = (PrefixCacheSpec(args.hash_block_tokens, prompt_tree=prompt_tree,
                                    host_bytes=int(args.prefix_host_gib * 2**30),
                                    host_link_bytes_per_s=args.host_link_gbps * 1e9 / 8)
                    if args.prefix_cache else None)
    result = simulate(reqs, setup, policy, args.epoch_s, config, tick,
                      lookahead_epochs=args.lookahead_epochs, scale_up_s=args.scale_up_s,
                      scale_down_delay_s=args.scale_down_delay_s if scale_down_delay_s is None else scale_down_delay_s,
                      batching=not args.no_batching,
                      prefix_cache=prefix_cache, execution=args.execution, min_workers=args.min_workers,
                      max_workers=args.max_workers, report_lag_epochs=args.report_lag_epochs)
    if bar is not None and seen[0] < limit:
        bar.update(limit - seen[0])
    return result


def _write_outputs(args: argparse.Namespace, scenarios: list[Scenario]) -> None:
    """The table (or one JSON object) on stdout, then the CSV and the plots where asked for."""
    if args.json:
        payload: dict[str, object] = {"scenarios": [sc.to_json() for sc in scenarios]}
        if len(scenarios) == 1:
            payload.update(scenarios[0].to_json())
        print(json.dumps(payload))
    else:
        print(table(scenarios))
    if args.csv is not None:
        text = to_csv(scenarios)
        if str(args.csv) == "-":
            sys.stdout.write(text)
        else:
            args.csv.write_text(text)
    if args.plot is not None:
        for path in plot(scenarios, args.plot):
            if not args.json:
                print(f"wrote {path}", file=sys.stderr)
