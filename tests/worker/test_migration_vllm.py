"""Migration with vLLM between agents, both ways with the builtin engine: token mode (abort, resubmit
prompt + output), and KV and hybrid modes through kvfleet's KV connector inside vLLM (the source
stops the request with its blocks kept, the KV crosses the migration transport, the target loads it
and recomputes only the tail). Under greedy decoding the client's stream is token for token the
unmigrated output: the two engines agree on greedy tokens for the same model (test_engine_contract.py).
The abort paths keep the request running on the source: a target that dies once the request is stopped
(it resumes from its own kept blocks, with the presence and frequency penalties counting the output it
had: engines/vllm/penalties.py), and a target without room (refused before it stops). A request with a
structured-output constraint moves off vLLM and onto it like any other: both engines constrain with
kvfleet's llguidance grammars (engines/grammar.py; on vLLM through kvfleet's logits processor,
engines/vllm/structured.py), rebuilt at the target from the output so far, so the moved output still
follows the constraint and is the unmoved one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from migration_testing import (
    MAX_TOKENS,
    FixedPort,
    Worker,
    fake_destination,
    follow_target,
    reference,
    start_worker,
    stream_with_migration,
    wait_idle,
)
from worker_testing import EngineLoop, SharedEngine, StartedEngine, start_engine


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


LETTERS = "[a-z]{300}"


def constrained_payload() -> dict[str, Any]:
    # The grammar holds EOS back until all 300 letters are written: the request outlives the move's start
    # (asked after 10 chunks) even when the tiny model writes several letters a token and the move's
    # request is slow to come, as on a loaded machine (80 letters could all be out first).
    return {"model": "tiny", "prompt": "Once upon a time, in a land far away, there lived", "max_tokens": 400,
            "temperature": 0, "structured_outputs": {"regex": LETTERS}}


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


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
@pytest.mark.parametrize("direction", ["vllm-to-builtin", "builtin-to-vllm"])
def test_kv_modes_move_the_kv_through_vllms_connector(vllm_and_builtin: tuple[Worker, Worker], direction: str,
                                                     mode: str) -> None:
    v, b = vllm_and_builtin
    source, target = (v, b) if direction == "vllm-to-builtin" else (b, v)
    ref_text, _ = reference(v, payload())
    # Past vLLM's first 128-token block, so that a stage has a full block to copy while it decodes.
    streamed, result = stream_with_migration(source, target, f"{direction}-{mode}", mode, payload=payload(),
                                             after_chunks=140)
    assert result["phase"] == "Succeeded", result
    assert result["mode"] == mode and result["bytesMoved"] > 0, result
    assert "tokens" not in result["message"], result
    assert streamed.done and streamed.text == ref_text
    wait_idle(v, b)


def test_a_target_that_dies_at_commit_leaves_the_vllm_request_running_from_its_own_kv(
        vllm_and_builtin: tuple[Worker, Worker], engine_loop: EngineLoop) -> None:
    """Stopped in vLLM (its blocks kept by the connector) when the target vanishes: the request resumes on
    the source from those blocks, and the client's stream stays whole."""
    v, b = vllm_and_builtin
    ref_text, _ = reference(v, payload())
    port, listener = fake_destination(engine_loop, "commit")
    real = b.agent._listener
    try:
        b.agent._listener = FixedPort(port)  # type: ignore[assignment]
        streamed, result = stream_with_migration(v, b, "vllm-dies-at-commit", "kv", payload=payload())
    finally:
        b.agent._listener = real
        engine_loop.run(listener.close())
    assert result["phase"] == "Failed" and "keeps running on the source" in result["message"], result
    assert streamed.done and streamed.text == ref_text
    wait_idle(v, b)


