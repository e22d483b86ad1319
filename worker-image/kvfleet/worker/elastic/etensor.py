"""eTensor (eLLM §4.2, §4.2.1): a virtual tensor whose slots map chunks of the unified pool on demand.

The KV cache and the activations each get one: a range of virtual addresses as large as the whole
pool, so either side could hold every chunk, of which only the slots in use map physical memory.
Tensors viewing the range (`view`) never move; mapping and unmapping change which of their bytes
are backed. The eTensor keeps the pool's books and the mappings in step: a chunk is mapped here only
while this eTensor's side owns it, and every call is all or nothing.

One exception, eLLM §5.1's asynchronous unmapping ("Overlapping (Un)mapping Overheads"): the paper
does not unmap a slot and only then hand its chunk on; VMM maps one physical chunk at several virtual
addresses, so the chunk goes to its new owner at once and the old slot is unmapped later, once the work
that may still read it has finished. `unmap_slots(slots, fence)` does that: the books say unmapped (the
chunk is FREE, or whoever's it is next) while the range still maps the chunk at the old slot until
`complete_unmaps` finds the fence passed. A slot or a chunk still mapped here that way is unmapped
first (its fence waited for) when this eTensor maps it again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfleet.worker.elastic.chunks import ChunkPool, Owner, OwnershipError
from kvfleet.worker.elastic.memory import Fence, MapError, PhysicalMemory, VirtualRange


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
        # Slots unmapped in the books whose range still maps the old chunk until the fence passes.
        self._pending: dict[int, tuple[int, Fence]] = {}
        # The range's map and unmap calls so far (a deferred unmap counts when it is done), for the
        # engine's counters of which ones ran on a step's path.
        self.num_maps = 0
        self.num_unmaps = 0

    @property
    def mapped_slots(self) -> frozenset[int]:
        return frozenset(self._chunk_of)

    @property
    def mapped_bytes(self) -> int:
        return len(self._chunk_of) * self.pool.chunk_bytes

    def chunk_of(self, slot: int) -> int | None:
        return self._chunk_of.get(slot)

    @property
    def pending_slots(self) -> frozenset[int]:
        """Slots unmapped in the books whose range still maps their old chunk (a deferred unmap)."""
        return frozenset(self._pending)

    def pending_chunk(self, slot: int) -> int | None:
        """The chunk a deferred unmap still leaves mapped at `slot`, if any."""
        pending = self._pending.get(slot)
        return pending[0] if pending is not None else None

    def map_slots(self, slots: Sequence[int], *, synchronize: bool = True) -> list[int]:
        """Take a chunk per slot from the pool and map it there; all or nothing (PoolExhausted or
        MapError leave the pool and the slots as they were). `synchronize=False`: no queued device
        work reads these slots (memory.py), as when mapping ahead while a step computes."""
        slots = list(slots)
        if len(set(slots)) != len(slots) or any(not 0 <= s < self.num_slots for s in slots):
            raise ValueError(f"slots {slots} must be distinct and within [0, {self.num_slots})")
        busy = [s for s in slots if s in self._chunk_of]
        if busy:
            raise ValueError(f"slots {busy} are already mapped")
        chunks = self.pool.take(len(slots), self.owner)
        done: list[int] = []
        try:
            self._settle(slots, chunks)
            for slot, chunk_id in zip(slots, chunks):
                self._range.map(slot, chunk_id, synchronize=synchronize)
                done.append(slot)
        except BaseException:
            for slot in done:
                self._range.unmap(slot, synchronize=synchronize)
            self.pool.give_back(chunks, self.owner)
            raise
        self._chunk_of.update(zip(slots, chunks))
        self.num_maps += len(slots)
        return chunks

    def adopt(self, slot: int, chunk_id: int) -> None:
        """Map a chunk the caller has already transferred to this side (no FREE round trip): step 4 of
        §4.3.1's inflation, on-demand remapping. On MapError the slot stays unmapped and the chunk stays
        the caller's (owned by this side, mapped nowhere here)."""
        if not 0 <= slot < self.num_slots or slot in self._chunk_of:
            raise ValueError(f"slot {slot} is not an unmapped slot of this eTensor")
        if self.pool.owner(chunk_id) is not self.owner or chunk_id in self._chunk_of.values():
            raise OwnershipError(f"chunk {chunk_id} is not {self.owner.value}'s to map here")
        self._settle([slot], [chunk_id])
        self._range.map(slot, chunk_id)
        self._chunk_of[slot] = chunk_id
        self.num_maps += 1

    def unmap_slots(self, slots: Sequence[int], fence: Fence | None = None) -> None:
        """Give the slots' chunks back to the pool (FREE). Without a fence the slots are unmapped now;
        with one (eLLM §5.1's asynchronous unmapping) only the books change now, and the range unmaps
        each slot once `complete_unmaps` finds the fence passed: the work queued before the fence may
        still read the old slot, and the chunk is meanwhile mapped wherever it goes next."""
        slots = list(slots)
        missing = [s for s in slots if s not in self._chunk_of]
        if missing or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} must be distinct mapped slots (not mapped: {missing})")
        if fence is None:
            for slot in slots:
                self._range.unmap(slot)
            self.num_unmaps += len(slots)
        else:
            self._pending.update((slot, (self._chunk_of[slot], fence)) for slot in slots)
        chunks = [self._chunk_of.pop(slot) for slot in slots]
        self.pool.give_back(chunks, self.owner)

    def complete_unmaps(self, *, wait: bool = False) -> int:
        """Do the deferred unmaps whose fence has passed (all of them, waiting, with `wait`); how many."""
        due = [slot for slot, (_, fence) in sorted(self._pending.items()) if wait or fence.done()]
        for slot in due:
            self._finish_unmap(slot)
        return len(due)

    def _settle(self, slots: Sequence[int], chunks: Sequence[int]) -> None:
        """A slot about to be mapped, or a chunk about to be mapped here, that a deferred unmap still
        holds in this range: that unmap first (a range maps a chunk at one of its slots at most)."""
        wanted_slots, wanted_chunks = set(slots), set(chunks)
        for slot in [s for s, (c, _) in sorted(self._pending.items()) if s in wanted_slots or c in wanted_chunks]:
            self._finish_unmap(slot)

    def _finish_unmap(self, slot: int) -> None:
        _, fence = self._pending[slot]
        try:
            fence.wait()
            trusted = True
        except Exception:  # the fence itself failed: the backend's own synchronize instead
            trusted = False
        self._range.unmap(slot, synchronize=not trusted)
        del self._pending[slot]
        self.num_unmaps += 1

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        return self._range.as_tensor(dtype, shape)

    def close(self) -> None:
        """Every chunk back to the pool, the deferred unmaps done, the range released (drop views first)."""
        if self._chunk_of:
            self.unmap_slots(sorted(self._chunk_of))
        self.complete_unmaps(wait=True)
        self._range.release()


__all__ = ["ETensor", "Fence", "MapError"]
