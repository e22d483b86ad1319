"""Elastic memory (eLLM) against the static split of the same memory budget, on the builtin engine.

Both engines get the same budget for KV cache and activations and serve the same local model, built
here with random weights at a named shape (`--shape`, bench/_shapes.py: `tiny` on the CPU, `llama-1b`
on a GPU) and context. The static engine splits the budget as vLLM does: an activation reserve sized
for its largest step (a prompt of the whole context, or a full prefill beside max_num_seqs decodes at
the longest context: `builtin.static_activation_reserve_bytes`), the rest KV. The elastic engine keeps
one chunk pool and a CPU buffer (docs/elastic-memory.md). The budget is either fixed (`--budget-gib`,
the same at every context, which is how eLLM's gain grows with the context) or set from the reserve:
`--reserve-share` is the reserve's share of the budget; the default 0.343 is eLLM's Figure 3 at 200K
tokens (activations 30.8% of the GPU, KV 59.1%), and a second row at 0.5 shows a tighter GPU.

What runs, in this order, so that a run stopped at a time limit keeps what matters most (every row is
printed, flushed, as it is measured, and followed by a JSON line of everything measured so far):
0. Per-chunk map and unmap latency of the device's memory backend (CUDA's VMM on a GPU, the host
   backend's memfd on the CPU): inline on a step's path, ahead of need (eLLM §5.1's speculative
   pre-mapping: no device synchronize) and asynchronous (§5.1's asynchronous unmapping: what the step
   sees of it, and the unmap done later).
1. Low load, one request at a time: TPOT of the static engine, the elastic one, and the elastic one
   without §5.1's overlap (`MemoryOptions.overlap_mapping=False`). Target: elastic at most
   1.05x static.
2. Offline, at each context of `--contexts`: every request at once (prompt = context less a short
   output); the largest decode batch each engine held and its decode tokens/s (from the engines' own
   step timings). Target: elastic batch >= 2x static (eLLM reports up to 3x at 128K).
3. Online, at the first context's tightest budget (not with --gpu): Poisson arrivals at 4x the rate
   the static engine prefills long prompts alone, half long prompts (half the context) and half short
   ones; TTFT and TPOT p50/p99 and goodput, the requests per second that met both SLOs, each SLO 25x
   the unloaded figure of its kind of request (eLLM §6.1's rule). Target: elastic goodput >= 1.5x.

    python bench/elastic.py --gpu      # one GPU: llama-1b, bfloat16, 8K and 32K, a 12 GiB budget (~1 min)
    python bench/elastic.py --quick    # the tiny model on the CPU at toy sizes (make test)
    python bench/elastic.py            # the tiny model at 8K, the documented CPU run

Last line: one JSON object (`device`, `context_tokens`, `max_batch` {context: {static, elastic}},
`batch_ratio` {context: ratio}, `low_load_tpot_ms` {static, elastic, elastic_no_overlap},
`low_load_tpot_ratio`, `gpu_chunk_map_us`, `goodput_ratio`, `complete`, and the rest of the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import gc
import json
import math
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402
from _shapes import SHAPES, describe, shape  # noqa: E402

from kvfleet.worker.elastic import (  # noqa: E402
    ChunkPool,
    ETensor,
    Owner,
    QueueFence,
    granularity_bytes,
    open_memory,
    record_marker,
)
from kvfleet.worker.elastic.options import MemoryOptions  # noqa: E402
from kvfleet.worker.engines.base import EngineConfig, EngineError, SamplingParams  # noqa: E402
from kvfleet.worker.engines.builtin import model as builtin_model  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine, static_activation_reserve_bytes  # noqa: E402
from kvfleet.worker.engines.builtin.model import read_architecture, torch_dtype  # noqa: E402
from kvfleet.worker.engines.builtin.options import BuiltinOptions  # noqa: E402
from kvfleet.worker.model.tiny import make_tiny  # noqa: E402

MIB = 1024 * 1024
GIB = 1024 * MIB
# eLLM Figure 3, 200K context: activations 30.8% of GPU memory, KV cache 59.1%.
PAPER_RESERVE_SHARE = 30.8 / (30.8 + 59.1)
SLO_FACTOR = 25.0
T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """What a run measures (the presets fill it; flags override)."""

    shape: str
    dtype: str
    contexts: list[int]
    shares: list[float]
    budget_bytes: int | None  # fixed at every context; None: from the reserve and each share
    online: bool
    stop_early: bool  # offline: abort the rest once the batch has been as large as it gets (`offline`)
    strict_row: bool  # offline: Algorithm 1 read strictly, at the first row
    low_load_output: int
    low_load_rounds: int
    online_requests: int
    online_output: int


def plan_of(args: argparse.Namespace, device: str) -> Plan:
    if args.gpu:
        base = Plan("llama-1b", "bfloat16", [8192, 32768], [PAPER_RESERVE_SHARE], 12 * GIB, online=False,
                    stop_early=True, strict_row=False, low_load_output=64, low_load_rounds=3,
                    online_requests=0, online_output=0)
    elif args.quick:
        base = Plan("tiny", "float32", [1024, 768], [0.5], None, online=True, stop_early=True, strict_row=True,
                    low_load_output=32, low_load_rounds=3, online_requests=12, online_output=8)
    else:
        base = Plan("tiny", "bfloat16" if device == "cuda" else "float32", [8192], [PAPER_RESERVE_SHARE, 0.5], None,
                    online=True, stop_early=False, strict_row=True, low_load_output=128, low_load_rounds=7,
                    online_requests=96, online_output=32)
    contexts = ([int(c) for c in args.contexts.split(",")] if args.contexts
                else [args.context_tokens] if args.context_tokens else base.contexts)
    return replace(base, shape=args.shape or base.shape, dtype=args.dtype or base.dtype, contexts=contexts,
                   shares=args.reserve_share or base.shares,
                   budget_bytes=int(args.budget_gib * GIB) if args.budget_gib else base.budget_bytes,
                   online=base.online and not args.skip_online)


@dataclass(frozen=True)
class Served:
    """One request's timings as its client saw them."""

    kind: str
    ttft_s: float
    tpot_s: float | None  # None with a single output token


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def release_device_memory() -> None:
    """After an engine stops: what torch's allocator keeps cached goes back to the driver, so the next
    engine's pool (cuMemCreate, outside that allocator) finds it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def share_checkpoint_reads() -> None:
    """Every engine here loads the same checkpoint: read it from disk once (llama-1b's float32 file is
    4 GB) and give each engine the same CPU tensors, which LlamaForward only reads (it copies them to
    its device and dtype, or on a float32 CPU engine keeps them as they are, read-only)."""
    builtin_model._read_safetensors = functools.cache(builtin_model._read_safetensors)  # type: ignore[assignment]


async def serve(engine: BuiltinEngine, request_id: str, prompt: list[int], max_tokens: int, kind: str,
                delay_s: float = 0.0) -> Served:
    await asyncio.sleep(delay_s)
    start = time.perf_counter()
    first = last = None
    count = 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(request_id, prompt, params):
        if out.new_token_ids:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            count += len(out.new_token_ids)
    assert first is not None and last is not None
    return Served(kind, first - start, (last - first) / (count - 1) if count > 1 else None)


def prompt_of(rng: random.Random, tokens: int) -> list[int]:
    return [1] + [rng.randrange(3, 2000) for _ in range(tokens - 1)]


def elastic_figures(engine: BuiltinEngine) -> dict[str, Any]:
    elastic = engine.elastic
    if elastic is None:
        return {}
    return {"parked": elastic.num_parked, "offloaded_prefills": elastic.num_offloaded_prefills,
            "inflated_chunks": elastic.inflated_chunks, "deflated_chunks": elastic.deflated_chunks,
            "mapping": elastic.mapping_counts()}


@dataclass(frozen=True)
class Run:
    """One engine setting the bench compares: the shared config and the memory options of the builtin engine."""

    config: EngineConfig
    memory: MemoryOptions

    def engine(self) -> BuiltinEngine:
        return BuiltinEngine(self.config, BuiltinOptions(memory=self.memory))

    def with_memory(self, **changes: Any) -> Run:
        return replace(self, memory=replace(self.memory, **changes))


async def offline(run: Run, context: int, output: int, count: int, stop_early: bool) -> dict[str, Any]:
    """All requests at once at the context: the largest decode batch and decode tokens/s.

    With `stop_early` the rest are aborted once the batch has been as large as it gets. A static
    engine admits requests until its KV is full, and every admitted one is prefilled before the first
    one ends (`output` is that long): so at the first request's end. An elastic one parks KV in its
    buffer and fetches it back, so its batch is largest once nothing waits or is parked any more: two
    steps after that (the first of them may still hold the last prefill)."""
    engine = run.engine()
    await engine.start()
    rng = random.Random(1)
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    everyone_in = asyncio.Event()

    async def consume(request_id: str, prompt: list[int]) -> int:
        tokens = steps_with_everyone_in = 0
        async for out in engine.generate(request_id, prompt, params):
            tokens += len(out.new_token_ids)
            steps_with_everyone_in = steps_with_everyone_in + 1 if engine.num_waiting() == 0 else 0
            if steps_with_everyone_in >= 2:
                everyone_in.set()
        return tokens

    try:
        start = time.perf_counter()
        tasks = [asyncio.create_task(consume(f"o{i}", prompt_of(rng, context - output))) for i in range(count)]
        if stop_early:
            if run.memory.elastic:
                waiter = asyncio.create_task(everyone_in.wait())
                await asyncio.wait([waiter, asyncio.gather(*tasks, return_exceptions=True)],
                                   return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            else:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for i in range(count):
                await engine.abort(f"o{i}")
        await asyncio.gather(*tasks)
        wall_s = time.perf_counter() - start
        profile = engine.speed_profile()
        assert profile is not None
        decode = profile.decode
        tokens = sum(p.batch * p.samples for p in decode)
        seconds = sum(p.step_seconds * p.samples for p in decode)
        return {"max_batch": max((p.batch for p in decode), default=0),
                "decode_tokens_per_s": tokens / seconds if seconds else 0.0, "wall_s": wall_s,
                "preemptions": engine.num_preemptions, **elastic_figures(engine)}
    finally:
        await engine.stop()
        release_device_memory()


async def low_load_tpot(configs: dict[str, Run], prompt_tokens: int, output: int, rounds: int) -> dict[str, float]:
    """TPOT with one request at a time: the engines loaded side by side, warmed up, and measured in
    alternating rounds (median kept), so load from elsewhere on the machine slows all alike."""
    engines = {name: run.engine() for name, run in configs.items()}
    rng = random.Random(5)
    tpots: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for engine in engines.values():
            await engine.start()
        for name, engine in engines.items():
            await serve(engine, f"warm-{name}", prompt_of(rng, 32), 8, "short")
        for i in range(rounds):
            prompt = prompt_of(rng, prompt_tokens)
            for name, engine in engines.items():
                served = await serve(engine, f"l{i}", prompt, output, "short")
                assert served.tpot_s is not None
                tpots[name].append(served.tpot_s)
        for name, engine in engines.items():
            if engine._elastic is not None:  # where §5.1's overlap spends its time, if it is on
                print(f"low load, {name}: {engine._elastic.mapping_counts()}", flush=True)
        return {name: statistics.median(values) for name, values in tpots.items()}
    finally:
        for engine in engines.values():
            await engine.stop()
        release_device_memory()


async def unloaded(run: Run, long_tokens: int, short_tokens: int, output: int) -> dict[str, float]:
    """TTFT of each kind and TPOT, one request at a time (the SLOs' base and the low-load figure)."""
    engine = run.engine()
    await engine.start()
    rng = random.Random(2)
    try:
        await serve(engine, "warm", prompt_of(rng, short_tokens), 4, "short")
        runs: dict[str, list[Served]] = {"long": [], "short": []}
        for i in range(3):
            for kind, tokens in (("long", long_tokens), ("short", short_tokens)):
                runs[kind].append(await serve(engine, f"u{kind}{i}", prompt_of(rng, tokens), output, kind))
        tpots = [s.tpot_s for s in runs["long"] + runs["short"] if s.tpot_s is not None]
        return {"ttft_long_s": statistics.median(s.ttft_s for s in runs["long"]),
                "ttft_short_s": statistics.median(s.ttft_s for s in runs["short"]),
                "tpot_s": statistics.median(tpots)}
    finally:
        await engine.stop()
        release_device_memory()


async def online(run: Run, arrivals: list[tuple[float, str, int]], output: int) -> list[Served]:
    engine = run.engine()
    await engine.start()
    rng = random.Random(3)
    try:
        return list(await asyncio.gather(*(serve(engine, f"p{i}", prompt_of(rng, tokens), output, kind, at)
                                           for i, (at, kind, tokens) in enumerate(arrivals))))
    finally:
        await engine.stop()
        release_device_memory()


def poisson(rate_per_s: float, count: int, long_tokens: int, short_tokens: int, seed: int = 4) -> list[tuple[float, str, int]]:
    rng = random.Random(seed)
    at = 0.0
    out = []
    for i in range(count):
        at += rng.expovariate(rate_per_s)
        kind, tokens = ("long", long_tokens) if i % 2 == 0 else ("short", short_tokens)
        out.append((at, kind, tokens))
    return out


def online_figures(served: list[Served], slo: dict[str, float], duration_s: float) -> dict[str, float]:
    ttft = [s.ttft_s for s in served]
    tpot = [s.tpot_s for s in served if s.tpot_s is not None]
    good = sum(1 for s in served if s.ttft_s <= slo[f"ttft_{s.kind}_s"] and (s.tpot_s is None or s.tpot_s <= slo["tpot_s"]))
    return {"ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_ms": 1000 * percentile(tpot, 0.5), "tpot_p99_ms": 1000 * percentile(tpot, 0.99),
            "slo_attainment": good / len(served), "goodput_per_s": good / duration_s}


def chunk_map_latency_us(device: torch.device, num_chunks: int = 64) -> dict[str, Any]:
    """Per-chunk map and unmap on the device's backend (CUDA VMM on a GPU), as the engine calls them:
    `map` and `unmap` inline (each synchronizes the device first on a GPU), `map_ahead` as eLLM §5.1's
    pre-mapping does it while a step computes (no synchronize), `unmap_deferred` what a step sees of
    §5.1's asynchronous unmapping (the books, and one fence queued on a one-thread executor, as the
    engine's, for all the slots of a deflation; `unmap_deferred_one` for a deflation of one chunk), and
    `unmap_deferred_later` the unmap itself, done once the fence has passed."""
    kind = "cuda" if device.type == "cuda" else "host"
    chunk_bytes = max(2 * MIB, granularity_bytes(kind, device))
    memory = open_memory(kind, num_chunks, chunk_bytes, device)
    tensor = ETensor(ChunkPool(num_chunks, chunk_bytes), memory, Owner.KV, num_chunks)
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def per_chunk(call: Callable[[int], object]) -> float:
        start = time.perf_counter()
        for slot in range(num_chunks):
            call(slot)
        return round(1e6 * (time.perf_counter() - start) / num_chunks, 2)

    try:
        tensor.map_slots([0])  # first-call costs (the driver's context on this thread)
        tensor.unmap_slots([0])
        out: dict[str, Any] = {"backend": kind, "chunk_bytes": chunk_bytes, "chunks": num_chunks}
        out["map"] = per_chunk(lambda slot: tensor.map_slots([slot]))
        out["unmap"] = per_chunk(lambda slot: tensor.unmap_slots([slot]))
        out["map_ahead"] = per_chunk(lambda slot: tensor.map_slots([slot], synchronize=False))
        # One deflation's worth: the slots behind one fence, as ElasticKVBlocks.shrink does.
        start = time.perf_counter()
        tensor.unmap_slots(list(range(num_chunks)), QueueFence(executor.submit(record_marker, device)))
        out["unmap_deferred"] = round(1e6 * (time.perf_counter() - start) / num_chunks, 2)
        start = time.perf_counter()
        done = tensor.complete_unmaps(wait=True)
        out["unmap_deferred_later"] = round(1e6 * (time.perf_counter() - start) / max(1, done), 2)
        # A deflation of one chunk: its fence alone (the executor's round trip is most of it).
        tensor.map_slots([0])
        start = time.perf_counter()
        tensor.unmap_slots([0], QueueFence(executor.submit(record_marker, device)))
        out["unmap_deferred_one"] = round(1e6 * (time.perf_counter() - start), 2)
        return out
    finally:
        tensor.close()
        memory.close()
        executor.shutdown()


class Report:
    """Everything measured so far; each `emit` prints it as one JSON line (the last one is the run's)."""

    def __init__(self, **fixed: Any) -> None:
        self.data: dict[str, Any] = dict(fixed)

    def emit(self, complete: bool = False) -> None:
        print(json.dumps({**self.data, "complete": complete}), flush=True)

    def guarded(self, what: str, fn: Callable[[], T]) -> T | None:
        """fn(), or None when it raised: the error is printed and kept under `errors`, and the run goes on
        (a GPU run is not watched: one failed measurement must not cost the others)."""
        try:
            return fn()
        except Exception as err:
            traceback.print_exc()
            self.data.setdefault("errors", {})[what] = f"{type(err).__name__}: {err}"
            print(f"ERROR {what}: {type(err).__name__}: {err}", flush=True)
            release_device_memory()
            return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model at toy sizes (tests this script)")
    parser.add_argument("--gpu", action="store_true",
                        help="one GPU, about 1 min (90 s with the model's build): llama-1b, bfloat16, contexts 8192,32768, "
                             "a 12 GiB budget, no online part")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="model shape (bench/_shapes.py; default tiny, --gpu llama-1b)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="weights and KV (default float32 on the CPU, bfloat16 on a GPU)")
    parser.add_argument("--contexts", help="comma-separated contexts in tokens (default 8192; quick 1024,768; --gpu 8192,32768)")
    parser.add_argument("--context-tokens", type=int, help="one context (the same as --contexts N)")
    parser.add_argument("--budget-gib", type=float, help="a fixed memory budget at every context (default: from --reserve-share)")
    parser.add_argument("--reserve-share", type=float, action="append",
                        help=f"the static reserve's share of the budget (repeatable; default {PAPER_RESERVE_SHARE:.3f} and 0.5)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="high enough that memory, not this, bounds the batch")
    parser.add_argument("--skip-online", action="store_true", help="leave out the online part")
    parser.add_argument("--model-dir", type=Path, help="where to build the model (default: a temporary directory)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = plan_of(args, device)
    if any(not 0 < s < 1 for s in plan.shares):
        parser.error("--reserve-share must be in (0, 1)")
    if any(c < 64 for c in plan.contexts):
        parser.error("--contexts: each context must be at least 64 tokens")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    gpu_name = torch.cuda.get_device_name() if device == "cuda" else None
    print(f"host: {platform.node()} ({cpu_model()}, {torch.get_num_threads()} torch threads), device: {gpu_name or device}, "
          f"torch {torch.__version__}", flush=True)
    report = Report(device=device, gpu=gpu_name, shape=plan.shape, dtype=plan.dtype, context_tokens=plan.contexts)
    if args.gpu and device != "cuda":
        print("SKIP --gpu: no CUDA device here (run it on a GPU, or drop --gpu for the CPU run)", flush=True)
        report.data["skipped"] = "no CUDA device"
        report.emit(complete=True)
        return 0
    phase_s: dict[str, float] = {}
    report.data["phase_s"] = phase_s
    t0 = time.perf_counter()

    # 0. The backend's per-chunk (un)map latency: needs no model, and is the one CUDA-only figure.
    latency = report.guarded("chunk_latency", lambda: chunk_map_latency_us(torch.device(device)))
    report.data["chunk_map_us"] = latency
    report.data["gpu_chunk_map_us"] = latency if device == "cuda" else None
    phase_s["chunk_latency"] = round(time.perf_counter() - t0, 2)
    if latency is not None:
        print(f"chunk (un)map on the {latency['backend']} backend, us per {latency['chunk_bytes'] // MIB} MiB chunk: map "
              f"{latency['map']}, unmap {latency['unmap']}; eLLM §5.1: map ahead {latency['map_ahead']}, asynchronous "
              f"unmap {latency['unmap_deferred']} on the step's path + {latency['unmap_deferred_later']} later", flush=True)
    report.emit()

    t = time.perf_counter()
    spec = shape(plan.shape, max(plan.contexts))
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="kvfleet-elastic-")) / plan.shape
    make_tiny(model_dir, spec=spec)
    share_checkpoint_reads()
    arch = read_architecture(model_dir)
    dtype = torch_dtype(plan.dtype)
    phase_s["model_build"] = round(time.perf_counter() - t, 2)
    report.data["model"] = describe(spec)
    print(f"model: {plan.shape} {describe(spec)}, {plan.dtype}, KV {arch.kv_bytes_per_token(dtype) // 1024} KiB a token; "
          f"built in {phase_s['model_build']:.1f} s; max_num_seqs {args.max_num_seqs}", flush=True)

    def reserve_of(context: int, budget: int | None = None) -> int:
        return static_activation_reserve_bytes(arch, dtype, context, args.max_num_seqs, budget)

    def configs(context: int, budget: int) -> tuple[Run, Run]:
        base = Run(EngineConfig(model_path=model_dir, max_model_len=context, max_num_seqs=args.max_num_seqs,
                                dtype=plan.dtype, device=device), MemoryOptions(budget_bytes=budget))
        # "elastic" is eLLM with §5.1's overlap (the engine's default leaves it off: docs/gpu.md);
        # the low-load rows measure it against the engine without it.
        return base, base.with_memory(elastic=True, cpu_buffer_bytes=budget, overlap_mapping=True)

    def budgets(context: int) -> list[tuple[float | None, int]]:
        if plan.budget_bytes is not None:
            return [(None, plan.budget_bytes)]
        # The budget from the reserve with the full 32 MiB decode workspace; the engine's own reserve
        # (in each row) may bound its workspace lower in a small budget.
        return [(share, int(reserve_of(context) / share)) for share in plan.shares]

    # 1. Low load at the first context, in a budget twice its static reserve (or the fixed one if less).
    t = time.perf_counter()
    first = plan.contexts[0]
    low_budget = min(budgets(first)[0][1], 2 * reserve_of(first))
    static_cfg, elastic_cfg = configs(first, low_budget)
    low_configs = {"static": static_cfg, "elastic": elastic_cfg,
                   "elastic_no_overlap": elastic_cfg.with_memory(overlap_mapping=False)}
    low = report.guarded("low_load", lambda: asyncio.run(low_load_tpot(
        low_configs, min(256, first // 2), plan.low_load_output, plan.low_load_rounds)))
    phase_s["low_load"] = round(time.perf_counter() - t, 2)
    report.data.update(low_load_budget_bytes=low_budget, low_load_tpot_s=low, low_load_tpot_ms=None,
                       low_load_tpot_ratio=None, low_load_tpot_ratio_no_overlap=None)
    if low is not None:
        report.data.update(low_load_tpot_ms={k: round(1000 * v, 4) for k, v in low.items()},
                           low_load_tpot_ratio=low["elastic"] / low["static"],
                           low_load_tpot_ratio_no_overlap=low["elastic_no_overlap"] / low["static"])
        print(f"low load TPOT ({min(256, first // 2)}-token prompts, {plan.low_load_output} tokens, {plan.low_load_rounds} "
              f"rounds, budget {low_budget / MIB:.0f} MiB): static {1000 * low['static']:.2f} ms, elastic "
              f"{1000 * low['elastic']:.2f} ms ({low['elastic'] / low['static']:.3f}x), elastic without §5.1's overlap "
              f"{1000 * low['elastic_no_overlap']:.2f} ms ({low['elastic_no_overlap'] / low['static']:.3f}x)", flush=True)
    report.emit()

    # 2. Offline at each context.
    rows: list[dict[str, Any]] = []
    max_batch: dict[str, dict[str, float]] = {}
    batch_ratio: dict[str, float | None] = {}
    report.data.update(rows=rows, max_batch=max_batch, batch_ratio=batch_ratio)
    print(f"{'context':>7} {'share':>6} {'budget MiB':>10} | {'static batch':>12} {'elastic batch':>13} {'ratio':>6} | "
          f"{'static tok/s':>12} {'elastic tok/s':>13} | elastic maps on the path / ahead", flush=True)
    for context in plan.contexts:
        t = time.perf_counter()
        kv_per_request = context * arch.kv_bytes_per_token(dtype)
        for share, budget in budgets(context):
            static_cfg, elastic_cfg = configs(context, budget)
            count = min(args.max_num_seqs, math.ceil(budget / kv_per_request) + 2)
            # Long enough that every request is prefilled before the first one ends, so the batch is
            # what memory allows, not what arrived (prompts take a step each, or share one when short).
            output = count // max(1, 2048 // context) + 16
            row: dict[str, Any] = {"context_tokens": context, "reserve_share": share, "budget_bytes": budget,
                                   "static_reserve_bytes": reserve_of(context, budget), "requests": count,
                                   "output_tokens": output}
            rows.append(row)
            runs = [("static", static_cfg), ("elastic", elastic_cfg)]
            row["elastic_strict"] = None
            if plan.strict_row and len(rows) == 1:
                # The paper's Algorithm 1 read strictly (a full decoding batch holds prefills off), first row only.
                runs.append(("elastic_strict", elastic_cfg.with_memory(park_decodes_for_prefill=False)))
            for name, config in runs:
                try:
                    row[name] = asyncio.run(offline(config, context, output, count, plan.stop_early))
                except Exception as err:  # a budget below the static reserve, say: the row says so
                    if not isinstance(err, EngineError):
                        traceback.print_exc()
                    row[name] = {"max_batch": 0, "decode_tokens_per_s": 0.0, "error": f"{type(err).__name__}: {err}"}
                    print(f"  {name} at {context} tokens: {row[name]['error']}", flush=True)
                    release_device_memory()
                report.emit()
            s, e = row["static"], row["elastic"]
            row["batch_ratio"] = e["max_batch"] / s["max_batch"] if s["max_batch"] else None
            if str(context) not in max_batch:
                max_batch[str(context)] = {"static": s["max_batch"], "elastic": e["max_batch"]}
                batch_ratio[str(context)] = row["batch_ratio"]
            mapping = e.get("mapping", {})
            strict = row["elastic_strict"]
            ratio = f"{row['batch_ratio']:>6.2f}" if row["batch_ratio"] is not None else f"{'-':>6}"
            share_text = f"{share:.3f}" if share is not None else "-"
            print(f"{context:>7} {share_text:>6} {budget / MIB:>10.0f} | {s['max_batch']:>12.0f} "
                  f"{e['max_batch']:>13.0f} {ratio} | {s['decode_tokens_per_s']:>12.1f} {e['decode_tokens_per_s']:>13.1f} | "
                  f"{mapping.get('maps_on_path', '-')} / {mapping.get('maps_ahead', '-')}"
                  + (f"   (Algorithm 1 strictly: batch {strict['max_batch']:.0f}, {strict['decode_tokens_per_s']:.1f} tok/s)"
                     if strict else ""), flush=True)
            report.emit()
        phase_s[f"offline_{context}"] = round(time.perf_counter() - t, 2)
    headline = rows[0]
    report.data.update(static_max_batch=headline["static"]["max_batch"], elastic_max_batch=headline["elastic"]["max_batch"],
                       reserve_share=headline["reserve_share"], budget_bytes=headline["budget_bytes"])

    # 3. Online at the first context's tightest budget (its last row), long prompts half the context.
    report.data["goodput_ratio"] = None
    if plan.online:
        t = time.perf_counter()
        online_budget = [r for r in rows if r["context_tokens"] == first][-1]["budget_bytes"]
        report.guarded("online", lambda: run_online(report, configs(first, online_budget), first, plan))
        phase_s["online"] = round(time.perf_counter() - t, 2)
    goodput_ratio = report.data["goodput_ratio"]

    targets = [(f"batch >= 2x static at {c} tokens", r is not None and r >= 2.0, f"{r:.2f}x" if r is not None else
                "static held no request") for c, r in batch_ratio.items()]
    if plan.online:
        targets.append(("goodput >= 1.5x static", goodput_ratio is not None and goodput_ratio >= 1.5,
                        f"{goodput_ratio:.2f}x" if goodput_ratio is not None else
                        "not measured: the static engine met no request's SLOs (or the online part failed)"))
    low_ratio, no_overlap_ratio = report.data["low_load_tpot_ratio"], report.data["low_load_tpot_ratio_no_overlap"]
    targets.append(("low-load TPOT <= 1.05x static", low_ratio is not None and low_ratio <= 1.05,
                    f"{low_ratio:.3f}x (without §5.1's overlap {no_overlap_ratio:.3f}x)" if low_ratio is not None
                    else "not measured"))
    for name, met, value in targets:
        print(f"{'PASS' if met else 'MISS'} {name}: {value}", flush=True)
    phase_s["total"] = round(time.perf_counter() - t0, 2)
    report.emit(complete=True)
    return 0


def run_online(report: Report, configs: tuple[Run, Run], context: int, plan: Plan) -> None:
    """The online part (module docstring, 3.) at `context`, its figures into the report."""
    static_cfg, elastic_cfg = configs
    long_tokens, short_tokens = context // 2, 64
    base_static = asyncio.run(unloaded(static_cfg, long_tokens, short_tokens, plan.online_output))
    slo = {key: SLO_FACTOR * value for key, value in base_static.items()}
    # The arrival rate: about what the static engine prefills long prompts at, so it queues.
    rate = 4.0 / max(base_static["ttft_long_s"], 1e-3)
    arrivals = poisson(rate, plan.online_requests, long_tokens, short_tokens)
    slo_config = dict(ttft_slo_s=slo["ttft_long_s"], tpot_slo_s=slo["tpot_s"])
    figures = {}
    for name, config in (("static", static_cfg), ("elastic", elastic_cfg.with_memory(**slo_config))):
        start = time.perf_counter()
        served = asyncio.run(online(config, arrivals, plan.online_output))
        figures[name] = online_figures(served, slo, time.perf_counter() - start)
    # Undefined when the static engine met no request's SLO (then no ratio is claimed: a MISS).
    report.data.update(online=figures, slo=slo, unloaded_static=base_static,
                       goodput_ratio=(figures["elastic"]["goodput_per_s"] / figures["static"]["goodput_per_s"]
                                      if figures["static"]["goodput_per_s"] else None))
    print(f"online: {plan.online_requests} requests at {rate:.2f}/s (half {long_tokens}-token prompts, half {short_tokens}), "
          f"SLOs TTFT long {slo['ttft_long_s']:.2f} s, short {slo['ttft_short_s']:.2f} s, TPOT {1000 * slo['tpot_s']:.0f} ms",
          flush=True)
    for name in ("static", "elastic"):
        f = figures[name]
        print(f"  {name:8} TTFT p50/p99 {f['ttft_p50_s']:.2f}/{f['ttft_p99_s']:.2f} s, TPOT p50/p99 "
              f"{f['tpot_p50_ms']:.0f}/{f['tpot_p99_ms']:.0f} ms, SLO met {100 * f['slo_attainment']:.0f}%, "
              f"goodput {f['goodput_per_s']:.3f}/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
