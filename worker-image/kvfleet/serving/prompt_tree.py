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

A host tier (MemServe §4.1 Table 1, `swap_out` / `swap_in`): where the engine has host memory to spare
(eLLM's CPU buffer), a block taken off the device need not leave the tree. `swap_out` moves least
recently used unpinned blocks to a place the caller gives (a node's value is then that place and
`on_host` is set), `drop_host` removes host blocks, least recently used leaves first, when the host
needs the room back, and `swap_in` puts a device block under a node on the host again. One invariant
keeps both tiers' eviction per block and matches contiguous: a block on the host has only blocks on
the host below it (a device block's whole prefix is on the device). So `swap_out` takes device blocks
with no device block below them, `swap_in` needs the parent on the device, and `insert` stops at a
block on the host (the caller swaps it in first to have its copy kept). `num_blocks` and
`num_evictable_blocks` count device blocks only, as before; `num_host_blocks` counts the others.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

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
    # `value` is where the host tier keeps the block (swap_out), not a device block.
    on_host: bool = False
    # Children on the device: a device node with none is what swap_out may take next.
    num_device_children: int = 0


@dataclass(frozen=True)
class Match(Generic[V]):
    """The longest cached prefix of a token list: its blocks' values and nodes, in order.

    With a host tier, a suffix of the nodes may be on the host (`Node.on_host`; their values are then
    host places): the caller swaps those in before it reads them."""

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
        # Device blocks; of those, the unpinned ones (refs == 0): what eviction could take, leaves first.
        self.num_blocks = 0
        self.num_evictable_blocks = 0
        # Blocks on the host tier; of those, the unpinned ones (what drop_host could take).
        self.num_host_blocks = 0
        self.num_evictable_host_blocks = 0
        # Candidates, (last_used, tiebreak, node); stale entries are skipped when popped. `_heap`:
        # device blocks with no device block below them (evict, swap_out); `_host_heap`: host leaves.
        self._heap: list[tuple[int, int, Node[V]]] = []
        self._host_heap: list[tuple[int, int, Node[V]]] = []
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
        # Their last use changed: the candidates among them go back in their heap at the new time
        # (at most the deepest device block and the deepest host block are).
        for child in nodes:
            self._offer(child)
        return Match(tuple(n.value for n in nodes if n.value is not None), tuple(nodes), self.block_size_tokens)

    def insert(self, tokens: Sequence[int], values: Sequence[V]) -> list[V]:
        """Cache the whole blocks of `tokens`, block i held at `values[i]` (Table 1's `insert`).

        Blocks already cached keep the value they had: the caller's values for those are returned,
        for it to free (its copy of a block someone cached first), unless the caller's value is the
        cached one (a block it matched and shared). Blocks past `len(values)` and a partial last block
        are not cached. At a block on the host the insert stops (a device block under it would break
        the tiers' invariant): the caller's values from there on are returned; `swap_in` first keeps them.
        """
        now = next(self._clock)
        keys = self._blocks(tokens)[: len(values)]
        node = self._root
        duplicates: list[V] = []
        for i, (key, value) in enumerate(zip(keys, values)):
            child = node.children.get(key)
            if child is not None and child.on_host:
                duplicates.extend(values[i: len(keys)])
                break
            if child is None:
                child = Node(key, value, node)
                node.children[key] = child
                node.num_device_children += 1
                self.num_blocks += 1
                self.num_evictable_blocks += 1
            elif child.value != value:
                duplicates.append(value)
            child.last_used = now
            node = child
        if node is not self._root:
            self._offer(node)
        return duplicates

    def acquire(self, match: Match[V]) -> None:
        """Pin a matched path: its blocks stay until `release` (a request reads them)."""
        for node in match.nodes:
            if node.refs == 0:
                if node.on_host:
                    self.num_evictable_host_blocks -= 1
                else:
                    self.num_evictable_blocks -= 1
            node.refs += 1

    def release(self, match: Match[V]) -> None:
        """Unpin what `acquire` pinned."""
        for node in match.nodes:
            if node.refs <= 0:
                raise ValueError("releasing a block that is not acquired")
            node.refs -= 1
            if node.refs == 0:
                if node.on_host:
                    self.num_evictable_host_blocks += 1
                else:
                    self.num_evictable_blocks += 1
                self._offer(node)

    def evict(self, num_blocks: int) -> list[V]:
        """Remove up to `num_blocks` unpinned device blocks, least recently used leaves first; their
        values (Table 1's delete). A device block with blocks on the host below it is not a leaf."""
        freed: list[V] = []
        kept: list[tuple[int, int, Node[V]]] = []  # swap_out's candidates that evict cannot take
        while len(freed) < num_blocks and self._heap:
            entry = heapq.heappop(self._heap)
            node = entry[2]
            if not self._device_candidate(node) or node.last_used != entry[0]:
                continue  # stale: removed, swapped out, no longer a leaf, pinned, or used since
            if node.children:
                kept.append(entry)
                continue
            parent = self._detach(node)
            self.num_blocks -= 1
            self.num_evictable_blocks -= 1
            parent.num_device_children -= 1
            if node.value is not None:
                freed.append(node.value)
            self._offer(parent)
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return freed

    def swap_out(self, num_blocks: int, place: Callable[[V], V | None]) -> list[V]:
        """Move up to `num_blocks` unpinned device blocks to the host, least recently used first, each
        with no device block below it (Table 1's swap_out); their device values, for the caller to free.

        `place(device_value)` copies the block to the host and returns where it keeps it (the node's
        value from now on), or None when the host has no room (then nothing more moves). It must not
        call back into the tree.
        """
        freed: list[V] = []
        while len(freed) < num_blocks and self._heap:
            entry = heapq.heappop(self._heap)
            node = entry[2]
            if not self._device_candidate(node) or node.last_used != entry[0]:
                continue
            value = cast(V, node.value)
            host = place(value)
            if host is None:
                heapq.heappush(self._heap, entry)
                break
            freed.append(value)
            node.value, node.on_host = host, True
            self.num_blocks -= 1
            self.num_evictable_blocks -= 1
            self.num_host_blocks += 1
            self.num_evictable_host_blocks += 1
            assert node.parent is not None
            node.parent.num_device_children -= 1
            self._offer(node.parent)
            self._offer(node)
        return freed

    def drop_host(self, num_blocks: int) -> list[V]:
        """Remove up to `num_blocks` unpinned blocks from the host tier, least recently used leaves
        first; their host places, for the caller to free (the host needs the room for something else)."""
        dropped: list[V] = []
        while len(dropped) < num_blocks and self._host_heap:
            last_used, _, node = heapq.heappop(self._host_heap)
            if not self._host_candidate(node) or node.last_used != last_used:
                continue
            parent = self._detach(node)
            self.num_host_blocks -= 1
            self.num_evictable_host_blocks -= 1
            dropped.append(cast(V, node.value))
            self._offer(parent)
        return dropped

    def swap_in(self, node: Node[V], value: V) -> V:
        """Put device block `value` under a node on the host (Table 1's swap_in: the caller has copied,
        or is copying, the block's KV there); its host place, for the caller to free. The parent must
        be on the device (a match's host nodes come back in order, shallowest first)."""
        parent = node.parent
        if parent is None or not node.on_host or parent.on_host:
            raise ValueError("swap_in needs a cached block on the host under one on the device")
        host = cast(V, node.value)
        node.value, node.on_host = value, False
        self.num_host_blocks -= 1
        self.num_blocks += 1
        if node.refs == 0:
            self.num_evictable_host_blocks -= 1
            self.num_evictable_blocks += 1
        parent.num_device_children += 1
        self._offer(node)
        return host

    def _detach(self, node: Node[V]) -> Node[V]:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        node.parent = None
        return parent

    def _device_candidate(self, node: Node[V]) -> bool:
        return node.parent is not None and not node.on_host and node.refs == 0 and node.num_device_children == 0

    def _host_candidate(self, node: Node[V]) -> bool:
        return node.parent is not None and node.on_host and node.refs == 0 and not node.children

    def _offer(self, node: Node[V]) -> None:
        """Put the node in the heap of what it is a candidate for now, if anything."""
        if self._device_candidate(node):
            heap = self._heap
        elif self._host_candidate(node):
            heap = self._host_heap
        else:
            return
        heapq.heappush(heap, (node.last_used, next(self._tiebreak), node))
        if len(heap) > 4 * (self.num_blocks + self.num_host_blocks) + 64:
            self._rebuild_heaps()

    def _rebuild_heaps(self) -> None:
        """Drop stale entries (every use pushes one; only evictions pop them) by listing the candidates."""
        self._heap, self._host_heap = [], []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if self._device_candidate(node):
                self._heap.append((node.last_used, next(self._tiebreak), node))
            elif self._host_candidate(node):
                self._host_heap.append((node.last_used, next(self._tiebreak), node))
        heapq.heapify(self._heap)
        heapq.heapify(self._host_heap)
