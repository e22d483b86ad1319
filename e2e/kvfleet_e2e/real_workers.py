"""What the e2e tests with real builtin workers share: seeded prompts, the unmigrated, unpooled
greedy output each request must come back equal to, and a streaming client that reads it back."""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import os
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import SamplingParams


def require_vllm() -> None:
    """Skips a test of vLLM workers where vllm is not installed; fails it where KVFLEET_REQUIRE_VLLM=1 says it must be."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("KVFLEET_REQUIRE_VLLM") == "1":
            pytest.fail("KVFLEET_REQUIRE_VLLM=1 but vllm is not installed (bash scripts/install-vllm.sh .venv)")
        pytest.skip("vllm is not installed (bash scripts/install-vllm.sh .venv)")


def seeded_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids of the tiny model, BOS first, the same for the same seed."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 2000) for _ in range(length - 1)]


def greedy_outputs(model_dir: Path, requests: Sequence[tuple[str, int, int]], kv_capacity_bytes: int,
                   engine_name: str = "builtin") -> dict[str, list[int]]:
    """Each (request id, prompt tokens, output tokens)'s greedy tokens on a plain engine of that kind, one
    request at a time, the i-th request's prompt seeded with i."""

    async def run() -> dict[str, list[int]]:
        engine = load_engine(engine_name, EngineConfig(model_path=model_dir, kv_capacity_bytes=kv_capacity_bytes,
                                                       max_model_len=2048))
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


def stream_completion(ip: str, request_id: str, body: dict[str, Any], *, direct: bool = False) -> tuple[str, int, str | None]:
    """(text, completion tokens, last finish reason) of a streamed completion from a worker or a router
    at `ip`:8000. A `direct` client (no router) must never see an SSE event: its worker relays a
    migrated request's continuation itself."""
    conn = http.client.HTTPConnection(ip, 8000, timeout=300)
    conn.request("POST", "/v1/completions",
                 json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode(),
                 {"Content-Type": "application/json", "X-Request-Id": request_id})
    response = conn.getresponse()
    assert response.status == 200, (request_id, response.status, response.read()[:400])
    text: list[str] = []
    tokens, finish, done = 0, None, False
    for raw in response:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
        elif direct and line.startswith("event: "):
            raise AssertionError(f"a direct client saw {line}")
    assert done, f"the stream of {request_id} ended without [DONE] after {len(text)} chunks"
    return "".join(text), tokens, finish


def stream_all(ip: str, requests: Sequence[tuple[str, int, int]], *, direct: bool = False,
               timeout_s: float = 240) -> dict[str, tuple[str, int, str | None]]:
    """Every (request id, prompt tokens, output tokens) streamed greedily at once from `ip`:8000, the i-th
    prompt seeded with i (as `greedy_outputs`): request id -> `stream_completion`'s answer. A client's
    error is raised here."""
    results: dict[str, tuple[str, int, str | None]] = {}
    errors: list[BaseException] = []

    def client(i: int, rid: str, length: int, max_tokens: int) -> None:
        try:
            body = {"model": "tiny", "prompt": seeded_prompt(length, i), "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            results[rid] = stream_completion(ip, rid, body, direct=direct)
        except BaseException as err:  # reported on the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=client, args=(i, *r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not errors, errors
    return results
