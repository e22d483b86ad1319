"""The builtin engine's KV block accounting: which blocks of the paged cache are free, and whose.

The cache's tensors are model.PagedKVCache; this is the bookkeeping around them that the
scheduler (builtin/scheduler.py) and the migration calls (builtin/migration.py) share on the event
loop: the free list and the blocks held for a request that is not running here yet (imported or
reserved by a migration). How many blocks a number of tokens takes is the engines' shared rule
(base.blocks_for).

`KVSpace` is what the scheduler asks of the memory its blocks live in (vLLM v1's scheduler calls a
KV cache manager the same way): a static cache (`BlockPool`) or elastic memory's pool
(builtin/elastic.py) behind one protocol, so the scheduler's request state machine is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvfleet.serving.prompt_tree import Match

BLOCK_SIZE_TOKENS = 16


class KVSpace(Protocol):
    """The blocks a scheduler allocates from (on the event loop only)."""

    @property
    def free(self) -> list[int]:
        """The free block ids: read on every step, so a plain list (`len(space.free)` is the free count)."""
        ...

    @property
    def num_blocks(self) -> int:
        """Every block id the space may ever hand out (and so the most one request may hold)."""
        ...

    @property
    def block_bytes(self) -> int: ...

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks; the caller has checked there are enough."""
        ...

    def release(self, block_ids: list[int]) -> None: ...

    def grow_for(self, num_blocks: int) -> None:
        """Try to have `num_blocks` blocks free by growing the space itself (elastic memory inflates);
        a static cache cannot grow. The scheduler evicts cached blocks after this, not before."""
        ...

    def park(self, request_id: str, block_ids: list[int]) -> torch.Tensor | None:
        """Queue a copy of a request leaving the device to host memory and return where it goes, or None
        when there is no room for it there (the request is recomputed instead)."""
        ...


class BlockPool:
    """The free list of one paged cache's block ids (on the event loop only).

    `free` is a plain list the scheduler reads on every step: `len(pool.free)` is the free count.
    """

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        # Taken from the end, so a fresh pool hands out block 0 first.
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks; the caller has checked there are enough."""
        taken = self.free[len(self.free) - num_blocks:]
        del self.free[len(self.free) - num_blocks:]
        return taken

    def release(self, block_ids: list[int]) -> None:
        self.free.extend(block_ids)

    def grow_for(self, num_blocks: int) -> None:
        """A static cache has the blocks it was opened with."""

    def park(self, request_id: str, block_ids: list[int]) -> torch.Tensor | None:
        """No host buffer: a preempted request is recomputed (vLLM's recompute policy)."""
        return None


@dataclass(eq=False)
class StagedKV:
    """KV imported or reserved for a request that has not been resumed yet (mutable, event loop only)."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # The prefix cache's blocks it starts with (PrefixKV.stage_prefix), locked in the prompt tree:
    # the first len(shared.nodes) of `blocks`. They are the cache's, never freed with the rest.
    shared: Match[int] | None = None

    @property
    def num_shared(self) -> int:
        return len(self.shared.nodes) if self.shared is not None else 0
