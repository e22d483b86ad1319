"""What the e2e tests with real builtin workers share: seeded prompts and the unmigrated, unpooled
greedy output each request must come back equal to."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path

from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import SamplingParams


def seeded_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids of the tiny model, BOS first, the same for the same seed."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 2000) for _ in range(length - 1)]


def greedy_outputs(model_dir: Path, requests: Sequence[tuple[str, int, int]], kv_capacity_bytes: int) -> dict[str, list[int]]:
    """Each (request id, prompt tokens, output tokens)'s greedy tokens on a plain builtin engine, the
    i-th request's prompt seeded with i (the builtin engine's greedy output is batch-invariant)."""

    async def run() -> dict[str, list[int]]:
        engine = load_engine("builtin", EngineConfig(model_path=model_dir, kv_capacity_bytes=kv_capacity_bytes))
        await engine.start()
        try:
            out: dict[str, list[int]] = {}
            for i, (rid, length, max_tokens) in enumerate(requests):
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                out[rid] = [t async for step in engine.generate(rid, seeded_prompt(length, i), params)
                            for t in step.new_token_ids]
            return out
        finally:
            await engine.stop()

    return asyncio.run(run())
