"""One GPU's prefix (context) cache, as the simulator models it: what `kvfleet simulate --prefix-cache` adds.

MemServe keeps the KV of finished requests as historical KV cache (§4.1: `insert` when a request
finishes) and finds a new prompt's cached prefix through a token index (§4.2: `match`, a radix tree
over prompt tokens). Traces do not carry tokens, only the Mooncake format's prompt block hashes
(`TraceRequest.hash_ids`), so the index here is the set of block hashes a GPU holds, and a match is
the longest run of a prompt's hash blocks, from its first, that the GPU holds: a block's KV depends on
every token before it, so a block after a miss cannot be reused. Matching whole hash blocks (512
tokens in Mooncake's traces) rather than MemServe's 16-token engine blocks (§4.2) finds no more than
the engine would.

Historical KV lives only in memory no running request needs: the cache is bounded by the GPU's free
KV bytes (C minus its running requests' KV) and gives way least recently used first, as vLLM's
prefix cache does when it reclaims free blocks. With a host tier (`PrefixCacheSpec.host_bytes`: MemServe
§4.1 Table 1's swap_out / swap_in, the builtin engine's CPU buffer) an evicted block moves to the
worker's host memory instead, and a match copies it back. Pure and deterministic, like the rest of
kvfleet.sim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.sim.traces import DEFAULT_HASH_BLOCK_TOKENS


@dataclass(frozen=True)
class PrefixCacheSpec:
    """Turns the per-GPU prefix cache model on for a replay; `hash_block_tokens` is the size of the
    trace's hash blocks (512 in Mooncake's traces)."""

    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS
    # Whether placement knows the caches: a pool's router keeps a global prompt tree and sends a request
    # to the worker holding the longest prefix of its prompt that has room for it (MemServe §6;
    # worker-image/kvfleet/router/locality.py). The replay tells the plan those GPUs, longest prefix
    # first (Arrive.prefix_tiers), and the default policy places there within its capacity rule.
    # False: a cache-blind router (least-loaded, or MELL by bytes alone), hits where placement happens
    # to put a request.
    prompt_tree: bool = False
    # A host tier per worker (MemServe §4.1 Table 1, swap_out / swap_in; the builtin engine's CPU buffer):
    # blocks evicted from GPU memory go to this many bytes of host memory, least recently used out, and
    # a prompt that finds its prefix there copies those blocks back over the host link before it
    # decodes instead of prefilling them. 0: no host tier (GPU memory only).
    host_bytes: int = 0
    host_link_bytes_per_s: float = 25e9

    def __post_init__(self) -> None:
        if self.hash_block_tokens <= 0:
            raise ValueError(f"hash_block_tokens must be positive, not {self.hash_block_tokens}")
        if self.host_bytes < 0 or not self.host_link_bytes_per_s > 0:
            raise ValueError("host_bytes must be >= 0 and host_link_bytes_per_s positive")

    def block_tokens(self, prompt_tokens: int, num_blocks: int) -> list[int]:
        """Tokens in each of a prompt's first `num_blocks` hash blocks: whole blocks, the last cut at
        the prompt's end (Mooncake hashes a partial last block too)."""
        size = self.hash_block_tokens
        return [max(0, min(size, prompt_tokens - i * size)) for i in range(num_blocks)]


