"""Elastic memory's physical layer (kvfleet.worker.elastic): one contract for every backend, and the
pool's books under random operations.

The contract runs on the host backend everywhere and on the CUDA backend where a GPU is present.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvfleet.worker.elastic import (  # noqa: E402
    ChunkPool,
    ETensor,
    MapError,
    Owner,
    OwnershipError,
    PhysicalMemory,
    PoolExhausted,
    granularity_bytes,
    open_memory,
)

BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def device_of(kind: str) -> Any:
    return torch.device("cuda" if kind == "cuda" else "cpu")


@pytest.fixture(params=BACKENDS)
def memory(request: pytest.FixtureRequest) -> Iterator[PhysicalMemory]:
    kind = request.param
    device = device_of(kind)
    opened = open_memory(kind, 8, granularity_bytes(kind, device), device)
    yield opened
    opened.close()


def floats(memory: PhysicalMemory) -> int:
    return memory.chunk_bytes // 4


def test_unmapped_slots_read_zero_and_mapped_ones_keep_what_is_written(memory: PhysicalMemory) -> None:
    virtual = memory.reserve(4)
    view = virtual.as_tensor(torch.float32, (4, floats(memory)))
    assert int(view.count_nonzero()) == 0
    virtual.map(1, 3)
    view[1] = 7.0
    assert float(view[1].sum()) == 7.0 * floats(memory)
    assert int(view[0].count_nonzero()) == int(view[2].count_nonzero()) == 0
    virtual.unmap(1)
    assert int(view.count_nonzero()) == 0
    virtual.unmap(1)  # a no-op
    virtual.map(2, 3)  # the chunk kept its bytes, now seen at another slot
    assert float(view[2].sum()) == 7.0 * floats(memory)
    virtual.release()
    virtual.release()


def test_one_chunk_in_two_ranges_is_the_same_memory(memory: PhysicalMemory) -> None:
    first, second = memory.reserve(2), memory.reserve(3)
    a = first.as_tensor(torch.float32, (2, floats(memory)))
    b = second.as_tensor(torch.float32, (3, floats(memory)))
    first.map(0, 5)
    second.map(2, 5)
    a[0, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0], device=a.device)
    assert b[2, :4].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_bad_maps_are_refused_and_leave_the_slot_reading_zero(memory: PhysicalMemory) -> None:
    virtual = memory.reserve(2)
    view = virtual.as_tensor(torch.float32, (2, floats(memory)))
    for slot, chunk in ((5, 0), (0, 99), (-1, 0)):
        with pytest.raises(MapError):
            virtual.map(slot, chunk)
    virtual.map(0, 1)
    with pytest.raises(MapError):
        virtual.map(0, 2)  # already mapped
    with pytest.raises(MapError):
        virtual.map(1, 1)  # the chunk is already at slot 0
    assert int(view[1].count_nonzero()) == 0
    with pytest.raises(ValueError, match="view"):
        virtual.as_tensor(torch.float32, (3, floats(memory)))


def test_chunks_come_in_the_backend_granularity() -> None:
    unit = granularity_bytes("host", torch.device("cpu"))
    assert unit == mmap.PAGESIZE
    with pytest.raises(ValueError, match="granularity"):
        open_memory("host", 2, unit + 1, torch.device("cpu"))


class FailingMemory:
    """A memory whose ranges refuse the k-th map: a partial failure in the middle of map_slots."""

    def __init__(self, inner: PhysicalMemory, fail_on_call: int) -> None:
        self.inner = inner
        self.name, self.device, self.chunk_bytes, self.num_chunks = inner.name, inner.device, inner.chunk_bytes, inner.num_chunks
        self.calls = 0
        self.fail_on_call = fail_on_call

    def reserve(self, num_slots: int) -> Any:
        virtual = self.inner.reserve(num_slots)
        outer = self

        class Failing:
            def __init__(self) -> None:
                self.num_slots, self.slot_bytes = virtual.num_slots, virtual.slot_bytes

            def map(self, slot: int, chunk_id: int) -> None:
                outer.calls += 1
                if outer.calls == outer.fail_on_call:
                    raise MapError("injected")
                virtual.map(slot, chunk_id)

            def unmap(self, slot: int) -> None:
                virtual.unmap(slot)

            def as_tensor(self, dtype: Any, shape: Any) -> Any:
                return virtual.as_tensor(dtype, shape)

            def release(self) -> None:
                virtual.release()

        return Failing()

    def close(self) -> None:
        self.inner.close()


def test_failed_maps_and_an_exhausted_pool_never_touch_other_kv(memory: PhysicalMemory) -> None:
    """KV written through an eTensor survives every failure of another call, and failures roll back."""
    pool = ChunkPool(memory.num_chunks, memory.chunk_bytes)
    failing = FailingMemory(memory, fail_on_call=5)
    kv = ETensor(pool, failing, Owner.KV, memory.num_chunks)  # type: ignore[arg-type]
    view = kv.view(torch.float32, (memory.num_chunks, floats(memory)))
    kv.map_slots([0, 1, 2])
    for slot in (0, 1, 2):
        view[slot] = torch.arange(floats(memory), dtype=torch.float32, device=view.device) * (slot + 1)
    sums = [float(view[slot].sum()) for slot in range(3)]
    before = (pool.count(Owner.FREE), pool.count(Owner.KV), kv.mapped_slots)
    with pytest.raises(MapError):
        kv.map_slots([3, 4, 5])  # the second of these maps (call 5) fails: the first is undone
    assert (pool.count(Owner.FREE), pool.count(Owner.KV), kv.mapped_slots) == before
    assert int(view[3].count_nonzero()) == 0
    activation = ETensor(pool, memory, Owner.ACTIVATION, memory.num_chunks)
    activation.map_slots(list(range(pool.count(Owner.FREE))))
    with pytest.raises(PoolExhausted):
        kv.map_slots([3])
    assert kv.mapped_slots == before[2]
    assert [float(view[slot].sum()) for slot in range(3)] == sums
    activation.unmap_slots([0])
    kv.map_slots([6])  # the freed chunk; it holds no other request's data
    kv.unmap_slots([1])
    kv.map_slots([1])
    assert [float(view[slot].sum()) for slot in (0, 2)] == [sums[0], sums[2]]
    activation.close()
    kv.close()
    assert pool.count(Owner.FREE) == pool.num_chunks


# -- the pool's books under random operations ---------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["take", "give", "transfer", "map", "unmap", "adopt"]),
                         st.sampled_from([Owner.KV, Owner.ACTIVATION]), st.integers(0, 7), st.integers(0, 3)),
               max_size=40)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_every_chunk_has_one_owner_and_is_mapped_only_by_it(ops: list[tuple[str, Owner, int, int]]) -> None:
    unit = granularity_bytes("host", torch.device("cpu"))
    memory = open_memory("host", 6, unit, torch.device("cpu"))
    pool = ChunkPool(6, unit)
    tensors = {Owner.KV: ETensor(pool, memory, Owner.KV, 8), Owner.ACTIVATION: ETensor(pool, memory, Owner.ACTIVATION, 8)}
    loose: dict[Owner, list[int]] = {Owner.KV: [], Owner.ACTIVATION: []}  # taken, not mapped
    try:
        for op, owner, a, n in ops:
            tensor = tensors[owner]
            snapshot = ([pool.owner(c) for c in range(6)], {o: t.mapped_slots for o, t in tensors.items()})
            try:
                if op == "take":
                    loose[owner] += pool.take(n, owner)
                elif op == "give" and n == 0:
                    other = Owner.ACTIVATION if owner is Owner.KV else Owner.KV
                    mapped_elsewhere = [tensors[other].chunk_of(s) for s in tensors[other].mapped_slots]
                    # The other side's chunk (loose or mapped): refused.
                    pool.give_back([c for c in loose[other] + mapped_elsewhere if c is not None][:1] or [a % 6 + 6], owner)
                elif op == "give":
                    pool.give_back(loose[owner][:n], owner)
                    loose[owner] = loose[owner][n:]
                elif op == "transfer":
                    other = Owner.ACTIVATION if owner is Owner.KV else Owner.KV
                    moved = loose[owner][:n]
                    pool.transfer(moved, owner, other)
                    loose[owner], loose[other] = loose[owner][n:], loose[other] + moved
                elif op == "map":
                    tensor.map_slots(list(range(a, min(8, a + n))))
                elif op == "unmap":
                    tensor.unmap_slots([s for s in sorted(tensor.mapped_slots) if s >= a][:n])
                elif op == "adopt" and loose[owner]:
                    tensor.adopt(a, loose[owner][0])
                    loose[owner] = loose[owner][1:]
            except (PoolExhausted, OwnershipError, ValueError, MapError):
                # A refused operation changes nothing.
                assert ([pool.owner(c) for c in range(6)], {o: t.mapped_slots for o, t in tensors.items()}) == snapshot
            counts = [pool.count(o) for o in Owner]
            assert sum(counts) == 6
            for o in (Owner.KV, Owner.ACTIVATION):
                mapped = [tensors[o].chunk_of(s) for s in tensors[o].mapped_slots]
                assert len(set(mapped)) == len(mapped)
                assert all(c is not None and pool.owner(c) is o for c in mapped)
                owned = {c for c in range(6) if pool.owner(c) is o}
                assert set(mapped) | set(loose[o]) == owned and not set(mapped) & set(loose[o])
    finally:
        for tensor in tensors.values():
            tensor.close()
        memory.close()
