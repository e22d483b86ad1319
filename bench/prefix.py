#!/usr/bin/env python3
"""Context caching and prefix-aware routing (MemServe): what the prefix cache and the
router's global prompt tree do to time to first token, against MELL's placement without a cache.

Three builtin workers (a small Llama-shaped model with random weights, float32 on the CPU) behind
one router, all in this process on loopback, serve multi-turn chat sessions: every session starts
with the same system prompt, each turn's prompt is the previous prompt, its answer and a new
question, and a turn is sent when the previous answer has come back; sessions start as a Poisson
process. Four setups, each on fresh workers:

- `no-cache`: MELL's placement (the router's Allocate), workers without a prefix cache;
- `cache`: the same placement, workers with the cache (MemServe §4.1-4.2);
- `session`: the cache, and a session's turns sent to the worker of its previous turn when it has
  room (MemServe Table 6's session-ID policy);
- `prompt-tree`: the cache, and the router's global prompt tree with exec(x, y) (MemServe §6, §5.3).

Reported per setup: TTFT mean and p99, mean job time (arrival to last token), prompt tokens the
engines prefilled. Then the radix index's `insert` / `match` latency against the number of cached
blocks (MemServe Fig. 9's analogue), for the engine's MemPool tree and the router's global tree.

    python bench/prefix.py            # 40 sessions x 5 turns, a few minutes on 2 cores
    python bench/prefix.py --quick    # 6 sessions x 2 turns (make test runs it)

Prints the machine first and, as its last line, one JSON object: ttft_mean_ms and prefilled_tokens
keyed by setup, ttft_cut_vs_no_cache (1 - prompt-tree mean / no-cache mean), and more.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback import free_port, wait_ready  # noqa: E402
from _machine import cpu_model  # noqa: E402

from kvfleet.router.app import Router, RouterConfig  # noqa: E402
from kvfleet.router.locality import GlobalPromptTree, Locality  # noqa: E402
from kvfleet.router.placement import PoolSnapshot, WorkerState  # noqa: E402
from kvfleet.router.pool import StaticPoolView  # noqa: E402
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.serving.prompt_tree import PromptTree  # noqa: E402
from kvfleet.sim.result import nearest_rank  # noqa: E402
from kvfleet.worker.agent import Agent, AgentConfig  # noqa: E402
from kvfleet.worker.engines import EngineConfig, load_engine  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine  # noqa: E402
from kvfleet.worker.model.tiny import TinySpec, make_tiny  # noqa: E402
from kvfleet.worker.text import Tokenizer  # noqa: E402

TOKEN = "bench-prefix-token"
# A model whose prefill is worth saving on a CPU: 4 layers of 512 (about 20M parameters).
SPEC = TinySpec(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1376)
SETUPS: tuple[tuple[str, bool, Locality], ...] = (
    ("no-cache", False, "none"), ("cache", True, "none"), ("session", True, "session"), ("prompt-tree", True, "prompt-tree"))


@dataclass(frozen=True)
class Workload:
    sessions: int
    turns: int
    system_tokens: int
    question_tokens: int
    answer_tokens: int
    sessions_per_s: float
    seed: int = 0


@dataclass
class Turn:
    ttft_s: float
    job_s: float


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    port = free_port()
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"127.0.0.1:{port}"


async def one_turn(session: aiohttp.ClientSession, router: str, prompt: list[int], max_tokens: int,
                   user: str) -> tuple[Turn, str]:
    """One streamed completion through the router: its TTFT (to the first text) and job time, and the
    answer's text (a client sees text; the next turn sends it back, tokenized again)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "user": user}
    started = time.perf_counter()
    first: float | None = None
    texts: list[str] = []
    async with session.post(f"http://{router}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: "):]).get("choices") or []
            text = choices[0].get("text", "") if choices else ""
            if text and first is None:
                first = time.perf_counter()
            texts.append(text)
    end = time.perf_counter()
    return Turn((first or end) - started, end - started), "".join(texts)


