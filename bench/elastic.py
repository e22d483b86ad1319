"""Elastic memory (eLLM) against the static split of the same memory budget, on the builtin engine.

Both engines get the same budget for KV cache and activations and serve the same tiny local model
(built here with a long context, float32, on this machine's device). The static engine splits the
budget as vLLM does: an activation reserve sized for its largest step (a prompt of the whole
context, or a full prefill beside max_num_seqs decodes at the longest context:
`builtin.static_activation_reserve_bytes`), the rest KV. The elastic engine keeps one chunk pool
and a CPU buffer (docs/elastic-memory.md). The budget is set from the reserve: `--reserve-share` is
the reserve's share of the budget; the default 0.343 is eLLM's Figure 3 at 200K tokens (activations
30.8% of the GPU, KV 59.1%), and a second row at 0.5 shows a tighter GPU.

Three measurements, each static and elastic in the same run:
1. Offline, at the longest context: every request arrives at once (prompt = context less a short
   output); the largest decode batch each engine held and its decode tokens/s (from the engines'
   own step timings). Target: elastic batch >= 2x static.
2. Online, at the tightest budget: Poisson arrivals at 4x the rate the static engine prefills long
   prompts alone, half long prompts (half the context) and half short ones;
   TTFT and TPOT p50/p99 and goodput, the requests per second that met both SLOs, each SLO 25x the
   unloaded figure of its kind of request (eLLM §6.1's rule). Target: elastic goodput >= 1.5x.
3. Low load, one request at a time: elastic TPOT at most 1.05x static.

Last line: one JSON object (`static_max_batch`, `elastic_max_batch`, `batch_ratio`, `goodput_ratio`,
`low_load_tpot_ratio`, `context_tokens`, `device`, and the rest of the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402

from kvfleet.worker.engines.base import EngineConfig, SamplingParams  # noqa: E402
from kvfleet.worker.engines.builtin import BuiltinEngine, static_activation_reserve_bytes  # noqa: E402
from kvfleet.worker.engines.builtin_model import read_architecture  # noqa: E402
from kvfleet.worker.model.tiny import TinySpec, make_tiny  # noqa: E402

MIB = 1024 * 1024
# eLLM Figure 3, 200K context: activations 30.8% of GPU memory, KV cache 59.1%.
PAPER_RESERVE_SHARE = 30.8 / (30.8 + 59.1)
SLO_FACTOR = 25.0


@dataclass(frozen=True)
class Served:
    """One request's timings as its client saw them."""

    kind: str
    ttft_s: float
    tpot_s: float | None  # None with a single output token


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


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


async def offline(config: EngineConfig, context: int, output: int, count: int) -> dict[str, float]:
    """All requests at once at the longest context: the largest decode batch and decode tokens/s."""
    engine = BuiltinEngine(config)
    await engine.start()
    rng = random.Random(1)
    try:
        start = time.perf_counter()
        await asyncio.gather(*(serve(engine, f"o{i}", prompt_of(rng, context - output), output, "long")
                               for i in range(count)))
        wall_s = time.perf_counter() - start
        profile = engine.speed_profile()
        assert profile is not None
        decode = profile.decode
        tokens = sum(p.batch * p.samples for p in decode)
        seconds = sum(p.step_seconds * p.samples for p in decode)
        return {"max_batch": max((p.batch for p in decode), default=0), "decode_tokens_per_s": tokens / seconds,
                "wall_s": wall_s, "preemptions": engine.num_preemptions,
                "parked": engine.elastic.num_parked if engine.elastic else 0,
                "offloaded_prefills": engine.elastic.num_offloaded_prefills if engine.elastic else 0}
    finally:
        await engine.stop()


async def low_load_tpot(configs: dict[str, EngineConfig], prompt_tokens: int, output: int, rounds: int) -> dict[str, float]:
    """TPOT with one request at a time: both engines loaded side by side and measured in alternating
    rounds (median kept), so load from elsewhere on the machine slows both alike."""
    engines = {name: BuiltinEngine(config) for name, config in configs.items()}
    for engine in engines.values():
        await engine.start()
    rng = random.Random(5)
    tpots: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for i in range(rounds):
            prompt = prompt_of(rng, prompt_tokens)
            for name, engine in engines.items():
                served = await serve(engine, f"l{i}", prompt, output, "short")
                assert served.tpot_s is not None
                tpots[name].append(served.tpot_s)
        return {name: statistics.median(values) for name, values in tpots.items()}
    finally:
        for engine in engines.values():
            await engine.stop()


async def unloaded(config: EngineConfig, long_tokens: int, short_tokens: int, output: int) -> dict[str, float]:
    """TTFT of each kind and TPOT, one request at a time (the SLOs' base and the low-load figure)."""
    engine = BuiltinEngine(config)
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


