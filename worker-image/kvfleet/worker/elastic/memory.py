"""Physical memory behind elastic tensors: one protocol, a host and a CUDA backend (eLLM §4.2).

An eTensor is a reserved range of virtual addresses whose slots map physical chunks on demand. GPUs
do this with CUDA's virtual memory management (cuda.py); the host backend (host.py) does the same
with a memfd and mmap, so the pool, its policies and the engine that uses them run and are tested on
machines without a GPU, through the same calls. Semantics both keep:
- chunks are created once and kept (creating physical memory is the slow part: ~190 us per 2 MB
  chunk with cuMemCreate, against ~1.5 us to map one; kvcached creates and releases per map and
  pays for it);
- a slot maps at most one chunk, and reads as zero while it maps none;
- one chunk may be mapped in several ranges at once: all see the same bytes (that is how a chunk
  changes tensors without a copy, and how eLLM's asynchronous unmapping, §5.1, maps a chunk at its new
  slot before the old one is unmapped); a range may refuse one chunk at two of its own slots;
- a failed map leaves the slot unmapped.

Work queued on a GPU may still read a slot when the host maps or unmaps it, so the CUDA backend
synchronizes the device before it does either. `synchronize=False` is the caller's word that no queued
work touches the slot: eLLM §5.1 ("Overlapping (Un)mapping Overheads") maps slots ahead of the step
that needs them while the step before computes, and unmaps an old slot once a `Fence` placed behind
the work that may read it has passed, so neither waits for the whole device on a step's path.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, Literal, Protocol, TypeVar

import torch


class MapError(Exception):
    """A slot could not be mapped (bad slot or chunk, or the OS or driver refused)."""


class VirtualRange(Protocol):
    """A reserved run of `num_slots` slots of `slot_bytes` each."""

    num_slots: int
    slot_bytes: int

    def map(self, slot: int, chunk_id: int, *, synchronize: bool = True) -> None:
        """Map a chunk at an unmapped slot; MapError (slot left unmapped) when it cannot. With
        `synchronize=False` the caller vouches that no queued device work reads the slot."""
        ...

    def unmap(self, slot: int, *, synchronize: bool = True) -> None:
        """The slot reads zero again; a no-op on an unmapped slot. With `synchronize=False` the
        caller vouches that no queued device work reads or writes the slot (a fence has passed)."""
        ...

    def as_tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A view of the whole range (no copy): shape's bytes must equal the range's."""
        ...

    def release(self) -> None:
        """Unmap everything and give the addresses back; idempotent. Drop tensors first."""
        ...


class PhysicalMemory(Protocol):
    """`num_chunks` physical chunks of `chunk_bytes` on `device`, and ranges to map them into."""

    name: str
    device: torch.device
    chunk_bytes: int
    num_chunks: int

    def reserve(self, num_slots: int) -> VirtualRange:
        """A new range whose every slot reads zero until mapped."""
        ...

    def close(self) -> None:
        """Release every range and the chunks; idempotent."""
        ...


class Fence(Protocol):
    """A point behind work already queued (eLLM §5.1's asynchronous unmapping waits for one before it
    unmaps a slot that work may still read)."""

    def done(self) -> bool:
        """Whether the work before it has finished (never blocks)."""
        ...

    def wait(self) -> None:
        """Block until the work before it has finished; raises if the fence itself failed."""
        ...


class Marker(Protocol):
    """The part of a recorded torch.cuda.Event that a fence reads."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def record_marker(device: torch.device) -> Marker | None:
    """A marker behind the device work this thread queued so far: a CUDA event recorded on the
    current stream, or None on the host (whose work has run by the time the call returns)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


class QueueFence:
    """A fence behind a one-thread queue (the engine's executor) and the device work it launched:
    `marker` is the future of `record_marker`, submitted to that queue, so it resolves once every job
    queued before it has run, to a CUDA event that completes once their GPU work has."""

    def __init__(self, marker: Future[Marker | None]) -> None:
        self._marker = marker

    def done(self) -> bool:
        if not self._marker.done():
            return False
        if self._marker.exception() is not None:
            return True  # `wait` raises: the caller falls back to synchronizing
        marker = self._marker.result()
        return marker is None or marker.query()

    def wait(self) -> None:
        marker = self._marker.result()
        if marker is not None:
            marker.synchronize()