def test_a_target_without_room_fails_the_move_and_the_vllm_request_runs_on(
        vllm_and_builtin: tuple[Worker, Worker], tiny_model_dir: Path, engine_loop: EngineLoop) -> None:
    v, _ = vllm_and_builtin
    small = start_worker("worker-small", tiny_model_dir, engine_loop, kv_capacity_bytes=16 * 2048)  # one block
    try:
        ref_text, _ = reference(v, payload())
        streamed, result = stream_with_migration(v, small, "vllm-no-room", "kv", payload=payload(), after_chunks=140)
        assert result["phase"] == "Failed" and "no room" in result["message"], result
        assert streamed.done and streamed.text == ref_text
        wait_idle(v, small)
    finally:
        engine_loop.run(small.runner.cleanup())


def test_a_rolled_back_vllm_request_keeps_its_penalties(vllm_and_builtin: tuple[Worker, Worker],
                                                        engine_loop: EngineLoop) -> None:
    """Resumed on vLLM from its own KV with the output it had as prompt: vLLM alone would count presence and
    frequency over what it generates from then on; the client's stream must be the unmoved one."""
    v, b = vllm_and_builtin
    penalized = {**payload(), "presence_penalty": 2.0, "frequency_penalty": 1.0}
    ref_text, ref_ids = reference(v, penalized)
    assert ref_ids != reference(v, payload())[1], "the penalties change nothing on this prompt"
    port, listener = fake_destination(engine_loop, "commit")
    real = b.agent._listener
    try:
        b.agent._listener = FixedPort(port)  # type: ignore[assignment]
        streamed, result = stream_with_migration(v, b, "vllm-penalized-dies-at-commit", "kv", payload=penalized,
                                                 after_chunks=40)
    finally:
        b.agent._listener = real
        engine_loop.run(listener.close())
    assert result["phase"] == "Failed" and "keeps running on the source" in result["message"], result
    assert streamed.done and streamed.text == ref_text
    wait_idle(v, b)


@pytest.mark.parametrize("mode", ["token", "kv"])
@pytest.mark.parametrize("direction", ["vllm-to-builtin", "builtin-to-vllm"])
def test_a_structured_request_moves_with_its_grammar(vllm_and_builtin: tuple[Worker, Worker], direction: str,
                                                     mode: str) -> None:
    v, b = vllm_and_builtin
    source, target = (v, b) if direction == "vllm-to-builtin" else (b, v)
    ref_text, _ = reference(v, constrained_payload())
    assert re.fullmatch(LETTERS, ref_text), ref_text
    assert reference(b, constrained_payload())[0] == ref_text, "the engines disagree: the comparison means nothing"
    streamed, result = stream_with_migration(source, target, f"{direction}-structured-{mode}", mode,
                                             payload=constrained_payload(), after_chunks=10)
    assert result["phase"] == "Succeeded" and result["mode"] == mode, result
    # The target went on with the grammar where it was: still the 300 letters, and the unmoved ones.
    assert streamed.done and streamed.text == ref_text, (streamed.text, ref_text)
    wait_idle(v, b)


def test_a_rolled_back_structured_vllm_request_keeps_its_grammar(vllm_and_builtin: tuple[Worker, Worker],
                                                                 engine_loop: EngineLoop) -> None:
    """Stopped in vLLM for a move whose target vanishes: resumed on the source from its own KV, with the
    output it had as prompt, its grammar goes on from that output (vLLM's own would start again)."""
    v, b = vllm_and_builtin
    ref_text, _ = reference(v, constrained_payload())
    port, listener = fake_destination(engine_loop, "commit")
    real = b.agent._listener
    try:
        b.agent._listener = FixedPort(port)  # type: ignore[assignment]
        streamed, result = stream_with_migration(v, b, "vllm-structured-dies-at-commit", "kv",
                                                 payload=constrained_payload(), after_chunks=10)
    finally:
        b.agent._listener = real
        engine_loop.run(listener.close())
    assert result["phase"] == "Failed" and "keeps running on the source" in result["message"], result
    assert streamed.done and streamed.text == ref_text and re.fullmatch(LETTERS, streamed.text)
    wait_idle(v, b)