class GpuPrefixCache:
    """The block hashes one GPU holds as historical KV, least recently used first, with their tokens;
    with `host_bytes`, also those its worker keeps in host memory (blocks evicted from the GPU)."""

    def __init__(self, kv_bytes_per_token: int, host_bytes: int = 0) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self._blocks: OrderedDict[int, int] = OrderedDict()  # hash id -> tokens of the block
        self._tokens = 0
        self.host_bytes = host_bytes
        self._host: OrderedDict[int, int] = OrderedDict()  # the host tier, least recently used first
        self._host_tokens = 0
        # Tokens of the last `match` found in the host tier (copied back to the GPU by it).
        self.last_host_tokens = 0

    @property
    def host_tokens(self) -> int:
        return self._host_tokens

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    @property
    def cached_bytes(self) -> int:
        return self._tokens * self.kv_bytes_per_token

    def hash_ids(self) -> list[int]:
        """The held hashes, least recently used first (the order eviction takes them in)."""
        return list(self._blocks)

    def match(self, hash_ids: Sequence[int], block_tokens: Sequence[int]) -> int:
        """Prompt tokens whose KV this GPU holds: its hash blocks from the first up to the first miss
        (§4.2 `match`), in GPU memory or the host tier. Blocks found in the host tier are copied back
        into GPU memory (swap_in; `last_host_tokens` says how many tokens), and the hit blocks become
        the most recently used."""
        hit_tokens, hits = self._held_prefix(hash_ids, block_tokens)
        self.last_host_tokens = 0
        for hash_id in hits:
            tokens = self._host.pop(hash_id, None)
            if tokens is not None:
                self._host_tokens -= tokens
                self.last_host_tokens += tokens
                self._blocks[hash_id] = tokens
                self._tokens += tokens
        self._touch(hits)
        return hit_tokens

    def peek(self, hash_ids: Sequence[int], block_tokens: Sequence[int]) -> int:
        """What `match` would return, without making the blocks recent: a scheduler looking at every
        worker's prompt tree (MemServe §6) before it picks one must not change the others' LRU order."""
        return self._held_prefix(hash_ids, block_tokens)[0]

    def _held_prefix(self, hash_ids: Sequence[int], block_tokens: Sequence[int]) -> tuple[int, list[int]]:
        hit_tokens = 0
        hits: list[int] = []
        for hash_id, tokens in zip(hash_ids, block_tokens):
            held = self._blocks.get(hash_id)
            if held is None:
                held = self._host.get(hash_id)
            if held is None:
                break
            # The same hash with fewer tokens (a partial last block in one request, a whole one in
            # another) holds only the shorter block's KV.
            hit_tokens += min(held, tokens)
            hits.append(hash_id)
        return hit_tokens, hits

    def insert(self, hash_ids: Sequence[int], block_tokens: Sequence[int]) -> None:
        """Keep a finished request's prompt blocks (§4.1 `insert`) as the most recently used."""
        for hash_id, tokens in zip(hash_ids, block_tokens):
            if tokens <= 0:
                continue
            in_host = self._host.pop(hash_id, None)
            if in_host is not None:  # written again on the GPU: the host copy is superseded
                self._host_tokens -= in_host
            held = self._blocks.get(hash_id, 0)
            if tokens > held:
                self._tokens += tokens - held
                self._blocks[hash_id] = tokens
        self._touch([h for h, t in zip(hash_ids, block_tokens) if h in self._blocks and t > 0])

    def _touch(self, prompt_order: list[int]) -> None:
        # Touched last block first, so that a prompt's first blocks are the most recent: eviction
        # takes a prefix from its end, and what is left still matches (vLLM frees blocks in reverse
        # order for the same reason).
        for hash_id in reversed(prompt_order):
            self._blocks.move_to_end(hash_id)

    def evict_to(self, limit_bytes: int) -> int:
        """Drop least recently used blocks until the GPU holds at most `limit_bytes` of them; returns how
        many. With a host tier each goes there (swap_out) as its most recent block, and the host tier
        then drops its least recently used blocks past `host_bytes`."""
        evicted = 0
        while self._blocks and self.cached_bytes > limit_bytes:
            hash_id, tokens = self._blocks.popitem(last=False)
            self._tokens -= tokens
            evicted += 1
            if self.host_bytes:
                self._host[hash_id] = tokens
                self._host_tokens += tokens
        while self._host and self._host_tokens * self.kv_bytes_per_token > self.host_bytes:
            _, tokens = self._host.popitem(last=False)
            self._host_tokens -= tokens
        return evicted
