"""Context caching with elastic memory (builtin/elastic.py): the prefix cache in eLLM's one pool, and
the CPU buffer as its host tier (MemServe §4.1 Table 1, swap_out / swap_in).

Outputs are compared token for token with the elastic engine without the cache (greedy decoding of
the tiny model has clear top-1 margins, test_builtin_engine.py). The pool's books are checked between
steps while requests run (every block is free, the cache's or one request's, exactly once) and after:
nothing leaked to a request that is gone, nothing left pinned, the host tier within the buffer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

torch = pytest.importorskip("torch")

from worker_testing import greedy, run, tokens_of  # noqa: E402

from kvfleet.worker.elastic.options import MemoryOptions  # noqa: E402
from kvfleet.worker.engines.base import EngineConfig  # noqa: E402
from kvfleet.worker.engines.builtin.elastic import ElasticScheduler  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine  # noqa: E402
from kvfleet.worker.engines.builtin.options import BuiltinOptions  # noqa: E402

T = TypeVar("T")
KIB = 1024
MIB = 1024 * KIB
SYSTEM = [1, *range(100, 180)]  # 81 tokens: 5 full blocks of 16 shared by every conversation


def elastic_engine(model_dir: Path, *, caching: bool, chunks: int, cpu_buffer_bytes: int = 0,
                   min_step_s: float = 0.0) -> BuiltinEngine:
    # Chunks of 256 KiB: 8 blocks of the tiny model in float32 (2 KiB a token).
    memory = MemoryOptions(budget_bytes=chunks * 256 * KIB, chunk_bytes=256 * KIB, elastic=True,
                           cpu_buffer_bytes=cpu_buffer_bytes)
    return BuiltinEngine(EngineConfig(model_path=model_dir, max_model_len=512, prefix_caching=caching,
                                      min_step_s=min_step_s), BuiltinOptions(memory=memory))


def elastic_of(engine: BuiltinEngine) -> ElasticScheduler:
    assert engine.elastic is not None
    return engine.elastic


def check_books(engine: BuiltinEngine) -> None:
    """Between steps: every block of the mapped chunks is free, the cache's (on the device) or one
    request's own (a request's shared prefix is the cache's), each exactly once; the host tier and
    parked KV together within the CPU buffer."""
    sched = elastic_of(engine)
    assert sched.kv is not None and sched.prefix is not None
    owners: list[int] = list(sched.kv.free)
    stack = list(sched.prefix.tree._root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if not node.on_host and node.value is not None:
            owners.append(node.value)
    for req in sched.requests.values():
        num_shared = 0
        if req.shared is not None:
            num_shared = len(req.shared.nodes)
            assert req.blocks[:num_shared] == [node.value for node in req.shared.nodes]
        owners += req.blocks[num_shared:]
    for staged in sched.staged.values():
        owners += staged.blocks
    total = sched.kv.mapped_bytes // sched.space.block_bytes
    assert len(owners) == len(set(owners)) == total, "a block is lost or held twice"
    assert sched.prefix.tree.num_host_blocks == len(sched.buffer._host_blocks)
    block_bytes = sched.space.block_bytes
    assert sched.prefix.tree.num_host_blocks * block_bytes + sched.buffer.held_bytes() <= sched.buffer.capacity_bytes


def check_books_at_rest(engine: BuiltinEngine) -> None:
    """Nothing runs: free + cached on the device == mapped, and nothing is pinned."""
    check_books(engine)
    sched = elastic_of(engine)
    assert sched.kv is not None and sched.prefix is not None
    assert not sched.requests and not sched._matches
    assert len(sched.kv.free) + sched.prefix.num_blocks == sched.kv.mapped_bytes // sched.space.block_bytes
    assert sched.prefix.num_evictable_blocks == sched.prefix.num_blocks
    assert sched.prefix.tree.num_evictable_host_blocks == sched.prefix.tree.num_host_blocks


async def checked_between_steps(engine: BuiltinEngine, body: Coroutine[Any, Any, T]) -> T:
    """Run `body` while checking the books at step boundaries (under the step lock, as suspend is)."""
    task = asyncio.ensure_future(body)
    lock = engine._step_lock
    assert lock is not None
    while not task.done():
        async with lock:
            check_books(engine)
        await asyncio.sleep(0.001)
    return await task


async def conversations(engine: BuiltinEngine, num_conversations: int, turns: int, *,
                        own_system: bool = False) -> list[list[int]]:
    """Conversations taking turns at once, each turn's prompt the last one, its answer and a new
    question; all open with SYSTEM, so running requests read its cached blocks together, or with
    `own_system` each with an 81-token system prompt of its own (none `rounds` opens with)."""

    async def conversation(c: int) -> list[list[int]]:
        system = [1, *range(1300 + 70 * c, 1380 + 70 * c)] if own_system else SYSTEM
        prompt, answers = system + [200 + c, 201 + c], []
        for turn in range(turns):
            answer = await tokens_of(engine.generate(f"c{c}-t{turn}", prompt, greedy(12)))
            answers.append(answer)
            prompt = prompt + answer + [300 + turn, 301 + c]
        return answers

    return [a for answers in await asyncio.gather(*(conversation(c) for c in range(num_conversations))) for a in answers]


async def rounds(engine: BuiltinEngine, num_conversations: int, turns: int, system_tokens: int) -> list[list[int]]:
    """Conversations with prompts of their own, one request at a time, round robin: least recently used
    is what comes next, so a pool too small for them all evicts what the next turn needs."""
    outputs = []
    prompts = {c: [1, *range(100 + 70 * c, 100 + 70 * c + system_tokens)] for c in range(num_conversations)}
    for turn in range(turns):
        for c in range(num_conversations):
            answer = await tokens_of(engine.generate(f"c{c}-t{turn}", prompts[c], greedy(12)))
            outputs.append(answer)
            prompts[c] = prompts[c] + answer + [30 + turn, 31 + c]
    return outputs


async def served(engine: BuiltinEngine, body: Any, *, check: bool = True) -> Any:
    await engine.start()
    try:
        if not check:
            return await body(engine)
        out = await checked_between_steps(engine, body(engine))
        check_books_at_rest(engine)
        return out
    finally:
        await engine.stop()


def test_multi_turn_outputs_equal_with_and_without_the_cache(tiny_model_dir: Path) -> None:
    def workload(e: BuiltinEngine) -> Coroutine[Any, Any, list[list[int]]]:
        return conversations(e, 4, 3)

    plain = elastic_engine(tiny_model_dir, caching=False, chunks=48, cpu_buffer_bytes=4 * MIB)
    cached = elastic_engine(tiny_model_dir, caching=True, chunks=48, cpu_buffer_bytes=4 * MIB)
    assert run(served(plain, workload, check=False)) == run(served(cached, workload))
    assert cached.num_prefilled_tokens < plain.num_prefilled_tokens / 2
    assert elastic_of(cached).num_cache_hit_tokens == plain.num_prefilled_tokens - cached.num_prefilled_tokens


def test_evicted_blocks_go_to_the_host_and_come_back(tiny_model_dir: Path) -> None:
    """20 chunks: a 100-token prefill's activations take over half the pool, so the cache is evicted
    again and again (deflation). Without a buffer what is evicted is gone and every turn is prefilled
    whole; with one it is swapped out, and swapped back in when its conversation's turn comes."""

    def workload(e: BuiltinEngine) -> Coroutine[Any, Any, list[list[int]]]:
        return rounds(e, 16, 3, 80)

    reference = run(served(elastic_engine(tiny_model_dir, caching=False, chunks=20), workload, check=False))
    dropping = elastic_engine(tiny_model_dir, caching=True, chunks=20)
    swapping = elastic_engine(tiny_model_dir, caching=True, chunks=20, cpu_buffer_bytes=4 * MIB)
    assert run(served(dropping, workload)) == reference
    assert run(served(swapping, workload)) == reference
    without, with_host = dropping.prefix_cache_stats(), swapping.prefix_cache_stats()
    assert without.host_blocks is None and without.num_swap_outs == without.num_swap_ins == 0
    assert with_host.num_swap_outs > 0 and with_host.num_swap_ins > 0
    assert with_host.host_blocks == elastic_of(swapping).prefix.tree.num_host_blocks  # type: ignore[union-attr]
    assert with_host.prefilled_tokens < without.prefilled_tokens
    # Every token is either prefilled or comes from the cache, the device's or the host's.
    assert with_host.hit_tokens + with_host.prefilled_tokens == without.hit_tokens + without.prefilled_tokens
    # The worker exports the host tier's figures, and only where there is one.
    from kvfleet.worker.gpu import GPUProbe
    from kvfleet.worker.metrics import WorkerMetrics

    def sample(e: BuiltinEngine, name: str) -> float | None:
        metrics = WorkerMetrics(lambda: 0.0, lambda: 0.0, lambda: 0.0, lambda: 0.0, GPUProbe(),
                                prefix_cache=e.prefix_cache_stats)
        return metrics.registry.get_sample_value(name)

    assert sample(swapping, "kvfleet_worker_prefix_cache_swap_ins") == with_host.num_swap_ins
    assert sample(swapping, "kvfleet_worker_prefix_cache_host_blocks") == with_host.host_blocks
    assert sample(dropping, "kvfleet_worker_prefix_cache_swap_ins") is None


