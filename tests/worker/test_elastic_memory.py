"""Elastic memory's physical layer (kvfleet.worker.elastic): one contract for every backend, and the
pool's books under random operations.

The contract runs on the host backend everywhere and on the CUDA backend where a GPU is present
(and cuda-python is installed); the property tests run on the host backend with page-sized chunks,
which maps real memory and is fast.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Literal

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
    VirtualRange,
    granularity_bytes,
    open_memory,
)

BACKENDS = ["host", pytest.param("cuda", marks=[pytest.mark.gpu,
                                                pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")])]
NUM_CHUNKS = 8


def device_of(kind: str) -> Any:
    return torch.device("cuda" if kind == "cuda" else "cpu")


@pytest.fixture(params=BACKENDS)
def memory(request: pytest.FixtureRequest) -> Iterator[PhysicalMemory]:
    kind = request.param
    device = device_of(kind)
    opened = open_memory(kind, NUM_CHUNKS, granularity_bytes(kind, device), device)
    yield opened
    opened.close()


def floats(memory: PhysicalMemory) -> int:
    return memory.chunk_bytes // 4


def view_of(virtual: VirtualRange, memory: PhysicalMemory) -> Any:
    return virtual.as_tensor(torch.float32, (virtual.num_slots, floats(memory)))


def pattern(memory: PhysicalMemory, seed: int) -> Any:
    """A chunk's worth of floats no other seed writes (seed 0 is not zero)."""
    return torch.arange(floats(memory), dtype=torch.float32, device=memory.device) * 0.5 + seed + 1


# -- the contract ---------------------------------------------------------------------------------


def test_unmapped_slots_read_zero_and_mapped_ones_keep_what_is_written(memory: PhysicalMemory) -> None:
    virtual = memory.reserve(4)
    view = view_of(virtual, memory)
    assert int(view.count_nonzero()) == 0
    virtual.map(1, 3)
    view[1] = 7.0
    assert float(view[1].sum()) == 7.0 * floats(memory)
    assert int(view[0].count_nonzero()) == int(view[2].count_nonzero()) == 0
    virtual.unmap(1)
    assert int(view.count_nonzero()) == 0
    virtual.unmap(1)  # a no-op
    virtual.map(1, 4)  # another chunk at the same slot: its own (zero) bytes, not chunk 3's
    assert int(view[1].count_nonzero()) == 0
    virtual.release()
    virtual.release()


def test_every_chunk_reads_zero_when_first_mapped_and_is_its_own_memory(memory: PhysicalMemory) -> None:
    virtual = memory.reserve(memory.num_chunks)
    view = view_of(virtual, memory)
    slot_of = {chunk_id: memory.num_chunks - 1 - chunk_id for chunk_id in range(memory.num_chunks)}
    for chunk_id, slot in slot_of.items():
        virtual.map(slot, chunk_id)
    assert int(view.count_nonzero()) == 0
    for chunk_id, slot in slot_of.items():
        view[slot] = pattern(memory, chunk_id)
    for chunk_id, slot in slot_of.items():
        assert torch.equal(view[slot], pattern(memory, chunk_id))


def test_a_chunk_keeps_its_bytes_across_unmap_and_remap(memory: PhysicalMemory) -> None:
    virtual = memory.reserve(6)
    view = view_of(virtual, memory)
    virtual.map(0, 3)
    view[0] = pattern(memory, 3)
    virtual.unmap(0)
    virtual.map(5, 3)
    assert torch.equal(view[5], pattern(memory, 3))
    virtual.map(0, 4)
    assert int(view[0].count_nonzero()) == 0


def test_one_chunk_in_two_ranges_is_the_same_memory(memory: PhysicalMemory) -> None:
    first, second = memory.reserve(2), memory.reserve(3)
    a, b = view_of(first, memory), view_of(second, memory)
    first.map(0, 5)
    second.map(2, 5)
    a[0] = pattern(memory, 5)
    assert torch.equal(b[2], pattern(memory, 5))
    b[2, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0], device=b.device)
    assert a[0, :4].tolist() == [1.0, 2.0, 3.0, 4.0]
    second.unmap(2)  # the other range still sees the chunk
    assert a[0, :4].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert int(b.count_nonzero()) == 0


