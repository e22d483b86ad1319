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


def engine(model_dir: Path, caching: bool, capacity_bytes: int = 4 * 2**20, min_step_s: float = 0.0) -> BuiltinEngine:
    return BuiltinEngine(EngineConfig(model_path=model_dir, kv_capacity_bytes=capacity_bytes, max_model_len=512,
                                      prefix_caching=caching, min_step_s=min_step_s))


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


# 52 tokens: 3 full blocks of 16 and 4 more, so a request with this prompt can match all 3 (the last
# token is always computed).
PROMPT = [1, *range(400, 451)]


def _reference(model_dir: Path, max_tokens: int) -> list[int]:
    async def body(e: BuiltinEngine) -> list[int]:
        return await tokens_of(e.generate("ref", PROMPT, greedy(max_tokens)))

    return list(run(served(engine(model_dir, False), body)))


def _drained(e: BuiltinEngine) -> None:
    """Nothing runs: once the cache is evicted every block is free (nothing leaked)."""
    books_balance(e)
    sched = e.scheduler
    assert sched.prefix is not None
    sched.evict_cached(sched.prefix.num_blocks)
    assert sched.prefix.num_blocks == 0 and len(sched.space.free) == sched.space.num_blocks


def test_a_running_request_s_prefilled_prompt_is_shared_with_one_admitted_after_it(tiny_model_dir: Path) -> None:
    """OpenAI `n` samples: the worker starts sample 0, and the others once it has its first token,
    all with the same prompt. Its 3 full prompt blocks join the cache once prefilled, so the second
    matches them while the first still runs, and the pool holds them once."""
    expected = _reference(tiny_model_dir, 30)

    async def body(e: BuiltinEngine) -> list[list[int]]:
        sched = e.scheduler
        assert sched.prefix is not None
        block_bytes = sched.space.block_bytes
        a = e.generate("a", PROMPT, greedy(30))
        first_a = [t async for out in _first(a, 1) for t in out.new_token_ids]
        req_a = sched.requests["a"]
        assert req_a.shared is not None and len(req_a.shared.nodes) == 3  # it reads its prompt from the tree
        assert req_a.blocks[:3] == list(req_a.shared.values)
        assert sched.prefix.num_blocks == 3 and sched.prefix.num_evictable_blocks == 0  # locked by "a"
        b = e.generate("b", PROMPT, greedy(30))
        first_b = [t async for out in _first(b, 1) for t in out.new_token_ids]
        assert sched.requests["a"].state.value == "running"  # b started while a still runs
        assert sched.num_cache_hit_tokens == 48  # the prompt's 3 full blocks
        assert sched.num_prefilled_tokens == len(PROMPT) + (len(PROMPT) - 48)
        req_b = sched.requests["b"]
        assert req_b.blocks[:3] == req_a.blocks[:3]
        usage = {r.request_id: r for r in e.kv_usage()}
        assert usage["a"].kv_bytes == len(req_a.blocks) * block_bytes and usage["a"].shared_bytes == 0
        assert usage["b"].kv_bytes == (len(req_b.blocks) - 3) * block_bytes
        assert usage["b"].shared_bytes == 3 * block_bytes
        in_use = sched.space.num_blocks - len(sched.space.free)
        assert sum(r.kv_bytes for r in usage.values()) == in_use * block_bytes  # the prompt's blocks once
        outputs = [first_a + await tokens_of(a), first_b + await tokens_of(b)]
        _drained(e)
        return outputs

    assert run(served(engine(tiny_model_dir, True, min_step_s=0.01), body)) == [expected, expected]


def test_a_request_aborted_after_its_prefill_leaves_its_prompt_cached(tiny_model_dir: Path) -> None:
    """Its prompt's blocks stay in the cache, unlocked and evictable, and a later request matches them."""
    expected = _reference(tiny_model_dir, 12)

    async def body(e: BuiltinEngine) -> list[int]:
        sched = e.scheduler
        assert sched.prefix is not None
        a = e.generate("a", PROMPT, greedy(30))
        assert [o async for o in _first(a, 1)]
        await e.abort("a")
        assert not sched.requests
        assert sched.prefix.num_blocks == sched.prefix.num_evictable_blocks == 3
        books_balance(e)
        out = await tokens_of(e.generate("c", PROMPT, greedy(12)))
        assert sched.num_cache_hit_tokens == 48
        _drained(e)
        return out

    assert run(served(engine(tiny_model_dir, True, min_step_s=0.01), body)) == expected