def test_a_parked_request_that_read_cached_blocks_comes_back_with_its_own_kv(tiny_model_dir: Path) -> None:
    """Parked while it reads SYSTEM's cached blocks, the request takes a copy of them along and lets
    go of them: they are evicted and their blocks overwritten while it waits, and it still decodes
    what it decodes without the cache."""
    prompt = SYSTEM + [7, 8, 9]

    async def reference(e: BuiltinEngine) -> list[int]:
        return await tokens_of(e.generate("x", prompt, greedy(40)))

    expected = run(served(elastic_engine(tiny_model_dir, caching=False, chunks=48), reference, check=False))

    async def scenario(e: BuiltinEngine) -> list[int]:
        sched = elastic_of(e)
        assert sched.prefix is not None and e._step_lock is not None and e._cache is not None
        await tokens_of(e.generate("warm", SYSTEM + [1, 2], greedy(2)))  # caches SYSTEM's 5 blocks
        stream = e.generate("x", prompt, greedy(40))
        first: list[int] = []
        async for out in stream:
            first += out.new_token_ids
            if len(first) >= 5:
                break
        async with e._step_lock:
            req = sched.requests["x"]
            assert req.shared is not None and len(req.shared.nodes) == 5
            sched.evict(req)
            assert req.parked is not None and req.shared is None and not req.blocks
            assert sched.prefix.num_evictable_blocks == sched.prefix.num_blocks == 5  # unpinned
            assert sched.evict_cached(5) == 5 and sched.prefix.num_blocks == 0  # (swapped out)
            cache = e._cache
            assert sched.kv is not None
            free = list(sched.kv.free)
            garbage = torch.full((len(cache.layers), 2, len(free), *cache.block_shape), 7.0, dtype=cache.layers[0].dtype)
            await e._in_executor(lambda: cache.write_blocks(free, garbage))
            check_books(e)
        rest = [t async for out in stream for t in out.new_token_ids]
        assert sched.num_parked >= 1 and sched.buffer.num_fetched >= 1
        return first + rest

    cached = elastic_engine(tiny_model_dir, caching=True, chunks=48, cpu_buffer_bytes=4 * MIB, min_step_s=0.01)
    assert run(served(cached, scenario)) == expected
    assert elastic_of(cached).num_cache_hit_tokens == 80


