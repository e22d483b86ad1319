"""The builtin engine: continuous batching over a paged KV cache in plain torch, with live migration.

kvfleet needs an engine whose KV blocks it can read and write to migrate running requests
(Llumnix-style staged copy, token re-prefill, or both), which upstream vLLM does not offer, and one
that runs wherever torch does (tests, the demo, CPUs). This is that engine: it keeps the `Engine`
contract of base.py exactly, and declares the KV migration capability (capabilities.py).

This module holds the engine's life cycle and its step loop; the package's docstring (builtin/__init__.py)
says which module owns each of the parts it drives.

Threads: one background asyncio task runs the steps; the torch work of a step runs in a one-thread
executor, so the event loop (shared with the HTTP server) stays responsive, and every tensor
operation (steps, KV export and import) is serialized on that thread. The step lock is held from
scheduling a step to processing its tokens, so `suspend` lands between steps.

A generate() stream that is never iterated does not register an early exit: its request runs to
completion (or until abort) and frees its KV then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Literal, TypeVar

import torch

from kvfleet.api.speed import SpeedProfile
from kvfleet.worker.elastic import ChunkPool, Fence, PhysicalMemory, QueueFence, granularity_bytes, open_memory, record_marker
from kvfleet.worker.engines.base import (
    DuplicateRequest,
    EngineConfig,
    EngineError,
    EngineInfo,
    RequestKV,
    SamplingParams,
    StepOutput,
    StructuredOutput,
    blocks_for,
)
from kvfleet.worker.engines.builtin.blocks import BLOCK_SIZE_TOKENS, BlockPool
from kvfleet.worker.engines.builtin.borrowing import BuiltinKVBorrowing, Lenders, RemotePartLost
from kvfleet.worker.engines.builtin.cpu_buffer import CpuBuffer
from kvfleet.worker.engines.builtin.elastic import ActivationChunks, ElasticKVBlocks, ElasticScheduler, ElasticSettings
from kvfleet.worker.engines.builtin.layer_kv import BuiltinLayerKV
from kvfleet.worker.engines.builtin.lending import BuiltinKVLending
from kvfleet.worker.engines.builtin.migration import BuiltinKVMigration
from kvfleet.worker.engines.builtin.model import (
    ACTIVATION_BASE_BYTES,
    LlamaArchitecture,
    LlamaForward,
    PagedKVCache,
    activation_bytes,
    block_major_shape,
    decode_workspace_bytes,
    read_architecture,
    torch_dtype,
)
from kvfleet.worker.engines.builtin.options import BuiltinOptions
from kvfleet.worker.engines.builtin.prefix import PrefixCache
from kvfleet.worker.engines.builtin.prefix_kv import BuiltinPrefixKV
from kvfleet.worker.engines.builtin.sampling import MakeConstraint, Sampled, TokenConstraint, next_tokens
from kvfleet.worker.engines.builtin.scheduler import PREFILL_TOKENS_PER_STEP, ModelLimits, RequestState, Scheduler, Step
from kvfleet.worker.engines.capabilities import EngineCapabilities, MemoryState, PrefixCacheStats
from kvfleet.worker.engines.grammar import Grammars
from kvfleet.worker.engines.speed import SpeedRecorder

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Without a capacity from the pod (tests, the bench), 64 MiB: 32k tokens of the tiny model, a few
# thousand of a 7B one; small enough for any CPU or GPU the engine runs on.
DEFAULT_KV_CAPACITY_BYTES = 64 * 1024 * 1024


class BuiltinEngine:
    """The torch engine (builtin/scheduler.py for scheduling; capabilities.py for migration)."""

    def __init__(self, config: EngineConfig, options: BuiltinOptions | None = None, *,
                 make_constraint: MakeConstraint | None = None) -> None:
        """`make_constraint` builds a structured-output request's grammar (builtin/sampling.py's
        `TokenConstraint`); by default llguidance's, from the model directory's tokenizer (grammar.py),
        loaded at the first such request."""
        self.config = config
        self._grammars: Grammars | None = None
        make_constraint = make_constraint or self._grammar_constraint
        self.options = options = options or BuiltinOptions()
        memory, distkv = options.memory, options.distkv
        self._info: EngineInfo | None = None
        self._model: LlamaForward | None = None
        self._cache: PagedKVCache | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._step_lock: asyncio.Lock | None = None
        self._elastic: ElasticScheduler | None = None
        self._memory: PhysicalMemory | None = None
        # DistKV's borrower side as the scheduler sees it (docs/distkv.md); only when configured.
        lenders = Lenders() if distkv.borrow else None
        if memory is not None and memory.elastic:
            # With prefix caching the cache is free memory of the pool, and the CPU buffer its host
            # tier (builtin/elastic.py, builtin/cpu_buffer.py).
            self._elastic = ElasticScheduler(config.max_num_seqs, BLOCK_SIZE_TOKENS, config.seed, ElasticSettings(
                threshold_bytes=0, park_decodes_for_prefill=memory.park_decodes_for_prefill,
                ttft_slo_s=memory.ttft_slo_s, tpot_slo_s=memory.tpot_slo_s, overlap_mapping=memory.overlap_mapping),
                CpuBuffer(memory.cpu_buffer_bytes, BLOCK_SIZE_TOKENS, prefix_caching=config.prefix_caching),
                make_constraint=make_constraint)
        self._sched: Scheduler = self._elastic or Scheduler(
            config.max_num_seqs, BLOCK_SIZE_TOKENS, config.seed,
            prefix=PrefixCache(BLOCK_SIZE_TOKENS) if config.prefix_caching else None, remote=lenders,
            make_constraint=make_constraint)
        # Exists from the start (capabilities are the same before and after start); `start` opens it.
        self._migration = BuiltinKVMigration(self._sched)
        self._prefix_kv = BuiltinPrefixKV(self._sched) if self._sched.prefix is not None else None
        self._layer_kv = BuiltinLayerKV(self._sched)
        # DistKV (docs/distkv.md): the lender's and the borrower's sides, each only when configured.
        if distkv.borrow and options.attention != "distattention":
            raise EngineError("borrowing KV (DistKV) needs attention 'distattention': remote KV is attended where it lives")
        if (distkv.borrow or distkv.lend_cap_bytes) and self._elastic is not None:
            raise EngineError("DistKV lending and borrowing need a static KV cache, not elastic memory")
        if distkv.lend_cap_bytes < 0:
            raise EngineError(f"the lending cap must be at least 0 bytes, not {distkv.lend_cap_bytes}")
        self._lending = BuiltinKVLending(self._sched, 0) if distkv.lend_cap_bytes else None
        self._borrowing = BuiltinKVBorrowing(self._sched, lenders, BLOCK_SIZE_TOKENS) if lenders is not None else None
        self._speed = SpeedRecorder("builtin")

    def _grammar_constraint(self, spec: StructuredOutput, output_token_ids: Sequence[int]) -> TokenConstraint:
        if self._grammars is None:
            if self._model is None:
                raise EngineError("the builtin engine is not started")
            self._grammars = Grammars(self.config.model_path, self._model.arch.vocab_size)
        return self._grammars.constraint(spec, output_token_ids)

    # -- the Engine contract -------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        if self._info is not None:
            return self._info
        config = self.config
        dtype = torch_dtype(config.dtype)
        device = torch.device(config.device)
        arch = read_architecture(config.model_path)
        max_model_len = config.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            raise EngineError(f"max_model_len {max_model_len} exceeds the model's {arch.max_position_embeddings} positions")
        kv_bytes_per_token = arch.kv_bytes_per_token(dtype)
        block_bytes = BLOCK_SIZE_TOKENS * kv_bytes_per_token
        pool = self.options.memory
        budget_bytes = None if pool is None else pool.budget_bytes
        if pool is not None and not pool.elastic:
            # The static split of the same budget: KV gets what the worst step's activations leave.
            reserve_bytes = static_activation_reserve_bytes(arch, dtype, max_model_len, config.max_num_seqs, pool.budget_bytes)
            capacity_bytes = pool.budget_bytes - reserve_bytes
            if capacity_bytes < block_bytes:
                raise EngineError(f"a memory budget of {budget_bytes} bytes leaves no KV block after the activation "
                                  f"reserve of {reserve_bytes} bytes that its largest step needs (a {max_model_len}-token prefill, or "
                                  f"{config.max_num_seqs} requests decoding at that context)")
        else:
            capacity_bytes = config.kv_capacity_bytes if config.kv_capacity_bytes is not None else DEFAULT_KV_CAPACITY_BYTES
        num_blocks = capacity_bytes // block_bytes
        if num_blocks < 1:
            raise EngineError(f"a KV capacity of {capacity_bytes} bytes holds no block of {block_bytes} bytes")
        loop = asyncio.get_running_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-builtin")
        elastic = self._elastic
        if elastic is not None:
            assert budget_bytes is not None
            memory, kv, activations = self._open_pool(budget_bytes, block_bytes, device)
            num_blocks = kv.num_blocks
            storage = kv.tensor.view(dtype, block_major_shape(arch, num_blocks, BLOCK_SIZE_TOKENS))
        else:
            storage = None

        def load() -> tuple[LlamaForward, PagedKVCache]:
            model = LlamaForward.load(config.model_path, dtype, device, max_model_len, self.options.attention)
            model.decode_workspace_bytes = decode_workspace_bytes(arch, dtype, max_model_len, BLOCK_SIZE_TOKENS,
                                                                  budget_bytes)
            return model, PagedKVCache(arch, num_blocks, BLOCK_SIZE_TOKENS, dtype, device, storage=storage)

        try:
            model, cache = await loop.run_in_executor(self._executor, load)
        except BaseException:
            self._close_pool()
            raise
        self._model, self._cache = model, cache
        limits = ModelLimits(max_model_len, model.arch.vocab_size, kv_bytes_per_token)
        if elastic is not None:
            space = elastic.attach(kv, activations,
                                   functools.partial(_activation_of, arch, dtype),
                                   ACTIVATION_BASE_BYTES + model.decode_workspace_bytes, self._copy_out, self._copy_in,
                                   self._new_sink)
            elastic.open(space, limits, frozenset(arch.eos_token_ids))
            capacity_bytes = elastic.memory_state().kv_capacity_bytes
            num_blocks = capacity_bytes // block_bytes
        else:
            self._sched.open(BlockPool(num_blocks, block_bytes), limits, frozenset(arch.eos_token_ids))
        self._step_lock = asyncio.Lock()
        self._migration.open(cache, self._executor, self._step_lock)
        if self._prefix_kv is not None:
            self._prefix_kv.open(cache, self._executor)
        self._layer_kv.open(cache, self._executor)
        if self._lending is not None:
            self._lending.open(cache, self._executor, self.options.distkv.lend_cap_bytes // block_bytes)
        if self._borrowing is not None:
            self._borrowing.open(cache, self._executor)
        self._info = EngineInfo(
            engine="builtin",
            model_path=str(config.model_path),
            max_model_len=max_model_len,
            block_size_tokens=BLOCK_SIZE_TOKENS,
            kv_bytes_per_token=kv_bytes_per_token,
            # An elastic engine's is what KV can hold when activations are at rest; it reports the
            # moving figure through `capabilities.elastic_memory`.
            kv_capacity_bytes=num_blocks * block_bytes,
            eos_token_ids=arch.eos_token_ids,
            measures_speed=True,
        )
        self._task = asyncio.create_task(self._run(), name="kvfleet-builtin-scheduler")
        logger.info("builtin engine: %s, %d KV blocks (%d bytes), max_model_len %d, %s on %s",
                    config.model_path, num_blocks, num_blocks * block_bytes, max_model_len, config.dtype, config.device)
        return self._info

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._sched.abort_all()
        executor, self._executor = self._executor, None
        if executor is not None:
            # Waits for a step that was in flight when the task was cancelled.
            await asyncio.to_thread(executor.shutdown, True)
        self._model = None
        self._cache = None
        self._migration.close()
        if self._prefix_kv is not None:
            self._prefix_kv.close()
        self._layer_kv.close()
        if self._lending is not None:
            self._lending.close()
        if self._borrowing is not None:
            self._borrowing.close()
        self._sched.close()
        self._close_pool()
        self._info = None

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the builtin engine is not started")
        return self._info

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(migration=self._migration, elastic_memory=self if self._elastic is not None else None,
                                  prefix_cache=self if self._sched.prefix is not None else None,
                                  prefix_kv=self._prefix_kv, layer_kv=self._layer_kv,
                                  lending=self._lending, borrowing=self._borrowing)

    @property
    def borrowing(self) -> BuiltinKVBorrowing | None:
        """The borrower's side, for its counters (the bench); None when the engine does not borrow."""
        return self._borrowing

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache now (capabilities.PrefixCache); only asked of an engine that caches."""
        sched = self._sched
        assert sched.prefix is not None
        stats = PrefixCacheStats(sched.num_cache_hit_tokens, sched.num_prefilled_tokens, sched.prefix.num_blocks,
                                 sched.prefix.num_evictable_blocks)
        elastic = self._elastic
        if elastic is None or not elastic.buffer.host_tier:
            return stats
        return dataclasses.replace(stats, host_blocks=sched.prefix.tree.num_host_blocks,
                                   num_swap_outs=elastic.buffer.num_swap_outs, num_swap_ins=elastic.buffer.num_swap_ins)

    def memory_state(self) -> MemoryState:
        """The elastic pool now (capabilities.ElasticMemory); only asked of an elastic engine."""
        assert self._elastic is not None
        return self._elastic.memory_state()

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler and its books (requests, KV space, prefix cache), for counters and checks that
        the `Engine` contract does not carry (benches, tests); driving it is the engine's alone."""
        return self._sched

    @property
    def elastic(self) -> ElasticScheduler | None:
        """The elastic scheduler, for its counters (the bench, metrics); None for a static engine."""
        return self._elastic

    @property
    def num_preemptions(self) -> int:
        """Requests preempted for KV blocks so far (each re-prefilled: recompute's cost)."""
        return self._sched.num_preemptions

    @property
    def num_prefilled_tokens(self) -> int:
        """Tokens prefilled so far, prompts and re-prefills after preemption or a resume."""
        return self._sched.num_prefilled_tokens

    def speed_profile(self) -> SpeedProfile | None:
        info = self._info
        if info is None:
            return None
        return self._speed.profile(info.model_path, info.kv_bytes_per_token, info.kv_capacity_bytes)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        sched = self._sched
        if sched.has(request_id):
            raise DuplicateRequest(f"request {request_id!r} is already on this engine")
        return sched.enqueue(sched.new_request(request_id, list(prompt_token_ids), [], params))

    async def abort(self, request_id: str) -> None:
        req = self._sched.get(request_id)
        if req is not None:
            self._sched.abort(req)
        self._sched.wake()

    def kv_usage(self) -> list[RequestKV]:
        if self._info is None:
            return []
        return self._sched.kv_usage()

    def num_waiting(self) -> int:
        return self._sched.num_waiting()

    def queued(self) -> list[RequestKV]:
        return self._sched.queued()

    # -- elastic memory ------------------------------------------------------------------------------

    def _open_pool(self, budget_bytes: int, block_bytes: int,
                   device: torch.device) -> tuple[PhysicalMemory, ElasticKVBlocks, ActivationChunks]:
        """The unified pool (eLLM §4.2.2): whole chunks of whole KV blocks, on the device's backend."""
        kind: Literal["host", "cuda"] = "cuda" if device.type == "cuda" else "host"
        unit = math.lcm(granularity_bytes(kind, device), block_bytes)
        assert self.options.memory is not None
        chunk_bytes = -(-self.options.memory.chunk_bytes // unit) * unit
        num_chunks = budget_bytes // chunk_bytes
        if num_chunks < 2:
            raise EngineError(f"a memory budget of {budget_bytes} bytes holds fewer than 2 chunks of {chunk_bytes} bytes")
        memory = self._memory = open_memory(kind, num_chunks, chunk_bytes, device)
        chunks = ChunkPool(num_chunks, chunk_bytes)
        # eLLM §5.1's asynchronous unmapping: with overlap_mapping, unmaps wait behind a fence.
        fence = self._fence if self.options.memory.overlap_mapping else None
        return (memory, ElasticKVBlocks(chunks, memory, block_bytes, unmap_fence=fence),
                ActivationChunks(chunks, memory, unmap_fence=fence))

    def _close_pool(self) -> None:
        memory, self._memory = self._memory, None
        if memory is not None and self._elastic is not None and self._elastic.kv is not None:
            self._elastic.kv.tensor.close()
            assert self._elastic.activations is not None
            self._elastic.activations.tensor.close()
        if memory is not None:
            memory.close()

    def _fence(self) -> Fence:
        """A fence behind every job queued on the executor so far and the device work they launched:
        a job of its own that records a CUDA event on a GPU (eLLM §5.1's asynchronous unmapping waits
        for it before it unmaps a slot those jobs may still read)."""
        executor, memory = self._executor, self._memory
        assert executor is not None and memory is not None
        return QueueFence(executor.submit(record_marker, memory.device))

    def _copy_out(self, block_ids: list[int]) -> tuple[torch.Tensor, concurrent.futures.Future[None]]:
        """Queue a copy of blocks to the CPU buffer (host memory; pinned next to a GPU)."""
        cache, executor = self._cache, self._executor
        assert cache is not None and executor is not None
        host = torch.empty((len(cache.layers), 2, len(block_ids), *cache.block_shape), dtype=cache.layers[0].dtype,
                           pin_memory=cache.layers[0].is_cuda)
        def copy() -> None:
            host.copy_(cache.read_blocks(block_ids))

        return host, executor.submit(copy)

    def _copy_in(self, block_ids: list[int], host: torch.Tensor) -> concurrent.futures.Future[None]:
        cache, executor = self._cache, self._executor
        assert cache is not None and executor is not None
        return executor.submit(cache.write_blocks, block_ids, host)

    def _new_sink(self, num_tokens: int) -> torch.Tensor:
        cache = self._cache
        assert cache is not None
        tokens = blocks_for(num_tokens, BLOCK_SIZE_TOKENS) * BLOCK_SIZE_TOKENS
        # Zeroed: the last block's slots past the prompt are masked in attention, but a mask's zero
        # weight times a NaN that uninitialized memory may hold is still NaN.
        return torch.zeros((len(cache.layers), 2, tokens, *cache.block_shape[1:]), dtype=cache.layers[0].dtype,
                           pin_memory=cache.layers[0].is_cuda)

    # -- the step loop -----------------------------------------------------------------------------

    async def _in_executor(self, fn: Callable[[], T]) -> T:
        if self._executor is None:
            raise RuntimeError("the builtin engine is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _run_step(self, step: Step) -> list[Sampled]:
        """The step on the executor; while it computes, elastic memory's (un)mapping that eLLM §5.1
        takes off the step's path (ElasticScheduler.overlap)."""
        if self._executor is None:
            raise RuntimeError("the builtin engine is not started")
        # Built here, on the loop: the watches it reads change only here (a by-layer hand-over's).
        on_layer = self._layer_kv.hook(step)
        tokens = asyncio.get_running_loop().run_in_executor(self._executor,
                                                            functools.partial(self._execute, step, on_layer))
        if self._elastic is not None:
            try:
                self._elastic.overlap(step)
            except Exception:  # the step's path maps what it needs, as it would without the overlap
                logger.exception("elastic memory: the (un)mapping overlapped with a step failed")
        return await tokens

    async def _run(self) -> None:
        sched = self._sched
        wake_event = sched.wake_event
        assert wake_event is not None and self._step_lock is not None
        while True:
            # Cleared before looking for work, so a wake-up during the step is not lost.
            wake_event.clear()
            async with self._step_lock:
                if self._borrowing is not None:
                    await self._borrowing.prepare()
                step = sched.schedule()
                started_s = time.monotonic()
                succeeded = False
                if step is not None:
                    try:
                        sampled = await self._run_step(step)
                        sched.process(step, [token for token, _ in sampled], [lp for _, lp in sampled])
                        succeeded = True
                    except RemotePartLost as err:
                        # Only that request's remote KV is gone: it is prefilled again, and the step's
                        # other requests run this step again (their KV writes are the same).
                        lost = sched.get(err.request_id)
                        if lost is not None and lost.state is RequestState.RUNNING and self._borrowing is not None:
                            logger.warning("%s; it is prefilled again", err)
                            self._borrowing.lose(lost)
                        else:  # aborted during the step: its leases went with it, which is what the step found
                            logger.info("%s (it ended during the step)", err)
                    except Exception as err:  # a failed step fails its requests, not the engine
                        logger.exception("builtin engine step failed")
                        sched.fail(step, EngineError(f"engine step failed: {err}"))
            if step is None:
                await wake_event.wait()
            else:
                # Let suspend/abort/HTTP handlers in between steps (for the rest of a paced step).
                await asyncio.sleep(max(0.0, self.config.min_step_s - (time.monotonic() - started_s)))
                if succeeded:
                    # The period up to here, pacing included: how fast the batch's requests progress.
                    # Waiting for work (or for a migration's hold on the step lock) is not the step's.
                    self._record_speed(step, time.monotonic() - started_s)

    def _record_speed(self, step: Step, step_seconds: float) -> None:
        """The step's shape as the recorder takes it: a request's KV after the step is the tokens it
        had cached plus those the step wrote; an entry of more than one new token is a prefill (a
        prompt, or a re-prefill after a preemption or a token-mode resume), all of whose tokens count."""
        context_tokens = prefill_tokens = 0
        for entry in step.entries:
            num_new = len(entry.token_ids)
            context_tokens += entry.start_position + num_new
            if num_new > 1:
                prefill_tokens += num_new
        self._speed.record_step(len(step.entries), context_tokens, prefill_tokens, step_seconds)

    def _execute(self, step: Step, on_layer: Callable[[int], None] | None = None) -> list[Sampled]:
        """The step's torch work, on the executor thread: one forward, then one token per request (and
        its logprobs, where asked); `on_layer` streams watched prompts' KV (builtin/layer_kv.py)."""
        assert self._model is not None and self._cache is not None
        return next_tokens(self._model.forward(step.entries, self._cache, on_layer=on_layer), step.samplings)


def _activation_of(arch: LlamaArchitecture, dtype: torch.dtype, new_tokens: int, context_tokens: int) -> int:
    return activation_bytes(arch, dtype, new_tokens, context_tokens, BLOCK_SIZE_TOKENS)


def static_activation_reserve_bytes(arch: LlamaArchitecture, dtype: torch.dtype, max_model_len: int,
                                    max_num_seqs: int, budget_bytes: int | None = None) -> int:
    """The activation reserve of a static split, as vLLM sizes it (a profiling run of the largest
    step): the most any step of this engine can need, a prompt of max_model_len alone, or a full
    prefill budget beside max_num_seqs - 1 decodes at the longest context (their attention in the
    decode workspace)."""
    alone = _activation_of(arch, dtype, max_model_len, max_model_len)
    prefill = min(PREFILL_TOKENS_PER_STEP, max_model_len)
    mixed = _activation_of(arch, dtype, prefill, prefill) + (max_num_seqs - 1) * _activation_of(arch, dtype, 1, max_model_len)
    workspace = decode_workspace_bytes(arch, dtype, max_model_len, BLOCK_SIZE_TOKENS, budget_bytes)
    return ACTIVATION_BASE_BYTES + workspace + max(alone, mixed)
