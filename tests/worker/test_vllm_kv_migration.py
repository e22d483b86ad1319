"""vLLM's KV migration capability (engines/vllm/migration.py over engines/vllm/connector.py), engine to engine.

What a migration's two executors do, called directly: suspend a running request on one engine, export
its KV, import it into another, resume there; the output must equal the unmigrated greedy output,
which only holds if the KV vLLM's connector hands out and takes in is the request's (a wrong block,
layout or offset changes the tokens). Between two vLLM engines, between vLLM and the builtin engine
(blocks of 128 and 16 tokens, one layout), and back onto the engine it was suspended on (a rolled-back
migration). Then the refusals: a request that finished, a target without room, a connector that cannot
move KV, and a load that fails (vLLM recomputes, and the migration is told).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from worker_testing import (
    TEST_KV_CAPACITY_BYTES,
    TEST_MAX_MODEL_LEN,
    EngineLoop,
    StartedEngine,
    greedy,
    skip_without_vllm,
    start_engine,
    tokens_of,
)

skip_without_vllm()

import torch  # noqa: E402

from kvfleet.worker.engines.base import Engine, EngineConfig  # noqa: E402
from kvfleet.worker.engines.capabilities import KVMigratable, MigrationError, kv_format_mismatch, split_blocks  # noqa: E402
from kvfleet.worker.engines.vllm.connector import KVLayout  # noqa: E402
from kvfleet.worker.engines.vllm.engine import VLLMEngine  # noqa: E402

PROMPT = [(7 * i + 3) % 500 + 10 for i in range(300)]   # past two of vLLM's 128-token blocks
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def second_vllm(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[VLLMEngine]:
    skip_without_vllm()
    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                                     max_model_len=TEST_MAX_MODEL_LEN, max_num_seqs=16))
    engine_loop.run(engine.start(), timeout_s=300)
    yield engine
    engine_loop.run(engine.stop())


@pytest.fixture(scope="module")
def vllm(tiny_model_dir: Path, engine_loop: EngineLoop, started_engines: dict[str, StartedEngine]) -> StartedEngine:
    return start_engine("vllm", tiny_model_dir, started_engines, engine_loop)


@pytest.fixture(scope="module")
def reference(vllm: StartedEngine) -> list[int]:
    return vllm.loop.run(tokens_of(vllm.engine.generate("kvm-reference", PROMPT, greedy(MAX_TOKENS))))


def migration_of(engine: Engine) -> KVMigratable:
    migration = engine.capabilities.migration
    assert migration is not None
    return migration


async def move(source: Engine, target: Engine, request_id: str, after_tokens: int, stages: bool = True) -> tuple[list[int], int]:
    """Runs PROMPT on `source`, moves it to `target` after `after_tokens` tokens as a KV migration's
    executors would (a stage while it decodes, suspend, the rest, resume); returns every token the
    client would see, and the target's KV usage seen while the request was suspended on the source."""
    src, dst = migration_of(source), migration_of(target)
    stream = source.generate(request_id, PROMPT, greedy(MAX_TOKENS))
    seen: list[int] = []
    async for step in stream:
        seen += step.new_token_ids
        if len(seen) >= after_tokens:
            break
    # The client keeps reading the source's stream until it ends, unfinished, at the suspension.
    reader = asyncio.create_task(tokens_of(stream))
    target_format = dst.kv_format()
    assert kv_format_mismatch(src.kv_format(), target_format) is None
    sent_block = 0
    if stages:
        first = await src.export_kv(request_id)   # full blocks, while it decodes
        assert first.num_blocks >= 1 and first.num_tokens == first.num_blocks * first.block_size_tokens
        first = first if target_format.any_block_size else split_blocks(first, target_format.block_size_tokens)
        dst.reserve_kv(request_id, -(-first.end_token // target_format.block_size_tokens))
        await dst.import_kv(request_id, first)
        sent_block = first.end_block * first.block_size_tokens // src.kv_format().block_size_tokens
    state = await src.suspend(request_id)
    seen += await reader
    assert list(state.output_token_ids) == seen
    assert state.num_cached_tokens == len(PROMPT) + len(seen) - 1
    held = {r.request_id: r.tokens for r in source.kv_usage()}
    assert held.get(request_id) == len(PROMPT) + len(seen), "a suspended request stays counted on the source, as it ran"
    rest = await src.export_kv(request_id, first_block=sent_block)
    assert rest.end_token == state.num_cached_tokens
    rest = rest if target_format.any_block_size else split_blocks(rest, target_format.block_size_tokens)
    dst.reserve_kv(request_id, -(-rest.end_token // target_format.block_size_tokens))
    await dst.import_kv(request_id, rest)
    staged = {r.request_id: r.tokens for r in target.kv_usage()}.get(request_id, 0)
    resumed = dst.resume(request_id, state.prompt_token_ids, state.output_token_ids, state.params)
    src.release(request_id)
    seen += await tokens_of(resumed)
    return seen, staged


async def idle(*engines: Engine) -> None:
    for _ in range(200):
        if not any(e.kv_usage() for e in engines):
            return
        await asyncio.sleep(0.02)
    raise AssertionError([e.kv_usage() for e in engines])


@pytest.fixture(scope="module")
def distattention(tiny_model_dir: Path, engine_loop: EngineLoop, started_engines: dict[str, StartedEngine]) -> StartedEngine:
    """vLLM attending through kvfleet's backend, whose blocks are plain NHD (connector.py PlainKVLayout)."""
    return start_engine("vllm-distattention", tiny_model_dir, started_engines, engine_loop)


@pytest.mark.parametrize("direction", ["vllm-to-vllm", "vllm-to-builtin", "builtin-to-vllm", "distattention-to-vllm",
                                       "vllm-to-distattention", "distattention-to-builtin", "builtin-to-distattention"])
def test_a_kv_move_keeps_the_greedy_output(vllm: StartedEngine, second_vllm: VLLMEngine, builtin_engine: StartedEngine,
                                           distattention: StartedEngine, reference: list[int], direction: str) -> None:
    """Between vLLM's CPU layout (calibrated), kvfleet's vLLM backend's plain one and the builtin engine's."""
    engines = {"vllm": vllm.engine, "builtin": builtin_engine.engine, "distattention": distattention.engine}
    source_name, _, target_name = direction.partition("-to-")
    source, target = engines[source_name], second_vllm if direction == "vllm-to-vllm" else engines[target_name]
    assert vllm.loop.run(tokens_of(builtin_engine.engine.generate("kvm-ref-b", PROMPT, greedy(MAX_TOKENS)))) == reference
    seen, staged = vllm.loop.run(move(source, target, f"kvm-{direction}", after_tokens=6))
    assert seen == reference
    assert staged >= len(PROMPT), "KV staged on the target counts there before the request resumes"
    vllm.loop.run(idle(source, target))


def test_a_request_resumed_where_it_was_suspended_continues_from_its_own_kv(vllm: StartedEngine, reference: list[int]) -> None:
    engine = vllm.engine
    migration = migration_of(engine)

    async def roll_back() -> list[int]:
        stream = engine.generate("kvm-rollback", PROMPT, greedy(MAX_TOKENS))
        seen: list[int] = []
        async for step in stream:
            seen += step.new_token_ids
            if len(seen) >= 5:
                break
        reader = asyncio.create_task(tokens_of(stream))
        state = await migration.suspend("kvm-rollback")
        seen += await reader
        kv = await migration.export_kv("kvm-rollback")   # a copy went out; the target then refused
        assert kv.end_token == state.num_cached_tokens
        seen += await tokens_of(migration.resume("kvm-rollback", state.prompt_token_ids, state.output_token_ids,
                                                 state.params))
        return seen

    assert vllm.loop.run(roll_back()) == reference
    vllm.loop.run(idle(engine))


def test_a_request_that_finishes_before_it_stops_is_not_suspended(vllm: StartedEngine) -> None:
    engine = vllm.engine
    migration = migration_of(engine)

    async def late() -> tuple[str, list[int]]:
        stream = engine.generate("kvm-late", PROMPT[:40], greedy(2))
        first = await stream.__anext__()
        reader = asyncio.create_task(tokens_of(stream))
        with pytest.raises(MigrationError) as refused:
            # Capped at one more token, which is its own budget's last: it finishes by itself.
            await migration.suspend("kvm-late")
        rest = await reader
        return str(refused.value), [*first.new_token_ids, *rest]

    message, seen = vllm.loop.run(late())
    # Either the connector capped it and saw it finish by itself, or it had finished before the ask came.
    assert "finished" in message, message
    assert len(seen) == 2
    with pytest.raises(MigrationError, match="holds no KV"):
        vllm.loop.run(migration.export_kv("kvm-late"))
    vllm.loop.run(idle(engine))


def test_a_target_without_room_refuses_before_the_bytes_move(vllm: StartedEngine) -> None:
    migration = migration_of(vllm.engine)
    info = vllm.info
    blocks = info.kv_capacity_bytes // (info.block_size_tokens * info.kv_bytes_per_token)
    with pytest.raises(MigrationError, match=f"no room for {blocks + 1} KV blocks"):
        migration.reserve_kv("kvm-huge", blocks + 1)
    migration.reserve_kv("kvm-fits", 2)
    assert [(r.request_id, r.tokens) for r in vllm.engine.kv_usage()] == [("kvm-fits", 2 * info.block_size_tokens)]

    async def release() -> None:   # on the engine's loop, as the executor calls it
        migration.release("kvm-fits")

    vllm.loop.run(release())
    assert vllm.engine.kv_usage() == []


def test_a_load_that_fails_is_recomputed_and_said(vllm: StartedEngine, reference: list[int]) -> None:
    """KV of the wrong shape staged behind the agent's back: the connector cannot write it, vLLM recomputes
    those tokens (kv_load_failure_policy=recompute), the output is still right, and resume_notes says so."""
    engine = vllm.engine
    migration = migration_of(engine)
    assert isinstance(engine, VLLMEngine)

    async def broken() -> tuple[list[int], list[str]]:
        outputs = reference[:4]
        migration.reserve_kv("kvm-broken", 3)
        bad = torch.zeros((2, 2, len(PROMPT), 3, 64))   # three KV heads, the model has two
        await engine._migration._client.ask("stage", bad, id="kvm-broken", first_token=0, num_tokens=len(PROMPT))  # type: ignore[union-attr]
        stream = migration.resume("kvm-broken", PROMPT, outputs, greedy(MAX_TOKENS))
        rest = await tokens_of(stream)
        return outputs + rest, migration.resume_notes("kvm-broken")

    seen, notes = vllm.loop.run(broken())
    assert seen == reference
    assert len(notes) == 1 and "vLLM recomputed it" in notes[0], notes
    vllm.loop.run(idle(engine))


def test_the_cpu_layout_is_read_off_vllms_own_kernel() -> None:
    """Calibration: vLLM's kernel stores K dim-major in each block; reading a block through the calibrated
    index gives back exactly what was written, token by token, and write is read's inverse."""
    heads, block, dim = 2, 32, 64
    layer = torch.zeros((3, heads, block, 2 * dim))
    layout = KVLayout.calibrate(layer, block, heads, dim, "auto")
    kv = torch.randn(2, 2, block, heads, dim)
    layout.write(layer, [2, 0], kv)
    assert torch.equal(layout.read(layer, [2, 0]), kv)
    assert torch.equal(layer[1], torch.zeros_like(layer[1]))
    with pytest.raises(RuntimeError, match="not the CPU backend's"):
        KVLayout.calibrate(torch.zeros((2, 3, block, heads, dim)), block, heads, dim, "auto")
    with pytest.raises(RuntimeError, match="quantized"):
        KVLayout.calibrate(layer, block, heads, dim, "fp8")


def test_formats_decide_whether_kv_can_move(vllm: StartedEngine, builtin_engine: StartedEngine) -> None:
    v, b = migration_of(vllm.engine).kv_format(), migration_of(builtin_engine.engine).kv_format()
    assert (v.block_size_tokens, b.block_size_tokens) == (128, 16)
    assert kv_format_mismatch(v, b) is None     # 128-token blocks split into 16-token ones
    assert kv_format_mismatch(b, v) is None     # vLLM stages any block size by tokens
    assert "do not split" in (kv_format_mismatch(replace(v, block_size_tokens=24), b) or "")
    assert "kv_heads" in (kv_format_mismatch(replace(b, kv_heads=4), v) or "")
