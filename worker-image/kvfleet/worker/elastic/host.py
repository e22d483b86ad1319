"""The host backend of elastic memory: memfd chunks mapped with mmap over a reserved range.

What CUDA's VMM does for eLLM's eTensors on a GPU (§4.2; memory.py, cuda.py), done with Linux calls
so the pool runs where CI does: the physical memory is one memfd, chunk i at offset i x chunk_bytes; a
range is reserved with mmap(PROT_NONE); mapping a chunk is mmap(MAP_SHARED | MAP_FIXED) of its offset
over the slot, which replaces what was there in one call. Unmapped slots map a zero chunk read-only (a
second memfd that is never written), so they read as zero, as kvcached's shared zero page does on a
GPU, and a write to one faults instead of landing anywhere. Python's mmap module cannot map at a fixed
address, hence ctypes. Linux only (memfd_create).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from collections.abc import Sequence

import torch

from kvfleet.worker.elastic.memory import MapError, RangeBook, SlotBook, check_view

_MAP_FAILED = ctypes.c_void_p(-1).value
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
MAP_FIXED = 0x10
PROT_NONE = 0


def _libc() -> ctypes.CDLL:
    if not sys.platform.startswith("linux"):
        raise OSError("the host memory backend needs Linux (memfd_create, mmap MAP_FIXED)")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _mmap(libc: ctypes.CDLL, address: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    result = libc.mmap(address, length, prot, flags, fd, offset)
    if result is None or result == _MAP_FAILED or (address is not None and result != address):
        err = ctypes.get_errno()
        raise MapError(f"mmap of {length} bytes at {address if address is not None else 'any address'} failed: "
                       f"{os.strerror(err) if err else 'placed elsewhere'}")
    return int(result)


class HostRange:
    """A reserved run of slots in this process's address space."""

    def __init__(self, memory: HostMemory, num_slots: int) -> None:
        self._memory = memory
        self.num_slots = num_slots
        self.slot_bytes = memory.chunk_bytes
        libc = memory.libc
        self.base = _mmap(libc, None, num_slots * self.slot_bytes, PROT_NONE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        self._slots = SlotBook(num_slots, memory.num_chunks)
        self._buffer: ctypes.Array[ctypes.c_char] | None = None
        try:
            for slot in range(num_slots):
                self._map_zero(slot)
        except MapError:
            libc.munmap(self.base, num_slots * self.slot_bytes)
            raise

    def _address(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def _map_zero(self, slot: int) -> None:
        _mmap(self._memory.libc, self._address(slot), self.slot_bytes, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED,
              self._memory.zero_fd, 0)

    def map(self, slot: int, chunk_id: int, *, synchronize: bool = True) -> None:
        # (`synchronize` is for the GPU: the host runs no work behind the caller's back.)
        self._slots.check_map(slot, chunk_id)
        try:
            _mmap(self._memory.libc, self._address(slot), self.slot_bytes, mmap.PROT_READ | mmap.PROT_WRITE,
                  mmap.MAP_SHARED | MAP_FIXED, self._memory.fd, chunk_id * self.slot_bytes)
        except MapError:
            self._map_zero(slot)  # whatever MAP_FIXED left there, the slot reads zero again
            raise
        self._slots.mapped(slot, chunk_id)

    def unmap(self, slot: int, *, synchronize: bool = True) -> None:
        if not self._slots.maps(slot):
            return
        # MAP_FIXED replaces the chunk's mapping in one call: the slot is never unbacked in between.
        self._map_zero(slot)
        self._slots.unmapped(slot)

    def as_tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        check_view(self.num_slots, self.slot_bytes, dtype, shape)
        if self._slots.released:
            raise MapError("the range was released")
        if self._buffer is None:
            # Kept on the range: the tensors borrow its memory, and frombuffer makes no copy.
            self._buffer = (ctypes.c_char * (self.num_slots * self.slot_bytes)).from_address(self.base)
        return torch.frombuffer(self._buffer, dtype=torch.uint8).view(dtype).view(tuple(shape))

    def release(self) -> None:
        """Unmap every slot and give the addresses back; idempotent. Tensors viewing the range must be
        dropped first: the addresses they point at are gone (a read through one faults)."""
        if not self._slots.release():
            return
        self._buffer = None
        self._memory.libc.munmap(self.base, self.num_slots * self.slot_bytes)


class HostMemory:
    """Physical chunks in a memfd (pages are allocated when first written, and kept)."""

    name = "host"

    def __init__(self, num_chunks: int, chunk_bytes: int) -> None:
        self.libc = _libc()
        self.device = torch.device("cpu")
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.fd = os.memfd_create("kvfleet-elastic-chunks")
        self.zero_fd = os.memfd_create("kvfleet-elastic-zero")
        try:
            os.ftruncate(self.fd, num_chunks * chunk_bytes)
            os.ftruncate(self.zero_fd, chunk_bytes)
        except OSError:
            os.close(self.fd)
            os.close(self.zero_fd)
            raise
        self._ranges: RangeBook[HostRange] = RangeBook()

    def reserve(self, num_slots: int) -> HostRange:
        return self._ranges.reserve(num_slots, lambda n: HostRange(self, n))

    def close(self) -> None:
        if not self._ranges.close():
            return
        os.close(self.fd)
        os.close(self.zero_fd)