async def online(config: EngineConfig, arrivals: list[tuple[float, str, int]], output: int) -> list[Served]:
    engine = BuiltinEngine(config)
    await engine.start()
    rng = random.Random(3)
    try:
        return list(await asyncio.gather(*(serve(engine, f"p{i}", prompt_of(rng, tokens), output, kind, at)
                                           for i, (at, kind, tokens) in enumerate(arrivals))))
    finally:
        await engine.stop()


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


def chunk_map_latency_us(device: str, num_chunks: int = 64) -> dict[str, float] | None:
    """Per-chunk map and unmap on the GPU backend (None without a GPU)."""
    if device != "cuda":
        return None
    from kvfleet.worker.elastic import ChunkPool, ETensor, Owner, granularity_bytes, open_memory

    gpu = torch.device("cuda")
    chunk_bytes = max(2 * MIB, granularity_bytes("cuda", gpu))
    memory = open_memory("cuda", num_chunks, chunk_bytes, gpu)
    tensor = ETensor(ChunkPool(num_chunks, chunk_bytes), memory, Owner.KV, num_chunks)
    try:
        start = time.perf_counter()
        for slot in range(num_chunks):
            tensor.map_slots([slot])
        mapped_s = time.perf_counter() - start
        start = time.perf_counter()
        tensor.unmap_slots(list(range(num_chunks)))
        unmapped_s = time.perf_counter() - start
        return {"map": 1e6 * mapped_s / num_chunks, "unmap": 1e6 * unmapped_s / num_chunks}
    finally:
        tensor.close()
        memory.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (tests this script)")
    parser.add_argument("--context-tokens", type=int, help="the longest context (default 8192; quick 1024)")
    parser.add_argument("--reserve-share", type=float, action="append",
                        help=f"the static reserve's share of the budget (repeatable; default {PAPER_RESERVE_SHARE:.3f} and 0.5)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="high enough that memory, not this, bounds the batch")
    parser.add_argument("--model-dir", type=Path, help="where to build the tiny model (default: a temporary directory)")
    args = parser.parse_args()
    context = args.context_tokens or (1024 if args.quick else 8192)
    shares = args.reserve_share or ([0.5] if args.quick else [PAPER_RESERVE_SHARE, 0.5])
    if any(not 0 < s < 1 for s in shares):
        parser.error("--reserve-share must be in (0, 1)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"host: {platform.node()} ({cpu_model()}, {torch.get_num_threads()} torch threads), device: {device}, "
          f"torch {torch.__version__}")
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="kvfleet-elastic-")) / "tiny"
    make_tiny(model_dir, spec=replace(TinySpec(), max_position_embeddings=context, model_max_length=context))
    arch = read_architecture(model_dir)
    dtype = torch.float32
    # The budget is set from the reserve with the full 32 MiB decode workspace; the engine's own
    # reserve (printed per row) may bound its workspace lower in a small budget.
    reserve = static_activation_reserve_bytes(arch, dtype, context, args.max_num_seqs)
    kv_per_request = context * arch.kv_bytes_per_token(dtype)
    print(f"model: tiny, {arch.num_layers} layers, context {context} tokens, KV {kv_per_request / MIB:.1f} MiB per "
          f"full-context request, float32; static activation reserve {reserve / MIB:.0f} MiB "
          f"(max_num_seqs {args.max_num_seqs})")

    def configs(budget: int) -> tuple[EngineConfig, EngineConfig]:
        base = EngineConfig(model_path=model_dir, max_model_len=context, max_num_seqs=args.max_num_seqs, dtype="float32",
                            device=device, memory_budget_bytes=budget)
        return base, replace(base, elastic_memory=True, cpu_buffer_bytes=budget)

    rows = []
    print(f"{'share':>6} {'budget MiB':>10} | {'static batch':>12} {'elastic batch':>13} {'ratio':>6} | "
          f"{'static tok/s':>12} {'elastic tok/s':>13}")
    for share in shares:
        budget = int(reserve / share)
        static_cfg, elastic_cfg = configs(budget)
        count = min(args.max_num_seqs, math.ceil(budget / kv_per_request) + 2)
        # Long enough that every request is prefilled before the first one ends, so the batch is
        # what memory allows, not what arrived (prompts take a step each, or share one when short).
        per_step = max(1, 2048 // context)
        output = count // per_step + 16
        s = asyncio.run(offline(static_cfg, context, output, count))
        e = asyncio.run(offline(elastic_cfg, context, output, count))
        ratio = e["max_batch"] / s["max_batch"] if s["max_batch"] else float("inf")
        # The paper's Algorithm 1 read strictly (a full decoding batch holds prefills off), first row only.
        strict = (asyncio.run(offline(replace(elastic_cfg, park_decodes_for_prefill=False), context, output, count))
                  if not rows else None)
        static_reserve = static_activation_reserve_bytes(arch, dtype, context, args.max_num_seqs, budget)
        rows.append({"reserve_share": share, "budget_bytes": budget, "static_reserve_bytes": static_reserve,
                     "requests": count, "output_tokens": output, "static": s, "elastic": e, "batch_ratio": ratio,
                     "elastic_strict": strict})
        print(f"{share:>6.3f} {budget / MIB:>10.0f} | {s['max_batch']:>12.0f} {e['max_batch']:>13.0f} {ratio:>6.2f} | "
              f"{s['decode_tokens_per_s']:>12.1f} {e['decode_tokens_per_s']:>13.1f}"
              + (f"   (Algorithm 1 strictly: batch {strict['max_batch']:.0f}, {strict['decode_tokens_per_s']:.1f} tok/s)"
                 if strict else ""))
    headline = rows[0]

    # Online at the tightest budget measured (the last row), long prompts half the context, enough of
    # them at once to fill the static split's KV room; low load at the same budget.
    static_cfg, elastic_cfg = configs(rows[-1]["budget_bytes"])
    long_tokens, short_tokens, online_output = context // 2, 64, 8 if args.quick else 32
    base_static = asyncio.run(unloaded(static_cfg, long_tokens, short_tokens, online_output))
    slo = {key: SLO_FACTOR * value for key, value in base_static.items()}
    # The arrival rate: about what the static engine prefills long prompts at, so it queues.
    count = 12 if args.quick else 96
    rate = 4.0 / max(base_static["ttft_long_s"], 1e-3)
    arrivals = poisson(rate, count, long_tokens, short_tokens)
    slo_config = dict(ttft_slo_s=slo["ttft_long_s"], tpot_slo_s=slo["tpot_s"])
    figures = {}
    for name, config in (("static", static_cfg), ("elastic", replace(elastic_cfg, **slo_config))):
        start = time.perf_counter()
        served = asyncio.run(online(config, arrivals, online_output))
        figures[name] = online_figures(served, slo, time.perf_counter() - start)
    # Undefined when the static engine met no request's SLO (then no ratio is claimed: a MISS).
    goodput_ratio = (figures["elastic"]["goodput_per_s"] / figures["static"]["goodput_per_s"]
                     if figures["static"]["goodput_per_s"] else None)
    low = asyncio.run(low_load_tpot({"static": static_cfg, "elastic": elastic_cfg}, 256, 32 if args.quick else 128,
                                    3 if args.quick else 7))
    low_load_tpot_ratio = low["elastic"] / low["static"]
    print(f"online: {count} requests at {rate:.2f}/s (half {long_tokens}-token prompts, half {short_tokens}), "
          f"SLOs TTFT long {slo['ttft_long_s']:.2f} s, short {slo['ttft_short_s']:.2f} s, TPOT {1000 * slo['tpot_s']:.0f} ms")
    for name in ("static", "elastic"):
        f = figures[name]
        print(f"  {name:8} TTFT p50/p99 {f['ttft_p50_s']:.2f}/{f['ttft_p99_s']:.2f} s, TPOT p50/p99 "
              f"{f['tpot_p50_ms']:.0f}/{f['tpot_p99_ms']:.0f} ms, SLO met {100 * f['slo_attainment']:.0f}%, "
              f"goodput {f['goodput_per_s']:.3f}/s")
    print(f"low load TPOT: static {1000 * low['static']:.2f} ms, elastic {1000 * low['elastic']:.2f} ms")
    gpu_map_us = chunk_map_latency_us(device)
    if gpu_map_us is not None:
        print(f"GPU chunk map/unmap: {gpu_map_us['map']:.1f}/{gpu_map_us['unmap']:.1f} us per 2 MiB chunk")
    targets = [("batch >= 2x static", headline["batch_ratio"] >= 2.0, f"{headline['batch_ratio']:.2f}x"),
               ("goodput >= 1.5x static", goodput_ratio is not None and goodput_ratio >= 1.5,
                f"{goodput_ratio:.2f}x" if goodput_ratio is not None else
                "not measured: the static engine met no request's SLOs"),
               ("low-load TPOT <= 1.05x static", low_load_tpot_ratio <= 1.05, f"{low_load_tpot_ratio:.3f}x")]
    for name, met, value in targets:
        print(f"{'PASS' if met else 'MISS'} {name}: {value}")
    print(json.dumps({
        "static_max_batch": headline["static"]["max_batch"], "elastic_max_batch": headline["elastic"]["max_batch"],
        "batch_ratio": headline["batch_ratio"], "goodput_ratio": goodput_ratio, "low_load_tpot_ratio": low_load_tpot_ratio,
        "context_tokens": context, "device": device, "reserve_share": headline["reserve_share"],
        "budget_bytes": headline["budget_bytes"], "rows": rows, "online": figures, "slo": slo,
        "unloaded_static": base_static, "low_load_tpot_s": low, "gpu_chunk_map_us": gpu_map_us,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
