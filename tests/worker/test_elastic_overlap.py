"""eLLM §5.1, "Overlapping (Un)mapping Overheads", in the builtin engine's elastic memory: decoding
speculative pre-mapping and asynchronous unmapping (builtin/elastic.py, etensor.py), on the host backend.

The seam is the scheduler's count of range maps and unmaps made while a step computes (`overlap`)
against those made on a step's path. With the overlap on, steady decoding maps nothing on the path;
the tokens are those of the engine without it and of the static engine; deflated slots stay mapped
behind a fence while their chunk already serves its new owner, and the pool's books (owners, free
lists, what the ranges really map) balance through a run that deflates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from worker_testing import ELASTIC_MAX_TOKENS, ELASTIC_PROMPTS, greedy, run, tokens_of  # noqa: E402

from kvfleet.worker.elastic import (  # noqa: E402
    ChunkPool,
    ETensor,
    Owner,
    QueueFence,
    granularity_bytes,
    open_memory,
    record_marker,
)
from kvfleet.worker.elastic.options import MemoryOptions  # noqa: E402
from kvfleet.worker.engines.base import EngineConfig  # noqa: E402
from kvfleet.worker.engines.builtin.elastic import ElasticKVBlocks, ElasticScheduler, MappingOverlap  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine  # noqa: E402
from kvfleet.worker.engines.builtin.options import BuiltinOptions  # noqa: E402
from kvfleet.worker.engines.builtin.scheduler import Step  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
PROMPTS, MAX_TOKENS = ELASTIC_PROMPTS, ELASTIC_MAX_TOKENS


class ManualFence:
    """A fence the test passes by hand; `wait` passes it (the work it stood behind is taken as done)."""

    def __init__(self) -> None:
        self.passed = False
        self.waited = 0

    def done(self) -> bool:
        return self.passed

    def wait(self) -> None:
        self.waited += 1
        self.passed = True


def elastic_engine(model_dir: Path, *, overlap: bool, chunks: int, cpu_buffer_bytes: int = 0) -> BuiltinEngine:
    # 256 KiB chunks: 8 blocks of the tiny model in float32 (2 KiB a token).
    memory = MemoryOptions(budget_bytes=chunks * 256 * KIB, chunk_bytes=256 * KIB, elastic=True,
                           cpu_buffer_bytes=cpu_buffer_bytes, overlap_mapping=overlap)
    return BuiltinEngine(EngineConfig(model_path=model_dir, max_model_len=512), BuiltinOptions(memory=memory))


def elastic_of(engine: BuiltinEngine) -> ElasticScheduler:
    assert engine.elastic is not None
    return engine.elastic


def mapping_of(engine: BuiltinEngine) -> MappingOverlap:
    """eLLM §5.1's part of a started engine's scheduler (its counters)."""
    mapping = elastic_of(engine).mapping
    assert mapping is not None
    return mapping


async def serve(engine: BuiltinEngine, prompts: list[list[int]], prefix: str = "r") -> list[list[int]]:
    return list(await asyncio.gather(*(tokens_of(engine.generate(f"{prefix}{i}", p, greedy(MAX_TOKENS)))
                                       for i, p in enumerate(prompts))))


def watch_steps(sched: ElasticScheduler, each: Any) -> None:
    """Call `each(step)` as every step is handed to the executor (just before the overlap's work)."""
    inner = sched.overlap

    def overlap(step: Step) -> None:
        each(step)
        inner(step)
        each(None)

    sched.overlap = overlap  # type: ignore[method-assign]


def check_books(sched: ElasticScheduler) -> None:
    """The pool's books and what the ranges map agree: every chunk has one owner, each side's eTensor
    maps exactly the chunks its side owns, the range still maps a deferred slot's old chunk and nothing
    else, and every block of the mapped KV chunks is free or one request's, exactly once."""
    kv, activations = sched.kv, sched.activations
    assert kv is not None and activations is not None
    pool = kv.chunks
    for tensor, owner in ((kv.tensor, Owner.KV), (activations.tensor, Owner.ACTIVATION)):
        mapped = {slot: tensor.chunk_of(slot) for slot in tensor.mapped_slots}
        assert sorted(c for c in mapped.values() if c is not None) == sorted(
            c for c in range(pool.num_chunks) if pool.owner(c) is owner)
        assert pool.count(owner) == len(mapped)
        assert not tensor.pending_slots & tensor.mapped_slots
        physical = tensor._range._slots.chunk_at  # type: ignore[attr-defined]  # the host range's own books
        expected = {**mapped, **{slot: tensor.pending_chunk(slot) for slot in tensor.pending_slots}}
        assert physical == expected
    assert pool.count(Owner.FREE) == pool.num_chunks - pool.count(Owner.KV) - pool.count(Owner.ACTIVATION)
    assert 0 not in kv.tensor.pending_slots  # a step may read KV slot 0 whatever its blocks
    held = [b for req in sched.requests.values() for b in req.blocks]
    held += [b for staged in sched.staged.values() for b in staged.blocks]
    blocks = sorted(held + list(kv.free))
    assert blocks == sorted(b for slot in kv.tensor.mapped_slots for b in kv._blocks_of(slot))
    assert kv.free == sorted(kv.free, reverse=True)


# -- the physical layer -----------------------------------------------------------------------------


@pytest.fixture
def host_memory() -> Iterator[Any]:
    cpu = torch.device("cpu")
    memory = open_memory("host", 4, granularity_bytes("host", cpu), cpu)
    yield memory
    memory.close()


def test_a_deferred_unmap_hands_the_chunk_on_at_once_and_unmaps_once_its_fence_passes(host_memory: Any) -> None:
    pool = ChunkPool(host_memory.num_chunks, host_memory.chunk_bytes)
    floats = host_memory.chunk_bytes // 4
    kv = ETensor(pool, host_memory, Owner.KV, 4)
    activation = ETensor(pool, host_memory, Owner.ACTIVATION, 4)
    kv_view = kv.view(torch.float32, (4, floats))
    activation_view = activation.view(torch.float32, (4, floats))
    try:
        assert kv.map_slots([0, 1]) == [0, 1]
        kv_view[1] = 7.0
        fence = ManualFence()
        kv.unmap_slots([1], fence)
        # The books: chunk 1 is FREE now, the slot unmapped; the range still maps the chunk there.
        assert pool.owner(1) is Owner.FREE and kv.mapped_slots == {0} and kv.chunk_of(1) is None
        assert kv.pending_slots == {1} and kv.pending_chunk(1) == 1
        assert bool((kv_view[1] == 7.0).all())
        # The chunk serves its new owner at once: one physical chunk at two virtual addresses.
        assert activation.map_slots([0]) == [1]
        activation_view[0] = 3.0
        assert bool((kv_view[1] == 3.0).all())
        unmaps = kv.num_unmaps
        assert kv.complete_unmaps() == 0 and kv.pending_slots == {1}
        fence.passed = True
        assert kv.complete_unmaps() == 1 and kv.num_unmaps == unmaps + 1 and not kv.pending_slots
        assert int(kv_view[1].count_nonzero()) == 0 and bool((activation_view[0] == 3.0).all())
    finally:
        del kv_view, activation_view
        activation.close()
        kv.close()


def test_mapping_a_chunk_or_slot_a_deferred_unmap_holds_waits_for_that_fence_first(host_memory: Any) -> None:
    pool = ChunkPool(host_memory.num_chunks, host_memory.chunk_bytes)
    floats = host_memory.chunk_bytes // 4
    kv = ETensor(pool, host_memory, Owner.KV, 4)
    view = kv.view(torch.float32, (4, floats))
    try:
        kv.map_slots([0, 1])
        view[0], view[1] = 5.0, 6.0
        first, second = ManualFence(), ManualFence()
        kv.unmap_slots([0], first)
        kv.unmap_slots([1], second)
        # The pool hands out chunk 0 again: still mapped at slot 0 of this very range, so slot 0 is
        # unmapped first (a range maps a chunk once); the chunk keeps its bytes.
        assert kv.map_slots([2]) == [0]
        assert first.waited == 1 and kv.pending_slots == {1} and second.waited == 0
        assert bool((view[2] == 5.0).all()) and int(view[0].count_nonzero()) == 0
        # A slot still pending is mapped again: its own deferred unmap goes first.
        assert kv.map_slots([1], synchronize=False) == [1]
        assert second.waited == 1 and not kv.pending_slots and kv.chunk_of(1) == 1
        assert bool((view[1] == 6.0).all())
        third = ManualFence()
        kv.unmap_slots([1], third)
        del view
        kv.close()  # a pending unmap is done on close, its fence waited for
        assert third.waited == 1 and pool.count(Owner.FREE) == pool.num_chunks
    finally:
        kv.close()


def test_kv_slot_0_is_never_mapped_ahead_nor_unmapped_behind_a_fence(host_memory: Any) -> None:
    """builtin.model pads the decode gathers' block tables with block 0, so a running step may read KV
    slot 0 whatever its blocks: only the time between steps (un)maps it."""
    block_bytes = host_memory.chunk_bytes // 2
    fences: list[ManualFence] = []

    def fence() -> ManualFence:
        fences.append(ManualFence())
        return fences[-1]

    kv = ElasticKVBlocks(ChunkPool(4, host_memory.chunk_bytes), host_memory, block_bytes, unmap_fence=fence)
    try:
        assert kv.grow(2) == 2 and kv.tensor.mapped_slots == {0, 1}
        assert kv.shrink(2) == 2 and len(fences) == 1
        assert kv.tensor.pending_slots == {1} and not kv.tensor.mapped_slots and not kv.free
        # Ahead of need: neither slot 0 nor, while another is free, the pending slot 1 (it would wait).
        assert kv.grow(1, ahead=True) == 1 and kv.tensor.mapped_slots == {2} and fences[0].waited == 0
        # The pool hands out chunk 1, which slot 1 still maps: that deferred unmap is done first.
        assert kv.grow(1, ahead=True) == 1 and kv.tensor.mapped_slots == {2, 3} and kv.tensor.chunk_of(3) == 1
        assert fences[0].waited == 1 and not kv.tensor.pending_slots
        assert kv.grow(1, ahead=True) == 1 and kv.tensor.mapped_slots == {1, 2, 3}
        assert kv.grow(1, ahead=True) == 0  # only slot 0 is left, which only the step's path maps
        assert kv.grow(1) == 1 and kv.tensor.mapped_slots == {0, 1, 2, 3}
        assert sorted(kv.free) == list(range(8))
    finally:
        kv.tensor.close()


def test_a_queue_fence_passes_once_the_jobs_queued_before_it_have_run() -> None:
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    release = threading.Event()
    try:
        executor.submit(release.wait, 10)
        fence = QueueFence(executor.submit(record_marker, torch.device("cpu")))
        assert not fence.done()
        release.set()
        fence.wait()
        assert fence.done()
        broken: concurrent.futures.Future[Any] = concurrent.futures.Future()
        broken.set_exception(RuntimeError("no event"))
        failed = QueueFence(broken)
        assert failed.done()  # passed, as far as waiting goes: `wait` says it failed
        with pytest.raises(RuntimeError):
            failed.wait()
    finally:
        executor.shutdown()


def test_cuda_backend_synchronizes_the_device_only_when_not_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_elastic_memory import FAKE_GRANULARITY_BYTES, FakeDriver

    from kvfleet.worker.elastic import cuda as cuda_backend

    fake = FakeDriver()
    syncs: list[Any] = []
    monkeypatch.setattr(cuda_backend, "_driver", lambda: fake)
    monkeypatch.setattr(cuda_backend, "_contexts", {})
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    memory = open_memory("cuda", 4, 2 * FAKE_GRANULARITY_BYTES, torch.device("cuda", 0))
    try:
        virtual = memory.reserve(4)
        virtual.map(0, 0)
        virtual.unmap(0)
        assert len(syncs) == 2
        virtual.map(1, 1, synchronize=False)  # ahead of need: no queued work reads the slot
        virtual.unmap(1, synchronize=False)  # behind a passed fence
        assert len(syncs) == 2
        assert fake.slot(virtual, 1)[0] == memory.zero_handle
    finally:
        memory.close()
    assert (fake.mappings, fake.reservations, fake.handles) == ({}, {}, {})


# -- the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def static_reference(tiny_model_dir: Path) -> list[list[int]]:
    engine = BuiltinEngine(EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=8 * MIB, max_model_len=512))

    async def go() -> list[list[int]]:
        await engine.start()
        try:
            return await serve(engine, PROMPTS)
        finally:
            await engine.stop()

    return run(go())


