"""The builtin engine's prefix cache: finished requests' full KV blocks by token prefix (MemServe §4.1-4.2).

The scheduler is handed this part (or None: no caching) and calls it at fixed points, as SGLang's
scheduler calls its radix cache: `match` (and lock) a waiting request's cached prefix before it is
admitted, `start` it from that prefix when it is, `insert` a finished request's blocks, `evict`
blocks nobody reads when the scheduler is short, `unlock` a prefix nobody reads any more. Cached
blocks are neither free nor any request's until evicted.

This is the cache of a static KV cache: an evicted block is dropped. Elastic memory keeps a host tier
behind it in the CPU buffer (builtin/cpu_buffer.py's `HostTierPrefixCache` overrides these calls).
"""

from __future__ import annotations

from kvfleet.serving.prompt_tree import Match, PromptTree
from kvfleet.worker.engines.builtin.blocks import KVSpace
from kvfleet.worker.engines.builtin.scheduler import Request


class PrefixCache:
    """A `PromptTree` of block ids and the scheduler's calls on it (module docstring)."""

    def __init__(self, block_size_tokens: int) -> None:
        self.block_size_tokens = block_size_tokens
        self.tree: PromptTree[int] = PromptTree(block_size_tokens)

    def reset(self) -> None:
        """Forget every cached block: a newly opened cache's block ids mean nothing in the old tree."""
        self.tree = PromptTree(self.block_size_tokens)

    @property
    def num_blocks(self) -> int:
        """Blocks cached on the device."""
        return self.tree.num_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks on the device that no request reads (pinned by none)."""
        return self.tree.num_evictable_blocks

    def match(self, tokens: list[int]) -> Match[int] | None:
        """The longest cached prefix of `tokens` (Table 1's match), locked so that making room cannot
        evict it; None when nothing of it is cached."""
        match = self.tree.match(tokens)
        if not match.nodes:
            return None
        self.tree.acquire(match)
        return match

    def unlock(self, match: Match[int]) -> None:
        """A matched prefix nobody reads any more: its blocks may be evicted again."""
        self.tree.release(match)

    def start(self, req: Request, match: Match[int], space: KVSpace) -> None:
        """An admitted request reads its cached prefix's blocks (still locked, until it ends)."""
        req.blocks, req.shared, req.num_cached = list(match.values), match, match.num_tokens

    def insert(self, tokens: list[int], block_ids: list[int], num_shared: int) -> list[int]:
        """A finished request's full blocks for `tokens` go in the tree (Table 1's insert); the ones
        returned duplicate blocks cached already and go back to the space. The first `num_shared` are
        the tree's own already (the prefix the request started from)."""
        return self.tree.insert(tokens, block_ids)

    def evict(self, num_blocks: int) -> list[int]:
        """Up to `num_blocks` device blocks nobody reads, least recently used first (MemServe's
        MemPool keeps history only while it is free memory), taken from the tree."""
        return self.tree.evict(num_blocks)