def test_parked_requests_take_the_buffer_from_the_host_tier(tiny_model_dir: Path) -> None:
    """A buffer of 32 blocks: one round of 16 conversations fills it with the cache's host blocks, then
    8 conversations at once make requests park. Their KV comes first: host blocks are dropped to make
    room (never below what parked KV needs), outputs equal, books balance throughout.

    The 8 open with system prompts of their own: with one they all share, each would read it from the
    cache once the first prefilled it (Scheduler._share_prompt), and the pool would not be short."""
    yielded: list[tuple[int, int]] = []  # host blocks before and after a park made room

    async def workload(e: BuiltinEngine) -> list[list[int]]:
        return await rounds(e, 16, 1, 80) + await conversations(e, 8, 2, own_system=True)

    async def watched(e: BuiltinEngine) -> list[list[int]]:
        sched = elastic_of(e)
        make_room = sched.buffer.make_room

        def recording(num_blocks: int) -> bool:
            assert sched.prefix is not None
            before = sched.prefix.tree.num_host_blocks
            room = make_room(num_blocks)
            yielded.append((before, sched.prefix.tree.num_host_blocks))
            return room

        sched.buffer.make_room = recording  # type: ignore[method-assign]
        return await workload(e)

    reference = run(served(elastic_engine(tiny_model_dir, caching=False, chunks=48), workload, check=False))
    e = elastic_engine(tiny_model_dir, caching=True, chunks=20, cpu_buffer_bytes=1 * MIB)
    assert run(served(e, watched)) == reference
    sched = elastic_of(e)
    assert sched.num_parked > 0 and sched.buffer.num_swap_outs > 0
    assert any(after < before for before, after in yielded)