@pytest.mark.parametrize("overlap", [True, False])
def test_steady_decoding_maps_nothing_on_the_steps_path(tiny_model_dir: Path, overlap: bool) -> None:
    """Between two decode steps of the same batch (the reservation after one, the plan of the next),
    no chunk is mapped with pre-mapping on; without it, every block boundary maps on the path."""
    engine = elastic_engine(tiny_model_dir, overlap=overlap, chunks=64)
    marks: list[tuple[int, bool, int]] = []  # (maps on the path so far, all decodes, batch) at each step

    async def go() -> list[list[int]]:
        await engine.start()
        sched, mapping = elastic_of(engine), mapping_of(engine)

        def mark(step: Step | None) -> None:
            if step is not None:
                marks.append((mapping.maps_on_path, all(len(e.token_ids) == 1 for e in step.entries), len(step.entries)))

        watch_steps(sched, mark)
        try:
            return await serve(engine, PROMPTS)
        finally:
            await engine.stop()

    run(go())
    steady = [(a, b) for a, b in zip(marks, marks[1:]) if a[1] and b[1] and a[2] == b[2]]
    assert len(steady) > 20
    on_path = sum(b[0] - a[0] for a, b in steady)
    if overlap:
        assert on_path == 0
        assert mapping_of(engine).premapped_chunks > 0
    else:
        assert on_path > 0
        assert mapping_of(engine).maps_ahead == 0


