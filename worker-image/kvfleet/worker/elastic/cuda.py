"""The CUDA backend of elastic memory: CUDA's virtual memory management through cuda-python.

eLLM (§4.2, §5.2) maps physical GPU memory chunks into virtual tensors with the CUDA VMM driver
calls; this is that, from Python (`cuda.bindings.driver`, the cuda-python package), without C++:
every chunk is created once with cuMemCreate and kept (creating is ~100x the cost of mapping), a
range is cuMemAddressReserve'd, and mapping a slot is cuMemMap + cuMemSetAccess of a kept handle.
Unmapped slots map a zero chunk (created and zeroed once, as kvcached's zero page), so they read as
zero; its access is read-write (read-only access is not supported on every driver), so the engine
must never write a slot it did not map, which it does not (it writes only its own blocks). Tensors
view a range through `__cuda_array_interface__`. Work queued on the GPU is synchronized before a
slot is unmapped, and the device's primary context is made current before every driver call (the
engine calls from its executor thread).

Not run on the machines this project's CI has (no GPU): tests/worker/test_elastic_memory.py runs its
contract suite here when CUDA is present and skips it otherwise; the closing note of the issue that
added it says whether it was run on a lent GPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from kvfleet.worker.elastic.memory import MapError, check_view


def _driver() -> Any:
    # Imported by name: CPU machines (and the type checker there) have no cuda-python.
    for name in ("cuda.bindings.driver", "cuda.cuda"):  # the second: cuda-python before 12.6
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("the CUDA memory backend needs cuda-python (pip install cuda-python)")


def _check(result: Any, what: str) -> Any:
    """cuda-python returns (CUresult, values...): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise MapError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else values


def _prop(device_index: int) -> Any:
    drv = _driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _make_current(device: torch.device) -> None:
    drv = _driver()
    torch.cuda.init()  # type: ignore[no-untyped-call]
    _check(drv.cuInit(0), "cuInit")
    dev = _check(drv.cuDeviceGet(_index(device)), "cuDeviceGet")
    ctx = _check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def cuda_granularity_bytes(device: torch.device) -> int:
    drv = _driver()
    _make_current(device)
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_check(drv.cuMemGetAllocationGranularity(_prop(_index(device)), flag), "cuMemGetAllocationGranularity"))


