"""eTensor (eLLM §4.2, §4.2.1): a virtual tensor whose slots map chunks of the unified pool on demand.

The KV cache and the activations each get one: a range of virtual addresses as large as the whole
pool, so either side could hold every chunk, of which only the slots in use map physical memory.
Tensors viewing the range (`view`) never move; mapping and unmapping change which of their bytes
are backed. The eTensor keeps the pool's books and the mappings in step: a chunk is mapped here only
while this eTensor's side owns it, and every call is all or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfleet.worker.elastic.chunks import ChunkPool, Owner, OwnershipError
from kvfleet.worker.elastic.memory import MapError, PhysicalMemory, VirtualRange


class ETensor:
    """`num_slots` slots of one chunk each, backed by chunks `owner` takes from `pool` when mapped."""

    def __init__(self, pool: ChunkPool, memory: PhysicalMemory, owner: Owner, num_slots: int) -> None:
        if owner is Owner.FREE:
            raise ValueError("an eTensor belongs to the KV or the activation side")
        if pool.chunk_bytes != memory.chunk_bytes:
            raise ValueError(f"pool chunks of {pool.chunk_bytes} bytes, memory chunks of {memory.chunk_bytes}")
        self.pool = pool
        self.owner = owner
        self.num_slots = num_slots
        self._range: VirtualRange = memory.reserve(num_slots)
        self._chunk_of: dict[int, int] = {}

    @property
    def mapped_slots(self) -> frozenset[int]:
        return frozenset(self._chunk_of)

    @property
    def mapped_bytes(self) -> int:
        return len(self._chunk_of) * self.pool.chunk_bytes

    def chunk_of(self, slot: int) -> int | None:
        return self._chunk_of.get(slot)

    def map_slots(self, slots: Sequence[int]) -> list[int]:
        """Take a chunk per slot from the pool and map it there; all or nothing (PoolExhausted or
        MapError leave the pool and the slots as they were)."""
        slots = list(slots)
        if len(set(slots)) != len(slots) or any(not 0 <= s < self.num_slots for s in slots):
            raise ValueError(f"slots {slots} must be distinct and within [0, {self.num_slots})")
        busy = [s for s in slots if s in self._chunk_of]
        if busy:
            raise ValueError(f"slots {busy} are already mapped")
        chunks = self.pool.take(len(slots), self.owner)
        done: list[int] = []
        try:
            for slot, chunk_id in zip(slots, chunks):
                self._range.map(slot, chunk_id)
                done.append(slot)
        except BaseException:
            for slot in done:
                self._range.unmap(slot)
            self.pool.give_back(chunks, self.owner)
            raise
        self._chunk_of.update(zip(slots, chunks))
        return chunks

    def adopt(self, slot: int, chunk_id: int) -> None:
        """Map a chunk the caller has already transferred to this side (no FREE round trip): step 4 of
        §4.3.1's inflation, on-demand remapping. On MapError the slot stays unmapped and the chunk stays
        the caller's (owned by this side, mapped nowhere here)."""
        if not 0 <= slot < self.num_slots or slot in self._chunk_of:
            raise ValueError(f"slot {slot} is not an unmapped slot of this eTensor")
        if self.pool.owner(chunk_id) is not self.owner or chunk_id in self._chunk_of.values():
            raise OwnershipError(f"chunk {chunk_id} is not {self.owner.value}'s to map here")
        self._range.map(slot, chunk_id)
        self._chunk_of[slot] = chunk_id

    def unmap_slots(self, slots: Sequence[int]) -> None:
        """Unmap the slots and give their chunks back to the pool (FREE)."""
        slots = list(slots)
        missing = [s for s in slots if s not in self._chunk_of]
        if missing or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} must be distinct mapped slots (not mapped: {missing})")
        for slot in slots:
            self._range.unmap(slot)
        chunks = [self._chunk_of.pop(slot) for slot in slots]
        self.pool.give_back(chunks, self.owner)

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        return self._range.as_tensor(dtype, shape)

    def close(self) -> None:
        """Every chunk back to the pool, the range released (drop views first)."""
        if self._chunk_of:
            self.unmap_slots(sorted(self._chunk_of))
        self._range.release()


__all__ = ["ETensor", "MapError"]
