"""The unified physical pool of elastic memory (eLLM §4.2.2): chunks and who owns each.

eLLM's point is that KV cache and activations draw on one pool of identical physical chunks, each
labelled with the side that owns it, so memory moves between the sides by relabelling ("ownership
transfer") instead of by copying. This module is only that bookkeeping, no memory: the mapping of
chunks into virtual tensors is etensor.py's. Every operation is all or nothing, so a failed one
leaves the pool as it was, and a chunk always has exactly one owner.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class Owner(enum.Enum):
    FREE = "free"
    KV = "kv"
    ACTIVATION = "activation"


class PoolExhausted(Exception):
    """Fewer FREE chunks than asked for."""


class OwnershipError(Exception):
    """A chunk given back or transferred by a side that does not own it."""


class ChunkPool:
    """`num_chunks` chunks of `chunk_bytes`, each owned by one `Owner` (all FREE to start)."""

    def __init__(self, num_chunks: int, chunk_bytes: int) -> None:
        if num_chunks < 1 or chunk_bytes < 1:
            raise ValueError(f"a pool needs chunks: {num_chunks} of {chunk_bytes} bytes")
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self._owner = [Owner.FREE] * num_chunks
        # FREE chunks, highest id first, so `take` hands out the lowest ids.
        self._free = list(range(num_chunks - 1, -1, -1))
        self._counts = {owner: 0 for owner in Owner}
        self._counts[Owner.FREE] = num_chunks

    def owner(self, chunk_id: int) -> Owner:
        return self._owner[chunk_id]

    def count(self, owner: Owner) -> int:
        return self._counts[owner]

    def take(self, num: int, owner: Owner) -> list[int]:
        """FREE -> `owner` for `num` chunks, all or none."""
        if owner is Owner.FREE or num < 0:
            raise ValueError(f"cannot take {num} chunks for {owner.value}")
        if num > len(self._free):
            raise PoolExhausted(f"{num} chunks asked for {owner.value}, {len(self._free)} free")
        taken = self._free[len(self._free) - num:][::-1]
        del self._free[len(self._free) - num:]
        for chunk_id in taken:
            self._owner[chunk_id] = owner
        self._counts[Owner.FREE] -= num
        self._counts[owner] += num
        return taken

    def give_back(self, chunk_ids: Sequence[int], owner: Owner) -> None:
        """`owner` -> FREE, all or none."""
        self.transfer(chunk_ids, owner, Owner.FREE)

    def transfer(self, chunk_ids: Sequence[int], source: Owner, target: Owner) -> None:
        """Relabel chunks from `source` to `target`, all or none: §4.2.2's ownership transfer, step 3 of
        §4.3.1's inflation (activation -> KV) and of its reverse, deflation. Only the labels move: the
        caller unmaps the chunks from the source's eTensor first and maps them into the target's after
        (ETensor.adopt)."""
        ids = list(chunk_ids)
        if len(set(ids)) != len(ids):
            raise OwnershipError(f"chunks listed twice: {sorted(ids)}")
        for chunk_id in ids:
            if not 0 <= chunk_id < self.num_chunks or self._owner[chunk_id] is not source:
                actual = self._owner[chunk_id].value if 0 <= chunk_id < self.num_chunks else "nobody (no such chunk)"
                raise OwnershipError(f"chunk {chunk_id} is owned by {actual}, not {source.value}")
        if source is target:
            return
        for chunk_id in ids:
            self._owner[chunk_id] = target
        if source is Owner.FREE:
            gone = set(ids)
            self._free = [c for c in self._free if c not in gone]
        if target is Owner.FREE:
            self._free.extend(ids)
            self._free.sort(reverse=True)
        self._counts[source] -= len(ids)
        self._counts[target] += len(ids)
