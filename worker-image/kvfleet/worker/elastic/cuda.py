"""The CUDA backend of elastic memory: CUDA's virtual memory management through cuda-python.

eLLM (§4.2, §5.2) maps physical GPU memory chunks into virtual tensors with the CUDA VMM driver
calls; this is that, from Python (`cuda.bindings.driver`, the cuda-python package), without C++:
every chunk is created once with cuMemCreate and kept until `close` (creating is ~100x the cost of
mapping: ~190 us per 2 MB against ~1.5 us, per kvcached's benches), a range is
cuMemAddressReserve'd, and mapping a slot is cuMemMap + cuMemSetAccess of a kept handle.

Unmapped slots map one shared zero chunk (created and zeroed once, as kvcached's zero page), so they
read as zero. Its mappings are read-only where the driver accepts CU_MEM_ACCESS_FLAGS_PROT_READ
(`CudaMemory.zero_read_only` says which), so that a write to an unmapped slot faults as it does on the
host backend; where the driver refuses, they are read-write and such a write would land in the zero
chunk and show through every unmapped slot: the engine writes only slots it mapped. Every chunk is
zeroed once at construction too (new GPU memory can hold NaN, and a masked-out KV entry times NaN is
NaN), so a chunk's first mapping reads zero on both backends.

CUDA cannot replace a mapping in place as mmap(MAP_FIXED) does: mapping a slot first unmaps the zero
chunk there, and unmapping puts it back. Work queued on the GPU may still read or write the slot, so
both synchronize the device first, unless the caller passes `synchronize=False`: eLLM §5.1's
pre-mapping (a slot no queued work reads, mapped while a step computes) and asynchronous unmapping (a
slot whose fence, a CUDA event recorded behind the work that could read it, has passed; memory.py).
The device's primary context (the one torch uses) is retained once and made current before every
driver call, since the engine calls from threads torch did not start (its event loop's, while its
executor thread runs the steps).

tests/worker/test_elastic_memory.py runs its contract suite on this backend where a GPU is present and
skips it otherwise (CI has none).
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from kvfleet.worker.elastic.memory import MapError, RangeBook, SlotBook, check_view


@functools.cache
def _driver() -> ModuleType:
    # Imported by name: CPU machines (and the type checker there) have no cuda-python.
    for name in ("cuda.bindings.driver", "cuda.cuda"):  # the second: cuda-python before 12.6
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("the CUDA memory backend needs cuda-python (pip install cuda-python)")


def _check(result: Any, what: str, error: type[Exception] = MapError) -> Any:
    """cuda-python returns (CUresult, values...): raise `error` naming the CUresult, else return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise error(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _prop(device_index: int) -> Any:
    drv = _driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


def _access(device_index: int, read_only: bool) -> Any:
    drv = _driver()
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device_index
    flags = drv.CUmemAccess_flags
    desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


def _make_current(device_index: int) -> None:
    """Make the device's primary context current on this thread (retained once per process)."""
    drv = _driver()
    ctx = _contexts.get(device_index)
    if ctx is None:
        with _contexts_lock:
            ctx = _contexts.get(device_index)
            if ctx is None:
                torch.cuda.init()  # type: ignore[no-untyped-call]  # torch's context first: the same primary one
                _check(drv.cuInit(0), "cuInit", RuntimeError)
                dev = _check(drv.cuDeviceGet(device_index), "cuDeviceGet", RuntimeError)
                ctx = _contexts[device_index] = _check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain",
                                                       RuntimeError)
    _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", RuntimeError)


def cuda_granularity_bytes(device: torch.device) -> int:
    """cuMemGetAllocationGranularity's minimum for pinned device memory (2 MiB on current GPUs)."""
    drv = _driver()
    index = _index(device)
    _make_current(index)
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_check(drv.cuMemGetAllocationGranularity(_prop(index), flag), "cuMemGetAllocationGranularity",
                      RuntimeError))