def test_views_of_any_dtype_are_the_same_bytes_without_a_copy(memory: PhysicalMemory) -> None:
    virtual = memory.reserve(2)
    virtual.map(1, 0)
    raw = virtual.as_tensor(torch.uint8, (2, memory.chunk_bytes))
    bf16 = virtual.as_tensor(torch.bfloat16, (2, 2, memory.chunk_bytes // 4))  # bfloat16 has no typestr
    half = virtual.as_tensor(torch.float16, (2 * memory.chunk_bytes // 2,))
    assert bf16.dtype == torch.bfloat16 and tuple(bf16.shape) == (2, 2, memory.chunk_bytes // 4)
    assert raw.data_ptr() == bf16.data_ptr() == half.data_ptr()
    bf16[1, 0, 0] = 1.0
    assert raw[1, :2].tolist() == [0x80, 0x3F]  # bfloat16 1.0, little-endian
    assert float(half[memory.chunk_bytes // 2]) == 1.875  # the same two bytes (0x3F80) read as a half


def test_bad_maps_are_refused_and_leave_the_slot_reading_zero(memory: PhysicalMemory) -> None:
    virtual = memory.reserve(2)
    view = view_of(virtual, memory)
    for slot, chunk in ((5, 0), (2, 0), (0, 99), (0, -1), (-1, 0)):
        with pytest.raises(MapError):
            virtual.map(slot, chunk)
    assert int(view.count_nonzero()) == 0
    virtual.map(0, 1)  # the refusals left the slot mappable
    view[0] = 1.0
    with pytest.raises(MapError):
        virtual.map(0, 2)  # already mapped
    with pytest.raises(MapError):
        virtual.map(1, 1)  # the chunk is already at slot 0 of this range
    assert int(view[1].count_nonzero()) == 0
    assert float(view[0].sum()) == floats(memory)
    with pytest.raises(ValueError, match="view"):
        virtual.as_tensor(torch.float32, (3, floats(memory)))


def test_release_and_close_are_idempotent(memory: PhysicalMemory) -> None:
    kept, released = memory.reserve(2), memory.reserve(2)
    kept.map(0, 0)
    released.map(1, 1)
    released.release()
    released.release()
    released.unmap(1)  # a no-op once released
    with pytest.raises(MapError):
        released.map(0, 2)
    memory.close()  # releases `kept` too, mapped slot and all
    memory.close()
    kept.release()
    with pytest.raises(MapError):
        memory.reserve(1)


def test_a_background_thread_maps_for_the_main_one(memory: PhysicalMemory) -> None:
    """The engine maps from its executor thread (on a GPU: the context must be made current there)."""
    virtual = memory.reserve(2)
    view = view_of(virtual, memory)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            virtual.map(1, 2)
        except BaseException as exc:  # checked on the main thread
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert errors == []
    view[1] = 3.0
    assert float(view[1].sum()) == 3.0 * floats(memory)


FAULT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from kvfleet.worker.elastic import granularity_bytes, open_memory

    kind = sys.argv[1]
    device = torch.device("cuda" if kind == "cuda" else "cpu")
    memory = open_memory(kind, 2, granularity_bytes(kind, device), device)
    virtual = memory.reserve(2)
    view = virtual.as_tensor(torch.uint8, (2, memory.chunk_bytes))
    virtual.map(0, 0)
    view[0] = 1
    if kind == "cuda":
        torch.cuda.synchronize()
    print("mapped write ok", flush=True)
    view[1] = 1
    if kind == "cuda":
        torch.cuda.synchronize()
    print("no fault", int(view[1].sum()), flush=True)
""")


def test_a_write_to_an_unmapped_slot_faults(memory: PhysicalMemory) -> None:
    """Unmapped slots are the read-only zero chunk: a stray write is a crash, not another request's KV."""
    if memory.name == "cuda" and not getattr(memory, "zero_read_only", False):
        pytest.skip("this driver maps no memory read-only: the CUDA zero chunk is read-write (cuda.py)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONFAULTHANDLER": ""}
    done = subprocess.run([sys.executable, "-c", FAULT_SCRIPT, memory.name], capture_output=True, text=True,
                          env=env, timeout=300)
    assert "mapped write ok" in done.stdout, done.stderr
    assert "no fault" not in done.stdout
    assert done.returncode != 0


@pytest.mark.parametrize("kind", BACKENDS)
def test_chunks_come_in_the_backend_granularity(kind: Literal["host", "cuda"]) -> None:
    device = device_of(kind)
    unit = granularity_bytes(kind, device)
    if kind == "host":
        assert unit == mmap.PAGESIZE
    assert unit > 0 and unit & (unit - 1) == 0
    for bad in (unit + 1, unit // 2, 0, -unit):
        with pytest.raises(ValueError, match="granularity"):
            open_memory(kind, 2, bad, device)
    open_memory(kind, 2, 2 * unit, device).close()


class FailingMemory:
    """A memory whose ranges refuse the k-th map (counted over all its ranges): a failure partway
    through map_slots, as a driver that runs out of something would cause."""

    def __init__(self, inner: PhysicalMemory, fail_on_call: int) -> None:
        self.inner = inner
        self.name, self.device = inner.name, inner.device
        self.chunk_bytes, self.num_chunks = inner.chunk_bytes, inner.num_chunks
        self.calls = 0
        self.fail_on_call = fail_on_call

    def reserve(self, num_slots: int) -> VirtualRange:
        return FailingRange(self, self.inner.reserve(num_slots))

    def close(self) -> None:
        self.inner.close()


class FailingRange:
    def __init__(self, memory: FailingMemory, inner: VirtualRange) -> None:
        self.memory, self.inner = memory, inner
        self.num_slots, self.slot_bytes = inner.num_slots, inner.slot_bytes

    def map(self, slot: int, chunk_id: int, *, synchronize: bool = True) -> None:
        self.memory.calls += 1
        if self.memory.calls == self.memory.fail_on_call:
            raise MapError("injected")
        self.inner.map(slot, chunk_id, synchronize=synchronize)

    def unmap(self, slot: int, *, synchronize: bool = True) -> None:
        self.inner.unmap(slot, synchronize=synchronize)

    def as_tensor(self, dtype: Any, shape: Sequence[int]) -> Any:
        return self.inner.as_tensor(dtype, shape)

    def release(self) -> None:
        self.inner.release()


def test_a_failed_map_or_an_exhausted_pool_never_corrupts_another_requests_kv(memory: PhysicalMemory) -> None:
    """KV written through an eTensor survives every failure of another call, and failed calls roll back."""
    pool = ChunkPool(memory.num_chunks, memory.chunk_bytes)
    failing = FailingMemory(memory, fail_on_call=5)
    kv = ETensor(pool, failing, Owner.KV, memory.num_chunks)
    view = kv.view(torch.float32, (memory.num_chunks, floats(memory)))
    kv.map_slots([0, 1, 2])
    for slot in (0, 1, 2):
        view[slot] = pattern(memory, slot)

    def books() -> tuple[Any, ...]:
        return (pool.count(Owner.FREE), pool.count(Owner.KV), pool.count(Owner.ACTIVATION), kv.mapped_slots,
                [kv.chunk_of(slot) for slot in range(kv.num_slots)], [pool.owner(c) for c in range(pool.num_chunks)])

    def kv_intact() -> bool:
        return all(torch.equal(view[slot], pattern(memory, slot)) for slot in (0, 1, 2))

    before = books()
    with pytest.raises(MapError, match="injected"):
        kv.map_slots([3, 4, 5])  # call 5 is the map of slot 4: slot 3's map is undone, the chunks go back
    assert books() == before and kv_intact()
    assert int(view[3:].count_nonzero()) == 0
    with pytest.raises(ValueError):
        kv.map_slots([2, 3])  # slot 2 is mapped: refused before anything is taken
    assert books() == before

    activation = ETensor(pool, memory, Owner.ACTIVATION, memory.num_chunks)
    activation.map_slots(list(range(pool.count(Owner.FREE))))
    before = books()
    with pytest.raises(PoolExhausted):
        kv.map_slots([3])
    assert books() == before and kv_intact()

    activation.unmap_slots([0])  # a chunk comes back FREE, and another request takes it
    kv.map_slots([6])
    assert int(view[6].count_nonzero()) == 0  # the activation side never wrote it
    view[6] = pattern(memory, 6)
    kv.unmap_slots([1])
    kv.map_slots([1])
    view[1] = pattern(memory, 1)
    assert kv_intact() and torch.equal(view[6], pattern(memory, 6))
    activation.close()
    kv.close()
    kv.close()
    assert pool.count(Owner.FREE) == pool.num_chunks


# -- the pool's books under random operations ---------------------------------------------------

POOL_CHUNKS = 6
POOL_OPS = st.lists(st.tuples(st.sampled_from(["take", "give", "transfer"]), st.sampled_from(list(Owner)),
                              st.sampled_from(list(Owner)), st.lists(st.integers(-1, POOL_CHUNKS), max_size=4),
                              st.integers(0, POOL_CHUNKS + 1)),
                    max_size=50)


@settings(max_examples=150, deadline=None)
@given(POOL_OPS)
def test_the_pool_matches_a_model_and_refusals_change_nothing(ops: list[tuple[str, Owner, Owner, list[int], int]]) -> None:
    """ChunkPool against a list of owners: every call does all of what the model says or none of it."""
    pool = ChunkPool(POOL_CHUNKS, 4096)
    model = [Owner.FREE] * POOL_CHUNKS
    for op, source, target, chunk_ids, num in ops:
        valid_ids = len(set(chunk_ids)) == len(chunk_ids) and all(0 <= c < POOL_CHUNKS for c in chunk_ids)
        try:
            if op == "take":
                taken = pool.take(num, target)
                assert target is not Owner.FREE and num <= model.count(Owner.FREE)
                assert len(taken) == len(set(taken)) == num and all(model[c] is Owner.FREE for c in taken)
                for c in taken:
                    model[c] = target
            elif op == "give":
                pool.give_back(chunk_ids, source)
                assert valid_ids and all(model[c] is source for c in chunk_ids)
                for c in chunk_ids:
                    model[c] = Owner.FREE
            else:
                pool.transfer(chunk_ids, source, target)
                assert valid_ids and all(model[c] is source for c in chunk_ids)
                for c in chunk_ids:
                    model[c] = target
        except PoolExhausted:
            assert op == "take" and num > model.count(Owner.FREE)
        except OwnershipError:
            assert op != "take" and not (valid_ids and all(model[c] is source for c in chunk_ids))
        except ValueError:
            assert op == "take" and target is Owner.FREE
        assert [pool.owner(c) for c in range(POOL_CHUNKS)] == model
        assert [pool.count(o) for o in Owner] == [model.count(o) for o in Owner]
        assert sum(pool.count(o) for o in Owner) == POOL_CHUNKS


ETENSOR_CHUNKS, ETENSOR_SLOTS = 6, 8
ETENSOR_OPS = st.lists(st.tuples(st.sampled_from(["take", "give", "give_foreign", "transfer", "map", "unmap",
                                                  "unmap_unmapped", "adopt"]),
                                 st.sampled_from([Owner.KV, Owner.ACTIVATION]), st.integers(0, ETENSOR_SLOTS - 1),
                                 st.integers(0, 3)),
                       max_size=40)


@settings(max_examples=60, deadline=None)
@given(ETENSOR_OPS)
def test_etensors_map_exactly_the_chunks_their_side_took_and_keep_their_bytes(
        ops: list[tuple[str, Owner, int, int]]) -> None:
    """Two eTensors (KV, activations) over one pool and one host memory, with chunks taken loose and
    adopted (§4.3.1's transfer-then-remap) beside map_slots. After every operation, valid or refused:
    the chunks each side owns are exactly those its eTensor maps plus those it holds loose; refusals
    change nothing; every mapped slot reads the bytes last written to its chunk, every other slot zero."""
    unit = granularity_bytes("host", torch.device("cpu"))
    memory = open_memory("host", ETENSOR_CHUNKS, unit, torch.device("cpu"))
    pool = ChunkPool(ETENSOR_CHUNKS, unit)
    sides = (Owner.KV, Owner.ACTIVATION)
    tensors = {o: ETensor(pool, memory, o, ETENSOR_SLOTS) for o in sides}
    views = {o: t.view(torch.float32, (ETENSOR_SLOTS, unit // 4)) for o, t in tensors.items()}
    loose: dict[Owner, list[int]] = {o: [] for o in sides}  # taken or transferred in, not mapped
    written = [0.0] * ETENSOR_CHUNKS  # what each chunk holds (every float of it)
    stamp = 0.0

    def write(owner: Owner, slot: int) -> None:
        nonlocal stamp
        chunk_id = tensors[owner].chunk_of(slot)
        assert chunk_id is not None
        # A chunk's bytes persist while it is FREE: a newly mapped one shows its last writer's.
        assert bool((views[owner][slot] == written[chunk_id]).all())
        stamp += 1.0
        views[owner][slot] = stamp
        written[chunk_id] = stamp

    def books() -> tuple[Any, ...]:
        return ([pool.owner(c) for c in range(ETENSOR_CHUNKS)], [pool.count(o) for o in Owner],
                {o: [t.chunk_of(s) for s in range(ETENSOR_SLOTS)] for o, t in tensors.items()})

    try:
        for op, owner, slot, num in ops:
            tensor, other = tensors[owner], Owner.ACTIVATION if owner is Owner.KV else Owner.KV
            before = books()
            try:
                if op == "take":
                    loose[owner] += pool.take(num, owner)
                elif op == "give":
                    pool.give_back(loose[owner][:num], owner)
                    loose[owner] = loose[owner][num:]
                elif op == "give_foreign":  # the other side's chunk, or one that does not exist: refused
                    theirs = loose[other] + [c for c in map(tensors[other].chunk_of, range(ETENSOR_SLOTS)) if c is not None]
                    pool.give_back(theirs[:1] or [ETENSOR_CHUNKS + slot], owner)
                    raise AssertionError("a foreign chunk was given back")
                elif op == "transfer":
                    moved = loose[owner][:num]
                    pool.transfer(moved, owner, other)
                    loose[owner], loose[other] = loose[owner][num:], loose[other] + moved
                elif op == "map":
                    slots = list(range(slot, min(ETENSOR_SLOTS, slot + num)))
                    tensor.map_slots(slots)
                    for s in slots:
                        write(owner, s)
                elif op == "unmap":
                    tensor.unmap_slots([s for s in sorted(tensor.mapped_slots) if s >= slot][:num])
                elif op == "unmap_unmapped":
                    tensor.unmap_slots([slot])  # refused unless mapped
                elif op == "adopt" and loose[owner]:
                    tensor.adopt(slot, loose[owner][0])
                    loose[owner] = loose[owner][1:]
                    write(owner, slot)
            except (PoolExhausted, OwnershipError, ValueError, MapError):
                assert books() == before
            for o in sides:
                mapped = [tensors[o].chunk_of(s) for s in sorted(tensors[o].mapped_slots)]
                owned = {c for c in range(ETENSOR_CHUNKS) if pool.owner(c) is o}
                assert len(set(mapped)) == len(mapped) and not set(mapped) & set(loose[o])
                assert set(mapped) | set(loose[o]) == owned
                assert tensors[o].mapped_bytes == len(mapped) * unit
                for s in range(ETENSOR_SLOTS):
                    chunk_id = tensors[o].chunk_of(s)
                    assert bool((views[o][s] == (0.0 if chunk_id is None else written[chunk_id])).all())
            assert sum(pool.count(o) for o in Owner) == ETENSOR_CHUNKS
    finally:
        views.clear()  # the views borrow the ranges closed below
        for tensor in tensors.values():
            tensor.close()
        memory.close()
    assert pool.count(Owner.FREE) == ETENSOR_CHUNKS - sum(len(v) for v in loose.values())


# -- the CUDA backend's driver calls, on a fake driver --------------------------------------------
# CI has no GPU, so the contract above skips cuda.py there. These run its code against a fake
# `cuda.bindings.driver` that keeps the driver's books (handles, reservations, mappings, access, the
# current context per thread) and refuses what the real one refuses, so that every path of cuda.py
# that does not touch a tensor runs everywhere: the order of its calls, its clean-up after failures,
# and the primary context on a background thread. The tensors themselves need a GPU.

FAKE_GRANULARITY_BYTES = 256


class FakeDeviceptr:
    def __init__(self, value: int = 0) -> None:
        self.value = int(value)

    def __int__(self) -> int:
        return self.value


class FakeLocation:
    def __init__(self) -> None:
        self.type: Any = None
        self.id: Any = None


class FakeProp:
    def __init__(self) -> None:
        self.type: Any = None
        self.location = FakeLocation()


class FakeAccessDesc:
    def __init__(self) -> None:
        self.location = FakeLocation()
        self.flags: Any = None


class FakeDriver:
    """The subset of cuda.bindings.driver that cuda.py calls, with the driver's rules."""

    import enum as _enum

    class CUresult(_enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_INVALID_CONTEXT = 201
        CUDA_ERROR_NOT_SUPPORTED = 801

    class CUmemAccess_flags(_enum.IntEnum):
        CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
        CU_MEM_ACCESS_FLAGS_PROT_READ = 1
        CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3

    class CUmemAllocationType(_enum.IntEnum):
        CU_MEM_ALLOCATION_TYPE_PINNED = 1

    class CUmemLocationType(_enum.IntEnum):
        CU_MEM_LOCATION_TYPE_DEVICE = 1

    class CUmemAllocationGranularity_flags(_enum.IntEnum):
        CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0

    CUdeviceptr = FakeDeviceptr
    CUmemAllocationProp = FakeProp
    CUmemAccessDesc = FakeAccessDesc

    def __init__(self, read_only_supported: bool = True) -> None:
        self.read_only_supported = read_only_supported
        self.handles: dict[int, bytearray] = {}
        self.reservations: dict[int, int] = {}  # base -> bytes
        self.mappings: dict[int, list[Any]] = {}  # address -> [handle, bytes, access flags or None]
        self.retained = 0
        self.fail_on: dict[str, int] = {}  # name -> fail its n-th call from now
        self._next = {"handle": 1, "address": 1 << 40}
        self._current = threading.local()

    def _fails(self, name: str) -> bool:
        left = self.fail_on.get(name)
        if left is None:
            return False
        self.fail_on[name] = left - 1
        return left == 1

    def _ok(self, *values: Any) -> tuple[Any, ...]:
        return (self.CUresult.CUDA_SUCCESS, *values)

    def _vmm(self, name: str) -> Any:
        """A VMM call's preconditions: this thread has a current context, and no failure is planted."""
        if getattr(self._current, "ctx", None) is None:
            return self.CUresult.CUDA_ERROR_INVALID_CONTEXT
        if self._fails(name):
            return self.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        return None

    def cuGetErrorName(self, err: Any) -> tuple[Any, ...]:
        return self._ok(self.CUresult(err).name.encode())

    def cuInit(self, flags: int) -> tuple[Any, ...]:
        return self._ok()

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, ...]:
        return self._ok(ordinal)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[Any, ...]:
        self.retained += 1
        return self._ok(("primary", dev))

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any, ...]:
        self._current.ctx = ctx
        return self._ok()

    def cuCtxSynchronize(self) -> tuple[Any, ...]:
        return self._ok()

    def cuMemGetAllocationGranularity(self, prop: FakeProp, option: Any) -> tuple[Any, ...]:
        return self._ok(FAKE_GRANULARITY_BYTES)

    def cuMemCreate(self, size: int, prop: FakeProp, flags: int) -> tuple[Any, ...]:
        if (err := self._vmm("cuMemCreate")) is not None:
            return (err, None)
        assert size % FAKE_GRANULARITY_BYTES == 0 and prop.location.id == 0
        handle = self._next["handle"]
        self._next["handle"] += 1
        self.handles[handle] = bytearray(b"\xff" * size)  # new device memory holds anything
        return self._ok(handle)

    def cuMemRelease(self, handle: int) -> tuple[Any, ...]:
        assert not any(m[0] == handle for m in self.mappings.values()), "a mapped handle released"
        return self._ok() if self.handles.pop(handle, None) is not None else (self.CUresult.CUDA_ERROR_INVALID_VALUE,)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> tuple[Any, ...]:
        if (err := self._vmm("cuMemAddressReserve")) is not None:
            return (err, None)
        base = self._next["address"]
        self._next["address"] += size + (1 << 30)
        self.reservations[base] = size
        return self._ok(FakeDeviceptr(base))

    def cuMemAddressFree(self, ptr: Any, size: int) -> tuple[Any, ...]:
        base = int(ptr)
        if self.reservations.get(base) != size or any(base <= a < base + size for a in self.mappings):
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.reservations[base]
        return self._ok()

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: int, flags: int) -> tuple[Any, ...]:
        if (err := self._vmm("cuMemMap")) is not None:
            return (err,)
        address = int(ptr)
        inside = any(b <= address and address + size <= b + n for b, n in self.reservations.items())
        overlaps = any(a < address + size and address < a + m[1] for a, m in self.mappings.items())
        if not inside or overlaps or handle not in self.handles or size != len(self.handles[handle]) or offset:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.mappings[address] = [handle, size, None]
        return self._ok()

    def cuMemSetAccess(self, ptr: Any, size: int, descs: list[FakeAccessDesc], count: int) -> tuple[Any, ...]:
        if (err := self._vmm("cuMemSetAccess")) is not None:
            return (err,)
        mapping = self.mappings.get(int(ptr))
        if mapping is None or mapping[1] != size or count != len(descs) != 1:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        flags = descs[0].flags
        if flags == self.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ and not self.read_only_supported:
            return (self.CUresult.CUDA_ERROR_NOT_SUPPORTED,)
        mapping[2] = flags
        return self._ok()

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple[Any, ...]:
        if (err := self._vmm("cuMemUnmap")) is not None:
            return (err,)
        mapping = self.mappings.get(int(ptr))
        if mapping is None or mapping[1] != size:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.mappings[int(ptr)]
        return self._ok()

    def cuMemsetD8(self, ptr: Any, value: int, size: int) -> tuple[Any, ...]:
        if (err := self._vmm("cuMemsetD8")) is not None:
            return (err,)
        address, end = int(ptr), int(ptr) + size
        while address < end:  # a write: every byte must be mapped read-write
            mapping = self.mappings.get(address)
            if mapping is None or mapping[2] != self.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
                return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
            self.handles[mapping[0]][:] = bytes([value]) * mapping[1]
            address += mapping[1]
        return self._ok()

    def slot(self, virtual: Any, slot: int) -> tuple[int, Any]:
        """(handle, access) mapped at a range's slot."""
        handle, size, access = self.mappings[virtual.base + slot * virtual.slot_bytes]
        assert size == virtual.slot_bytes
        return handle, access


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    from kvfleet.worker.elastic import cuda as cuda_backend

    fake = FakeDriver()
    monkeypatch.setattr(cuda_backend, "_driver", lambda: fake)
    monkeypatch.setattr(cuda_backend, "_contexts", {})
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    yield fake
    # Whatever the test did, nothing of the driver's may be left behind.
    assert (fake.mappings, fake.reservations, fake.handles) == ({}, {}, {})


def open_fake(num_chunks: int = 4) -> Any:
    return open_memory("cuda", num_chunks, 2 * FAKE_GRANULARITY_BYTES, torch.device("cuda", 0))


@pytest.mark.parametrize("read_only_supported", [True, False])
def test_cuda_backend_keeps_the_driver_books(fake_driver: FakeDriver, read_only_supported: bool) -> None:
    fake_driver.read_only_supported = read_only_supported
    memory = open_fake()
    ro, rw = (FakeDriver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ,
              FakeDriver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    zero_access = ro if read_only_supported else rw
    assert memory.zero_read_only is read_only_supported
    assert len(fake_driver.handles) == memory.num_chunks + 1  # every chunk and the zero chunk, made once
    assert all(set(data) == {0} for data in fake_driver.handles.values())  # and zeroed once
    assert (fake_driver.mappings, fake_driver.reservations) == ({}, {})  # the zeroing's mappings are gone
    first, second = memory.reserve(3), memory.reserve(2)
    assert all(fake_driver.slot(first, s) == (memory.zero_handle, zero_access) for s in range(3))
    first.map(1, 2)
    assert fake_driver.slot(first, 1) == (memory.handles[2], rw)
    second.map(0, 2)  # one chunk in two ranges
    assert fake_driver.slot(second, 0) == (memory.handles[2], rw)
    for slot, chunk_id in ((1, 3), (0, 2), (3, 0), (0, memory.num_chunks)):
        with pytest.raises(MapError):
            first.map(slot, chunk_id)
    assert [fake_driver.slot(first, s)[0] for s in range(3)] == [memory.zero_handle, memory.handles[2], memory.zero_handle]
    first.unmap(1)
    first.unmap(1)
    assert fake_driver.slot(first, 1) == (memory.zero_handle, zero_access)
    errors: list[BaseException] = []

    def work() -> None:  # a thread with no current context: cuda.py must make one current
        try:
            first.map(2, 1)
        except BaseException as exc:  # checked on the main thread
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert errors == [] and fake_driver.slot(first, 2) == (memory.handles[1], rw)
    first.release()
    first.release()
    assert len(fake_driver.reservations) == 1
    memory.close()
    memory.close()
    assert fake_driver.retained == 1  # the primary context is retained once, not per call


@pytest.mark.parametrize("call", ["cuMemUnmap", "cuMemMap", "cuMemSetAccess"])
def test_cuda_map_failures_leave_the_slot_on_the_zero_chunk(fake_driver: FakeDriver, call: str) -> None:
    memory = open_fake()
    try:
        virtual = memory.reserve(2)
        fake_driver.fail_on[call] = 1
        with pytest.raises(MapError, match=call):
            virtual.map(0, 1)
        assert fake_driver.slot(virtual, 0)[0] == memory.zero_handle
        virtual.map(0, 1)  # nothing was left half-done
        assert fake_driver.slot(virtual, 0)[0] == memory.handles[1]
    finally:
        memory.close()


def test_cuda_etensor_rolls_back_a_failure_partway(fake_driver: FakeDriver) -> None:
    memory = open_fake()
    pool = ChunkPool(memory.num_chunks, memory.chunk_bytes)
    try:
        kv = ETensor(pool, memory, Owner.KV, memory.num_chunks)
        kv.map_slots([0])
        fake_driver.fail_on["cuMemMap"] = 3  # slots 1 and 2 map (calls 1 and 2), slot 3 (call 3) fails
        with pytest.raises(MapError):
            kv.map_slots([1, 2, 3])
        assert pool.count(Owner.KV) == 1 and kv.mapped_slots == {0}
        assert [fake_driver.slot(kv._range, s)[0] for s in range(4)] == [memory.handles[0]] + [memory.zero_handle] * 3
        kv.close()
        assert pool.count(Owner.FREE) == pool.num_chunks
    finally:
        memory.close()


@pytest.mark.parametrize("call", ["cuMemCreate", "cuMemsetD8", "cuMemSetAccess", "cuMemAddressReserve"])
def test_cuda_memory_that_fails_to_open_leaves_nothing(fake_driver: FakeDriver, call: str) -> None:
    fake_driver.fail_on[call] = 3 if call == "cuMemCreate" else 1
    with pytest.raises(RuntimeError, match=call):
        open_fake()


def test_cuda_range_that_fails_to_reserve_leaves_nothing(fake_driver: FakeDriver) -> None:
    memory = open_fake()
    try:
        before = dict(fake_driver.mappings), dict(fake_driver.reservations)
        fake_driver.fail_on["cuMemMap"] = 3  # the third slot's zero chunk
        with pytest.raises(MapError):
            memory.reserve(4)
        assert (dict(fake_driver.mappings), dict(fake_driver.reservations)) == before
    finally:
        memory.close()
