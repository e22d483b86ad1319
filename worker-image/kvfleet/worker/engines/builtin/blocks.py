"""The builtin engine's KV block accounting: which blocks of the paged cache are free, and whose.

The cache's tensors are model.PagedKVCache; this is the bookkeeping around them that the
scheduler (builtin/scheduler.py) and the migration calls (builtin/migration.py) share on the event
loop: the free list and the blocks held for a request that is not running here yet (imported or
reserved by a migration). How many blocks a number of tokens takes is the engines' shared rule
(base.blocks_for).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCK_SIZE_TOKENS = 16


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


@dataclass(eq=False)
class StagedKV:
    """KV imported or reserved for a request that has not been resumed yet (mutable, event loop only)."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
