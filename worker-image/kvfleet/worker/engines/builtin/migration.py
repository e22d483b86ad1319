"""The builtin engine's `KVMigratable` capability: export, reserve, import, suspend, resume, release.

capabilities.py documents the calls and their contract; this module is how the builtin engine keeps
it, apart from the scheduling it builds on (builtin/scheduler.py). What it means here:
- A stage's blocks are copied through the engine's one-thread executor, queued behind any step in
  flight, so an export sees every token the request has cached.
- KV imported or reserved for a request is held apart ("staged") until `resume` takes it; it counts
  in kv_usage() under the request's id, as MELL must see it.
- A resumed request goes to the front of the queue: a migrated request is already late.

Refusals raise MigrationError (an EngineError). `BuiltinKVMigration` is an object of its own, not
part of the engine, so that the feature is what `engine.capabilities.migration` hands out and
nothing else: it is given the scheduler at construction, and the cache, the executor and the step
lock when the engine starts (`open`), and it sees nothing else of the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from kvfleet.worker.engines.base import DuplicateRequest, SamplingParams, StepOutput, blocks_for
from kvfleet.worker.engines.builtin.blocks import StagedKV
from kvfleet.worker.engines.builtin.model import PagedKVCache
from kvfleet.worker.engines.builtin.scheduler import RequestState, Scheduler
from kvfleet.worker.engines.capabilities import KVBlocks, KVFormat, MigrationError, SuspendedRequest

T = TypeVar("T")


class BuiltinKVMigration:
    """The KVMigratable calls over a builtin engine's scheduler, cache, executor and step lock."""

    def __init__(self, sched: Scheduler) -> None:
        # Built with the engine, so `engine.capabilities` is the same before and after start (base.py);
        # calls that need the cache refuse until `open`, as the engine's own calls do.
        self._sched = sched
        self._cache: PagedKVCache | None = None
        self._executor: concurrent.futures.Executor | None = None
        self._step_lock: asyncio.Lock | None = None

    def open(self, cache: PagedKVCache, executor: concurrent.futures.Executor, step_lock: asyncio.Lock) -> None:
        """Take a started engine's cache, its one-thread executor (all tensor work) and its step lock."""
        self._cache = cache
        self._executor = executor
        self._step_lock = step_lock

    def close(self) -> None:
        """Let go of a stopped engine's cache and executor.

        The step lock stays, as it does on the engine: a suspend after stop finds no request and
        refuses with MigrationError (the engine aborted them all).
        """
        self._cache = None
        self._executor = None

    def _require_cache(self) -> PagedKVCache:
        if self._cache is None:
            raise RuntimeError("the builtin engine is not started")
        return self._cache

    async def _in_executor(self, fn: Callable[[], T]) -> T:
        if self._executor is None:
            raise RuntimeError("the builtin engine is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def resume_notes(self, request_id: str) -> list[str]:
        return []  # imported KV is written before resume, or the import refused

    def kv_format(self) -> KVFormat:
        """Its cache's layout; blocks of its own size only (capabilities.KVFormat)."""
        cache = self._require_cache()
        block_size, heads, head_dim = cache.block_shape
        return KVFormat(len(cache.layers), heads, head_dim, str(cache.layers[0].dtype).removeprefix("torch."), block_size)

    async def suspend(self, request_id: str) -> SuspendedRequest:
        """Stop decoding the request at the next step boundary and keep its KV (see KVMigratable in capabilities.py)."""
        assert self._step_lock is not None, "start() first"
        sched = self._sched
        async with self._step_lock:
            req = sched.get(request_id)
            if req is None or req.state not in (RequestState.WAITING, RequestState.RUNNING):
                raise MigrationError(f"request {request_id!r} is not queued or running on this engine")
            if req.spans:
                # Its KV lives on several workers (DistKV): no one target holds it, and the operator
                # orders no move for it (docs/distkv.md).
                raise MigrationError(f"request {request_id!r} borrows KV from other workers and is not moved")
            sched.detach(req)
            req.state = RequestState.SUSPENDED
            req.queue.put_nowait(None)
            sched.wake()
            return SuspendedRequest(
                request_id=request_id,
                prompt_token_ids=tuple(req.prompt),
                output_token_ids=tuple(req.output),
                params=req.params,
                num_cached_tokens=req.num_cached,
            )

    async def export_kv(self, request_id: str, first_block: int = 0, end_block: int | None = None) -> KVBlocks:
        """Copy blocks [first_block, end_block) of the request's KV to the CPU (see KVMigratable in capabilities.py)."""
        req = self._sched.get(request_id)
        if req is None or not (req.blocks or req.parked is not None):
            raise MigrationError(f"request {request_id!r} holds no KV on this engine")
        bs = self._sched.block_size_tokens
        cached = req.num_cached
        written = blocks_for(cached, bs)
        if end_block is None:
            # A running request keeps writing into its last, partial block: only full blocks are final.
            end_block = cached // bs if req.state is RequestState.RUNNING else written
        if not 0 <= first_block <= end_block <= written:
            raise MigrationError(f"blocks [{first_block}, {end_block}) of {request_id!r}: it has {written} written blocks")
        block_ids = req.blocks[first_block:end_block]
        num_tokens = max(0, min(cached, end_block * bs) - first_block * bs)
        cache = self._require_cache()
        parked = req.parked
        # Queued behind any step in flight, so the copy sees every token counted in `cached` (and
        # behind the copy that parks a request's KV in the CPU buffer, which is queued the same way).
        if parked is not None:
            data = await self._in_executor(lambda: parked[:, :, first_block:end_block].clone())
        else:
            data = await self._in_executor(lambda: cache.read_blocks(block_ids).cpu())
        return KVBlocks(request_id, first_block, num_tokens, bs, data)

    def reserve_kv(self, request_id: str, num_blocks: int) -> None:
        """Pre-allocate blocks [0, num_blocks) for KV about to be imported under request_id.

        A migration's destination reserves each stage's blocks before the bytes are sent, so a full
        destination refuses at once (MigrationError) instead of after the copy; `import_kv` then
        writes into the reserved blocks, and `release` frees them if the migration is abandoned.
        """
        if self._sched.get(request_id) is not None:
            raise DuplicateRequest(f"request {request_id!r} is already on this engine")
        self._require_cache()
        self._stage_blocks(request_id, num_blocks)

    async def import_kv(self, request_id: str, kv: KVBlocks) -> None:
        """Allocate and fill blocks for a request about to be resumed here (see KVMigratable in capabilities.py)."""
        sched = self._sched
        if sched.get(request_id) is not None:
            raise DuplicateRequest(f"request {request_id!r} is already on this engine")
        cache = self._require_cache()
        bs = sched.block_size_tokens
        expected = (2, kv.num_blocks, *cache.block_shape)
        if kv.block_size_tokens != bs or tuple(kv.data.shape[1:]) != expected or kv.data.shape[0] != len(cache.layers):
            raise MigrationError(f"KV blocks of shape {tuple(kv.data.shape)} (block size {kv.block_size_tokens}) do not fit "
                                 f"this engine's cache ({len(cache.layers)}, {', '.join(map(str, expected))})")
        staged = sched.staged_kv(request_id) or StagedKV()
        if kv.first_block > len(staged.blocks) or kv.first_block * bs > staged.num_tokens:
            raise MigrationError(f"KV of {request_id!r} from block {kv.first_block} leaves a gap: "
                                 f"{staged.num_tokens} tokens imported so far")
        staged = self._stage_blocks(request_id, kv.end_block)
        staged.num_tokens = max(staged.num_tokens, kv.end_token)
        # Blocks staged from this worker's prefix cache hold the same KV and are the cache's: never written.
        skip = max(0, min(staged.num_shared, kv.end_block) - kv.first_block)
        block_ids = staged.blocks[kv.first_block + skip:kv.end_block]
        if block_ids:
            data = kv.data[:, :, skip:]
            await self._in_executor(lambda: cache.write_blocks(block_ids, data))

    def _stage_blocks(self, request_id: str, num_blocks: int) -> StagedKV:
        """Grow the request's staged KV to at least `num_blocks` blocks, or refuse if they are not free."""
        sched = self._sched
        staged = sched.stage(request_id, num_blocks)
        if staged is None:
            held = sched.staged_kv(request_id)
            num_new = num_blocks - (len(held.blocks) if held is not None else 0)
            raise MigrationError(f"no room for {num_new} KV blocks of {request_id!r}: {sched.num_free_blocks} free")
        return staged

    def resume(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
               params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Continue a request from its tokens and any KV held for it here (see KVMigratable in capabilities.py)."""
        sched = self._sched
        own = sched.get(request_id)
        if own is not None and own.state is not RequestState.SUSPENDED:
            raise DuplicateRequest(f"request {request_id!r} is already running on this engine")
        if len(output_token_ids) >= params.max_tokens:
            raise MigrationError(f"request {request_id!r} already has all its {params.max_tokens} tokens")
        # Its sampling state is its tokens: penalties and min_tokens count them, and its grammar (structured
        # output) is built here by replaying the output tokens through it (Scheduler.new_request).
        req = sched.new_request(request_id, list(prompt_token_ids), list(output_token_ids), params)
        if own is not None:
            req.blocks, req.num_cached, req.parked, req.shared = own.blocks, own.num_cached, own.parked, own.shared
            own.blocks, own.parked, own.shared, own.state = [], None, None, RequestState.FINISHED
        elif (staged := sched.take_staged(request_id)) is not None:
            # Blocks it starts from the prefix cache (PrefixKV.stage_prefix) stay locked for it as shared.
            req.blocks, req.num_cached, req.shared = staged.blocks, staged.num_tokens, staged.shared
            # Its imported prompt goes in the cache now, as a prompt prefilled here would (MemServe's
            # transfer_with_insert): a request with the same prompt arriving while it runs shares it.
            sched.share_prompt(req)
        # At least the last token is computed again: its logits give the next token.
        req.num_cached = min(req.num_cached, req.num_tokens - 1)
        # Ahead of new requests: a migrated request is already late by its downtime.
        return sched.enqueue(req, front=True)

    def release(self, request_id: str) -> None:
        """Free the KV of a suspended request, or KV imported for one (see KVMigratable in capabilities.py)."""
        sched = self._sched
        req = sched.get(request_id)
        if req is not None:
            if req.state is not RequestState.SUSPENDED:
                raise MigrationError(f"request {request_id!r} is {req.state.value}: abort it instead")
            sched.finish(req)
        sched.release_staged(request_id)
        sched.wake()