def granularity_bytes(kind: Literal["host", "cuda"], device: torch.device) -> int:
    """The unit chunks come in: the page size on the host, the driver's granularity on a GPU."""
    if kind == "host":
        return mmap.PAGESIZE
    from kvfleet.worker.elastic.cuda import cuda_granularity_bytes

    return cuda_granularity_bytes(device)


def open_memory(kind: Literal["host", "cuda"], num_chunks: int, chunk_bytes: int, device: torch.device) -> PhysicalMemory:
    """The backend's physical memory: every chunk created now."""
    unit = granularity_bytes(kind, device)
    if chunk_bytes < unit or chunk_bytes % unit:
        raise ValueError(f"a chunk of {chunk_bytes} bytes is not a positive multiple of the {kind} backend's "
                         f"granularity ({unit} bytes)")
    if num_chunks < 1:
        raise ValueError(f"{num_chunks} chunks: the pool needs at least one")
    if kind == "host":
        from kvfleet.worker.elastic.host import HostMemory

        return HostMemory(num_chunks, chunk_bytes)
    from kvfleet.worker.elastic.cuda import CudaMemory

    return CudaMemory(num_chunks, chunk_bytes, device)


def check_view(num_slots: int, slot_bytes: int, dtype: torch.dtype, shape: Sequence[int]) -> None:
    """as_tensor's precondition, with a message that says what was asked."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if nbytes != num_slots * slot_bytes:
        raise ValueError(f"a {tuple(shape)} {dtype} view is {nbytes} bytes; the range is {num_slots * slot_bytes}")


class SlotBook:
    """Which chunk each slot of one range maps: the checks every backend's `map` makes before it touches
    the device or the address space, and the books after, kept once for all backends."""

    def __init__(self, num_slots: int, num_chunks: int) -> None:
        self.num_slots = num_slots
        self.num_chunks = num_chunks
        self.chunk_at: dict[int, int] = {}
        self.mapped_chunks: set[int] = set()
        self.released = False

    def check_map(self, slot: int, chunk_id: int) -> None:
        """Raise MapError unless `chunk_id` may be mapped at `slot` now."""
        if self.released:
            raise MapError("the range was released")
        if not 0 <= slot < self.num_slots:
            raise MapError(f"slot {slot} is outside the range's {self.num_slots}")
        if not 0 <= chunk_id < self.num_chunks:
            raise MapError(f"chunk {chunk_id} does not exist (the memory has {self.num_chunks})")
        if slot in self.chunk_at:
            raise MapError(f"slot {slot} already maps chunk {self.chunk_at[slot]}")
        if chunk_id in self.mapped_chunks:
            raise MapError(f"chunk {chunk_id} is already mapped in this range")

    def mapped(self, slot: int, chunk_id: int) -> None:
        self.chunk_at[slot] = chunk_id
        self.mapped_chunks.add(chunk_id)

    def maps(self, slot: int) -> bool:
        """Whether `slot` maps a chunk (a released range maps none)."""
        return not self.released and slot in self.chunk_at

    def unmapped(self, slot: int) -> None:
        self.mapped_chunks.discard(self.chunk_at.pop(slot))

    def release(self) -> bool:
        """Forget every mapping; False if the range was already released (release is idempotent)."""
        if self.released:
            return False
        self.released = True
        self.chunk_at.clear()
        self.mapped_chunks.clear()
        return True


RangeT = TypeVar("RangeT", bound=VirtualRange)


class RangeBook(Generic[RangeT]):
    """The ranges one backend's memory has reserved, so that `close` releases them all once."""

    def __init__(self) -> None:
        self._ranges: list[RangeT] = []
        self.closed = False

    def reserve(self, num_slots: int, make: Callable[[int], RangeT]) -> RangeT:
        if self.closed:
            raise MapError("the memory was closed")
        if num_slots < 1:
            raise ValueError("a range needs at least one slot")
        virtual = make(num_slots)
        self._ranges.append(virtual)
        return virtual

    def close(self) -> bool:
        """Release every range; False if the memory was already closed (close is idempotent)."""
        if self.closed:
            return False
        self.closed = True
        for virtual in self._ranges:
            virtual.release()
        self._ranges.clear()
        return True
