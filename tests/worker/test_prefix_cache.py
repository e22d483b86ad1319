"""Context caching in the builtin engine (MemServe's MemPool index, kvfleet.serving.prompt_tree): the
same tokens, fewer prefilled, cached blocks evicted before anything is preempted, migration intact."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from worker_testing import greedy, run, tokens_of  # noqa: E402

from kvfleet.worker.engines.base import EngineConfig, StepOutput  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine  # noqa: E402

SYSTEM = [1, *range(100, 180)]  # 81 tokens: 5 full blocks of 16 shared by every conversation


async def conversations(engine: BuiltinEngine, turns: int = 3) -> list[list[int]]:
    """Two conversations taking turns: each turn's prompt is the last prompt, its answer and a new question."""
    outputs: list[list[int]] = []
    prompts = {c: SYSTEM + [200 + c, 201 + c] for c in range(2)}
    for turn in range(turns):
        for c in range(2):
            answer = await tokens_of(engine.generate(f"c{c}-t{turn}", prompts[c], greedy(12)))
            outputs.append(answer)
            prompts[c] = prompts[c] + answer + [300 + turn, 301 + c]
    return outputs


def engine(model_dir: Path, caching: bool, capacity_bytes: int = 4 * 2**20) -> BuiltinEngine:
    return BuiltinEngine(EngineConfig(model_path=model_dir, kv_capacity_bytes=capacity_bytes, max_model_len=512,
                                      prefix_caching=caching))


async def served(e: BuiltinEngine, body: Any) -> Any:
    await e.start()
    try:
        return await body(e)
    finally:
        await e.stop()


def books_balance(e: BuiltinEngine) -> None:
    sched = e.scheduler
    assert sched.prefix is not None
    assert len(sched.space.free) + sched.prefix.num_blocks == sched.space.num_blocks
    assert sched.prefix.num_evictable_blocks == sched.prefix.num_blocks  # nothing runs: nothing pinned


def test_multi_turn_outputs_equal_and_only_new_tokens_are_prefilled(tiny_model_dir: Path) -> None:
    plain, cached = engine(tiny_model_dir, False), engine(tiny_model_dir, True)

    async def with_books(e: BuiltinEngine) -> list[list[int]]:
        out = await conversations(e)
        books_balance(e)
        return out

    assert run(served(plain, conversations)) == run(served(cached, with_books))
    assert cached.num_prefilled_tokens < plain.num_prefilled_tokens / 2
    assert cached.scheduler.num_cache_hit_tokens == plain.num_prefilled_tokens - cached.num_prefilled_tokens


def test_cached_blocks_are_evicted_before_anything_is_preempted(tiny_model_dir: Path) -> None:
    # 64 blocks of KV: each 200-token request takes 13, so five finished ones fill the cache and every
    # later one must evict history; none is preempted and the books still balance.
    async def body(e: BuiltinEngine) -> None:
        for i in range(8):
            await tokens_of(e.generate(f"r{i}", [1, *range(10 + 30 * i, 10 + 30 * i + 190)], greedy(8)))
        books_balance(e)
        assert e.scheduler.prefix is not None and e.scheduler.prefix.num_blocks > 0

    e = engine(tiny_model_dir, True, capacity_bytes=64 * 16 * 2048)
    run(served(e, body))
    assert e.num_preemptions == 0


def test_a_request_reading_cached_blocks_migrates_and_its_source_keeps_them(tiny_model_dir: Path) -> None:
    prompt = SYSTEM + [7, 8, 9]

    async def reference(e: BuiltinEngine) -> list[int]:
        return await tokens_of(e.generate("x", prompt, greedy(40)))

    expected = run(served(engine(tiny_model_dir, False), reference))

    async def scenario() -> list[int]:
        source = BuiltinEngine(EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=4 * 2**20, max_model_len=512,
                                            prefix_caching=True, min_step_s=0.01))
        target = engine(tiny_model_dir, False)
        await source.start()
        await target.start()
        try:
            await tokens_of(source.generate("warm", SYSTEM + [1, 2], greedy(2)))  # caches SYSTEM's 5 blocks
            stream = source.generate("x", prompt, greedy(40))
            first = [t async for out in _first(stream, 10) for t in out.new_token_ids]
            assert source.scheduler.num_cache_hit_tokens == 80
            migration, destination = source.capabilities.migration, target.capabilities.migration
            assert migration is not None and destination is not None
            state = await migration.suspend("x")
            rest = [t async for out in stream for t in out.new_token_ids]  # the source's stream ends at suspend
            kv = await migration.export_kv("x")
            await destination.import_kv("x", kv)
            moved = destination.resume("x", state.prompt_token_ids, state.output_token_ids, state.params)
            migration.release("x")
            books_balance(source)
            assert source.scheduler.prefix is not None and source.scheduler.prefix.num_blocks >= 5
            return first + rest + await tokens_of(moved)
        finally:
            await source.stop()
            await target.stop()

    assert run(scenario()) == expected