async def run_setup(name: str, caching: bool, locality: Locality, model_dir: Path, work: Workload,
                    capacity_bytes: int) -> dict[str, Any]:
    tokenizer = Tokenizer(model_dir)
    agents: list[Agent] = []
    runners: list[web.AppRunner] = []
    workers: list[WorkerState] = []
    for i in range(3):
        engine = load_engine("builtin", EngineConfig(model_path=model_dir, kv_capacity_bytes=capacity_bytes,
                                                     max_model_len=2048, max_num_seqs=32, dtype="float32",
                                                     prefix_caching=caching))
        agent = Agent(AgentConfig(model_name="tiny", credentials=PoolCredentials.of(TOKEN), migration_port=None), engine, tokenizer, None)
        runner, address = await serve(agent.app())
        agents.append(agent)
        runners.append(runner)
        workers.append(WorkerState(f"worker-{i}", address, True, i, None))
    router = Router(RouterConfig(pool_name="bench", credentials=PoolCredentials.of(TOKEN)), StaticPoolView(
        PoolSnapshot(tuple(workers), {}, locality=locality)))
    router_runner, router_address = await serve(router.app())
    runners.append(router_runner)
    rng = random.Random(work.seed)
    vocab = SPEC.vocab_size
    bos = tokenizer.encode("")

    def answer_ids(text: str) -> list[int]:
        ids = tokenizer.encode(text)
        return ids[len(bos):] if ids[:len(bos)] == bos else ids
    system = [rng.randrange(3, vocab) for _ in range(work.system_tokens)]
    turns: list[Turn] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for w in workers:
                await wait_ready(session, w.address, timeout_s=60)
            await wait_ready(session, router_address, timeout_s=60)

            async def conversation(index: int, start_s: float) -> None:
                await asyncio.sleep(start_s)
                local = random.Random(work.seed * 1000 + index)
                prompt = list(system)
                for _ in range(work.turns):
                    prompt += [local.randrange(3, vocab) for _ in range(work.question_tokens)]
                    turn, answer = await one_turn(session, router_address, prompt, work.answer_tokens, f"s{index}")
                    turns.append(turn)
                    prompt += answer_ids(answer)

            starts, t = [], 0.0
            for _ in range(work.sessions):
                starts.append(t)
                t += rng.expovariate(work.sessions_per_s)
            began = time.perf_counter()
            await asyncio.gather(*(conversation(i, s) for i, s in enumerate(starts)))
            elapsed_s = time.perf_counter() - began
    finally:
        for r in runners:
            await r.cleanup()
    prefilled = sum(a.engine.num_prefilled_tokens for a in agents if isinstance(a.engine, BuiltinEngine))
    ttfts_ms = [t.ttft_s * 1000 for t in turns]
    placements = {s.labels["rule"]: int(s.value) for m in router.metrics.placements.collect() for s in m.samples
                  if s.name.endswith("_total")}
    return {"setup": name, "turns": len(turns), "ttft_mean_ms": statistics.fmean(ttfts_ms),
            "ttft_p99_ms": nearest_rank(ttfts_ms, 99), "job_mean_ms": statistics.fmean(t.job_s * 1000 for t in turns),
            "prefilled_tokens": prefilled, "elapsed_s": elapsed_s, "placements": placements}