def test_a_request_preempted_after_sharing_its_prompt_decodes_the_same(tiny_model_dir: Path) -> None:
    """The older reader of the shared prompt is preempted (recompute): its lock goes, the other reader
    keeps the blocks (now in its own kv_bytes), and the preempted one starts again from the cache."""
    expected = _reference(tiny_model_dir, 30)

    async def body(e: BuiltinEngine) -> list[list[int]]:
        sched = e.scheduler
        assert sched.prefix is not None and e._step_lock is not None
        block_bytes = sched.space.block_bytes
        a = e.generate("a", PROMPT, greedy(30))
        first_a = [t async for out in _first(a, 1) for t in out.new_token_ids]
        b = e.generate("b", PROMPT, greedy(30))
        first_b = [t async for out in _first(b, 1) for t in out.new_token_ids]
        async with e._step_lock:
            req_a, req_b = sched.requests["a"], sched.requests["b"]
            sched.preempt(req_a)
            assert req_a.shared is None and not req_a.blocks and req_a.num_cached == 0
            assert sched.prefix.num_blocks == 3 and sched.prefix.num_evictable_blocks == 0  # b reads them
            usage = {r.request_id: r for r in e.kv_usage()}
            assert set(usage) == {"b"} and usage["b"].shared_bytes == 0
            assert usage["b"].kv_bytes == len(req_b.blocks) * block_bytes
            books_in_use = sched.space.num_blocks - len(sched.space.free)
            assert books_in_use == len(req_b.blocks)
        sched.wake()
        outputs = [first_a + await tokens_of(a), first_b + await tokens_of(b)]
        assert sched.num_preemptions == 1
        assert sched.num_cache_hit_tokens == 2 * 48  # b's hit, and a's when it came back
        _drained(e)
        return outputs

    assert run(served(engine(tiny_model_dir, True, min_step_s=0.01), body)) == [expected, expected]


def test_requests_prefilled_in_one_step_keep_one_copy_of_their_prompt(tiny_model_dir: Path) -> None:
    """Both prefill the same prompt in the same step (nothing was cached to match): the first to be
    delivered inserts its blocks, the other switches to them and its copies go back to the pool."""
    expected = _reference(tiny_model_dir, 20)

    async def body(e: BuiltinEngine) -> list[list[int]]:
        sched = e.scheduler
        assert sched.prefix is not None
        block_bytes = sched.space.block_bytes
        a, b = e.generate("a", PROMPT, greedy(20)), e.generate("b", PROMPT, greedy(20))
        firsts = [[t async for out in _first(s, 1) for t in out.new_token_ids] for s in (a, b)]
        assert sched.num_cache_hit_tokens == 0 and sched.num_prefilled_tokens == 2 * len(PROMPT)
        req_a, req_b = sched.requests["a"], sched.requests["b"]
        assert req_a.shared is not None and req_b.shared is not None and req_a.blocks[:3] == req_b.blocks[:3]
        assert sched.prefix.num_blocks == 3
        usage = {r.request_id: r for r in e.kv_usage()}
        assert sorted(r.shared_bytes for r in usage.values()) == [0, 3 * block_bytes]
        in_use = sched.space.num_blocks - len(sched.space.free)
        assert in_use == len(req_a.blocks) + len(req_b.blocks) - 3
        assert sum(r.kv_bytes for r in usage.values()) == in_use * block_bytes
        outputs = [firsts[0] + await tokens_of(a), firsts[1] + await tokens_of(b)]
        _drained(e)
        return outputs

    assert run(served(engine(tiny_model_dir, True, min_step_s=0.01), body)) == [expected, expected]