async def _first(stream: AsyncIterator[StepOutput], count: int) -> AsyncIterator[StepOutput]:
    """The stream's first `count` tokens' outputs, leaving the rest in the stream."""
    seen = 0
    while seen < count:
        out = await stream.__anext__()
        seen += len(out.new_token_ids)
        yield out


def test_the_cache_is_a_capability_whose_figures_the_worker_exports(tiny_model_dir: Path) -> None:
    from kvfleet.worker.gpu import GPUProbe
    from kvfleet.worker.metrics import WorkerMetrics

    assert engine(tiny_model_dir, False).capabilities.prefix_cache is None
    e = engine(tiny_model_dir, True)
    cache = e.capabilities.prefix_cache
    assert cache is not None
    metrics = WorkerMetrics(lambda: 0.0, lambda: 0.0, lambda: 0.0, lambda: 0.0, GPUProbe(),
                            prefix_cache=cache.prefix_cache_stats)

    async def body(e: BuiltinEngine) -> None:
        await tokens_of(e.generate("a", SYSTEM + [1, 2], greedy(4)))
        await tokens_of(e.generate("b", SYSTEM + [3, 4], greedy(4)))

    run(served(e, body))
    stats = cache.prefix_cache_stats()
    assert stats.hit_tokens == 80 and stats.prefilled_tokens == (len(SYSTEM) + 2) + (len(SYSTEM) + 2 - 80)
    sample = metrics.registry.get_sample_value
    assert sample("kvfleet_worker_prefix_cache_hit_tokens") == 80
    assert sample("kvfleet_worker_prefilled_tokens") == stats.prefilled_tokens
    assert sample("kvfleet_worker_prefix_cache_blocks") == stats.cached_blocks == stats.evictable_blocks > 0


def test_usage_counts_a_shared_block_once_and_the_cache_apart(tiny_model_dir: Path) -> None:
    """Reports MELL can trust: two running requests reading the same 5 cached blocks hold 5 blocks
    between them, not 10; the cache nobody reads is neither request's, and it is evictable."""
    from kvfleet.worker.reporter import CacheFigures, build_report

    e = engine(tiny_model_dir, True)

    async def body(e: BuiltinEngine) -> None:
        await tokens_of(e.generate("warm", SYSTEM + [1, 2], greedy(2)))  # leaves SYSTEM's 5 blocks cached
        block_bytes = e.scheduler.space.block_bytes
        assert e.kv_usage() == [] and e.prefix_cache_stats().evictable_blocks == 5
        a = e.generate("a", SYSTEM + [3, 4], greedy(40))
        b = e.generate("b", SYSTEM + [5, 6], greedy(40))
        seen = [o async for o in _first(a, 1)] + [o async for o in _first(b, 1)]
        assert len(seen) == 2
        usage = {r.request_id: r for r in e.kv_usage()}
        held = len(e.scheduler.requests["a"].blocks), len(e.scheduler.requests["b"].blocks)
        older, newer = sorted(usage, key=lambda rid: e.scheduler.requests[rid].admitted_seq)
        assert usage[older].shared_bytes == 0 and usage[older].kv_bytes == held[older != "a"] * block_bytes
        assert usage[newer].shared_bytes == 5 * block_bytes
        assert usage[newer].kv_bytes == (held[newer != "a"] - 5) * block_bytes
        in_use = e.scheduler.space.num_blocks - len(e.scheduler.space.free)
        assert sum(r.kv_bytes for r in usage.values()) == in_use * block_bytes  # each block once
        stats = e.prefix_cache_stats()
        assert stats.evictable_blocks == 0  # both read the 5 cached blocks: pinned
        report = build_report(e.kv_usage(), e.info.kv_capacity_bytes, 1,
                              prefix_cache=CacheFigures(stats.evictable_blocks * block_bytes, stats.cached_blocks))
        loads = {r.id: r for r in report.requests}
        assert loads[newer].shared_bytes == 5 * block_bytes and loads[older].shared_bytes is None
        assert loads[newer].whole_kv_bytes == held[newer != "a"] * block_bytes
        assert report.used_bytes == in_use * block_bytes and report.evictable_bytes == 0
        assert report.prefix_cache_blocks == 5
        await e.abort("a")
        await e.abort("b")

    run(served(e, body))
