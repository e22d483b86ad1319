"""eLLM's CPU buffer in the builtin engine (§4.3.2): host memory for the KV of requests that wait, and
the prefix cache's host tier in what they leave of it.

The elastic scheduler (builtin/elastic.py) decides who parks, who is fetched back and which prefill
writes its KV straight to host memory (Algorithm 1), and how much of the buffer it may count on
(Algorithm 2's logical size); this part does what it decides and keeps the buffer's books. The KV of
a request that cannot stay in the pool is copied here and comes back before it decodes, instead of
being recomputed (`park`, `fetch`); an offloaded prefill's KV is written to a host tensor of its own
(`offload`) and waits parked after its step (`take_sink`).

KV copies to and from the buffer run on the engine's one executor thread, queued the moment the
scheduler decides them, so every copy out of a block precedes any later write to it (a step, or a
migration importing KV), and every copy in precedes the step that reads it. On the host backend they
do not overlap compute (both are the CPU); an offloaded prefill's copies on a GPU are non-blocking.
A copy out of blocks keeps their chunk mapped until it has run (the KV side's `copy_out`,
`ElasticKVBlocks.draining`): an unmapped slot reads as zero.

With prefix caching (MemServe's context caching) the buffer is the cache's host tier (MemServe §4.1
Table 1, swap_out / swap_in): it builds the `HostTierPrefixCache` the scheduler is opened with
(`cache`). An evicted block is copied here and stays in the prompt tree, within what parked KV leaves
of the buffer (parked requests come first: a host block is dropped when a request parks), and a
request whose cached prefix is partly here gets those blocks copied back into blocks of its own
before it prefills past them.

| piece | what it owns |
|---|---|
| `HostTier` | what the prefix cache asks of the buffer (Table 1's swap_out and swap_in) |
| `HostTierPrefixCache` | the prefix cache (builtin/prefix.py) with its host tier in the CPU buffer |
| `CpuBuffer` | the buffer: parked KV, offloaded prefills' sinks, the cache's host blocks, their copies |
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Protocol, cast

import torch

from kvfleet.serving.prompt_tree import Match
from kvfleet.worker.engines.base import EngineError, blocks_for
from kvfleet.worker.engines.builtin.blocks import KVSpace
from kvfleet.worker.engines.builtin.prefix import PrefixCache
from kvfleet.worker.engines.builtin.scheduler import Request

logger = logging.getLogger(__name__)

# Queue a copy of blocks to host memory on the executor: the host tensor (filled once it ran) and the copy.
CopyOut = Callable[[list[int]], tuple[torch.Tensor, "Future[None]"]]
# Queue a copy of host KV into blocks on the executor.
CopyIn = Callable[[list[int], torch.Tensor], "Future[None]"]
# The host tensor an offloaded prefill of so many tokens writes its KV to.
NewSink = Callable[[int], torch.Tensor]


class HostTier(Protocol):
    """The CPU buffer as the prefix cache's host tier sees it (MemServe §4.1 Table 1's swap_out and
    swap_in); the buffer keeps it, since parked KV shares it and comes first."""

    @property
    def in_use(self) -> bool:
        """Whether the buffer can take blocks now (it has a size, and the engine's copies exist)."""
        ...

    def host_free_blocks(self) -> int:
        """Blocks the buffer holds nothing in (parked KV, sinks and host blocks left out)."""
        ...

    def place_on_host(self, block_id: int) -> int | None:
        """Queue a copy of one device block to the buffer; the slot that names it, None if no room."""
        ...

    def drop_host_blocks(self, slots: list[int]) -> None: ...

    def host_copy_failed(self, slot: int) -> bool:
        """Whether the copy that was to fill a host slot failed (it holds nothing to start from)."""
        ...

    def swap_in(self, request_id: str, slots: list[int], space: KVSpace) -> list[int]:
        """Copy host slots into new blocks of the request's own, queued ahead of its step; the blocks."""
        ...


class HostTierPrefixCache(PrefixCache):
    """The prefix cache of elastic memory (module docstring): an evicted block is swapped out to the CPU
    buffer where it has room and stays in the prompt tree; a request whose prefix is partly there gets
    copies of those blocks of its own."""

    def __init__(self, block_size_tokens: int, host: HostTier) -> None:
        super().__init__(block_size_tokens)
        self._host = host

    def match(self, tokens: list[int]) -> Match[int] | None:
        match = self.tree.match(tokens)
        for i, node in enumerate(match.nodes):
            # A host copy that failed holds nothing to start from: the prefix ends before it.
            if node.on_host and self._host.host_copy_failed(cast(int, node.value)):
                match = Match(match.values[:i], match.nodes[:i], match.block_size_tokens)
                break
        if not match.nodes:
            return None
        self.tree.acquire(match)
        return match

    def start(self, req: Request, match: Match[int], space: KVSpace) -> None:
        """The blocks on the device it shares (locked until it ends), those on the host it gets copies
        of in blocks of its own (Table 1's swap_in), queued on the executor ahead of its step. Own
        copies, not the tree's: a copy that fails then fails this request alone, as a parked request's
        fetch does, and a finished request's insert puts them back in the tree (`insert`)."""
        bs = self.block_size_tokens
        num_device = next((i for i, node in enumerate(match.nodes) if node.on_host), len(match.nodes))
        device = Match(match.values[:num_device], match.nodes[:num_device], bs)
        blocks = list(device.values)
        if num_device < len(match.nodes):
            host_nodes = match.nodes[num_device:]
            blocks += self._host.swap_in(req.request_id, [cast(int, node.value) for node in host_nodes], space)
            # The host blocks are unlocked (the request reads its copies); the device part stays locked.
            self.tree.release(Match(match.values[num_device:], host_nodes, bs))
        req.blocks, req.shared = blocks, device if device.nodes else None
        req.num_cached = match.num_tokens

    def insert(self, tokens: list[int], block_ids: list[int], num_shared: int) -> list[int]:
        """Before a finished request's blocks go in the tree, its copies of blocks the tree keeps on the
        host replace those (swap_in without a copy): the insert keeps them then, and the tiers'
        invariant (a host block has only host blocks below it) holds."""
        path = self.tree.match(tokens).nodes
        for i in range(num_shared, len(path)):
            if path[i].on_host:
                self._host.drop_host_blocks([self.tree.swap_in(path[i], block_ids[i])])
        return self.tree.insert(tokens, block_ids)

    def evict(self, num_blocks: int) -> list[int]:
        """Swapped out to the host tier where it has room (older host blocks make way for them),
        dropped otherwise."""
        tree = self.tree
        freed: list[int] = []
        if self._host.in_use:
            room = self._host.host_free_blocks()
            if room < num_blocks:
                self._host.drop_host_blocks(tree.drop_host(num_blocks - room))
            freed = tree.swap_out(num_blocks, self._host.place_on_host)
        if len(freed) < num_blocks:
            freed += tree.evict(num_blocks - len(freed))
        return freed


class CpuBuffer:
    """eLLM's CPU buffer (§4.3.2) and its books (module docstring): the `HostTier` of the prefix cache it
    builds, and what `ElasticSpace.park` hands a leaving request's KV to. The elastic scheduler decides;
    this queues the copies and keeps, until they are known to have worked, the futures of each."""

    def __init__(self, capacity_bytes: int, block_size_tokens: int, *, prefix_caching: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_size_tokens = block_size_tokens
        # The prefix cache the scheduler is opened with, its host tier here; None without caching.
        self.cache = HostTierPrefixCache(block_size_tokens, self) if prefix_caching else None
        # Set by `open` (a started engine): the space's block size, the scheduler's requests (whose
        # parked KV is here), and the tensor work the buffer queues.
        self._block_bytes = 0
        self._requests: Mapping[str, Request] = {}
        self._copy_out: CopyOut | None = None
        self._copy_in: CopyIn | None = None
        self._new_sink: NewSink | None = None
        # The executor's copies to and from the buffer, by request, until they are known to have worked.
        self._copies_out: dict[str, Future[None]] = {}
        self._copies_in: dict[str, Future[None]] = {}
        # Offloaded prefills' host tensors their KV goes to, while their step is in flight.
        self._sink_of: dict[str, torch.Tensor] = {}
        # The prefix cache's host tier: cached blocks swapped out, by the place the prompt tree gives
        # them (a slot), with the copy that fills each.
        self._host_blocks: dict[int, tuple[torch.Tensor, Future[None]]] = {}
        self._slots = itertools.count()
        # Copies a request's swapped-in blocks depend on (out to the host, back in), until checked.
        self._swap_copies: dict[str, list[Future[None]]] = {}
        # Counters (metrics, the bench): parked KV fetched back (the scheduler's `num_parked` counts it
        # going), cached blocks copied to the host tier, and back in for a request.
        self.num_fetched = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    def open(self, block_bytes: int, requests: Mapping[str, Request], copy_out: CopyOut, copy_in: CopyIn,
             new_sink: NewSink) -> None:
        """Take a started engine's block size, the scheduler's requests and the tensor work queued here.

        `copy_out(blocks)` queues a copy of the blocks' KV to host memory (the KV side keeps their
        chunks mapped until it ran); `copy_in` one of such KV into blocks; `new_sink(tokens)` makes the
        host tensor an offloaded prefill writes its KV to ([layers, 2, whole blocks of tokens, kv_heads,
        head_dim]). The cache's host blocks are forgotten (the scheduler's `open` starts an empty tree).
        """
        self._block_bytes, self._requests = block_bytes, requests
        self._copy_out, self._copy_in, self._new_sink = copy_out, copy_in, new_sink
        self._host_blocks.clear()

    @property
    def in_use(self) -> bool:
        return self.capacity_bytes > 0 and self._copy_out is not None

    @property
    def host_tier(self) -> bool:
        """Whether cached blocks are swapped out to the buffer rather than dropped."""
        return self.cache is not None and self.in_use

    # -- the books ------------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """The KV parked in the buffer (the prefix cache's host blocks are apart: they yield to it)."""
        return sum(req.parked.shape[2] * self._block_bytes for req in self._requests.values() if req.parked is not None)

    def committed_blocks(self) -> int:
        """Blocks of the buffer nothing can take back now: parked KV, offloaded prefills' sinks in
        flight, and host blocks of the cache that a waiting request about to start from has pinned."""
        tree = self.cache.tree if self.cache is not None else None
        pinned = 0 if tree is None else tree.num_host_blocks - tree.num_evictable_host_blocks
        return (self.held_bytes() // self._block_bytes
                + sum(sink.shape[2] for sink in self._sink_of.values()) // self.block_size_tokens + pinned)

    def host_free_blocks(self) -> int:
        """Blocks the buffer holds nothing in: less parked KV, sinks and the cache's host blocks."""
        return (self.capacity_bytes // self._block_bytes - self.committed_blocks()
                - (0 if self.cache is None else self.cache.tree.num_evictable_host_blocks))

    def make_room(self, num_blocks: int) -> bool:
        """Room in the buffer for `num_blocks` blocks of parked KV: host blocks of the cache yield
        (parked requests come first). Whether there is room."""
        short = num_blocks - self.host_free_blocks()
        if short > 0 and self.cache is not None:
            self.drop_host_blocks(self.cache.tree.drop_host(short))
        return num_blocks <= self.host_free_blocks()

    # -- parked KV and offloaded prefills (§4.3.2) --------------------------------------------------

    def park(self, request_id: str, block_ids: list[int]) -> torch.Tensor | None:
        """`ElasticSpace.park`: a copy of a leaving request's blocks to the buffer if it has room (the
        cache's host blocks make way), queued on the executor now, so ahead of any later write to
        these blocks; None without room (the request is recomputed)."""
        if self._copy_out is None or not self.make_room(len(block_ids)):
            return None
        host, copy = self._copy_out(block_ids)
        self._copies_out[request_id] = copy
        return host

    def fetch(self, request_id: str, host: torch.Tensor, block_ids: list[int]) -> bool:
        """A parked request comes back into `block_ids`: its KV copied into them on the executor ahead
        of its step; False, and nothing queued, when its park's copy failed (it is recomputed)."""
        assert self._copy_in is not None
        copy_out = self._copies_out.pop(request_id, None)
        if copy_out is not None and _failed(copy_out):
            logger.warning("parking %s failed (%s): it is recomputed", request_id, copy_out.exception())
            return False
        self._copies_in[request_id] = self._copy_in(block_ids[: host.shape[2]], host)
        self.num_fetched += 1
        return True

    def offload(self, request_id: str, num_tokens: int) -> torch.Tensor:
        """The host tensor a prefill admitted offloaded writes its KV to; the cache's host blocks make
        way for it (Algorithm 1 counted on the room without them)."""
        assert self._new_sink is not None
        self.make_room(blocks_for(num_tokens, self.block_size_tokens))
        sink = self._sink_of[request_id] = self._new_sink(num_tokens)
        return sink

    def take_sink(self, request_id: str) -> torch.Tensor:
        """An offloaded prefill that goes on waits parked: its sink, in parked KV's layout."""
        sink = self._sink_of.pop(request_id)
        return sink.view(sink.shape[0], 2, -1, self.block_size_tokens, *sink.shape[3:])

    def copy_error(self, request_id: str) -> EngineError | None:
        """After a request's step: the error it fails alone with when its KV did not come back from the
        buffer (a fetch) or a cached block it swapped in did not (its own copies); None if they worked."""
        copy_in = self._copies_in.pop(request_id, None)
        swap_copies = self._swap_copies.pop(request_id, ())
        if copy_in is not None and copy_in.exception() is not None:
            return EngineError(f"fetching its KV from the CPU buffer failed: {copy_in.exception()}")
        failed = next((copy.exception() for copy in swap_copies if copy.exception() is not None), None)
        if failed is not None:
            return EngineError(f"swapping its cached prefix in from the CPU buffer failed: {failed}")
        return None

    def forget(self, request_id: str) -> None:
        """A request ended: its copies and sink are nobody's concern any more."""
        self._swap_copies.pop(request_id, None)
        self._copies_out.pop(request_id, None)
        self._copies_in.pop(request_id, None)
        self._sink_of.pop(request_id, None)

    # -- the prefix cache's host tier (HostTier) ------------------------------------------------------

    def host_copy_failed(self, slot: int) -> bool:
        return _failed(self._host_blocks[slot][1])

    def swap_in(self, request_id: str, slots: list[int], space: KVSpace) -> list[int]:
        assert self._copy_in is not None
        blocks: list[int] = []
        copies: list[Future[None]] = []
        for slot in slots:
            host, copy_out = self._host_blocks[slot]
            block_ids = space.allocate(1)
            # Queued after the copy that filled `host` (one FIFO executor), ahead of the step.
            copies += [copy_out, self._copy_in(block_ids, host)]
            blocks += block_ids
        self._swap_copies[request_id] = copies
        self.num_swap_ins += len(slots)
        return blocks

    def place_on_host(self, block_id: int) -> int | None:
        """Table 1's swap_out of one block: a copy to host memory queued now (before any later write to
        the block); the slot the prompt tree keeps for it, or None when the buffer has no room."""
        assert self._copy_out is not None
        if self.host_free_blocks() < 1:
            return None
        host, copy = self._copy_out([block_id])
        slot = next(self._slots)
        self._host_blocks[slot] = (host, copy)
        self.num_swap_outs += 1
        return slot

    def drop_host_blocks(self, slots: list[int]) -> None:
        for slot in slots:
            del self._host_blocks[slot]


def _failed(copy: Future[None]) -> bool:
    return copy.done() and copy.exception() is not None
