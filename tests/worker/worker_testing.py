"""Shared by the worker tests: the tiny model's test sizes, a long-lived event loop, engine start-up.

Engines are expensive to start (vLLM takes ~25 s on these machines), so each engine kind is started
once per session and shared; tests drive it from a background event loop through `EngineLoop.run`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from kvfleet.worker.elastic.options import MemoryOptions
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import Engine, EngineInfo, SamplingParams, StepOutput
from kvfleet.worker.engines.builtin.options import BuiltinOptions
from kvfleet.worker.engines.vllm.options import VLLMOptions

T = TypeVar("T")

# 2 KV heads x 64 dims x 2 layers x K,V x 4 bytes = 2 KiB a token: 16 MiB holds 8,192 tokens.
TEST_KV_CAPACITY_BYTES = 16 * 1024 * 1024
TEST_MAX_MODEL_LEN = 512


class EngineLoop:
    """An asyncio loop in a thread, so session-scoped engines outlive any one test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def skip_without_vllm() -> None:
    """Skips a vLLM test where vLLM is not installed, unless the run requires it (`make test` does)."""
    if not vllm_available():
        if os.environ.get("KVFLEET_REQUIRE_VLLM") == "1":
            pytest.fail("KVFLEET_REQUIRE_VLLM=1 but vllm is not installed (run: bash scripts/install-vllm.sh .venv)")
        pytest.skip("vllm is not installed (bash scripts/install-vllm.sh .venv); KVFLEET_REQUIRE_VLLM=1 makes this a failure")


class StartedEngine:
    def __init__(self, name: str, engine: Engine, info: EngineInfo, loop: EngineLoop) -> None:
        self.name = name
        self.engine = engine
        self.info = info
        self.loop = loop


def start_engine(name: str, model_dir: Path, engines: dict[str, StartedEngine], loop: EngineLoop) -> StartedEngine:
    """The session's engine of this kind, started on first use."""
    if name.startswith("vllm"):
        skip_without_vllm()
    if name not in engines:
        config = EngineConfig(model_path=model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                              max_model_len=TEST_MAX_MODEL_LEN, max_num_seqs=16, dtype="float32")
        options: BuiltinOptions | VLLMOptions | None = None
        if name == "builtin-elastic":  # the builtin engine with elastic memory keeps the same contract
            options = BuiltinOptions(memory=MemoryOptions(budget_bytes=4 * TEST_KV_CAPACITY_BYTES, elastic=True,
                                                          cpu_buffer_bytes=TEST_KV_CAPACITY_BYTES))
        elif name == "vllm-elastic":  # and vLLM with elastic memory (engines/vllm/elastic.py)
            config = replace(config, kv_capacity_bytes=None)
            options = VLLMOptions(memory=MemoryOptions(budget_bytes=4 * TEST_KV_CAPACITY_BYTES, elastic=True))
        elif name == "vllm-distattention":  # and vLLM attending through kvfleet's backend (vllm/attention.py)
            options = VLLMOptions(attention="distattention")
        engine = load_engine(name.split("-")[0], config, options)
        info = loop.run(engine.start(), timeout_s=300)
        engines[name] = StartedEngine(name, engine, info, loop)
    return engines[name]


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """Greedy sampling that ignores EOS unless told otherwise, so a run's length is known."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


async def collect(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    return [out async for out in engine.generate(request_id, prompt, params)]


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
    """Run a coroutine to its end on a fresh event loop, failing it after `timeout_s`."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def tokens_of(stream: AsyncIterator[StepOutput]) -> list[int]:
    """Every token a generate() stream yields, in order."""
    return [t async for out in stream for t in out.new_token_ids]


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]


# The elastic-memory tests' workload: prompts long enough to grow several blocks and still running
# when the pool runs short (test_elastic_engine.py, test_elastic_overlap.py).
ELASTIC_PROMPTS = [[1, *range(10 + 7 * i, 10 + 7 * i + 20 + 3 * i)] for i in range(10)]
ELASTIC_MAX_TOKENS = 40


# The tiny model's vocabulary: the width of its logits.
TINY_VOCAB_SIZE = 2048


class Sequenced:
    """A fake grammar (builtin/sampling.py's TokenConstraint): exactly the next token of a fixed sequence
    may come; finished at its end. `done`: the output already generated (a moved request's)."""

    def __init__(self, tokens: Sequence[int], width: int = TINY_VOCAB_SIZE, done: Sequence[int] = ()) -> None:
        self.tokens, self.width, self.at = list(tokens), width, 0
        for token in done:
            self.advance(token)

    def allowed(self) -> Any:
        mask = torch.zeros(self.width, dtype=torch.bool)
        if self.at < len(self.tokens):
            mask[self.tokens[self.at]] = True
        return mask

    def advance(self, token_id: int) -> None:
        if self.finished or token_id != self.tokens[self.at]:
            raise ValueError(f"token {token_id} does not follow")
        self.at += 1

    @property
    def finished(self) -> bool:
        return self.at == len(self.tokens)


class SharedEngine:
    """The session's engine behind an agent that must not stop it (other tests use it too).

    Everything but stop() is the engine's own (delegated), so the wrapper keeps up with the contract.
    """

    def __init__(self, started: StartedEngine) -> None:
        self._engine = started.engine

    async def stop(self) -> None:
        pass

    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def activation_slack(new_tokens: int, attention: str) -> float:
    """How far above a forward's measured peak (besides the fixed part) the activation charge may be:
    1.6x, but 2x for a DistAttention decode on the CPU, whose C kernel (kvfleet.kernels.cpu_native)
    allocates nothing per token, so the workspace in the fixed part goes unused and a decode's charge
    is the rest of the layer's, about 1.8x what it allocates."""
    from kvfleet.kernels import cpu_native

    native_decode = attention == "distattention" and new_tokens == 1 and cpu_native.status() == "native"
    return 2.0 if native_decode else 1.6
