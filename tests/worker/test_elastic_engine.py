"""The builtin engine with elastic memory (eLLM, builtin/elastic.py): same tokens, more room.

Outputs are compared token for token with the engine without elastic memory (greedy decoding of the
tiny model has clear top-1 margins, test_builtin_engine.py), under memory pressure that makes the
elastic engine park KV in its CPU buffer, offload prefills, recompute, and move chunks between the KV
and the activation side. The activation charge is checked against what torch really allocates.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from worker_testing import ELASTIC_MAX_TOKENS, ELASTIC_PROMPTS, Sequenced, activation_slack, run, tokens_of  # noqa: E402

from kvfleet.worker.elastic.options import MemoryOptions  # noqa: E402
from kvfleet.worker.engines.base import (  # noqa: E402
    EngineConfig,
    EngineError,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    StructuredOutput,
)
from kvfleet.worker.engines.builtin.elastic import ElasticScheduler  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine, static_activation_reserve_bytes  # noqa: E402
from kvfleet.worker.engines.builtin.model import (  # noqa: E402
    ACTIVATION_BASE_BYTES,
    LlamaForward,
    PagedKVCache,
    SeqBatchEntry,
    activation_bytes,
    read_architecture,
)
from kvfleet.worker.engines.builtin.options import BuiltinOptions  # noqa: E402
from kvfleet.worker.engines.builtin.sampling import MakeConstraint  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
PROMPTS, MAX_TOKENS = ELASTIC_PROMPTS, ELASTIC_MAX_TOKENS


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def serve_all(engine: BuiltinEngine, prompts: list[list[int]]) -> list[list[int]]:
    await engine.start()
    try:
        return list(await asyncio.gather(*(tokens_of(engine.generate(f"r{i}", p, greedy())) for i, p in enumerate(prompts))))
    finally:
        await engine.stop()


def elastic_engine(model_dir: Path, *, min_step_s: float = 0.0, make_constraint: MakeConstraint | None = None,
                   **memory: Any) -> BuiltinEngine:
    # 3.5 MiB in 256 KiB chunks (8 blocks of the tiny model in float32): ten requests' KV and their
    # decode activations do not fit at once, so the pool is always short.
    memory.setdefault("budget_bytes", 14 * 256 * KIB)
    memory.setdefault("chunk_bytes", 256 * KIB)
    memory.setdefault("elastic", True)
    return BuiltinEngine(EngineConfig(model_path=model_dir, max_model_len=512, min_step_s=min_step_s),
                         BuiltinOptions(memory=MemoryOptions(**memory)), make_constraint=make_constraint)


def elastic_of(engine: BuiltinEngine) -> ElasticScheduler:
    assert engine.elastic is not None
    return engine.elastic


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    """Every prompt alone-enough on a roomy static cache."""
    engine = BuiltinEngine(EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=8 * MIB, max_model_len=512))
    return run(serve_all(engine, PROMPTS))


def test_outputs_equal_with_the_cpu_buffer_under_pressure(tiny_model_dir: Path, reference: list[list[int]]) -> None:
    engine = elastic_engine(tiny_model_dir, cpu_buffer_bytes=4 * MIB)
    assert run(serve_all(engine, PROMPTS)) == reference
    elastic = elastic_of(engine)
    # The buffer was really used: requests parked and fetched back, prefills admitted with their KV
    # sent straight to host memory, and no recompute.
    assert elastic.num_parked + elastic.num_offloaded_prefills > 0
    assert elastic.buffer.num_fetched > 0
    assert elastic.num_preemptions == 0
    assert elastic.inflated_chunks > 0


def test_outputs_equal_without_a_buffer_where_requests_wait_or_recompute(tiny_model_dir: Path,
                                                                         reference: list[list[int]]) -> None:
    engine = elastic_engine(tiny_model_dir)
    assert run(serve_all(engine, PROMPTS)) == reference
    elastic = elastic_of(engine)
    assert elastic.num_parked == elastic.num_offloaded_prefills == 0
    assert elastic.inflated_chunks > 0


async def outputs_of(stream: AsyncIterator[StepOutput]) -> list[StepOutput]:
    return [out async for out in stream]


def test_sampling_parameters_hold_under_pressure(tiny_model_dir: Path, reference: list[list[int]]) -> None:
    """The elastic scheduler's steps sample like the base's: a constrained request with logprobs, among
    requests parked and fetched back, follows its grammar and gets one logprob a token."""
    sequence = [9, 8, 7, 1500, 6, 5, 4, 3]

    def make(spec: StructuredOutput, done: Sequence[int]) -> Sequenced:
        return Sequenced(json.loads(spec.spec), done=done)

    async def scenario() -> tuple[list[list[int]], list[StepOutput]]:
        engine = elastic_engine(tiny_model_dir, cpu_buffer_bytes=4 * MIB, make_constraint=make)
        await engine.start()
        try:
            params = SamplingParams(max_tokens=MAX_TOKENS, structured=StructuredOutput("grammar", json.dumps(sequence)),
                                    logprobs=1)
            stream = engine.generate("c", PROMPTS[3], params)
            constrained = asyncio.ensure_future(outputs_of(stream))
            outputs = await asyncio.gather(*(tokens_of(engine.generate(f"r{i}", p, greedy())) for i, p in enumerate(PROMPTS)))
            assert elastic_of(engine).num_parked + elastic_of(engine).num_offloaded_prefills > 0
            return list(outputs), await constrained
        finally:
            await engine.stop()

    outputs, outs = run(scenario())
    assert outputs == reference
    assert [t for o in outs for t in o.new_token_ids] == sequence and outs[-1].finish_reason == "stop"
    assert [lp.token_id for o in outs for lp in o.logprobs] == sequence


def test_a_pool_at_rest_gives_kv_more_than_the_static_split(tiny_model_dir: Path) -> None:
    budget = 512 * MIB

    async def capacities() -> tuple[int, int, int]:
        config = EngineConfig(model_path=tiny_model_dir, max_model_len=2048)
        static = BuiltinEngine(config, BuiltinOptions(memory=MemoryOptions(budget_bytes=budget)))
        elastic = BuiltinEngine(config, BuiltinOptions(memory=MemoryOptions(budget_bytes=budget, elastic=True)))
        try:
            info_static, info_elastic = await static.start(), await elastic.start()
            return info_static.kv_capacity_bytes, info_elastic.kv_capacity_bytes, elastic.memory_state().budget_bytes
        finally:
            await static.stop()
            await elastic.stop()

    static_bytes, elastic_bytes, pool_bytes = run(capacities())
    arch = read_architecture(tiny_model_dir)
    reserve = static_activation_reserve_bytes(arch, torch.float32, 2048, 64, budget)
    assert static_bytes == (budget - reserve) // (16 * 2048) * 16 * 2048
    assert pool_bytes == budget
    # Less what any step's activations hold (the base and the 32 MiB decode workspace, in 2 MiB chunks)
    # and the threshold of two chunks (one per side's rounding).
    assert elastic_bytes == budget - 34 * MIB - 4 * MIB
    assert elastic_bytes > static_bytes


def test_a_budget_below_the_static_reserve_is_refused_with_the_reason(tiny_model_dir: Path) -> None:
    engine = BuiltinEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=2048),
                           BuiltinOptions(memory=MemoryOptions(budget_bytes=64 * MIB)))
    with pytest.raises(EngineError, match="leaves no KV block after the activation reserve"):
        run(engine.start())


def test_reported_capacity_moves_with_activations(tiny_model_dir: Path) -> None:
    async def scenario() -> tuple[int, int, int]:
        engine = BuiltinEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=2048),
                               BuiltinOptions(memory=MemoryOptions(budget_bytes=128 * MIB, elastic=True)))
        await engine.start()
        try:
            at_rest = engine.memory_state().kv_capacity_bytes
            await tokens_of(engine.generate("long", [1, *range(2, 1800)], greedy(2)))
            after_prefill = engine.memory_state().kv_capacity_bytes
            for i in range(40):  # short steps push the long prefill out of the window
                await tokens_of(engine.generate(f"s{i}", [1, 2, 3], greedy(1)))
            return at_rest, after_prefill, engine.memory_state().kv_capacity_bytes
        finally:
            await engine.stop()

    at_rest, after_prefill, later = run(scenario())
    assert after_prefill < at_rest - 10 * MIB  # an 1,800-token prefill holds tens of MiB of activations
    assert later == at_rest  # once out of the window, short steps hold what any step holds (one chunk)


def test_a_request_whose_prefill_cannot_fit_the_pool_is_refused(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        engine = elastic_engine(tiny_model_dir, cpu_buffer_bytes=64 * MIB)
        await engine.start()
        try:
            with pytest.raises(RequestTooLong, match="memory pool"):
                engine.generate("big", [1, *range(2, 500)], greedy(4))
        finally:
            await engine.stop()

    run(scenario())


def test_without_a_buffer_a_prefill_whose_kv_and_activations_cannot_fit_together_is_refused(tiny_model_dir: Path) -> None:
    # No CPU buffer: the prefill's KV cannot be offloaded, so it needs the pool beside its activations.
    # A prompt whose activations alone fit but not with its KV used to be admitted and wait forever.
    async def scenario() -> None:
        engine = elastic_engine(tiny_model_dir, budget_bytes=24 * 256 * KIB)
        await engine.start()
        try:
            with pytest.raises(RequestTooLong, match="memory pool"):
                engine.generate("big", [1, *range(2, 158)], greedy(4))
            assert await asyncio.wait_for(tokens_of(engine.generate("small", [1, *range(2, 40)], greedy(4))), 60)
        finally:
            await engine.stop()

    run(scenario())


def test_a_parked_request_migrates_by_kv_and_gives_the_unmigrated_output(tiny_model_dir: Path,
                                                                         reference: list[list[int]]) -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        source = elastic_engine(tiny_model_dir, cpu_buffer_bytes=4 * MIB, min_step_s=0.02)
        target = BuiltinEngine(EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=8 * MIB, max_model_len=512))
        await source.start()
        await target.start()
        try:
            streams = {f"r{i}": asyncio.create_task(tokens_of(source.generate(f"r{i}", p, greedy())))
                       for i, p in enumerate(PROMPTS)}
            elastic = elastic_of(source)
            deadline = time.monotonic() + 30
            while not any(r.parked is not None and r.output for r in elastic.parked):
                assert time.monotonic() < deadline, "no request was parked with output"
                await asyncio.sleep(0.002)
            parked = next(r for r in elastic.parked if r.parked is not None and r.output)
            migration, destination = source.capabilities.migration, target.capabilities.migration
            assert migration is not None and destination is not None
            state = await migration.suspend(parked.request_id)
            kv = await migration.export_kv(parked.request_id)
            assert kv.num_tokens == state.num_cached_tokens > 0
            await destination.import_kv(parked.request_id, kv)
            moved = destination.resume(parked.request_id, state.prompt_token_ids, state.output_token_ids, state.params)
            migration.release(parked.request_id)
            before = await streams.pop(parked.request_id)
            after = await tokens_of(moved)
            others = await asyncio.gather(*streams.values())
            assert all(len(t) == MAX_TOKENS for t in others)
            return before + after, reference[int(parked.request_id[1:])]
        finally:
            await source.stop()
            await target.stop()

    migrated, unmigrated = run(scenario())
    assert migrated == unmigrated


@pytest.mark.parametrize(("new_tokens", "context_tokens", "batch"),
                         [(512, 512, 1), (2048, 2048, 1), (1, 1024, 8), (1, 2000, 32), (1, 2000, 64), (40, 40, 1)])
def test_activation_charge_bounds_what_torch_allocates(tiny_model_dir: Path, new_tokens: int, context_tokens: int,
                                                       batch: int) -> None:
    """The charge (builtin.model.activation_bytes) is never below the forward's measured peak and at
    most 1.6x it (plus the fixed base; worker_testing.activation_slack): what a step holds of the pool
    is what it really needs."""
    from torch.profiler import ProfilerActivity, profile

    arch = read_architecture(tiny_model_dir)
    model = LlamaForward.load(tiny_model_dir, torch.float32, torch.device("cpu"), 2048)
    blocks_each = -(-context_tokens // 16)
    cache = PagedKVCache(arch, blocks_each * batch, 16, torch.float32, torch.device("cpu"))
    entries = [SeqBatchEntry(tuple((7 * i + j) % 2000 + 1 for j in range(new_tokens)), context_tokens - new_tokens,
                             tuple(range(i * blocks_each, (i + 1) * blocks_each))) for i in range(batch)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model.forward(entries, cache)
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    fixed = ACTIVATION_BASE_BYTES + model.decode_workspace_bytes
    charged = fixed + batch * activation_bytes(arch, torch.float32, new_tokens, context_tokens, 16)
    assert peak <= charged <= activation_slack(new_tokens, model.attention) * peak + fixed
