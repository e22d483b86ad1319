"""One contract, both engines: what the agent, the router and migration may rely on (engines/base.py).

Each test runs against the builtin engine and vLLM (skipped where vLLM is not installed, a failure
under `make test`, which requires it). The engines are shared per session, so every test leaves
them empty and checks that it did.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from worker_testing import (
    TEST_KV_CAPACITY_BYTES,
    TEST_MAX_MODEL_LEN,
    StartedEngine,
    collect,
    greedy,
    skip_without_vllm,
    start_engine,
    tokens,
)

from kvfleet.worker.engines.base import (
    DuplicateRequest,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    kv_blocks_bytes,
)
from kvfleet.worker.engines.capabilities import EngineCapabilities

PROMPTS = [[1, 17, 300, 45, 99], [1, 5, 6, 7], [1, 1000, 1500, 20, 21, 22, 23, 24, 25, 26], [1, 400],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [1, 77, 78]]
_ids = itertools.count()


def rid(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def assert_empty(e: StartedEngine) -> None:
    """Nothing holds KV and nothing waits: the engine freed everything the test used."""
    async def settle() -> None:
        for _ in range(100):
            if not e.engine.kv_usage() and e.engine.num_waiting() == 0:
                return
            await asyncio.sleep(0.05)

    e.loop.run(settle())
    assert e.engine.kv_usage() == []
    assert e.engine.num_waiting() == 0


def test_info_reports_the_allocated_capacity(any_engine: StartedEngine) -> None:
    info = any_engine.info
    # tiny model: 2 layers x 2 KV heads x 64 dims x K and V x 4 bytes (float32)
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert info.max_model_len == TEST_MAX_MODEL_LEN
    block_bytes = info.block_size_tokens * info.kv_bytes_per_token
    assert info.kv_capacity_bytes % block_bytes == 0
    assert info.engine == any_engine.name.removesuffix("-elastic")
    elastic = any_engine.engine.capabilities.elastic_memory
    if elastic is not None:
        # The pool less what any step holds, in whole blocks, and what it reports when nothing runs.
        state = elastic.memory_state()
        assert info.kv_capacity_bytes == state.kv_capacity_bytes < state.budget_bytes
        return
    # Whole blocks of the capacity asked for, never more than asked.
    assert TEST_KV_CAPACITY_BYTES - block_bytes < info.kv_capacity_bytes <= TEST_KV_CAPACITY_BYTES


def test_capabilities_are_declared_not_inferred_from_the_type(any_engine: StartedEngine) -> None:
    # The executor decides KV or token moves from this and the KV format it states: every engine here
    # moves KV (vLLM through kvfleet's connector), in one format but the block size; the reporter
    # reads a moving capacity from the elastic builtin engine only.
    capabilities = any_engine.engine.capabilities
    assert isinstance(capabilities, EngineCapabilities)
    assert capabilities.migration is not None
    fmt = capabilities.migration.kv_format()
    assert (fmt.layers, fmt.kv_heads, fmt.head_dim, fmt.dtype) == (2, 2, 64, "float32")
    assert fmt.block_size_tokens == any_engine.info.block_size_tokens
    assert fmt.any_block_size == any_engine.name.startswith("vllm")
    assert (capabilities.elastic_memory is not None) == any_engine.name.endswith("-elastic")


def test_speed_is_measured_or_declared_unmeasured(any_engine: StartedEngine) -> None:
    """The builtin engine times every step (engines/speed.py); vLLM measures none and says so in its info."""
    engine, info = any_engine.engine, any_engine.info
    assert info.measures_speed == any_engine.name.startswith("builtin")
    before = engine.speed_profile()
    any_engine.loop.run(collect(engine, rid("speed"), PROMPTS[0], greedy(3)))
    if not info.measures_speed:
        assert before is None and engine.speed_profile() is None
        return
    samples_before = before.num_samples if before is not None else 0

    async def recorded() -> Any:  # the last step counts once its period ends, just after its token left
        for _ in range(100):
            profile = engine.speed_profile()
            if profile is not None and profile.num_samples == samples_before + 3:
                return profile
            await asyncio.sleep(0.01)
        return engine.speed_profile()

    profile = any_engine.loop.run(recorded())
    assert profile is not None and profile.num_samples == samples_before + 3  # a prefill and two decodes
    assert (profile.engine, profile.model, profile.kv_bytes_per_token, profile.capacity_bytes) == (
        info.engine, info.model_path, info.kv_bytes_per_token, info.kv_capacity_bytes)
    assert_empty(any_engine)


def test_generates_exactly_max_tokens_greedy_and_streams_them(any_engine: StartedEngine) -> None:
    e = any_engine
    outs = e.loop.run(collect(e.engine, rid("len"), PROMPTS[0], greedy(12)))
    assert len(tokens(outs)) == 12
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    assert len(outs) >= 2, "tokens are streamed step by step, not in one piece at the end"
    assert outs[-1].num_tokens == len(PROMPTS[0]) + 12
    again = e.loop.run(collect(e.engine, rid("len"), PROMPTS[0], greedy(12)))
    assert tokens(again) == tokens(outs), "greedy decoding is deterministic"
    assert_empty(e)


def test_stop_token_ends_the_request_and_is_the_last_token(any_engine: StartedEngine) -> None:
    e = any_engine
    free = tokens(e.loop.run(collect(e.engine, rid("free"), PROMPTS[1], greedy(10))))
    stop_at = next(i for i in range(2, 10) if free[i] not in free[:i])  # its first occurrence
    outs = e.loop.run(collect(e.engine, rid("stop"), PROMPTS[1], greedy(10, stop_token_ids=(free[stop_at],))))
    assert tokens(outs) == free[: stop_at + 1]
    assert outs[-1].finish_reason == "stop"
    assert_empty(e)


def test_abort_mid_stream_frees_the_kv(any_engine: StartedEngine) -> None:
    e = any_engine
    request_id = rid("abort")

    async def run() -> list[StepOutput]:
        outs: list[StepOutput] = []
        async for out in e.engine.generate(request_id, PROMPTS[2], greedy(200)):
            outs.append(out)
            if len(tokens(outs)) >= 3 and not out.finished:
                usage = {r.request_id: r for r in e.engine.kv_usage()}
                assert request_id in usage
                await e.engine.abort(request_id)
        return outs

    outs = e.loop.run(run())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(tokens(outs)) < 200
    assert_empty(e)


def test_leaving_the_stream_early_aborts_the_request(any_engine: StartedEngine) -> None:
    e = any_engine

    async def run() -> None:
        stream = e.engine.generate(rid("leave"), PROMPTS[3], greedy(200))
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]

    e.loop.run(run())
    assert_empty(e)


def test_concurrent_requests_give_the_same_tokens_as_one_at_a_time(any_engine: StartedEngine) -> None:
    e = any_engine
    alone = [tokens(e.loop.run(collect(e.engine, rid("alone"), p, greedy(8 + i)))) for i, p in enumerate(PROMPTS)]

    async def together() -> list[list[int]]:
        runs = [collect(e.engine, rid("together"), p, greedy(8 + i)) for i, p in enumerate(PROMPTS)]
        return [tokens(outs) for outs in await asyncio.gather(*runs)]

    assert e.loop.run(together()) == alone
    assert_empty(e)


def test_kv_usage_counts_tokens_and_whole_blocks_while_running(any_engine: StartedEngine) -> None:
    e = any_engine
    info = e.info
    request_id = rid("usage")
    seen: list[tuple[int, int, int]] = []  # (tokens reported in the step, tokens in kv_usage, bytes)

    async def run() -> None:
        async for out in e.engine.generate(request_id, PROMPTS[4], greedy(20)):
            if out.finished:
                break
            usage = {r.request_id: r for r in e.engine.kv_usage()}
            seen.append((out.num_tokens, usage[request_id].tokens, usage[request_id].kv_bytes))
            # What it may still write: max_tokens less the output it holds (the operator's "about to finish").
            remaining.append(usage[request_id].remaining_tokens == 20 - (usage[request_id].tokens - len(PROMPTS[4])))

    remaining: list[bool] = []
    e.loop.run(run())
    assert seen and all(remaining)
    for step_tokens, usage_tokens, kv_bytes in seen:
        # The engine may already be one step further than the output the test holds.
        assert step_tokens <= usage_tokens <= step_tokens + 1
        assert kv_bytes == kv_blocks_bytes(usage_tokens, info.block_size_tokens, info.kv_bytes_per_token)
    assert seen[-1][1] >= len(PROMPTS[4]) + 18
    assert_empty(e)


def test_too_long_and_duplicate_requests_are_refused_before_any_output(any_engine: StartedEngine) -> None:
    e = any_engine
    with pytest.raises(RequestTooLong):
        e.loop.run(collect(e.engine, rid("long"), [1] * (TEST_MAX_MODEL_LEN - 4), greedy(10)))
    request_id = rid("dup")

    async def duplicate() -> None:
        first = e.engine.generate(request_id, PROMPTS[0], greedy(100))
        await anext(first)  # type: ignore[call-overload]
        try:
            with pytest.raises(DuplicateRequest):
                await collect(e.engine, request_id, PROMPTS[1], greedy(4))
        finally:
            await first.aclose()  # type: ignore[attr-defined]

    e.loop.run(duplicate())
    assert_empty(e)


def test_seeded_sampling_is_reproducible(any_engine: StartedEngine) -> None:
    e = any_engine
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    first = tokens(e.loop.run(collect(e.engine, rid("seed"), PROMPTS[0], params)))
    second = tokens(e.loop.run(collect(e.engine, rid("seed"), PROMPTS[0], params)))
    assert first == second
    other = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert tokens(e.loop.run(collect(e.engine, rid("seed"), PROMPTS[0], other))) != first
    assert_empty(e)


def test_both_engines_give_the_same_greedy_tokens(tiny_model_dir: Any, engine_loop: Any, started_engines: Any) -> None:
    skip_without_vllm()
    builtin = start_engine("builtin", tiny_model_dir, started_engines, engine_loop)
    vllm = start_engine("vllm", tiny_model_dir, started_engines, engine_loop)
    for prompt in PROMPTS:
        a = tokens(engine_loop.run(collect(builtin.engine, rid("x"), prompt, greedy(16))))
        b = tokens(engine_loop.run(collect(vllm.engine, rid("x"), prompt, greedy(16))))
        assert a == b, f"prompt {prompt}"


def test_queued_requests_are_listed_with_the_kv_they_will_hold(any_engine: StartedEngine) -> None:
    """More requests than batch slots (max_num_seqs 16): the rest wait, and `queued()` shows each with
    its prompt's tokens and blocks, which the worker reports so that MELL sees the demand."""
    e = any_engine
    info = e.info
    ids = [rid("queue") for _ in range(19)]
    prompts = {request_id: PROMPTS[i % len(PROMPTS)] for i, request_id in enumerate(ids)}

    async def run() -> tuple[list[Any], list[Any]]:
        async def consume(request_id: str) -> None:
            async for _ in e.engine.generate(request_id, prompts[request_id], greedy(400)):
                pass

        tasks = [asyncio.create_task(consume(request_id)) for request_id in ids]
        try:
            for _ in range(600):
                if len(e.engine.kv_usage()) >= 16 and e.engine.num_waiting() > 0:
                    break
                await asyncio.sleep(0.02)
            return e.engine.kv_usage(), e.engine.queued()
        finally:
            for request_id in ids:
                await e.engine.abort(request_id)
            await asyncio.gather(*tasks, return_exceptions=True)

    usage, queued = e.loop.run(run())
    assert len(queued) == 19 - len(usage) > 0
    assert {r.request_id for r in usage} | {r.request_id for r in queued} == set(ids)
    for r in queued:
        assert r.tokens == len(prompts[r.request_id])
        assert r.kv_bytes == kv_blocks_bytes(r.tokens, info.block_size_tokens, info.kv_bytes_per_token)
    assert [r.request_id for r in queued] == sorted(r.request_id for r in queued)
    assert_empty(e)
