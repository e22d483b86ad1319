"""Decode throughput of the builtin engine against vLLM, and KV-load report writes under steady load.

Both engines serve the same tiny local model (`kvfleet model make-tiny`, float32) with the same
prompts, greedy, in one run: both loaded side by side, then measured in alternating rounds (one
request, then a batch of concurrent ones; median of the rounds), so load from elsewhere on a shared
machine slows both alike. The ratio printed is builtin tokens/s over vLLM tokens/s on the batch (the
figure a serving pod lives by). On a GPU machine both run on the GPU; here, on the CPU.

Report writes: the worker's LoadReporter runs against the builtin engine while a steady Poisson
stream of requests arrives and finishes; it writes only on arrivals, finishes and size-class
changes, at most once per interval. The baseline in the same run is what a per-token reporter would
write: one write per generated token. Last line: one JSON object with `builtin_tokens_per_s`,
`vllm_tokens_per_s`, `ratio`, `report_writes_per_s` (and the per-token baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import Engine, SamplingParams
from kvfleet.worker.model.tiny import make_tiny
from kvfleet.worker.reporter import LoadReporter

KV_CAPACITY_BYTES = 64 * 1024 * 1024


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 2000) for _ in range(rng.randrange(16, 96))] for _ in range(count)]


async def decode(engine: Engine, batch: list[list[int]], max_tokens: int, tag: str) -> tuple[int, float]:
    """Generated tokens and seconds for the batch run concurrently."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> int:
        return sum([len(out.new_token_ids) async for out in engine.generate(f"{tag}-{i}", prompt, params)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    return sum(counts), time.perf_counter() - start


async def throughput(names: list[str], model: Path, batch: list[list[int]], max_tokens: int, device: str,
                     repeat: int) -> dict[str, dict[str, float]]:
    """Both engines loaded side by side and measured in alternation, `repeat` rounds, median kept:
    a burst of load from elsewhere on the machine then slows both, not only the one it hits."""
    engines = {}
    load_s = {}
    for name in names:
        engines[name] = load_engine(name, EngineConfig(model_path=model, kv_capacity_bytes=KV_CAPACITY_BYTES,
                                                       max_model_len=1024, max_num_seqs=len(batch), dtype="float32",
                                                       device=device))
        t0 = time.perf_counter()
        await engines[name].start()
        load_s[name] = time.perf_counter() - t0
    single: dict[str, list[float]] = {name: [] for name in names}
    batched: dict[str, list[float]] = {name: [] for name in names}
    try:
        for name, engine in engines.items():
            await decode(engine, batch[:2], 4, f"{name}-warm")  # first-call costs (allocations, compilation)
        for r in range(repeat):
            for name, engine in engines.items():
                tokens, seconds = await decode(engine, batch[:1], max_tokens, f"{name}-one-{r}")
                single[name].append(tokens / seconds)
                tokens, seconds = await decode(engine, batch, max_tokens, f"{name}-batch-{r}")
                batched[name].append(tokens / seconds)
    finally:
        for engine in engines.values():
            await engine.stop()
    results = {}
    for name in names:
        results[name] = {"load_s": load_s[name], "single_tokens_per_s": statistics.median(single[name]),
                         "batch_tokens_per_s": statistics.median(batched[name])}
        print(f"{name:8s} load {load_s[name]:6.1f} s   1 request {results[name]['single_tokens_per_s']:8.1f} tok/s   "
              f"{len(batch)} requests {results[name]['batch_tokens_per_s']:8.1f} tok/s   (median of {repeat})", flush=True)
    return results


async def report_writes(model: Path, duration_s: float, rate_per_s: float, interval_s: float, device: str) -> dict[str, float]:
    """Writes/s of the real reporter over a steady load, and tokens/s generated meanwhile."""
    engine = load_engine("builtin", EngineConfig(model_path=model, kv_capacity_bytes=KV_CAPACITY_BYTES, max_model_len=1024,
                                                 dtype="float32", device=device))
    info = await engine.start()
    writes = 0

    async def write(_: object) -> None:  # the report; only its count matters here
        nonlocal writes
        writes += 1

    reporter = LoadReporter(engine.kv_usage, info.kv_capacity_bytes, write, interval_s=interval_s)
    task = asyncio.create_task(reporter.run())
    rng = random.Random(7)
    generated = 0

    async def one(i: int) -> None:
        nonlocal generated
        prompt = [1] + [rng.randrange(3, 2000) for _ in range(rng.randrange(8, 200))]
        params = SamplingParams(max_tokens=rng.randrange(16, 160), temperature=0.0, ignore_eos=True)
        async for out in engine.generate(f"steady-{i}", prompt, params):
            generated += len(out.new_token_ids)
            reporter.nudge()  # as the agent does on arrival and finish; the reporter decides whether to write

    start = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    i = 0
    while time.perf_counter() - start < duration_s:
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(rng.expovariate(rate_per_s))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    task.cancel()
    await engine.stop()
    result = {"requests": i, "seconds": elapsed, "report_writes_per_s": writes / elapsed,
              "per_token_writes_per_s": generated / elapsed}
    print(f"reports  {i} requests in {elapsed:.1f} s, interval {interval_s} s: {result['report_writes_per_s']:.2f} writes/s "
          f"(a per-token reporter: {result['per_token_writes_per_s']:.1f} writes/s)", flush=True)
    return result


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests in the batch run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--report-seconds", type=float, default=20.0)
    parser.add_argument("--report-rate", type=float, default=2.0, help="arrivals per second in the report run")
    parser.add_argument("--report-interval", type=float, default=1.0, help="reporter interval (the pool's epoch), s")
    parser.add_argument("--model-dir", type=Path, default=None, help="where the tiny model is built (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="small sizes (tests this script)")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds per engine (median kept)")
    parser.add_argument("--no-vllm", action="store_true", help="the builtin engine only (no ratio)")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.report_seconds, args.repeat = 4, 8, 3.0, 1

    import torch  # after argparse, so --help is instant

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    print(f"host: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), python {platform.python_version()}, "
          f"torch {torch.__version__}, device {gpu or 'cpu'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny(args.model_dir or Path(tmp) / "tiny")
        batch = prompts(args.batch, seed=1)
        names = ["builtin"]
        if args.no_vllm:
            print("vllm     skipped (--no-vllm): no ratio", flush=True)
        elif vllm_installed():
            names.append("vllm")
        else:
            print("vllm     not installed (bash scripts/install-vllm.sh .venv): no ratio", flush=True)
        measured = asyncio.run(throughput(names, model, batch, args.max_tokens, device, args.repeat))
        builtin, vllm = measured["builtin"], measured.get("vllm")
        reports = asyncio.run(report_writes(model, args.report_seconds, args.report_rate, args.report_interval, device))
    ratio = builtin["batch_tokens_per_s"] / vllm["batch_tokens_per_s"] if vllm else None
    if ratio is not None:
        print(f"builtin / vLLM on {args.batch} concurrent requests: {ratio:.2f}x", flush=True)
    print(json.dumps({
        "device": gpu or "cpu", "batch": args.batch, "max_tokens": args.max_tokens,
        "builtin_tokens_per_s": round(builtin["batch_tokens_per_s"], 1),
        "vllm_tokens_per_s": round(vllm["batch_tokens_per_s"], 1) if vllm else None,
        "ratio": round(ratio, 3) if ratio is not None else None,
        "builtin_single_tokens_per_s": round(builtin["single_tokens_per_s"], 1),
        "vllm_single_tokens_per_s": round(vllm["single_tokens_per_s"], 1) if vllm else None,
        "report_writes_per_s": round(reports["report_writes_per_s"], 3),
        "per_token_writes_per_s": round(reports["per_token_writes_per_s"], 1),
    }))
    return 0


if __name__ == "__main__":  # vLLM starts processes that import this file again
    raise SystemExit(main())