class _ArrayInterface:
    """What torch.as_tensor reads to wrap device memory it does not own (bytes: every dtype views them,
    bfloat16 included, which has no typestr)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


class CudaRange:
    """A cuMemAddressReserve'd run of slots; each slot maps exactly one handle (a chunk or the zero chunk)."""

    def __init__(self, memory: CudaMemory, num_slots: int) -> None:
        drv = _driver()
        self._memory = memory
        self.num_slots = num_slots
        self.slot_bytes = memory.chunk_bytes
        _make_current(memory.device_index)
        self.base = int(_check(drv.cuMemAddressReserve(num_slots * self.slot_bytes, 0, 0, 0), "cuMemAddressReserve",
                               RuntimeError))
        self._slots = SlotBook(num_slots, memory.num_chunks)
        slot = 0
        try:
            for slot in range(num_slots):
                self._map_zero(slot)
        except MapError:
            for done in range(slot):
                drv.cuMemUnmap(self._address(done), self.slot_bytes)
            drv.cuMemAddressFree(self._address(0), num_slots * self.slot_bytes)
            raise

    def _address(self, slot: int) -> Any:
        return _driver().CUdeviceptr(self.base + slot * self.slot_bytes)

    def _map_handle(self, slot: int, handle: Any, access: Any) -> None:
        drv = _driver()
        address = self._address(slot)
        _check(drv.cuMemMap(address, self.slot_bytes, 0, handle, 0), "cuMemMap")
        try:
            _check(drv.cuMemSetAccess(address, self.slot_bytes, [access], 1), "cuMemSetAccess")
        except MapError:
            drv.cuMemUnmap(address, self.slot_bytes)
            raise

    def _map_zero(self, slot: int) -> None:
        self._map_handle(slot, self._memory.zero_handle, self._memory.zero_access)

    def map(self, slot: int, chunk_id: int, *, synchronize: bool = True) -> None:
        self._slots.check_map(slot, chunk_id)
        _make_current(self._memory.device_index)
        if synchronize:
            # Kernels still queued may read the slot's zero chunk: unmapping it under them would fault.
            torch.cuda.synchronize(self._memory.device)
        _check(_driver().cuMemUnmap(self._address(slot), self.slot_bytes), "cuMemUnmap")
        try:
            self._map_handle(slot, self._memory.handles[chunk_id], self._memory.access)
        except MapError:
            self._map_zero(slot)  # the contract: a failed map leaves the slot reading zero
            raise
        self._slots.mapped(slot, chunk_id)

    def unmap(self, slot: int, *, synchronize: bool = True) -> None:
        if not self._slots.maps(slot):
            return
        _make_current(self._memory.device_index)
        if synchronize:
            torch.cuda.synchronize(self._memory.device)  # nothing queued may still read or write the chunk
        _check(_driver().cuMemUnmap(self._address(slot), self.slot_bytes), "cuMemUnmap")
        self._slots.unmapped(slot)
        self._map_zero(slot)

    def as_tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        check_view(self.num_slots, self.slot_bytes, dtype, shape)
        if self._slots.released:
            raise MapError("the range was released")
        raw = torch.as_tensor(_ArrayInterface(self.base, self.num_slots * self.slot_bytes), device=self._memory.device)
        return raw.view(dtype).view(tuple(shape))

    def release(self) -> None:
        """Unmap every slot and free the addresses; idempotent. Tensors viewing the range must be dropped
        first: the addresses they point at are gone."""
        if not self._slots.release():
            return
        drv = _driver()
        _make_current(self._memory.device_index)
        torch.cuda.synchronize(self._memory.device)
        # Not checked: release also runs on the way out of a failure, and must finish.
        for slot in range(self.num_slots):
            drv.cuMemUnmap(self._address(slot), self.slot_bytes)
        drv.cuMemAddressFree(self._address(0), self.num_slots * self.slot_bytes)


class CudaMemory:
    """`num_chunks` physical chunks on one GPU, created and zeroed now and kept until `close`."""

    name = "cuda"

    def __init__(self, num_chunks: int, chunk_bytes: int, device: torch.device) -> None:
        drv = _driver()
        self.device_index = _index(device)
        self.device = torch.device("cuda", self.device_index)
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        _make_current(self.device_index)
        prop = _prop(self.device_index)
        self.access = _access(self.device_index, read_only=False)
        self.handles: list[Any] = []
        self._ranges: RangeBook[CudaRange] = RangeBook()
        try:
            for _ in range(num_chunks + 1):
                self.handles.append(_check(drv.cuMemCreate(chunk_bytes, prop, 0), "cuMemCreate", RuntimeError))
            self.zero_handle = self.handles.pop()
            self._zero_all()
            self.zero_read_only = self._accepts_read_only()
        except BaseException:
            for handle in self.handles:
                drv.cuMemRelease(handle)
            if hasattr(self, "zero_handle"):
                drv.cuMemRelease(self.zero_handle)
            raise
        self.zero_access = _access(self.device_index, read_only=self.zero_read_only)

    def _zero_all(self) -> None:
        """Zero every chunk and the zero chunk: map them side by side once, one memset, one sync."""
        drv = _driver()
        handles = [*self.handles, self.zero_handle]
        total_bytes = len(handles) * self.chunk_bytes
        base = int(_check(drv.cuMemAddressReserve(total_bytes, 0, 0, 0), "cuMemAddressReserve", RuntimeError))
        mapped = 0
        try:
            for i, handle in enumerate(handles):
                address = drv.CUdeviceptr(base + i * self.chunk_bytes)
                _check(drv.cuMemMap(address, self.chunk_bytes, 0, handle, 0), "cuMemMap", RuntimeError)
                mapped += 1
                _check(drv.cuMemSetAccess(address, self.chunk_bytes, [self.access], 1), "cuMemSetAccess", RuntimeError)
            _check(drv.cuMemsetD8(drv.CUdeviceptr(base), 0, total_bytes), "cuMemsetD8", RuntimeError)
            _check(drv.cuCtxSynchronize(), "cuCtxSynchronize", RuntimeError)
        finally:
            for i in range(mapped):
                drv.cuMemUnmap(drv.CUdeviceptr(base + i * self.chunk_bytes), self.chunk_bytes)
            drv.cuMemAddressFree(drv.CUdeviceptr(base), total_bytes)

    def _accepts_read_only(self) -> bool:
        """Whether this driver maps memory read-only (CU_MEM_ACCESS_FLAGS_PROT_READ); not all do."""
        drv = _driver()
        base = drv.CUdeviceptr(int(_check(drv.cuMemAddressReserve(self.chunk_bytes, 0, 0, 0), "cuMemAddressReserve",
                                          RuntimeError)))
        try:
            _check(drv.cuMemMap(base, self.chunk_bytes, 0, self.zero_handle, 0), "cuMemMap", RuntimeError)
            try:
                err, = drv.cuMemSetAccess(base, self.chunk_bytes, [_access(self.device_index, read_only=True)], 1)
                return bool(err == drv.CUresult.CUDA_SUCCESS)
            finally:
                drv.cuMemUnmap(base, self.chunk_bytes)
        finally:
            drv.cuMemAddressFree(base, self.chunk_bytes)

    def reserve(self, num_slots: int) -> CudaRange:
        return self._ranges.reserve(num_slots, lambda n: CudaRange(self, n))

    def close(self) -> None:
        if not self._ranges.close():
            return
        drv = _driver()
        for handle in [*self.handles, self.zero_handle]:
            drv.cuMemRelease(handle)
        self.handles.clear()