def radix_latency(sizes: list[int], repeats: int) -> list[dict[str, float]]:
    """insert / match of a 64-block prompt against trees holding `size` cached blocks (Fig. 9's analogue)."""
    rng = random.Random(1)
    bs, prompt_blocks = 16, 64
    rows = []
    for size in sizes:
        tree: PromptTree[int] = PromptTree(bs)
        glob = GlobalPromptTree(bs, ttl_s=1e9, max_blocks=10 * size + 1000)
        prompts = []
        for i in range(size // prompt_blocks):
            tokens = [rng.randrange(2048) for _ in range(prompt_blocks * bs)]
            tree.insert(tokens, list(range(i * prompt_blocks, (i + 1) * prompt_blocks)))
            glob.insert(f"w{i % 3}", tokens, now_s=float(i))
            prompts.append(tokens)
        probes = [rng.choice(prompts) for _ in range(repeats)]
        fresh = [[rng.randrange(2048) for _ in range(prompt_blocks * bs)] for _ in range(repeats)]

        def timed(fn: Any, items: list[list[int]]) -> float:
            # The garbage of building the tree first: a collection of it inside the loop is not the
            # index's cost (it made the match at 131K blocks read 40x slower than it is).
            gc.collect()
            start = time.perf_counter()
            for item in items:
                fn(item)
            return (time.perf_counter() - start) / len(items) * 1e6

        rows.append({"cached_blocks": tree.num_blocks,
                     "match_us": timed(tree.match, probes),
                     "insert_us": timed(lambda t, tree=tree: tree.insert(t, list(range(prompt_blocks))), fresh),
                     "global_match_us": timed(lambda t, glob=glob: glob.match(t, now_s=0.0), probes)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 sessions x 2 turns, small radix trees")
    p.add_argument("--model-dir", type=Path, default=None, help="where to build the model (default: a temp dir)")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = (Workload(6, 2, 256, 16, 8, 4.0) if args.quick
            else Workload(40, 5, 512, 32, 24, 1.0))
    model_dir = make_tiny((args.model_dir or Path(tempfile.mkdtemp())) / "prefix-bench", spec=SPEC)
    kv_bytes_per_token = 2 * SPEC.num_layers * SPEC.num_kv_heads * SPEC.head_dim * 4
    longest = work.system_tokens + work.turns * (work.question_tokens + work.answer_tokens)
    # Each worker holds about four of the longest prompts at once: MELL spreads the sessions over
    # the three workers when they overlap, and a worker's cache competes with its running requests.
    capacity_bytes = 4 * longest * kv_bytes_per_token
    print(f"host: {platform.node()} ({cpu_model()}, {torch.get_num_threads()} torch threads), device: cpu, "
          f"python {platform.python_version()}, torch {torch.__version__}")
    print(f"workload: {work.sessions} sessions x {work.turns} turns, system prompt {work.system_tokens} tokens, "
          f"questions {work.question_tokens}, answers {work.answer_tokens}, sessions start at {work.sessions_per_s}/s; "
          f"3 workers of {capacity_bytes / 2**20:.1f} MiB KV ({capacity_bytes // kv_bytes_per_token} tokens)")
    results = {}
    for name, caching, locality in SETUPS:
        r = asyncio.run(run_setup(name, caching, locality, model_dir, work, capacity_bytes))
        results[name] = r
        print(f"{name:>12}: TTFT mean {r['ttft_mean_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms  "
              f"job mean {r['job_mean_ms']:8.1f} ms  prefilled {r['prefilled_tokens']:>8} tokens  "
              f"({r['turns']} turns in {r['elapsed_s']:.1f} s; placements {r['placements']})", flush=True)
    radix = radix_latency([1024, 8192] if args.quick else [1024, 16384, 131072], 50 if args.quick else 200)
    for row in radix:
        print(f"radix: {row['cached_blocks']:>7} cached blocks: match {row['match_us']:7.1f} us, insert "
              f"{row['insert_us']:7.1f} us, global-tree match {row['global_match_us']:7.1f} us (64-block prompt)")
    base = results["no-cache"]["ttft_mean_ms"]
    cut = 1 - results["prompt-tree"]["ttft_mean_ms"] / base if base > 0 else None
    vs_session = results["prompt-tree"]["ttft_mean_ms"] / results["session"]["ttft_mean_ms"]
    print(f"prompt tree: TTFT mean {cut:.1%} below no cache (target >= 50%), "
          f"{vs_session:.2f}x session affinity's (target < 1)" if cut is not None else "no TTFT measured")
    print(json.dumps({
        "ttft_mean_ms": {k: round(v["ttft_mean_ms"], 2) for k, v in results.items()},
        "ttft_p99_ms": {k: round(v["ttft_p99_ms"], 2) for k, v in results.items()},
        "job_mean_ms": {k: round(v["job_mean_ms"], 2) for k, v in results.items()},
        "prefilled_tokens": {k: v["prefilled_tokens"] for k, v in results.items()},
        "ttft_cut_vs_no_cache": round(cut, 4) if cut is not None else None,
        "prompt_tree_over_session_ttft": round(vs_session, 4),
        "radix_match_us": {str(int(r["cached_blocks"])): round(r["match_us"], 2) for r in radix},
        "radix_insert_us": {str(int(r["cached_blocks"])): round(r["insert_us"], 2) for r in radix},
        "sessions": work.sessions, "turns": work.turns, "device": "cpu",
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
