"""The prompt tree of context caching (MemServe §4.2, §6): token prefixes, by whole KV blocks, to where
their KV is kept.

MemServe indexes historical KV cache by prompt tokens with SGLang's radix tree, at the engine's block
granularity (16 tokens here), and uses the same tree twice: in each instance's MemPool, where a node
points to the KV block that holds its tokens, and in the global scheduler, where a node says which
instance holds it. So this module is generic in what a node carries (`V`: a block id in the builtin
engine, a worker in the router) and pure (no torch, no I/O), and both sides use it.

The tree's edges are whole blocks: a node is one block of `block_size_tokens` token ids under its
prefix, so a match is always a whole number of blocks and every node is one block to keep or evict.
(SGLang compresses runs of single-child nodes into one edge; with block-sized edges a lookup costs
one dict probe per block either way, and eviction stays per block.)

Reference counts keep what running requests use: `match` finds, `acquire` pins the matched path
(each block a request reads), `release` unpins; `evict` takes least recently used unpinned leaves
only, so a block is never taken from under a request, and a parent goes only after its children.
Counts (`num_blocks`, `num_evictable_blocks`) are exact at every step: a worker reports them (shared
blocks once, evictable ones apart) so the scheduler neither double-counts nor mistakes cache for load.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(eq=False)
class Node(Generic[V]):
    """One cached block: its tokens under its parent's prefix, and what it points to."""

    key: tuple[int, ...]
    value: V | None
    parent: Node[V] | None
    children: dict[tuple[int, ...], Node[V]] = field(default_factory=dict)
    refs: int = 0
    last_used: int = 0


@dataclass(frozen=True)
class Match(Generic[V]):
    """The longest cached prefix of a token list: its blocks' values and nodes, in order."""

    values: tuple[V, ...]
    nodes: tuple[Node[V], ...]
    block_size_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.nodes) * self.block_size_tokens


class PromptTree(Generic[V]):
    """Cached token prefixes by whole blocks (module docstring)."""

    def __init__(self, block_size_tokens: int) -> None:
        if block_size_tokens < 1:
            raise ValueError("blocks hold at least one token")
        self.block_size_tokens = block_size_tokens
        self._root: Node[V] = Node((), None, None)
        self._clock = itertools.count(1)
        self.num_blocks = 0
        # Unpinned nodes (refs == 0): what eviction could take, leaves first.
        self.num_evictable_blocks = 0
        # Candidate leaves for eviction, (last_used, tiebreak, node); stale entries are skipped.
        self._heap: list[tuple[int, int, Node[V]]] = []
        self._tiebreak = itertools.count()

    def _blocks(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        bs = self.block_size_tokens
        return [tuple(tokens[i:i + bs]) for i in range(0, len(tokens) - len(tokens) % bs, bs)]

    def match(self, tokens: Sequence[int]) -> Match[V]:
        """The longest cached prefix of whole blocks (Table 1's `match`); marks it recently used."""
        now = next(self._clock)
        node, nodes = self._root, []
        for key in self._blocks(tokens):
            child = node.children.get(key)
            if child is None:
                break
            child.last_used = now
            nodes.append(child)
            node = child
        if nodes and not nodes[-1].children and nodes[-1].refs == 0:
            self._push(nodes[-1])
        return Match(tuple(n.value for n in nodes if n.value is not None), tuple(nodes), self.block_size_tokens)

    def insert(self, tokens: Sequence[int], values: Sequence[V]) -> list[V]:
        """Cache the whole blocks of `tokens`, block i held at `values[i]` (Table 1's `insert`).

        Blocks already cached keep the value they had: the caller's values for those are returned,
        for it to free (its copy of a block someone cached first), unless the caller's value is the
        cached one (a block it matched and shared). Blocks past `len(values)` and a partial last block
        are not cached.
        """
        now = next(self._clock)
        keys = self._blocks(tokens)[: len(values)]
        node, duplicates = self._root, []
        for key, value in zip(keys, values):
            child = node.children.get(key)
            if child is None:
                child = Node(key, value, node)
                node.children[key] = child
                self.num_blocks += 1
                self.num_evictable_blocks += 1
            elif child.value != value:
                duplicates.append(value)
            child.last_used = now
            node = child
        if node is not self._root and not node.children and node.refs == 0:
            self._push(node)
        return duplicates

    def acquire(self, match: Match[V]) -> None:
        """Pin a matched path: its blocks stay until `release` (a request reads them)."""
        for node in match.nodes:
            if node.refs == 0:
                self.num_evictable_blocks -= 1
            node.refs += 1

    def release(self, match: Match[V]) -> None:
        """Unpin what `acquire` pinned."""
        for node in match.nodes:
            if node.refs <= 0:
                raise ValueError("releasing a block that is not acquired")
            node.refs -= 1
            if node.refs == 0:
                self.num_evictable_blocks += 1
                if not node.children:
                    self._push(node)

    def evict(self, num_blocks: int) -> list[V]:
        """Remove up to `num_blocks` unpinned blocks, least recently used leaves first; their values."""
        freed: list[V] = []
        while len(freed) < num_blocks and self._heap:
            last_used, _, node = heapq.heappop(self._heap)
            if node.parent is None or node.children or node.refs or node.last_used != last_used:
                continue  # stale: removed, no longer a leaf, pinned, or used since
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.num_blocks -= 1
            self.num_evictable_blocks -= 1
            if node.value is not None:
                freed.append(node.value)
            if parent is not self._root and not parent.children and parent.refs == 0:
                self._push(parent)
        return freed

    def _push(self, node: Node[V]) -> None:
        heapq.heappush(self._heap, (node.last_used, next(self._tiebreak), node))
