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
decodes, instead of being recomputed (§4.3.2: builtin/cpu_buffer.py's `CpuBuffer`, which with prefix
caching is also the cache's host tier). What to run each step is Algorithm 1 and the buffer's size
Algorithm 2, both pure functions in elastic/policy.py; `ElasticScheduler` does what they
decide, through the parts it is composed of.

| piece | what it owns |
|---|---|
| `ElasticKVBlocks` | the KV eTensor and the free list of the blocks in its mapped chunks |
| `ActivationChunks` | the activation eTensor: the chunks the step's activations are charged to |
| `ElasticSpace` | the scheduler's `KVSpace` over the pool: grows by inflation, parks KV in the CPU buffer |
| `MappingOverlap` | eLLM §5.1: mapping ahead and unmapping behind fences while a step computes, its counters |
| `ElasticScheduler` | the scheduler's batch choice replaced by Algorithm 1; Algorithm 2 in `process` |

The activations themselves are allocated by torch; the pool charges them (a chunk the activation
side holds is mapped into its eTensor and the KV side cannot use it), which is what decides how much
KV a step may hold. On a GPU, placing them in those chunks would need torch's allocator to map
through the pool (eLLM patches PyTorch's caching allocator for that, §5.2); kvfleet does not.

Copies to and from the CPU buffer run on the engine's one executor thread (builtin/cpu_buffer.py).
Unmapping is not on the executor, so a chunk with a block still being copied out is not deflated
(`ElasticKVBlocks.draining`, kept by `ElasticSpace.copy_out`): an unmapped slot reads as zero.

eLLM §5.1, "Overlapping (Un)mapping Overheads" (`ElasticSettings.overlap_mapping`, on by default) keeps
mapping off a step's path. Decoding speculative pre-mapping: once a step is handed to the executor,
while it computes, `MappingOverlap.overlap` assumes every sequence in it produces its next token and
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
need. Evicted blocks go to the CPU buffer's host tier where it has room (MemServe §4.1 Table 1,
builtin/cpu_buffer.py's `HostTierPrefixCache`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable, Sequence, Set
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvfleet.serving.prompt_tree import Match
from kvfleet.worker.elastic import ChunkPool, ETensor, Fence, MapError, Owner, PhysicalMemory, PoolExhausted
from kvfleet.worker.elastic.policy import (
    Admission,
    Demand,
    PoolState,
    SloWindow,
    plan_batch,
    scale_logical_buffer,
)
from kvfleet.worker.engines.base import RequestTooLong, SamplingParams, TokenLogprobs, blocks_for
from kvfleet.worker.engines.builtin.blocks import BlockPool
from kvfleet.worker.engines.builtin.cpu_buffer import CopyIn, CopyOut, CpuBuffer, NewSink
from kvfleet.worker.engines.builtin.model import SeqBatchEntry
from kvfleet.worker.engines.builtin.sampling import MakeConstraint
from kvfleet.worker.engines.builtin.scheduler import PREFILL_TOKENS_PER_STEP, Request, RequestState, Scheduler, Step
from kvfleet.worker.engines.capabilities import MemoryState

logger = logging.getLogger(__name__)

# Activations' bytes for (new tokens, context tokens) of one sequence (model.activation_bytes).
ActivationOf = Callable[[int, int], int]
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

    def __init__(self, chunks: ChunkPool, memory: PhysicalMemory, block_bytes: int, *,
                 unmap_fence: FenceOf | None = None) -> None:
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
        self.unmap_fence = unmap_fence

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

    def __init__(self, chunks: ChunkPool, memory: PhysicalMemory, *, unmap_fence: FenceOf | None = None) -> None:
        self.chunks = chunks
        self.tensor = ETensor(chunks, memory, Owner.ACTIVATION, chunks.num_chunks)
        # As ElasticKVBlocks.unmap_fence: reclaimed chunks go to KV at once, their slots unmapped later.
        self.unmap_fence = unmap_fence

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


class ElasticSpace:
    """The `KVSpace` an elastic scheduler hands its base (builtin/blocks.py): the KV eTensor's blocks,
    grown by inflation into FREE chunks and idle activation chunks (§4.3.1), and a leaving request's
    KV parked in the CPU buffer (§4.3.2) by `park` (the buffer decides the room). Copies out of its
    blocks go through `copy_out`, which keeps their chunks mapped until they have run."""

    def __init__(self, kv: ElasticKVBlocks, activations: ActivationChunks, buffer: CpuBuffer, copy_out: CopyOut) -> None:
        self.kv, self.activations = kv, activations
        self._buffer = buffer
        self._copy_out = copy_out
        # Chunks the balloon moved to the KV side (metrics, the bench), here, in the scheduler's plan
        # and in §5.1's pre-mapping.
        self.inflated_chunks = 0

    @property
    def free(self) -> list[int]:
        return self.kv.free

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def block_bytes(self) -> int:
        return self.kv.block_bytes

    def allocate(self, num_blocks: int) -> list[int]:
        return self.kv.allocate(num_blocks)

    def release(self, block_ids: list[int]) -> None:
        self.kv.release(block_ids)

    def grow_for(self, num_blocks: int) -> None:
        """After a step, before preempting for a running request's next block: inflate (§4.3.1), into
        FREE chunks first, then into the activation side's idle ones."""
        kv, activations = self.kv, self.activations
        want = -(-(num_blocks - len(kv.free)) // kv.blocks_per_chunk)
        grown = kv.grow(want)
        if grown < want:
            activations.reclaim(0, want - grown)
            grown += kv.grow(want - grown)
        self.inflated_chunks += grown

    def park(self, request_id: str, block_ids: list[int]) -> torch.Tensor | None:
        return self._buffer.park(request_id, block_ids)

    def copy_out(self, block_ids: list[int]) -> tuple[torch.Tensor, Future[None]]:
        """The CPU buffer's copy out of blocks (parked KV, a cached block swapped out), queued on the
        executor; free or not, the blocks' chunk stays mapped until it has run (`kv.draining`)."""
        host, copy = self._copy_out(block_ids)
        self.kv.draining.update(dict.fromkeys(block_ids, copy))
        return host, copy


class MappingOverlap:
    """eLLM §5.1, "Overlapping (Un)mapping Overheads" (module docstring): the (un)mapping done while a
    step computes, and the range calls counted on and off the steps' path."""

    def __init__(self, space: ElasticSpace, block_size_tokens: int, *, enabled: bool) -> None:
        self.space = space
        self.block_size_tokens = block_size_tokens
        self.enabled = enabled
        # The eTensors' range calls made while a step computed (`overlap`), and chunks pre-mapped
        # there; the rest of the range calls ran on a step's path (`maps_on_path`).
        self.maps_ahead = 0
        self.unmaps_ahead = 0
        self.premapped_chunks = 0
        # Wall time spent in `overlap` (on the event loop, while the executor runs the step).
        self.overlap_calls = 0
        self.overlap_us = 0

    def overlap(self, step: Step, offloaded: Set[str]) -> None:
        """eLLM §5.1 while `step` computes: the engine calls this (through `ElasticScheduler.overlap`)
        right after handing the step to its executor, before it waits for the step's tokens.
        `offloaded`: the step's prefills whose KV goes to the CPU buffer (they park after it).

        Asynchronous unmapping: the old slots that deflation left behind fences are unmapped, those
        whose fence has passed (none is waited for: a fence behind this step would hold the event loop
        until the step ends). Decoding speculative pre-mapping: "assume each sequence will produce the
        next token and proactively initiate asynchronous memory allocation in advance": the chunks
        the step after needs for those tokens are mapped now, so the reservation after this step finds
        its blocks free. Nothing here touches a slot the step may read (ElasticKVBlocks.grow)."""
        if not self.enabled:
            return
        space = self.space
        maps, unmaps = self._range_calls()
        started_s = time.perf_counter()
        try:
            space.kv.tensor.complete_unmaps()
            space.activations.tensor.complete_unmaps()
            self._premap(step, offloaded)
        except MapError as err:  # all or nothing: the step's path maps what it needs, as without this
            logger.warning("elastic memory: mapping ahead of the next step failed (%s)", err)
        finally:
            after_maps, after_unmaps = self._range_calls()
            self.maps_ahead += after_maps - maps
            self.unmaps_ahead += after_unmaps - unmaps
            self.overlap_calls += 1
            self.overlap_us += round(1e6 * (time.perf_counter() - started_s))

    def _premap(self, step: Step, offloaded: Set[str]) -> None:
        kv = self.space.kv
        bs = self.block_size_tokens
        needed = 0
        for req in step.requests:
            if req.state is not RequestState.RUNNING or req.request_id in offloaded:
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
        # FREE chunks only. Taking idle activation chunks here too (the reclaim `ElasticSpace.grow_for` does after
        # the step) made them ping-pong on an H200: the next step mapped them back for its activations,
        # on its path, with a device synchronize each time (low-load TPOT 1.27x static; docs/gpu.md).
        grown = kv.grow(want, ahead=True)
        self.space.inflated_chunks += grown
        self.premapped_chunks += grown

    def _range_calls(self) -> tuple[int, int]:
        kv, activations = self.space.kv.tensor, self.space.activations.tensor
        return (kv.num_maps + activations.num_maps, kv.num_unmaps + activations.num_unmaps)

    @property
    def maps_on_path(self) -> int:
        """Range maps made on a step's path (between one step's tokens and the next step's start)."""
        return self._range_calls()[0] - self.maps_ahead

    @property
    def unmaps_on_path(self) -> int:
        """Range unmaps made on a step's path (deferred ones done in `overlap` are not)."""
        return self._range_calls()[1] - self.unmaps_ahead

    def mapping_counts(self) -> dict[str, int]:
        """eLLM §5.1's figures: range calls on and off the steps' path, and unmaps still deferred."""
        pending = len(self.space.kv.tensor.pending_slots) + len(self.space.activations.tensor.pending_slots)
        return {"maps_on_path": self.maps_on_path, "maps_ahead": self.maps_ahead,
                "unmaps_on_path": self.unmaps_on_path, "unmaps_ahead": self.unmaps_ahead,
                "premapped_chunks": self.premapped_chunks, "unmaps_pending": pending,
                "overlap_calls": self.overlap_calls, "overlap_us": self.overlap_us}


# `mapping_counts` of an engine not started yet: nothing mapped, on the path or off it.
NO_MAPPING_COUNTS = {"maps_on_path": 0, "maps_ahead": 0, "unmaps_on_path": 0, "unmaps_ahead": 0,
                     "premapped_chunks": 0, "unmaps_pending": 0, "overlap_calls": 0, "overlap_us": 0}


@dataclass(frozen=True)
class ElasticSettings:
    """The worker's elastic-memory settings (EngineConfig), in the units the scheduler uses (the CPU
    buffer's size is its part's, `CpuBuffer.capacity_bytes`)."""

    threshold_bytes: int
    park_decodes_for_prefill: bool = True
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    # eLLM §5.1: map ahead while a step computes, unmap behind fences (module docstring).
    overlap_mapping: bool = True


class ElasticScheduler(Scheduler):
    """The builtin scheduler with eLLM's memory: Algorithm 1 picks each step's batch over one pool
    (`schedule`), Algorithm 2 sizes the CPU buffer's logical share (`process`) (module docstring). The
    request state machine, admission, preemption and the prefix cache's calls are the base
    scheduler's. It is composed of the `CpuBuffer` it is built with (parked KV, offloaded prefills'
    sinks, and the prefix cache's host tier, whose `HostTierPrefixCache` it opens the base with), and,
    once the engine has started (`attach`), the `ElasticSpace` over the pool and §5.1's `MappingOverlap`."""

    def __init__(self, max_num_seqs: int, block_size_tokens: int, seed: int | None, settings: ElasticSettings,
                 buffer: CpuBuffer, *, make_constraint: MakeConstraint | None = None) -> None:
        # The prefix cache, if any, lives in the same pool, with the CPU buffer as its host tier;
        # requests, their sampling and their grammars (`make_constraint`) are the base's.
        super().__init__(max_num_seqs, block_size_tokens, seed, prefix=buffer.cache, make_constraint=make_constraint)
        self.settings = settings
        self.buffer = buffer
        self.kv: ElasticKVBlocks | None = None
        self.elastic_space: ElasticSpace | None = None
        self.activations: ActivationChunks | None = None
        self.mapping: MappingOverlap | None = None
        self._activation_of: ActivationOf = lambda new, context: 0
        self._base_activation_bytes = 0
        self._threshold_bytes = settings.threshold_bytes
        # Offloaded prefills of the step in flight (their KV goes to the buffer; they park after it).
        self._offloaded_now: set[str] = set()
        # Algorithm 2's logical buffer: the whole buffer without objectives (nothing to trade), one
        # chunk to start with them (the paper's initial 1).
        with_slo = settings.ttft_slo_s is not None or settings.tpot_slo_s is not None
        self.logical_buffer_bytes = buffer.capacity_bytes
        self._with_slo = with_slo
        self._slo_window = SloWindow()
        self._arrived_s: dict[str, float] = {}
        self._last_token_s: dict[str, float] = {}
        self._recent_activation: collections.deque[int] = collections.deque(maxlen=CAPACITY_WINDOW_STEPS)
        # Counters (metrics, the bench): prefills admitted offloaded, chunks the balloon moved to the
        # activation side (`inflated_chunks`: back); parked requests are `num_parked`, fetched ones the
        # buffer's `num_fetched`.
        self.num_offloaded_prefills = 0
        self.deflated_chunks = 0
        self.max_batch = 0
        # The waiting requests' cached prefixes while a step is planned (pinned, so making room cannot
        # take them).
        self._matches: dict[str, Match[int]] = {}

    def attach(self, kv: ElasticKVBlocks, activations: ActivationChunks, activation_of: ActivationOf,
               base_activation_bytes: int, copy_out: CopyOut, copy_in: CopyIn, new_sink: NewSink) -> ElasticSpace:
        """Take the started engine's pool and the tensor work the CPU buffer queues; the space to `open`.

        `copy_out`, `copy_in` and `new_sink` are the buffer's (`CpuBuffer.open`); `copy_out` reaches it
        through the space, which keeps the blocks' chunks mapped until a copy out of them has run.
        With `overlap_mapping`, the pool's eTensors were built with a fence to unmap behind.
        """
        self.kv, self.activations = kv, activations
        space = self.elastic_space = ElasticSpace(kv, activations, self.buffer, copy_out)
        self.mapping = MappingOverlap(space, self.block_size_tokens, enabled=self.settings.overlap_mapping)
        self._activation_of, self._base_activation_bytes = activation_of, base_activation_bytes
        self.buffer.open(kv.block_bytes, self.requests, space.copy_out, copy_in, new_sink)
        if self._with_slo:
            self.logical_buffer_bytes = min(kv.chunks.chunk_bytes, self.buffer.capacity_bytes)
        # Algorithm 1 counts bytes; the pool hands out chunks, and each side may round up by one.
        self._threshold_bytes = self.settings.threshold_bytes + 2 * kv.chunks.chunk_bytes
        return space

    @property
    def inflated_chunks(self) -> int:
        """Chunks the balloon moved to the KV side so far (inflation, §4.3.1)."""
        return self.elastic_space.inflated_chunks if self.elastic_space is not None else 0

    def overlap(self, step: Step) -> None:
        """eLLM §5.1's (un)mapping while `step` computes (`MappingOverlap.overlap`); the engine calls it
        right after handing the step to its executor."""
        if self.mapping is not None:
            self.mapping.overlap(step, self._offloaded_now)

    def mapping_counts(self) -> dict[str, int]:
        """eLLM §5.1's figures (`MappingOverlap.mapping_counts`)."""
        return self.mapping.mapping_counts() if self.mapping is not None else dict(NO_MAPPING_COUNTS)

    # -- memory figures -------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        assert self.kv is not None
        return self.kv.chunks.num_chunks * self.kv.chunks.chunk_bytes

    def memory_state(self) -> MemoryState:
        if self.kv is None or self.activations is None:
            return MemoryState(0, 0, self.buffer.capacity_bytes, 0, 0)
        # What KV can count on: the pool less θ and the largest activation of the recent steps.
        chunk_bytes = self.kv.chunks.chunk_bytes
        resting = -(-self._base_activation_bytes // chunk_bytes) * chunk_bytes  # what any step holds
        recent = max(self._recent_activation, default=resting)
        capacity = self.total_bytes - self._threshold_bytes - recent
        capacity = max(self.space.block_bytes, capacity // self.space.block_bytes * self.space.block_bytes)
        return MemoryState(kv_capacity_bytes=capacity, cpu_buffer_bytes=self.buffer.held_bytes(),
                           cpu_buffer_capacity_bytes=self.buffer.capacity_bytes,
                           activation_bytes=self.activations.held_chunks * chunk_bytes,
                           budget_bytes=self.total_bytes)

    # -- requests ---------------------------------------------------------------------------------

    def new_request(self, request_id: str, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
        req = super().new_request(request_id, prompt, output, params)
        # Beyond the KV check: its prefill's activations (with its KV offloaded to the CPU buffer, or
        # in the pool when the buffer cannot take it all) and its last decode (KV in the pool) must
        # each fit the pool, or it would wait forever.
        most_tokens = len(prompt) + params.max_tokens
        most_kv = blocks_for(most_tokens, self.block_size_tokens) * self.space.block_bytes
        room = self.total_bytes - self._threshold_bytes - self._base_activation_bytes
        context = len(prompt) + len(output)
        prompt_kv = blocks_for(context, self.block_size_tokens) * self.space.block_bytes
        prefill = (self._activation_of(context, context)
                   + (prompt_kv if prompt_kv > self.buffer.capacity_bytes else 0))
        decode = most_kv + self._activation_of(1, most_tokens)
        if max(prefill, decode) > room:
            raise RequestTooLong(f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} need "
                                 f"{max(prefill, decode)} bytes of KV and activations at once; this engine's "
                                 f"memory pool has {room}")
        self._arrived_s[request_id] = time.monotonic()
        return req

    def finish(self, req: Request) -> None:
        super().finish(req)
        self.buffer.forget(req.request_id)
        self._arrived_s.pop(req.request_id, None)
        self._last_token_s.pop(req.request_id, None)
        self._offloaded_now.discard(req.request_id)

    # -- steps ----------------------------------------------------------------------------------

    def schedule(self) -> Step | None:
        """Algorithm 1 over the running and parked requests, then the waiting ones; the batch's
        memory made real (chunks mapped each way, KV parked and fetched); None when nothing runs."""
        kv, activations, space = self.kv, self.activations, self.elastic_space
        assert kv is not None and activations is not None and space is not None
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
            self.evict(req)
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
            space.inflated_chunks += grown
            if grown >= want:
                continue
            # Then cached blocks nobody reads (swapped out to the host tier where it has room), and
            # only then does the batch shrink (MemServe keeps history only in memory nothing else needs).
            if self.evict_cached(needed - len(kv.free)) > 0:
                continue
            if admitted:
                dropped, _ = admitted.pop()
                act_bytes -= self._prefill_demand(dropped).activation_bytes
                self._release_match(dropped.request_id)
            elif batch_decodes:
                victim = batch_decodes.pop()
                act_bytes -= self._decode_demand(victim).activation_bytes
                if victim.state is RequestState.RUNNING:
                    self.evict(victim)
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
        """Find and lock the cached prefix a request about to be prefilled from scratch can start from,
        for the step's plan (`_matches`)."""
        match = self.match_prefix(req)
        if match is not None:
            self._matches[req.request_id] = match

    def _release_match(self, request_id: str) -> None:
        match = self._matches.pop(request_id, None)
        if match is not None and self.prefix is not None:
            self.prefix.unlock(match)

    def _num_cached_at_start(self, req: Request) -> int:
        match = self._matches.get(req.request_id)
        return match.num_tokens if match is not None else req.num_cached


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
            if need <= 0 or not self.evict_cached(need * kv.blocks_per_chunk):
                return unmapped
            concurrent.futures.wait([copy for copy in kv.draining.values() if not copy.done()])
            unmapped += kv.shrink(need)

    def _pool_state(self) -> PoolState:
        assert self.kv is not None
        kv_bytes = self.kv.mapped_bytes
        # The cache's host blocks are not held against it: they yield to parked KV (CpuBuffer.make_room).
        available = (min(self.logical_buffer_bytes, self.buffer.capacity_bytes)
                     - self.buffer.committed_blocks() * self.space.block_bytes)
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
        return num_blocks * self.space.block_bytes

    def _decode_demand(self, req: Request, counted: set[int] | None = None) -> Demand:
        return Demand(self._kv_bytes_after_step(req, req.shared, counted),
                      self._activation_of(req.num_tokens - req.num_cached, req.num_tokens))

    def _prefill_demand(self, req: Request, counted: set[int] | None = None) -> Demand:
        match = self._matches.get(req.request_id)
        # (A one-token prompt would read as a decode in the forward, which needs blocks; a prefill
        # after a cached prefix reads that prefix's blocks, so its KV stays in the pool.)
        offloadable = (match is None and not req.blocks and req.num_cached == 0 and req.num_tokens > 1
                       and self.buffer.capacity_bytes > 0)
        num_cached = self._num_cached_at_start(req)
        return Demand(self._kv_bytes_after_step(req, match, counted),
                      self._activation_of(req.num_tokens - num_cached, req.num_tokens), offloadable)

    def _staged_bytes(self) -> int:
        return sum(len(s.blocks) for s in self.staged.values()) * self.space.block_bytes

    def _new_blocks(self, decodes: list[Request], admitted: list[tuple[Request, Admission]]) -> int:
        bs = self.block_size_tokens
        gpu = decodes + [r for r, how in admitted if how is Admission.GPU]
        return sum(max(0, blocks_for(r.num_tokens, bs) - len(r.blocks) - self._cached_on_device(r)) for r in gpu)

    def _cached_on_device(self, req: Request) -> int:
        """Blocks of a candidate's cached prefix it will share, not allocate (those on the device)."""
        match = self._matches.get(req.request_id)
        return 0 if match is None else sum(1 for node in match.nodes if not node.on_host)

    def _build_step(self, decodes: list[Request], admitted: list[tuple[Request, Admission]], activation_bytes: int) -> Step | None:
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
            if how is Admission.GPU:
                match = self._matches.pop(req.request_id, None)
                held = len(match.nodes) if match is not None else len(req.blocks)
                self.admit(req, blocks_for(req.num_tokens, bs) - held, match)
                continue
            # Its KV goes to the buffer: the cache's host blocks make way (Algorithm 1 counted on the
            # room without them).
            entries_extra[req.request_id] = self.buffer.offload(req.request_id, req.num_tokens)
            self._offloaded_now.add(req.request_id)
            self.num_offloaded_prefills += 1
            self.admit(req, 0)
        if not self.running:
            return None
        requests = tuple(self.running)
        self.max_batch = max(self.max_batch, len(requests))
        self._recent_activation.append(activation_bytes)
        entries = tuple(SeqBatchEntry(tuple(r.context()[r.num_cached:]), r.num_cached, tuple(r.blocks),
                                      offload_to=entries_extra.get(r.request_id)) for r in requests)
        return Step(requests, entries, tuple(self.sampling(r) for r in requests))

    def _fetch(self, req: Request) -> None:
        """A parked request comes back (line 17): blocks allocated now, its KV copied into them on the
        executor ahead of the step (the buffer's `fetch`); a park whose copy failed is recomputed
        instead (nothing else is touched)."""
        assert req.parked is not None
        self.parked.remove(req)
        host, req.parked = req.parked, None
        req.blocks = self.space.allocate(blocks_for(req.num_tokens, self.block_size_tokens))
        if not self.buffer.fetch(req.request_id, host, req.blocks):
            req.num_cached = 0

    def process(self, step: Step, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs | None] = ()) -> None:
        # A request whose KV did not come back from the buffer (parked KV, or cached blocks swapped in
        # from the host tier: its own copies) has computed garbage: it fails alone.
        buffer = self.buffer
        for req in step.requests:
            error = buffer.copy_error(req.request_id)
            if error is not None and req.state is RequestState.RUNNING:
                self.running.remove(req)
                req.queue.put_nowait(error)
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
        self.deliver(step, tokens, logprobs)
        self._settle_offloaded()
        self.reserve_next_slots()
        if self._with_slo:
            # Algorithm 2, on §4.4.2's violation events.
            ttft_event, tpot_event = self._slo_window.observe(ttft_misses, tpot_misses)
            assert self.kv is not None
            capacity = buffer.capacity_bytes
            self.logical_buffer_bytes = scale_logical_buffer(
                self.logical_buffer_bytes, ttft_event=ttft_event, tpot_event=tpot_event,
                max_bytes=capacity, min_bytes=min(self.kv.chunks.chunk_bytes, capacity))

    def _settle_offloaded(self) -> None:
        """Offloaded prefills that go on wait parked, their KV already in the buffer (their sink)."""
        for req in [r for r in self.running if r.request_id in self._offloaded_now]:
            self._offloaded_now.discard(req.request_id)
            self.running.remove(req)
            req.parked = self.buffer.take_sink(req.request_id)
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


def _drop_last(decodes: list[Request], prefills: list[Request]) -> tuple[list[Request], list[Request]]:
    """One request fewer for the next try: the newest admission, else the last decode."""
    if prefills:
        return decodes, prefills[:-1]
    return decodes[:-1], prefills