def test_a_chunk_is_not_deflated_while_a_copy_out_of_its_blocks_is_pending() -> None:
    """Unmapped slots read as zero: a chunk whose free block a queued copy (a park, a swap_out) still
    reads stays mapped until the copy has run."""
    from concurrent.futures import Future

    from kvfleet.worker.elastic import ChunkPool, open_memory
    from kvfleet.worker.engines.builtin.elastic import ElasticKVBlocks

    chunk_bytes, block_bytes = 64 * KIB, 16 * KIB
    memory = open_memory("host", 4, chunk_bytes, torch.device("cpu"))
    kv = ElasticKVBlocks(ChunkPool(4, chunk_bytes), memory, block_bytes)
    try:
        assert kv.grow(2) == 2
        copy: Future[None] = Future()
        kv.draining[5] = copy  # a block of the second chunk
        assert kv.shrink(2) == 1 and len(kv.free) == 4  # the first chunk only
        copy.set_result(None)
        assert kv.shrink(1) == 1 and not kv.free and not kv.draining
    finally:
        kv.tensor.close()
        memory.close()


def test_a_prefilled_prompt_swapped_in_from_the_host_is_shared_while_it_runs(tiny_model_dir: Path) -> None:
    """SYSTEM's blocks are on the host tier: the first request gets copies of them of its own (swap_in);
    once its prompt is prefilled those copies go back in the tree in place of the host blocks (the
    host tier's insert), and it reads them from there, so a second request with the same prompt,
    started while the first runs, shares them on the device."""
    prompt = SYSTEM + [7, 8, 9]  # 84 tokens: 5 full blocks

    async def reference(e: BuiltinEngine) -> list[int]:
        return await tokens_of(e.generate("x", prompt, greedy(30)))

    expected = run(served(elastic_engine(tiny_model_dir, caching=False, chunks=48), reference, check=False))

    async def scenario(e: BuiltinEngine) -> list[list[int]]:
        sched = elastic_of(e)
        assert sched.prefix is not None and e._step_lock is not None
        await tokens_of(e.generate("warm", SYSTEM + [1, 2], greedy(2)))  # caches SYSTEM's 5 blocks
        async with e._step_lock:
            assert sched.evict_cached(5) == 5 and sched.prefix.tree.num_host_blocks == 5  # swapped out
        a = e.generate("a", prompt, greedy(30))
        first_a: list[int] = []
        async for out in a:
            first_a += out.new_token_ids
            break
        assert sched.buffer.num_swap_ins == 5
        req_a = sched.requests["a"]
        assert req_a.shared is not None and len(req_a.shared.nodes) == 5
        assert sched.prefix.tree.num_host_blocks == 0 and sched.prefix.num_blocks == 5
        b = e.generate("b", prompt, greedy(30))
        first_b: list[int] = []
        async for out in b:
            first_b += out.new_token_ids
            break
        assert sched.requests["b"].blocks[:5] == req_a.blocks[:5] and sched.buffer.num_swap_ins == 5
        assert sched.num_cache_hit_tokens == 2 * 80
        return [first_a + await tokens_of(a), first_b + await tokens_of(b)]

    cached = elastic_engine(tiny_model_dir, caching=True, chunks=48, cpu_buffer_bytes=4 * MIB, min_step_s=0.01)
    assert run(served(cached, scenario)) == [expected, expected]