def test_outputs_with_the_overlap_equal_those_without_it_and_the_static_engines(
        tiny_model_dir: Path, static_reference: list[list[int]]) -> None:
    """Under pressure (parking in the CPU buffer, offloaded prefills, chunks moving both ways)."""
    outputs = {}
    for overlap in (True, False):
        engine = elastic_engine(tiny_model_dir, overlap=overlap, chunks=14, cpu_buffer_bytes=4 * MIB)

        async def go(engine: BuiltinEngine = engine) -> list[list[int]]:
            await engine.start()
            try:
                return await serve(engine, PROMPTS)
            finally:
                await engine.stop()

        outputs[overlap] = run(go())
        sched = elastic_of(engine)
        assert sched.num_parked + sched.num_offloaded_prefills > 0 and sched.inflated_chunks > 0
    assert outputs[True] == outputs[False] == static_reference


def test_books_balance_through_a_run_that_deflates(tiny_model_dir: Path) -> None:
    """Short requests grow the KV side, a longer prompt's prefill deflates its empty chunks for its
    activations (behind fences), short ones again: the books are checked as every step starts and
    after its overlapped work, and at the end; unmaps ran off the steps' path."""
    long_prompt = [1, *range(3, 43)]
    counts: dict[bool, dict[str, int]] = {}
    outputs: dict[bool, Any] = {}
    for overlap in (True, False):
        engine = elastic_engine(tiny_model_dir, overlap=overlap, chunks=14, cpu_buffer_bytes=4 * MIB)

        async def go(engine: BuiltinEngine = engine) -> Any:
            await engine.start()
            sched = elastic_of(engine)
            watch_steps(sched, lambda step: check_books(sched))
            try:
                first = await serve(engine, PROMPTS)
                long = await tokens_of(engine.generate("long", long_prompt, greedy(8)))
                again = await serve(engine, PROMPTS, prefix="s")
                check_books(sched)
                assert sched.deflated_chunks > 0
                kv = sched.kv
                assert kv is not None
                assert all(copy.done() for copy in kv.draining.values())
                return first, long, again
            finally:
                await engine.stop()

        outputs[overlap] = run(go())
        sched = elastic_of(engine)
        counts[overlap] = sched.mapping_counts()
        assert sched.kv is not None and sched.kv.chunks.count(Owner.FREE) == sched.kv.chunks.num_chunks
    assert outputs[True] == outputs[False]
    assert counts[True]["unmaps_ahead"] > 0 and counts[False]["unmaps_ahead"] == 0
    assert counts[True]["unmaps_on_path"] < counts[False]["unmaps_on_path"]
