"""Elastic memory in the builtin engine (eLLM): KV cache and activations in one pool of chunks, and a
CPU buffer for the KV of requests that wait.

A statically split worker keeps an activation reserve sized for its longest prefill, idle most of
the time, while requests queue for KV blocks (eLLM: Elastic Memory Management Framework for Efficient
LLM Serving, §3). Here the two share one `ChunkPool` (kvfleet.worker.elastic): the KV cache is a
virtual tensor (`ETensor`, §4.2.1) whose chunks are mapped when blocks are needed and unmapped when a
chunk's blocks are all free, and each step's activations are charged from its real shapes
(`model.activation_bytes`) against the same pool, so the KV side grows into whatever
activations leave (inflation and deflation, §4.3.1).
The KV of a request that cannot stay in the pool goes to a CPU buffer and comes back before it
decodes, instead of being recomputed (§4.3.2). What to run each step is Algorithm 1 and the
buffer's size Algorithm 2, both pure functions in builtin/elastic_policy.py; this module does what
they decide.

| piece | what it owns |
|---|---|
| `ElasticKVBlocks` | the KV eTensor and the free list of the blocks in its mapped chunks |
| `ActivationChunks` | the activation eTensor: the chunks the step's activations are charged to |
| `ElasticScheduler` | the requests (scheduler.Scheduler) plus parked ones, Algorithms 1 and 2 |

The activations themselves are allocated by torch; the pool charges them (a chunk the activation
side holds is mapped into its eTensor and the KV side cannot use it), which is what decides how much
KV a step may hold. On a GPU, placing them in those chunks would need torch's allocator to map
through the pool (eLLM patches PyTorch's caching allocator for that, §5.2); kvfleet does not.

KV copies to and from the CPU buffer run on the engine's one executor thread, queued the moment the
scheduler decides them, so every copy out of a block precedes any later write to it (a step, or a
migration importing KV), and every copy in precedes the step that reads it. On the host backend they
do not overlap compute (both are the CPU); an offloaded prefill's copies on a GPU are non-blocking.
Unmapping is not on the executor, so a chunk with a block still being copied out is not deflated
(`ElasticKVBlocks.draining`): an unmapped slot reads as zero.

eLLM §5.1, "Overlapping (Un)mapping Overheads" (`ElasticSettings.overlap_mapping`, on by default) keeps
mapping off a step's path. Decoding speculative pre-mapping: once a step is handed to the executor,
while it computes, `ElasticScheduler.overlap` assumes every sequence in it produces its next token and
maps the chunks whose blocks those tokens go to (at most PREMAP_LIMIT_BYTES a step; the paper maps
under 50 MB ahead), so the reservation after the step finds them mapped. Asynchronous unmapping:
deflation hands a chunk on at once and leaves the old slot mapped behind a fence (a job queued on the
executor that records a CUDA event on a GPU: everything that could read the slot was queued before it);
the old slots are unmapped in the next step's overlap, once their fence has passed (etensor.py). The
KV eTensor's slot 0 is neither: model pads the decode gathers' block tables with block 0, so a
step may read slot 0 whatever its blocks, and only the time between steps may (un)map it.

With prefix caching (MemServe's context caching, builtin/scheduler.py) the cache lives in the same
pool: its blocks are free memory to Algorithm 1 (a batch's demand never counts them, and a block
several requests read counts once), and they are evicted, least recently used and unpinned only,
before the batch shrinks, a request parks or recomputes, or activations go without the chunks they
need. The CPU buffer is the cache's host tier (MemServe §4.1 Table 1, swap_out / swap_in): an evicted
block is copied there and stays in the prompt tree, within what parked KV leaves of the buffer (parked
requests come first: a host block is dropped when a request parks), and a request whose cached prefix
is partly there gets those blocks copied back into blocks of its own before it prefills past them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

import torch

from kvfleet.serving.prompt_tree import Match
from kvfleet.worker.elastic import ChunkPool, ETensor, Fence, MapError, Owner, PhysicalMemory, PoolExhausted
from kvfleet.worker.engines.base import (
    EngineError,
    RequestKV,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    blocks_for,
    kv_blocks_bytes,
)
from kvfleet.worker.engines.builtin.blocks import BlockPool
from kvfleet.worker.engines.builtin.elastic_policy import (
    Admission,
    Demand,
    PoolState,
    SloWindow,
    plan_batch,
    scale_logical_buffer,
)
from kvfleet.worker.engines.builtin.model import SeqBatchEntry
from kvfleet.worker.engines.builtin.sampling import Sampling
from kvfleet.worker.engines.builtin.scheduler import PREFILL_TOKENS_PER_STEP, Request, RequestState, Scheduler, Step
from kvfleet.worker.engines.capabilities import MemoryState

logger = logging.getLogger(__name__)

# Activations' bytes for (new tokens, context tokens) of one sequence (model.activation_bytes).
ActivationOf = Callable[[int, int], int]
# Queue a copy of blocks to host memory on the executor: the host tensor (filled once it ran) and the copy.
CopyOut = Callable[[list[int]], tuple[torch.Tensor, "Future[None]"]]
# Queue a copy of host KV into blocks on the executor.
CopyIn = Callable[[list[int], torch.Tensor], "Future[None]"]
# A fence behind everything queued so far (eLLM §5.1's asynchronous unmapping; memory.Fence).
FenceOf = Callable[[], Fence]
# Steps whose activation peaks make up the reported capacity (a report interval's worth or so).
CAPACITY_WINDOW_STEPS = 32
# The most KV mapped ahead of need while one step computes (eLLM §5.1: "minimal additional memory
# mapping (< 50MB)"); at least one chunk.
PREMAP_LIMIT_BYTES = 48 * 1024 * 1024


class ElasticKVBlocks(BlockPool):
    """The KV eTensor's blocks: `free` holds the free blocks of mapped chunks, lowest id last (so
    allocation fills low chunks first and high ones empty out, to be unmapped for activations)."""

    def __init__(self, chunks: ChunkPool, memory: PhysicalMemory, block_bytes: int) -> None:
        if chunks.chunk_bytes % block_bytes:
            raise ValueError(f"a chunk of {chunks.chunk_bytes} bytes is not whole blocks of {block_bytes} bytes")
        super().__init__(0, block_bytes)
        self.chunks = chunks
        self.blocks_per_chunk = chunks.chunk_bytes // block_bytes
        self.tensor = ETensor(chunks, memory, Owner.KV, chunks.num_chunks)
        # Every block the pool could ever map: the block ids' range (and the most one request may hold).
        self.num_blocks = chunks.num_chunks * self.blocks_per_chunk
        # Blocks whose KV a queued copy still reads (parked or swapped out to the CPU buffer): free or
        # not, their chunk stays mapped until the copy has run (the executor runs it, not this thread).
        self.draining: dict[int, Future[None]] = {}
        # Set: deflation's unmaps wait behind a fence (eLLM §5.1's asynchronous unmapping); None: inline.
        self.unmap_fence: FenceOf | None = None

    @property
    def mapped_bytes(self) -> int:
        return self.tensor.mapped_bytes

    def _blocks_of(self, slot: int) -> range:
        return range(slot * self.blocks_per_chunk, (slot + 1) * self.blocks_per_chunk)

    def grow(self, num_chunks: int, *, ahead: bool = False) -> int:
        """Inflation (§4.3.1 ❸❹): map up to `num_chunks` FREE chunks at the lowest unmapped slots (a
        slot a deferred unmap still holds last: mapping it waits for its fence). `ahead`: while a step
        computes (eLLM §5.1's pre-mapping): no device synchronize, and never slot 0, which a step's
        decode gathers may read whatever its blocks (the padding of model's block tables)."""
        num_chunks = min(num_chunks, self.chunks.count(Owner.FREE))
        if num_chunks <= 0:
            return 0
        slots = _unmapped_slots(self.tensor, num_chunks, skip=0 if ahead else None)
        if not slots:
            return 0
        try:
            self.tensor.map_slots(slots, synchronize=not ahead)
        except PoolExhausted:
            return 0
        for slot in slots:
            self.free.extend(self._blocks_of(slot))
        self.free.sort(reverse=True)
        return len(slots)

    def shrink(self, num_chunks: int) -> int:
        """Deflation: unmap up to `num_chunks` chunks whose blocks are all free, highest first."""
        if num_chunks <= 0:
            return 0
        self.draining = {b: copy for b, copy in self.draining.items() if not copy.done()}
        free = set(self.free) - self.draining.keys()
        empty = [slot for slot in sorted(self.tensor.mapped_slots, reverse=True)
                 if all(b in free for b in self._blocks_of(slot))][:num_chunks]
        if not empty:
            return 0
        # The chunks are FREE at once; their old slots are unmapped behind a fence (eLLM §5.1), but for
        # slot 0, which a step may read whatever its blocks (`grow`): it is unmapped now, between steps.
        deferred = [slot for slot in empty if slot != 0] if self.unmap_fence is not None else []
        if deferred:
            assert self.unmap_fence is not None
            self.tensor.unmap_slots(deferred, self.unmap_fence())
        if len(deferred) < len(empty):
            self.tensor.unmap_slots([slot for slot in empty if slot not in deferred])
        gone = {b for slot in empty for b in self._blocks_of(slot)}
        self.free = [b for b in self.free if b not in gone]
        return len(empty)

    def release(self, block_ids: list[int]) -> None:
        super().release(block_ids)
        self.free.sort(reverse=True)


class ActivationChunks:
    """The activation eTensor (§4.2.1): chunks charged to steps' activations. Chunks stay mapped after
    a step (the pool's reuse, §4.2.2) until the KV side needs them (`reclaim`, the GC of §4.3.1 ❷)."""

    def __init__(self, chunks: ChunkPool, memory: PhysicalMemory) -> None:
        self.chunks = chunks
        self.tensor = ETensor(chunks, memory, Owner.ACTIVATION, chunks.num_chunks)
        # As ElasticKVBlocks.unmap_fence: reclaimed chunks go to KV at once, their slots unmapped later.
        self.unmap_fence: FenceOf | None = None

    @property
    def held_chunks(self) -> int:
        return len(self.tensor.mapped_slots)

    def hold(self, num_chunks: int) -> bool:
        """Hold at least `num_chunks` chunks, taking FREE ones; False if the pool has too few."""
        missing = num_chunks - self.held_chunks
        if missing <= 0:
            return True
        if self.chunks.count(Owner.FREE) < missing:
            return False
        self.tensor.map_slots(_unmapped_slots(self.tensor, missing))
        return True

    def reclaim(self, keep_chunks: int, num_chunks: int) -> int:
        """Unmap up to `num_chunks` held chunks beyond the `keep_chunks` the current step needs (behind
        a fence when `unmap_fence` is set: nothing reads activation slots, but the rule is one)."""
        idle = max(0, min(num_chunks, self.held_chunks - keep_chunks))
        if idle:
            slots = sorted(self.tensor.mapped_slots, reverse=True)[:idle]
            self.tensor.unmap_slots(slots, self.unmap_fence() if self.unmap_fence is not None else None)
        return idle


@dataclass(frozen=True)
class ElasticSettings:
    """The worker's elastic-memory settings (EngineConfig), in the units the scheduler uses."""

    cpu_buffer_bytes: int
    threshold_bytes: int
    park_decodes_for_prefill: bool = True
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    # eLLM §5.1: map ahead while a step computes, unmap behind fences (module docstring).
    overlap_mapping: bool = True


class ElasticScheduler(Scheduler):
    """The builtin scheduler with eLLM's memory: Algorithm 1 picks each step's batch over one pool,
    waiting KV parks in the CPU buffer, Algorithm 2 sizes the buffer (module docstring)."""

    def __init__(self, max_num_seqs: int, block_size_tokens: int, seed: int | None, settings: ElasticSettings) -> None:
        super().__init__(max_num_seqs, block_size_tokens, seed)
        self.settings = settings
        # Requests whose KV is in the CPU buffer (state WAITING, no blocks), in decoding order.
        self.parked: collections.deque[Request] = collections.deque()
        self.kv: ElasticKVBlocks | None = None
        self.activations: ActivationChunks | None = None
        self._activation_of: ActivationOf = lambda new, context: 0
        self._base_activation_bytes = 0
        self._threshold_bytes = settings.threshold_bytes
        self._copy_out: CopyOut | None = None
        self._copy_in: CopyIn | None = None
        self._new_sink: Callable[[int], torch.Tensor] | None = None
        # The executor's copies to and from the buffer, by request, until they are known to have worked.
        self._copies_out: dict[str, Future[None]] = {}
        self._copies_in: dict[str, Future[None]] = {}
        # Offloaded prefills of the step in flight, and the host tensors their KV goes to.
        self._offloaded_now: set[str] = set()
        self._sink_of: dict[str, torch.Tensor] = {}
        # Algorithm 2's logical buffer: the whole buffer without objectives (nothing to trade), one
        # chunk to start with them (the paper's initial 1).
        with_slo = settings.ttft_slo_s is not None or settings.tpot_slo_s is not None
        self.logical_buffer_bytes = settings.cpu_buffer_bytes
        self._with_slo = with_slo
        self._slo_window = SloWindow()
        self._arrived_s: dict[str, float] = {}
        self._last_token_s: dict[str, float] = {}
        self._recent_activation: collections.deque[int] = collections.deque(maxlen=CAPACITY_WINDOW_STEPS)
        # Counters (metrics, the bench): KV parked, fetched back, prefills admitted offloaded, chunks
        # moved by the balloon each way.
        self.num_parked = 0
        self.num_fetched = 0
        self.num_offloaded_prefills = 0
        self.inflated_chunks = 0
        self.deflated_chunks = 0
        self.max_batch = 0
        # Prefix caching's host tier (module docstring): cached blocks swapped out, by the place the
        # prompt tree gives them (a slot), with the copy that fills each; and the waiting requests'
        # cached prefixes while a step is planned (pinned, so making room cannot take them).
        self._host_blocks: dict[int, tuple[torch.Tensor, Future[None]]] = {}
        self._slots = itertools.count()
        self._matches: dict[str, Match[int]] = {}
        # Copies a request's swapped-in blocks depend on (out to the host, back in), until checked.
        self._swap_copies: dict[str, list[Future[None]]] = {}
        # Counters: cached blocks copied to the host tier, and back in for a request.
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        # eLLM §5.1's counters: the eTensors' range calls made while a step computed (`overlap`), and
        # chunks pre-mapped there; the rest of the range calls ran on a step's path (`maps_on_path`).
        self.maps_ahead = 0
        self.unmaps_ahead = 0
        self.premapped_chunks = 0
        # Wall time spent in `overlap` (on the event loop, while the executor runs the step).
        self.overlap_calls = 0
        self.overlap_us = 0

    def attach(self, kv: ElasticKVBlocks, activations: ActivationChunks, activation_of: ActivationOf,
               base_activation_bytes: int, copy_out: CopyOut, copy_in: CopyIn,
               new_sink: Callable[[int], torch.Tensor], fence: FenceOf | None = None) -> None:
        """Take the started engine's pool and the tensor work the scheduler queues (`open` takes `kv` too).

        `copy_out(blocks)` queues a copy of the blocks' KV to host memory; `copy_in` one of such KV
        into blocks; `new_sink(tokens)` makes the host tensor an offloaded prefill writes its KV to
        ([layers, 2, whole blocks of tokens, kv_heads, head_dim]); `fence()` queues a fence behind the
        executor's work (with `overlap_mapping`, unmaps wait behind one; without a fence, inline).
        """
        self.kv, self.activations = kv, activations
        if self.settings.overlap_mapping and fence is not None:
            kv.unmap_fence = activations.unmap_fence = fence
        self._activation_of, self._base_activation_bytes = activation_of, base_activation_bytes
        self._copy_out, self._copy_in, self._new_sink = copy_out, copy_in, new_sink
        self._host_blocks.clear()  # (`open` started an empty prompt tree)
        if self._with_slo:
            self.logical_buffer_bytes = min(kv.chunks.chunk_bytes, self.settings.cpu_buffer_bytes)
        # Algorithm 1 counts bytes; the pool hands out chunks, and each side may round up by one.
        self._threshold_bytes = self.settings.threshold_bytes + 2 * kv.chunks.chunk_bytes

    # -- memory figures -------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        assert self.kv is not None
        return self.kv.chunks.num_chunks * self.kv.chunks.chunk_bytes

    def buffer_held_bytes(self) -> int:
        """The KV parked in the CPU buffer (the prefix cache's host blocks are apart: they yield to it)."""
        return sum(req.parked.shape[2] * self.pool.block_bytes for req in self.requests.values() if req.parked is not None)

    @property
    def host_tier(self) -> bool:
        """Whether cached blocks are swapped out to the CPU buffer rather than dropped."""
        return self.prefix is not None and self.settings.cpu_buffer_bytes > 0 and self._copy_out is not None

    def _committed_buffer_blocks(self) -> int:
        """Blocks of the CPU buffer nothing can take back now: parked KV, offloaded prefills' sinks in
        flight, and host blocks of the cache that a waiting request about to start from has pinned."""
        bs = self.block_size_tokens
        pinned = 0 if self.prefix is None else self.prefix.num_host_blocks - self.prefix.num_evictable_host_blocks
        return (self.buffer_held_bytes() // self.pool.block_bytes
                + sum(sink.shape[2] for sink in self._sink_of.values()) // bs + pinned)

    def memory_state(self) -> MemoryState:
        if self.kv is None or self.activations is None:
            return MemoryState(0, 0, self.settings.cpu_buffer_bytes, 0, 0)
        # What KV can count on: the pool less θ and the largest activation of the recent steps.
        chunk_bytes = self.kv.chunks.chunk_bytes
        resting = -(-self._base_activation_bytes // chunk_bytes) * chunk_bytes  # what any step holds
        recent = max(self._recent_activation, default=resting)
        capacity = self.total_bytes - self._threshold_bytes - recent
        capacity = max(self.pool.block_bytes, capacity // self.pool.block_bytes * self.pool.block_bytes)
        return MemoryState(kv_capacity_bytes=capacity, cpu_buffer_bytes=self.buffer_held_bytes(),
                           cpu_buffer_capacity_bytes=self.settings.cpu_buffer_bytes,
                           activation_bytes=self.activations.held_chunks * chunk_bytes,
                           budget_bytes=self.total_bytes)

    # -- requests ---------------------------------------------------------------------------------

    def new_request(self, request_id: str, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
        req = super().new_request(request_id, prompt, output, params)
        # Beyond the KV check: its prefill's activations (with its KV offloaded to the CPU buffer, or
        # in the pool when the buffer cannot take it all) and its last decode (KV in the pool) must
        # each fit the pool, or it would wait forever.
        most_tokens = len(prompt) + params.max_tokens
        most_kv = blocks_for(most_tokens, self.block_size_tokens) * self.pool.block_bytes
        room = self.total_bytes - self._threshold_bytes - self._base_activation_bytes
        context = len(prompt) + len(output)
        prompt_kv = blocks_for(context, self.block_size_tokens) * self.pool.block_bytes
        prefill = (self._activation_of(context, context)
                   + (prompt_kv if prompt_kv > self.settings.cpu_buffer_bytes else 0))
        decode = most_kv + self._activation_of(1, most_tokens)
        if max(prefill, decode) > room:
            raise RequestTooLong(f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} need "
                                 f"{max(prefill, decode)} bytes of KV and activations at once; this engine's "
                                 f"memory pool has {room}")
        self._arrived_s[request_id] = time.monotonic()
        return req

    def enqueue(self, req: Request, *, front: bool = False) -> AsyncIterator[StepOutput]:
        if req.parked is None:
            return super().enqueue(req, front=front)
        # A request resumed with its KV still in the buffer (a migration rolled back) waits parked.
        self.requests[req.request_id] = req
        if front:
            self.parked.appendleft(req)
        else:
            self.parked.append(req)
        self.wake()
        return self._stream(req)

    def detach(self, req: Request) -> None:
        if req.state is RequestState.WAITING and req in self.parked:
            self.parked.remove(req)
        else:
            super().detach(req)

    def finish(self, req: Request) -> None:
        super().finish(req)
        self._swap_copies.pop(req.request_id, None)
        self._copies_out.pop(req.request_id, None)
        self._copies_in.pop(req.request_id, None)
        self._sink_of.pop(req.request_id, None)
        self._arrived_s.pop(req.request_id, None)
        self._last_token_s.pop(req.request_id, None)
        self._offloaded_now.discard(req.request_id)

    def num_waiting(self) -> int:
        return super().num_waiting() + len(self.parked)

    def queued(self) -> list[RequestKV]:
        """Waiting requests and parked ones: both hold no blocks and need them to run (MELL's demand)."""
        queued = super().queued()
        if self.limits is None:
            return queued
        per_token = self.limits.kv_bytes_per_token
        queued += [RequestKV(req.request_id, req.num_tokens, kv_blocks_bytes(req.num_tokens, self.block_size_tokens, per_token))
                   for req in self.parked]
        return sorted(queued, key=lambda r: r.request_id)

    # -- steps ----------------------------------------------------------------------------------

    def schedule(self) -> Step | None:
        """Algorithm 1 over the running and parked requests, then the waiting ones; the batch's
        memory made real (chunks mapped each way, KV parked and fetched); None when nothing runs."""
        kv, activations = self.kv, self.activations
        assert kv is not None and activations is not None
        decodes = (list(self.running) + list(self.parked))[: self.max_num_seqs]
        prefills = self._prefill_candidates(len(decodes))
        act_chunks = 0
        while True:
            counted: set[int] = set()  # cached blocks charged already (a prefix of either queue runs)
            decode_demands = [self._decode_demand(r, counted) for r in decodes]
            plan = plan_batch(self._pool_state(), decode_demands, [self._prefill_demand(r, counted) for r in prefills],
                              base_activation_bytes=self._base_activation_bytes, base_kv_bytes=self._staged_bytes(),
                              park_for_prefill=self.settings.park_decodes_for_prefill)
            batch_decodes = decodes[: plan.num_decodes]
            admitted = list(zip(prefills, plan.prefills))
            if not batch_decodes and not admitted:
                break
            # Line 24-27's balloon, activation side first: the step's activations must be held
            # before any KV moves, else it does not run in this shape.
            act_chunks = -(-plan.activation_bytes // kv.chunks.chunk_bytes)
            if not activations.hold(act_chunks):
                deflated = kv.shrink(act_chunks - activations.held_chunks - kv.chunks.count(Owner.FREE))
                self.deflated_chunks += deflated
                if not activations.hold(act_chunks):
                    # Cached blocks nobody reads are free memory: they go before the batch shrinks.
                    self.deflated_chunks += self._deflate_cache(act_chunks)
                if not activations.hold(act_chunks):
                    decodes, prefills = _drop_last(decodes[: plan.num_decodes], prefills[: len(plan.prefills)])
                    continue
            break
        # Running requests Algorithm 1 left out give their blocks up (parked, or recomputed later).
        for req in [r for r in list(self.running) if r not in batch_decodes]:
            self._evict(req)
        # KV for the batch: inflate into FREE chunks, then into the activation side's idle ones; a
        # fragmented pool may still fall short, then the newest admissions wait, and the activations
        # they would have needed become idle (reclaimable) in turn.
        chunk_bytes = kv.chunks.chunk_bytes
        act_bytes = plan.activation_bytes
        while True:
            needed = self._new_blocks(batch_decodes, admitted)
            short = needed - len(kv.free)
            if short <= 0:
                break
            want = -(-short // kv.blocks_per_chunk)
            grown = kv.grow(want)
            if grown < want:
                activations.reclaim(-(-act_bytes // chunk_bytes), want - grown)
                grown += kv.grow(want - grown)
            self.inflated_chunks += grown
            if grown >= want:
                continue
            # Then cached blocks nobody reads (swapped out to the host tier where it has room), and
            # only then does the batch shrink (MemServe keeps history only in memory nothing else needs).
            if self._evict_cached(needed - len(kv.free)) > 0:
                continue
            if admitted:
                dropped, _ = admitted.pop()
                act_bytes -= self._prefill_demand(dropped).activation_bytes
                self._release_match(dropped.request_id)
            elif batch_decodes:
                victim = batch_decodes.pop()
                act_bytes -= self._decode_demand(victim).activation_bytes
                if victim.state is RequestState.RUNNING:
                    self._evict(victim)
            else:
                break
        act_chunks = -(-act_bytes // chunk_bytes) if batch_decodes or admitted else 0
        step = self._build_step(batch_decodes, admitted, act_chunks * kv.chunks.chunk_bytes)
        for request_id in list(self._matches):  # candidates not admitted start from the cache next time
            self._release_match(request_id)
        return step

    def _prefill_candidates(self, num_decodes: int) -> list[Request]:
        """Waiting requests in order, as many as batch slots and the prefill token budget allow, each
        with its cached prefix found and pinned (MemServe Table 1's match) for the step's plan."""
        budget_tokens = PREFILL_TOKENS_PER_STEP
        out: list[Request] = []
        for req in self.waiting:
            if num_decodes + len(out) >= self.max_num_seqs:
                break
            self._match_prefix(req)
            num_new = req.num_tokens - self._num_cached_at_start(req)
            if out and num_new > budget_tokens:
                self._release_match(req.request_id)
                break
            out.append(req)
            budget_tokens -= num_new
        return out

    # -- the prefix cache in the pool (MemServe §4.1 Table 1, §4.2) --------------------------------

    def _match_prefix(self, req: Request) -> None:
        """Find and pin the cached prefix a request about to be prefilled from scratch can start from
        (at least its last token is computed: its logits give the next token)."""
        prefix = self.prefix
        if prefix is None or req.blocks or req.num_cached or req.parked is not None:
            return
        match = prefix.match(req.context()[: req.num_tokens - 1])
        for i, node in enumerate(match.nodes):
            # A host copy that failed holds nothing to start from: the prefix ends before it.
            if node.on_host and _failed(self._host_blocks[cast(int, node.value)][1]):
                match = Match(match.values[:i], match.nodes[:i], match.block_size_tokens)
                break
        if match.nodes:
            prefix.acquire(match)
            self._matches[req.request_id] = match

    def _release_match(self, request_id: str) -> None:
        match = self._matches.pop(request_id, None)
        if match is not None and self.prefix is not None:
            self.prefix.release(match)

    def _num_cached_at_start(self, req: Request) -> int:
        match = self._matches.get(req.request_id)
        return match.num_tokens if match is not None else req.num_cached

    def _start_from_cache(self, req: Request, match: Match[int]) -> None:
        """An admitted request takes its cached prefix: the blocks on the device it shares (pinned
        until it ends), those on the host it gets copies of in blocks of its own (Table 1's swap_in),
        queued on the executor ahead of its step. Own copies, not the tree's: a copy that fails then
        fails this request alone, as a parked request's fetch does, and a finished request's insert
        puts them back in the tree (`_cache_blocks`)."""
        assert self._copy_in is not None and self.prefix is not None
        bs = self.block_size_tokens
        num_device = next((i for i, node in enumerate(match.nodes) if node.on_host), len(match.nodes))
        device = Match(match.values[:num_device], match.nodes[:num_device], bs)
        blocks = list(device.values)
        copies: list[Future[None]] = []
        for node in match.nodes[num_device:]:
            host, copy_out = self._host_blocks[cast(int, node.value)]
            block_ids = self.pool.allocate(1)
            # Queued after the copy that filled `host` (one FIFO executor), ahead of the step.
            copies += [copy_out, self._copy_in(block_ids, host)]
            blocks += block_ids
        if num_device < len(match.nodes):
            # The host blocks are unpinned (the request reads its copies); the device part stays pinned.
            self.prefix.release(Match(match.values[num_device:], match.nodes[num_device:], bs))
            self._swap_copies[req.request_id] = copies
            self.num_swap_ins += len(match.nodes) - num_device
        req.blocks, req.shared = blocks, device if device.nodes else None
        req.num_cached = match.num_tokens
        self.num_cache_hit_tokens += match.num_tokens

    def _evict_cached(self, num_blocks: int) -> int:
        """Free up to `num_blocks` device blocks of the cache that nobody reads, least recently used
        first: swapped out to the host tier where it has room (older host blocks make way for them),
        dropped otherwise. How many were freed."""
        prefix = self.prefix
        if prefix is None or num_blocks <= 0:
            return 0
        freed: list[int] = []
        if self.host_tier:
            room = self._buffer_free_blocks()
            if room < num_blocks:
                self._drop_host_blocks(prefix.drop_host(num_blocks - room))
            freed = prefix.swap_out(num_blocks, self._place_on_host)
        if len(freed) < num_blocks:
            freed += prefix.evict(num_blocks - len(freed))
        self.pool.release(freed)
        return len(freed)

    def _buffer_free_blocks(self) -> int:
        """Blocks the CPU buffer holds nothing in: less parked KV, sinks and the cache's host blocks."""
        return (self.settings.cpu_buffer_bytes // self.pool.block_bytes - self._committed_buffer_blocks()
                - (0 if self.prefix is None else self.prefix.num_evictable_host_blocks))

    def _place_on_host(self, block_id: int) -> int | None:
        """Table 1's swap_out of one block: a copy to host memory queued now (before any later write to
        the block); the slot the prompt tree keeps for it, or None when the buffer has no room."""
        assert self._copy_out is not None and self.kv is not None
        if self._buffer_free_blocks() < 1:
            return None
        host, copy = self._copy_out([block_id])
        slot = next(self._slots)
        self._host_blocks[slot] = (host, copy)
        self.kv.draining[block_id] = copy
        self.num_swap_outs += 1
        return slot

    def _drop_host_blocks(self, slots: list[int]) -> None:
        for slot in slots:
            del self._host_blocks[slot]

    def _make_buffer_room(self, num_blocks: int) -> bool:
        """Room in the CPU buffer for `num_blocks` blocks of parked KV: host blocks of the cache yield
        (parked requests come first). Whether there is room."""
        short = num_blocks - self._buffer_free_blocks()
        if short > 0 and self.prefix is not None:
            self._drop_host_blocks(self.prefix.drop_host(short))
        return num_blocks <= self._buffer_free_blocks()

    def _deflate_cache(self, act_chunks: int) -> int:
        """Evict cached blocks nobody reads, least recently used first, until the activation side can
        hold `act_chunks` chunks (deflation, eLLM §4.3.1); the chunks unmapped.

        A chunk is unmapped only once the copies out of its blocks have run (an unmapped slot reads
        as zero), and this step's activations need it now: so the copies are waited for here. They
        are the executor's only work (no step is in flight while one is planned), a chunk's worth of
        blocks a round."""
        kv, activations = self.kv, self.activations
        assert kv is not None and activations is not None
        unmapped = 0
        while True:
            need = act_chunks - activations.held_chunks - kv.chunks.count(Owner.FREE)
            if need <= 0 or not self._evict_cached(need * kv.blocks_per_chunk):
                return unmapped
            concurrent.futures.wait([copy for copy in kv.draining.values() if not copy.done()])
            unmapped += kv.shrink(need)

    def _cache_blocks(self, req: Request) -> None:
        """Before a finished request's blocks go in the tree (Table 1's insert), its copies of blocks
        the tree keeps on the host replace those (swap_in without a copy): the insert keeps them then,
        and the tiers' invariant (a host block has only host blocks below it) holds."""
        prefix = self.prefix
        if prefix is not None:
            bs = self.block_size_tokens
            full = min(req.num_cached, req.num_tokens) // bs
            num_shared = len(req.shared.nodes) if req.shared is not None else 0
            if full > num_shared:
                path = prefix.match(req.context()[: full * bs]).nodes
                for i in range(num_shared, len(path)):
                    if path[i].on_host:
                        self._drop_host_blocks([prefix.swap_in(path[i], req.blocks[i])])
        super()._cache_blocks(req)

    def _pool_state(self) -> PoolState:
        assert self.kv is not None
        kv_bytes = self.kv.mapped_bytes
        # The cache's host blocks are not held against it: they yield to parked KV (_make_buffer_room).
        available = (min(self.logical_buffer_bytes, self.settings.cpu_buffer_bytes)
                     - self._committed_buffer_blocks() * self.pool.block_bytes)
        return PoolState(total_bytes=self.total_bytes, kv_bytes=kv_bytes, activation_bytes=self.total_bytes - kv_bytes,
                         threshold_bytes=self._threshold_bytes, buffer_available_bytes=max(0, available))

    def _kv_bytes_after_step(self, req: Request, shared: Match[int] | None, counted: set[int] | None) -> int:
        # Its tokens and the slot of the one it samples (reserved after the step), less the cached
        # blocks on the device a request before it in the queues reads too (`counted`: charged there).
        num_blocks = blocks_for(req.num_tokens + 1, self.block_size_tokens)
        if shared is not None and counted is not None:
            for node in shared.nodes:
                if node.on_host:  # (the request gets its own copy)
                    continue
                if id(node) in counted:
                    num_blocks -= 1
                counted.add(id(node))
        return num_blocks * self.pool.block_bytes

    def _decode_demand(self, req: Request, counted: set[int] | None = None) -> Demand:
        return Demand(self._kv_bytes_after_step(req, req.shared, counted),
                      self._activation_of(req.num_tokens - req.num_cached, req.num_tokens))

    def _prefill_demand(self, req: Request, counted: set[int] | None = None) -> Demand:
        match = self._matches.get(req.request_id)
        # (A one-token prompt would read as a decode in the forward, which needs blocks; a prefill
        # after a cached prefix reads that prefix's blocks, so its KV stays in the pool.)
        offloadable = (match is None and not req.blocks and req.num_cached == 0 and req.num_tokens > 1
                       and self.settings.cpu_buffer_bytes > 0)
        num_cached = self._num_cached_at_start(req)
        return Demand(self._kv_bytes_after_step(req, match, counted),
                      self._activation_of(req.num_tokens - num_cached, req.num_tokens), offloadable)

    def _staged_bytes(self) -> int:
        return sum(len(s.blocks) for s in self.staged.values()) * self.pool.block_bytes

    def _new_blocks(self, decodes: list[Request], admitted: list[tuple[Request, Admission]]) -> int:
        bs = self.block_size_tokens
        gpu = decodes + [r for r, how in admitted if how is Admission.GPU]
        return sum(max(0, blocks_for(r.num_tokens, bs) - len(r.blocks) - self._cached_on_device(r)) for r in gpu)

    def _cached_on_device(self, req: Request) -> int:
        """Blocks of a candidate's cached prefix it will share, not allocate (those on the device)."""
        match = self._matches.get(req.request_id)
        return 0 if match is None else sum(1 for node in match.nodes if not node.on_host)

    def _evict(self, req: Request) -> None:
        """A running request leaves the pool: its KV to the CPU buffer if there is room (the cache's
        host blocks make way), else recompute."""
        written = blocks_for(req.num_cached, self.block_size_tokens)
        if written == 0 or self._copy_out is None or not self._make_buffer_room(written):
            super()._preempt(req)  # recompute: blocks freed, re-prefilled later
            return
        self._park(req, req.blocks[:written])

    def _park(self, req: Request, block_ids: list[int]) -> None:
        assert self._copy_out is not None and self.kv is not None
        # Queued on the executor now, so ahead of any later write to these blocks. All of them, the
        # cached prefix it shares too: it gives up its pin on those (they may be evicted while it
        # waits) and comes back with its whole KV in blocks of its own (`_fetch`).
        host, copy = self._copy_out(block_ids)
        self._copies_out[req.request_id] = copy
        self.kv.draining.update(dict.fromkeys(block_ids, copy))
        self.running.remove(req)
        self._free_blocks(req)
        req.parked, req.state = host, RequestState.WAITING
        self.parked.appendleft(req)
        self.num_parked += 1
        logger.debug("parked %s (%d tokens) in the CPU buffer", req.request_id, req.num_cached)

    def _make_room(self, num_blocks: int) -> None:
        """After a step, before preempting for a running request's next block: inflate (§4.3.1)."""
        kv, activations = self.kv, self.activations
        assert kv is not None and activations is not None
        want = -(-(num_blocks - len(kv.free)) // kv.blocks_per_chunk)
        grown = kv.grow(want)
        if grown < want:
            activations.reclaim(0, want - grown)
            grown += kv.grow(want - grown)
        self.inflated_chunks += grown
        # Then cached blocks nobody reads, before anything is parked or refused (module docstring).
        self._evict_cached(num_blocks - len(kv.free))

    def _preempt(self, req: Request) -> None:
        """Out of blocks after a step: park the newest running request rather than recompute it."""
        self._evict(req)

    def _build_step(self, decodes: list[Request], admitted: list[tuple[Request, Admission]], activation_bytes: int) -> Step | None:
        assert self._copy_in is not None and self._new_sink is not None
        bs = self.block_size_tokens
        running_ids = {id(r) for r in self.running}
        for req in decodes:
            if req.state is RequestState.WAITING:  # parked: fetch its KV back (line 17)
                self._fetch(req)
                req.state = RequestState.RUNNING
            if id(req) not in running_ids:
                self.running.append(req)
        entries_extra: dict[str, torch.Tensor] = {}
        for req, how in admitted:
            self.waiting.remove(req)
            if how is Admission.GPU:
                match = self._matches.pop(req.request_id, None)
                if match is not None:
                    self._start_from_cache(req, match)
                req.blocks.extend(self.pool.allocate(max(0, blocks_for(req.num_tokens, bs) - len(req.blocks))))
            else:
                # Its KV goes to the buffer: the cache's host blocks make way (Algorithm 1 counted
                # on the room without them).
                self._make_buffer_room(blocks_for(req.num_tokens, bs))
                entries_extra[req.request_id] = self._sink_of[req.request_id] = self._new_sink(req.num_tokens)
                self._offloaded_now.add(req.request_id)
                self.num_offloaded_prefills += 1
            req.state = RequestState.RUNNING
            req.admitted_seq = self._admissions
            self._admissions += 1
            self.num_prefilled_tokens += req.num_tokens - req.num_cached
            self.running.append(req)
        if not self.running:
            return None
        requests = tuple(self.running)
        self.max_batch = max(self.max_batch, len(requests))
        self._recent_activation.append(activation_bytes)
        entries = tuple(SeqBatchEntry(tuple(r.context()[r.num_cached:]), r.num_cached, tuple(r.blocks),
                                      offload_to=entries_extra.get(r.request_id)) for r in requests)
        samplings = tuple(Sampling(r.params.temperature, r.params.top_p, r.seed, r.num_tokens) for r in requests)
        return Step(requests, entries, samplings)

    def _fetch(self, req: Request) -> None:
        """A parked request comes back: blocks allocated now, its KV copied into them on the executor
        ahead of the step; a park whose copy failed is recomputed instead (nothing else is touched)."""
        assert self._copy_in is not None and req.parked is not None
        self.parked.remove(req)
        copy_out = self._copies_out.pop(req.request_id, None)
        host, req.parked = req.parked, None
        req.blocks = self.pool.allocate(blocks_for(req.num_tokens, self.block_size_tokens))
        if copy_out is not None and copy_out.done() and copy_out.exception() is not None:
            logger.warning("parking %s failed (%s): it is recomputed", req.request_id, copy_out.exception())
            req.num_cached = 0
            return
        self._copies_in[req.request_id] = self._copy_in(req.blocks[: host.shape[2]], host)
        self.num_fetched += 1

    def process(self, step: Step, tokens: list[int]) -> None:
        # A request whose KV did not come back from the buffer has computed garbage: it fails alone.
        for req in step.requests:
            copy_in = self._copies_in.pop(req.request_id, None)
            if copy_in is not None and req.state is RequestState.RUNNING and copy_in.exception() is not None:
                self.running.remove(req)
                req.queue.put_nowait(EngineError(f"fetching its KV from the CPU buffer failed: {copy_in.exception()}"))
                self.finish(req)
            # Likewise for cached blocks swapped in from the host tier (its own copies: it alone fails).
            swap_copies = self._swap_copies.pop(req.request_id, ())
            failed = next((copy.exception() for copy in swap_copies if copy.exception() is not None), None)
            if failed is not None and req.state is RequestState.RUNNING:
                self.running.remove(req)
                req.queue.put_nowait(EngineError(f"swapping its cached prefix in from the CPU buffer failed: {failed}"))
                self.finish(req)
        now = time.monotonic()
        ttft_misses = tpot_misses = 0
        ttft, tpot = self.settings.ttft_slo_s, self.settings.tpot_slo_s
        for req in step.requests:
            if req.state is not RequestState.RUNNING:
                continue
            last = self._last_token_s.get(req.request_id)
            if last is None:
                arrived = self._arrived_s.get(req.request_id, now)
                ttft_misses += ttft is not None and now - arrived > ttft
            else:
                tpot_misses += tpot is not None and now - last > tpot
            self._last_token_s[req.request_id] = now
        super().process(step, tokens)
        if self._with_slo:
            # Algorithm 2, on §4.4.2's violation events.
            ttft_event, tpot_event = self._slo_window.observe(ttft_misses, tpot_misses)
            assert self.kv is not None
            self.logical_buffer_bytes = scale_logical_buffer(
                self.logical_buffer_bytes, ttft_event=ttft_event, tpot_event=tpot_event,
                max_bytes=self.settings.cpu_buffer_bytes, min_bytes=min(self.kv.chunks.chunk_bytes, self.settings.cpu_buffer_bytes))

    def _reserve_next_slots(self) -> None:
        self._settle_offloaded()
        super()._reserve_next_slots()

    # -- eLLM §5.1: (un)mapping off the step's path ------------------------------------------------

    def overlap(self, step: Step) -> None:
        """eLLM §5.1, "Overlapping (Un)mapping Overheads", while `step` computes: the engine calls this
        right after handing the step to its executor, before it waits for the step's tokens.

        Asynchronous unmapping: the old slots that deflation left behind fences are unmapped, those
        whose fence has passed (none is waited for: a fence behind this step would hold the event loop
        until the step ends). Decoding speculative pre-mapping: "assume each sequence will produce the
        next token and proactively initiate asynchronous memory allocation in advance": the chunks
        the step after needs for those tokens are mapped now, so the reservation after this step finds
        its blocks free. Nothing here touches a slot the step may read (ElasticKVBlocks.grow)."""
        kv, activations = self.kv, self.activations
        if not self.settings.overlap_mapping or kv is None or activations is None:
            return
        maps, unmaps = self._range_calls()
        started_s = time.perf_counter()
        try:
            kv.tensor.complete_unmaps()
            activations.tensor.complete_unmaps()
            self._premap(step)
        except MapError as err:  # all or nothing: the step's path maps what it needs, as without this
            logger.warning("elastic memory: mapping ahead of the next step failed (%s)", err)
        finally:
            after_maps, after_unmaps = self._range_calls()
            self.maps_ahead += after_maps - maps
            self.unmaps_ahead += after_unmaps - unmaps
            self.overlap_calls += 1
            self.overlap_us += round(1e6 * (time.perf_counter() - started_s))

    def _premap(self, step: Step) -> None:
        kv, activations = self.kv, self.activations
        assert kv is not None and activations is not None
        bs = self.block_size_tokens
        needed = 0
        for req in step.requests:
            if req.state is not RequestState.RUNNING or req.request_id in self._offloaded_now:
                continue  # gone, or an offloaded prefill (it parks after the step)
            if len(req.output) + 1 >= req.params.max_tokens:
                continue  # this step's token is its last
            # After the step: its tokens and the one it samples now, whose KV the step after writes.
            needed += max(0, blocks_for(req.num_tokens + 1, bs) - len(req.blocks))
        short = needed - len(kv.free)
        if short <= 0:
            return
        chunk_bytes = kv.chunks.chunk_bytes
        want = min(-(-short // kv.blocks_per_chunk), max(1, PREMAP_LIMIT_BYTES // chunk_bytes))
        # FREE chunks only. Taking idle activation chunks here too (the reclaim `_make_room` does after
        # the step) made them ping-pong on an H200: the next step mapped them back for its activations,
        # on its path, with a device synchronize each time (low-load TPOT 1.27x static; docs/gpu.md).
        grown = kv.grow(want, ahead=True)
        self.inflated_chunks += grown
        self.premapped_chunks += grown

    def _range_calls(self) -> tuple[int, int]:
        kv, activations = self.kv, self.activations
        assert kv is not None and activations is not None
        return (kv.tensor.num_maps + activations.tensor.num_maps, kv.tensor.num_unmaps + activations.tensor.num_unmaps)

    @property
    def maps_on_path(self) -> int:
        """Range maps made on a step's path (between one step's tokens and the next step's start)."""
        return self._range_calls()[0] - self.maps_ahead if self.kv is not None else 0

    @property
    def unmaps_on_path(self) -> int:
        """Range unmaps made on a step's path (deferred ones done in `overlap` are not)."""
        return self._range_calls()[1] - self.unmaps_ahead if self.kv is not None else 0

    def mapping_counts(self) -> dict[str, int]:
        """eLLM §5.1's figures: range calls on and off the steps' path, and unmaps still deferred."""
        pending = 0
        if self.kv is not None and self.activations is not None:
            pending = len(self.kv.tensor.pending_slots) + len(self.activations.tensor.pending_slots)
        return {"maps_on_path": self.maps_on_path, "maps_ahead": self.maps_ahead,
                "unmaps_on_path": self.unmaps_on_path, "unmaps_ahead": self.unmaps_ahead,
                "premapped_chunks": self.premapped_chunks, "unmaps_pending": pending,
                "overlap_calls": self.overlap_calls, "overlap_us": self.overlap_us}

    def _settle_offloaded(self) -> None:
        """Offloaded prefills that go on wait parked, their KV already in the buffer (their sink)."""
        bs = self.block_size_tokens
        for req in [r for r in self.running if r.request_id in self._offloaded_now]:
            self._offloaded_now.discard(req.request_id)
            self.running.remove(req)
            sink = self._sink_of.pop(req.request_id)
            req.parked = sink.view(sink.shape[0], 2, -1, bs, *sink.shape[3:])
            req.state = RequestState.WAITING
            self.parked.append(req)
        self._offloaded_now.clear()


def _unmapped_slots(tensor: ETensor, num: int, skip: int | None = None) -> list[int]:
    """The lowest `num` slots the eTensor's books call unmapped (but `skip`), those a deferred unmap
    still holds last (mapping one waits for its fence)."""
    mapped, pending = tensor.mapped_slots, tensor.pending_slots
    slots = list(itertools.islice((slot for slot in range(tensor.num_slots)
                                   if slot not in mapped and slot not in pending and slot != skip), num))
    if len(slots) < num:
        slots += sorted(slot for slot in pending if slot != skip)[: num - len(slots)]
    return slots


def _failed(copy: Future[None]) -> bool:
    return copy.done() and copy.exception() is not None


def _drop_last(decodes: list[Request], prefills: list[Request]) -> tuple[list[Request], list[Request]]:
    """One request fewer for the next try: the newest admission, else the last decode."""
    if prefills:
        return decodes, prefills[:-1]
    return decodes[:-1], prefills
