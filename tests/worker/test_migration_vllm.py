"""Migration with vLLM: token mode through its public API (abort, resubmit prompt + output), both ways.

vLLM exposes no running request's KV, so a migration from or to a vLLM worker runs in token mode
and a KVMigration that asked for KV says it fell back (docs/migration.md). Under greedy decoding the
client's stream is still token for token the unmigrated output: the two engines agree on greedy
tokens for the same model (test_engine_contract.py), and vLLM re-prefills prompt + output with the
rest of the budget.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from migration_testing import (
    MAX_TOKENS,
    Worker,
    follow_target,
    reference,
    start_worker,
    stream_with_migration,
    wait_idle,
)
from worker_testing import EngineLoop, StartedEngine, start_engine

from kvfleet.worker.engines.base import EngineInfo


class SharedEngine:
    """The session's vLLM engine behind an agent that must not stop it (other tests use it too).

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


@pytest.fixture(scope="module")
def vllm_and_builtin(tiny_model_dir: Path, engine_loop: EngineLoop,
                     started_engines: dict[str, StartedEngine]) -> Iterator[tuple[Worker, Worker]]:
    started = start_engine("vllm", tiny_model_dir, started_engines, engine_loop)
    v = start_worker("worker-vllm", tiny_model_dir, engine_loop, engine=SharedEngine(started))
    b = start_worker("worker-builtin", tiny_model_dir, engine_loop)
    yield v, b
    for w in (v, b):
        engine_loop.run(w.runner.cleanup())


def payload() -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Once upon a time, in a land far away, there lived", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("direction", ["vllm-to-builtin", "builtin-to-vllm"])
@pytest.mark.parametrize("router", [False, True])
def test_token_mode_keeps_greedy_output(vllm_and_builtin: tuple[Worker, Worker], direction: str, router: bool) -> None:
    v, b = vllm_and_builtin
    source, target = (v, b) if direction == "vllm-to-builtin" else (b, v)
    ref_text, ref_ids = reference(v, payload())
    assert reference(b, payload())[1] == ref_ids, "the engines disagree on greedy tokens: the comparison means nothing"
    request_id = f"{direction}-{'router' if router else 'direct'}"
    streamed, result = stream_with_migration(source, target, request_id, "token", payload=payload(), router=router)
    assert result["phase"] == "Succeeded", result
    assert result["mode"] == "token" and result["bytesMoved"] == 0
    if router:
        moved = json.loads(streamed.events[-1][1])
        rest = follow_target(target, request_id, moved["index"])
        ids = [t for c in streamed.chunks + rest.chunks for t in c["kvfleet"]["token_ids"]]
        assert ids == ref_ids
        assert streamed.text + rest.text == ref_text
    else:
        assert streamed.done and streamed.text == ref_text
    wait_idle(v, b)


def test_kv_mode_with_vllm_falls_back_to_tokens_and_says_so(vllm_and_builtin: tuple[Worker, Worker]) -> None:
    v, b = vllm_and_builtin
    ref_text, _ = reference(v, payload())
    streamed, result = stream_with_migration(v, b, "vllm-kv-asked", "kv", payload=payload())
    assert result["phase"] == "Succeeded", result
    assert result["mode"] == "token"
    assert "moved as tokens" in result["message"] and "vllm" in result["message"]
    assert streamed.done and streamed.text == ref_text
    wait_idle(v, b)