class _ArrayInterface:
    """What torch.as_tensor reads to wrap device memory it does not own."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


class CudaRange:
    def __init__(self, memory: CudaMemory, num_slots: int) -> None:
        drv = _driver()
        self._memory = memory
        self.num_slots = num_slots
        self.slot_bytes = memory.chunk_bytes
        _make_current(memory.device)
        self.base = int(_check(drv.cuMemAddressReserve(num_slots * self.slot_bytes, 0, 0, 0), "cuMemAddressReserve"))
        self._mapped: dict[int, int] = {}
        self._released = False
        for slot in range(num_slots):
            self._map_handle(slot, memory.zero_handle)

    def _address(self, slot: int) -> Any:
        return _driver().CUdeviceptr(self.base + slot * self.slot_bytes)

    def _map_handle(self, slot: int, handle: Any) -> None:
        drv = _driver()
        address = self._address(slot)
        _check(drv.cuMemMap(address, self.slot_bytes, 0, handle, 0), "cuMemMap")
        try:
            _check(drv.cuMemSetAccess(address, self.slot_bytes, [self._memory.access], 1), "cuMemSetAccess")
        except MapError:
            drv.cuMemUnmap(address, self.slot_bytes)
            raise

    def map(self, slot: int, chunk_id: int) -> None:
        if self._released:
            raise MapError("the range was released")
        if not 0 <= slot < self.num_slots:
            raise MapError(f"slot {slot} is outside the range's {self.num_slots}")
        if not 0 <= chunk_id < self._memory.num_chunks:
            raise MapError(f"chunk {chunk_id} does not exist (the memory has {self._memory.num_chunks})")
        if slot in self._mapped or chunk_id in self._mapped.values():
            raise MapError(f"slot {slot} or chunk {chunk_id} is already mapped in this range")
        _make_current(self._memory.device)
        torch.cuda.synchronize(self._memory.device)
        _check(_driver().cuMemUnmap(self._address(slot), self.slot_bytes), "cuMemUnmap")
        try:
            self._map_handle(slot, self._memory.handles[chunk_id])
        except MapError:
            self._map_handle(slot, self._memory.zero_handle)
            raise
        self._mapped[slot] = chunk_id

    def unmap(self, slot: int) -> None:
        if self._released or self._mapped.pop(slot, None) is None:
            return
        _make_current(self._memory.device)
        torch.cuda.synchronize(self._memory.device)  # nothing queued may still read or write the chunk
        _check(_driver().cuMemUnmap(self._address(slot), self.slot_bytes), "cuMemUnmap")
        self._map_handle(slot, self._memory.zero_handle)

    def as_tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        check_view(self.num_slots, self.slot_bytes, dtype, shape)
        raw = torch.as_tensor(_ArrayInterface(self.base, self.num_slots * self.slot_bytes), device=self._memory.device)
        return raw.view(dtype).view(tuple(shape))

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        drv = _driver()
        _make_current(self._memory.device)
        torch.cuda.synchronize(self._memory.device)
        for slot in range(self.num_slots):
            drv.cuMemUnmap(self._address(slot), self.slot_bytes)
        self._mapped.clear()
        drv.cuMemAddressFree(_driver().CUdeviceptr(self.base), self.num_slots * self.slot_bytes)


class CudaMemory:
    """`num_chunks` physical chunks on one GPU, created now and kept until `close`."""

    name = "cuda"

    def __init__(self, num_chunks: int, chunk_bytes: int, device: torch.device) -> None:
        drv = _driver()
        self.device = torch.device("cuda", _index(device))
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        _make_current(self.device)
        prop = _prop(_index(self.device))
        self.access = drv.CUmemAccessDesc()
        self.access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = _index(self.device)
        self.access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.handles: list[Any] = []
        self._ranges: list[CudaRange] = []
        self._closed = False
        try:
            for _ in range(num_chunks):
                self.handles.append(_check(drv.cuMemCreate(chunk_bytes, prop, 0), "cuMemCreate"))
            self.zero_handle = _check(drv.cuMemCreate(chunk_bytes, prop, 0), "cuMemCreate")
            # New GPU memory holds anything, NaN included, and a masked-out KV slot times NaN is NaN:
            # every chunk starts zeroed, as the host backend's do.
            for handle in [*self.handles, self.zero_handle]:
                self._zero(handle)
        except BaseException:
            for handle in self.handles:
                drv.cuMemRelease(handle)
            raise

    def _zero(self, handle: Any) -> None:
        drv = _driver()
        address = _check(drv.cuMemAddressReserve(self.chunk_bytes, 0, 0, 0), "cuMemAddressReserve")
        _check(drv.cuMemMap(address, self.chunk_bytes, 0, handle, 0), "cuMemMap")
        _check(drv.cuMemSetAccess(address, self.chunk_bytes, [self.access], 1), "cuMemSetAccess")
        _check(drv.cuMemsetD8(address, 0, self.chunk_bytes), "cuMemsetD8")
        _check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        _check(drv.cuMemUnmap(address, self.chunk_bytes), "cuMemUnmap")
        _check(drv.cuMemAddressFree(address, self.chunk_bytes), "cuMemAddressFree")

    def reserve(self, num_slots: int) -> CudaRange:
        if self._closed:
            raise MapError("the memory was closed")
        virtual = CudaRange(self, num_slots)
        self._ranges.append(virtual)
        return virtual

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for virtual in self._ranges:
            virtual.release()
        drv = _driver()
        for handle in [*self.handles, self.zero_handle]:
            drv.cuMemRelease(handle)
        self.handles.clear()
