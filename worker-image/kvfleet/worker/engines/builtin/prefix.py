"""The builtin engine's prefix cache: requests' full KV blocks by token prefix (MemServe §4.1-4.2).

The scheduler is handed this part (or None: no caching) and calls it at fixed points, as SGLang's
scheduler calls its radix cache: `match` (and lock) a waiting request's cached prefix before it is
admitted, `start` it from that prefix when it is, `share` a running request's prompt blocks once
they are prefilled, `insert` a finished request's blocks, `evict` blocks nobody reads when the
scheduler is short, `unlock` a prefix nobody reads any more. Cached blocks are neither free nor any
request's until evicted.

A prompt's blocks go in as soon as it is prefilled, not when its request finishes (vLLM caches a
block once it is full; "MemServe: Flexible Mem Pool for Building Disaggregated LLM Serving with
Caching", §4 context caching, indexes a prompt's KV for reuse): requests running at once with the same
prompt (OpenAI `n` samples, a shared system prompt under load) then prefill and hold it once.

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

    def share(self, req: Request, num_blocks: int) -> list[int]:
        """A running request's first `num_blocks` blocks, full and written (its prefilled prompt's),
        go in the tree (Table 1's insert) and it reads them from there on, locked, exactly as if it had
        started from them (`start`): `req.shared` covers them and they lead `req.blocks`. Where the tree
        holds some already (another request inserted the same tokens first) the request switches to
        the tree's blocks: the same tokens at the same positions have the same KV. Its own copies of
        those are returned, for the space.

        Built of `insert` and `match` so that a subclass's tiers (HostTierPrefixCache swaps host blocks
        in under the request's copies) hold here as they do at a finished request's insert."""
        bs = self.block_size_tokens
        tokens = req.context()[: num_blocks * bs]
        old = req.shared
        num_shared = len(old.nodes) if old is not None else 0
        # The duplicates are read off the match below, not taken from insert: where an insert stops
        # short (a block on the host) it returns blocks the request must keep, as it still reads them.
        self.insert(tokens, req.blocks[:num_blocks], num_shared)
        match = self.match(tokens)  # locked for the request from here on
        if match is None:
            return []
        num_device = next((i for i, node in enumerate(match.nodes) if node.on_host), len(match.nodes))
        if num_device < len(match.nodes):  # a host node's value is a host slot, not a block to read
            self.unlock(Match(match.values[num_device:], match.nodes[num_device:], bs))
            match = Match(match.values[:num_device], match.nodes[:num_device], bs)
        if len(match.nodes) <= num_shared:  # nothing past what it shares already
            self.unlock(match)
            return []
        num = len(match.nodes)
        duplicates = [own for own, cached in zip(req.blocks[:num], match.values) if own != cached]
        req.blocks[:num] = match.values
        # Its old lock covers a prefix of the new one (locked nodes are never evicted): let it go last,
        # so no block it reads is unlocked in between.
        if old is not None:
            self.unlock(old)
        req.shared = match
        return duplicates

    def insert(self, tokens: list[int], block_ids: list[int], num_shared: int) -> list[int]:
        """A request's full blocks for `tokens` go in the tree (Table 1's insert): a finished request's
        (`_cache_blocks`) or a running one's prefilled prompt (`share`); the ones returned duplicate
        blocks cached already and go back to the space. The first `num_shared` are the tree's own
        already (the prefix the request reads from it)."""
        return self.tree.insert(tokens, block_ids)

    def evict(self, num_blocks: int) -> list[int]:
        """Up to `num_blocks` device blocks nobody reads, least recently used first (MemServe's
        MemPool keeps history only while it is free memory), taken from the tree."""
        return self.tree.evict(num_blocks)
