"""The builtin engine: continuous batching over a paged KV cache in plain torch, with live migration.

kvfleet needs an engine whose KV blocks it can read and write to migrate running requests
(Llumnix-style staged copy, token re-prefill, or both), which upstream vLLM does not offer, and one
that runs wherever torch does (tests, the demo, CPUs). This is that engine: it keeps the `Engine`
contract of base.py exactly, and adds the migration API below. The forward pass is
builtin_model.py.

Scheduling, vLLM-like:
- One background asyncio task runs the steps; the torch work of a step runs in a one-thread
  executor, so the event loop (shared with the HTTP server) stays responsive, and every tensor
  operation (steps, KV export and import) is serialized on that thread.
- Each step admits waiting requests (FIFO) while max_num_seqs and free blocks allow, prefills them
  whole (no chunking; at most PREFILL_TOKENS_PER_STEP prompt tokens a step, but always at least
  one request), and decodes every running request, all in one forward.
- After a step each continuing request holds blocks for all its tokens, including the slot of the
  token it just sampled (the next step writes it), so kv_usage() counts prompt + generated tokens
  and whole blocks, as MELL sizes requests. When blocks run out, the most recently admitted request
  is preempted: its blocks are freed and it goes back to the front of the queue, to be re-prefilled
  from prompt + generated tokens (vLLM's recompute policy; its stream sees no gap but a delay).
- Sampling: greedy at temperature 0; otherwise temperature, then top-p, then one uniform draw from
  a generator seeded by (request seed, position of the token in the sequence). The draw depends only
  on those two numbers, so a request resumed on another engine continues the same random stream,
  whether it arrives as prompt + output (a migration) or as one longer prompt (the router's resume
  after a worker died: the position of its next token is the same).
  A request without a seed gets one from the engine's RNG (seeded by EngineConfig.seed), and
  `suspend` hands it on.

Migration API (source S, destination D; all on the engines' event loops):

    # staged copy while the request keeps decoding on S (full blocks only, by default):
    kv = await S.export_kv(request_id, first_block=0)          # -> KVBlocks
    await D.import_kv(request_id, kv)                          # D allocates and fills the blocks
    kv = await S.export_kv(request_id, first_block=kv.end_block)   # ... more stages
    state = await S.suspend(request_id)                        # stop decoding, keep the KV on S
    kv = await S.export_kv(request_id, first_block=...)        # last stage, partial block included
    await D.import_kv(request_id, kv)
    stream = D.resume(request_id, state.prompt_token_ids, state.output_token_ids, state.params)
    S.release(request_id)                                      # free the KV on S

- `export_kv(request_id, first_block=0, end_block=None) -> KVBlocks`: blocks [first_block,
  end_block) of the request's block table, all layers, copied to the CPU. end_block defaults to the
  blocks that can no longer change: the full ones while the request runs, all that hold KV once it is
  suspended. A partial block may be asked for explicitly; KVBlocks.num_tokens says how many of its
  tokens are valid.
- `import_kv(request_id, kv) -> None`: allocates the blocks on D (MigrationError if they do not fit)
  and writes them. Stages must be contiguous; a stage may re-send the last (partial) block.
- `reserve_kv(request_id, num_blocks) -> None`: allocates (without writing) the staged blocks a
  stage is about to fill, so a destination refuses a stage it has no room for before any byte moves.
- `suspend(request_id) -> SuspendedRequest`: at a step boundary, stops scheduling the request and
  keeps its KV. Its generate() stream ends without a finished output (the request did not finish:
  its continuation is the stream `resume` returns). Waiting requests can be suspended too; one that
  holds no KV (queued, or preempted) can only move in token mode (export_kv raises MigrationError).
- `resume(request_id, prompt_token_ids, output_token_ids, params) -> AsyncIterator[StepOutput]`:
  continues the request; the stream yields only tokens after output_token_ids. With KV imported for
  request_id it re-prefills only the tokens the KV does not cover (KV mode: the last token; hybrid
  mode: the tail after the last block sent); without, all of prompt + output (token mode). On the
  engine where the request is suspended it continues from its own KV (rollback of a failed
  migration). Raises like generate(), before yielding anything. It takes no KV argument: what
  import_kv staged under request_id is the KV, so a resume cannot pair tokens with another's blocks.
- `release(request_id)`: frees a suspended request's KV on S, or KV imported on D for a migration
  that will not be resumed. Unknown ids are ignored.

Refusals by the migration calls raise MigrationError (an EngineError). `num_preemptions` and
`num_prefilled_tokens` count what recompute cost, for metrics and to check what a resume re-prefilled.

A generate() stream that is never iterated does not register an early exit: its request runs to
completion (or until abort) and frees its KV then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import hashlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from kvfleet.worker.engines.base import (
    DuplicateRequest,
    EngineConfig,
    EngineError,
    EngineInfo,
    FinishReason,
    RequestKV,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    kv_blocks_bytes,
)
from kvfleet.worker.engines.builtin_model import LlamaForward, PagedKVCache, SeqBatchEntry, read_model_spec, torch_dtype

logger = logging.getLogger(__name__)
T = TypeVar("T")

BLOCK_SIZE_TOKENS = 16
# Without a capacity from the pod (tests, the bench), 64 MiB: 32k tokens of the tiny model, a few
# thousand of a 7B one; small enough for any CPU or GPU the engine runs on.
DEFAULT_KV_CAPACITY_BYTES = 64 * 1024 * 1024
# Prefill is not chunked: this bounds how many prompt tokens one step adds (and so how long the
# running requests wait for their next token), except that a longer single prompt still goes alone.
PREFILL_TOKENS_PER_STEP = 2048


class MigrationError(EngineError):
    """A migration call that cannot be carried out (unknown request, wrong state, no room)."""


@dataclass(frozen=True)
class SuspendedRequest:
    """All a destination needs to continue a request, besides its KV."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    # With the seed the source used (its own choice when the client gave none).
    params: SamplingParams
    # Tokens whose K and V are in the cache: prompt + output except the last output token.
    num_cached_tokens: int


@dataclass(frozen=True)
class KVBlocks:
    """A run of one request's KV blocks, all layers: what one stage of a KV migration carries."""

    request_id: str
    first_block: int
    # Valid tokens in these blocks, from the first block's start; the last block may be partial.
    num_tokens: int
    block_size_tokens: int
    # [layers, 2 (K, V), blocks, block_size_tokens, kv_heads, head_dim], on the CPU.
    data: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])

    @property
    def end_block(self) -> int:
        """The first block after these: where the next stage starts."""
        return self.first_block + self.num_blocks

    @property
    def end_token(self) -> int:
        """Tokens covered from the start of the request up to the end of these blocks' valid tokens."""
        return self.first_block * self.block_size_tokens + self.num_tokens

    @property
    def nbytes(self) -> int:
        return int(self.data.numel() * self.data.element_size())


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SUSPENDED = "suspended"
    FINISHED = "finished"


# What a request's stream receives: an output, an error, or None when it was suspended.
_StreamItem = StepOutput | EngineError | None


@dataclass(eq=False)
class _Request:
    """The engine's mutable bookkeeping of one request (lives on the event loop only)."""

    request_id: str
    prompt: list[int]
    output: list[int]
    params: SamplingParams
    seed: int
    queue: asyncio.Queue[_StreamItem] = field(default_factory=asyncio.Queue)
    state: _State = _State.WAITING
    blocks: list[int] = field(default_factory=list)
    # Tokens whose K and V are written in `blocks`.
    num_cached: int = 0
    admitted_seq: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def context(self) -> list[int]:
        return self.prompt + self.output


@dataclass(eq=False)
class _StagedKV:
    """KV imported for a request that has not been resumed yet."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_p: float
    seed: int
    position: int  # of the token drawn: tokens before it in prompt + output


@dataclass(frozen=True)
class _Step:
    requests: tuple[_Request, ...]
    entries: tuple[SeqBatchEntry, ...]
    samplings: tuple[_Sampling, ...]


def _draw_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_token(logits: torch.Tensor, sampling: _Sampling) -> int:
    """One token from a row of float32 logits: temperature, top-p, then a seeded uniform draw.

    Inverse-CDF over the sorted distribution rather than torch.multinomial, so the result depends
    only on the probabilities and the (seed, position) draw, not on a generator's internal use.
    """
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True, stable=True)
    cumulative = sorted_probs.cumsum(0)
    # Keep the smallest prefix whose mass reaches top_p (the best token is always kept).
    kept = (cumulative - sorted_probs) < sampling.top_p
    sorted_probs = sorted_probs * kept
    cumulative = sorted_probs.cumsum(0)
    generator = torch.Generator().manual_seed(_draw_seed(sampling.seed, sampling.position))
    draw = torch.rand((), generator=generator, dtype=torch.float64).item() * cumulative[-1].item()
    index = int(torch.searchsorted(cumulative, torch.tensor([draw], dtype=cumulative.dtype), right=True).item())
    index = min(index, int(kept.sum().item()) - 1)
    return int(order[index].item())


def _blocks_for(num_tokens: int, block_size_tokens: int) -> int:
    return -(-num_tokens // block_size_tokens)


class BuiltinEngine:
    """The torch engine (see the module docstring for scheduling and the migration API)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._info: EngineInfo | None = None
        self._model: LlamaForward | None = None
        self._cache: PagedKVCache | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake_event: asyncio.Event | None = None
        self._step_lock: asyncio.Lock | None = None
        self._free_blocks: list[int] = []
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # in admission order
        self._staged: dict[str, _StagedKV] = {}
        self._admissions = 0
        self._rng = random.Random(config.seed)
        self._eos_ids: frozenset[int] = frozenset()
        # Counters for metrics and benchmarks: how much recompute preemption and re-prefill cost.
        self.num_preemptions = 0
        self.num_prefilled_tokens = 0

    # -- the Engine contract -------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        if self._info is not None:
            return self._info
        config = self.config
        dtype = torch_dtype(config.dtype)
        device = torch.device(config.device)
        spec = read_model_spec(config.model_path)
        max_model_len = config.max_model_len or spec.max_position_embeddings
        if max_model_len > spec.max_position_embeddings:
            raise EngineError(f"max_model_len {max_model_len} exceeds the model's {spec.max_position_embeddings} positions")
        kv_bytes_per_token = spec.kv_bytes_per_token(dtype)
        block_bytes = BLOCK_SIZE_TOKENS * kv_bytes_per_token
        capacity_bytes = config.kv_capacity_bytes if config.kv_capacity_bytes is not None else DEFAULT_KV_CAPACITY_BYTES
        num_blocks = capacity_bytes // block_bytes
        if num_blocks < 1:
            raise EngineError(f"a KV capacity of {capacity_bytes} bytes holds no block of {block_bytes} bytes")
        loop = asyncio.get_running_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-builtin")

        def load() -> tuple[LlamaForward, PagedKVCache]:
            model = LlamaForward.load(config.model_path, dtype, device, max_model_len)
            return model, PagedKVCache(spec, num_blocks, BLOCK_SIZE_TOKENS, dtype, device)

        self._model, self._cache = await loop.run_in_executor(self._executor, load)
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._eos_ids = frozenset(spec.eos_token_ids)
        self._wake_event = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._info = EngineInfo(
            engine="builtin",
            model_path=str(config.model_path),
            max_model_len=max_model_len,
            block_size_tokens=BLOCK_SIZE_TOKENS,
            kv_bytes_per_token=kv_bytes_per_token,
            kv_capacity_bytes=num_blocks * block_bytes,
            eos_token_ids=spec.eos_token_ids,
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
        for req in list(self._requests.values()):
            self._abort_request(req)
        for request_id in list(self._staged):
            self._release_staged(request_id)
        executor, self._executor = self._executor, None
        if executor is not None:
            # Waits for a step that was in flight when the task was cancelled.
            await asyncio.to_thread(executor.shutdown, True)
        self._model = None
        self._cache = None
        self._free_blocks = []
        self._info = None

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the builtin engine is not started")
        return self._info

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        if request_id in self._requests or request_id in self._staged:
            raise DuplicateRequest(f"request {request_id!r} is already on this engine")
        req = self._new_request(request_id, list(prompt_token_ids), [], params)
        self._requests[request_id] = req
        self._waiting.append(req)
        self._wake()
        return self._stream(req)

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._abort_request(req)
        self._wake()

    def kv_usage(self) -> list[RequestKV]:
        if self._info is None:
            return []
        block_bytes = self._info.block_size_tokens * self._info.kv_bytes_per_token
        usage = []
        for req in self._requests.values():
            if req.blocks:
                tokens = req.num_cached if req.state is _State.WAITING else req.num_tokens
                usage.append(RequestKV(req.request_id, tokens, len(req.blocks) * block_bytes))
        for request_id, staged in self._staged.items():
            if staged.blocks:
                usage.append(RequestKV(request_id, staged.num_tokens, len(staged.blocks) * block_bytes))
        return sorted(usage, key=lambda r: r.request_id)

    def num_waiting(self) -> int:
        return sum(1 for req in self._waiting if not req.blocks)

    def queued(self) -> list[RequestKV]:
        if self._info is None:
            return []
        info = self._info
        return sorted((RequestKV(req.request_id, req.num_tokens,
                                 kv_blocks_bytes(req.num_tokens, info.block_size_tokens, info.kv_bytes_per_token))
                       for req in self._waiting if not req.blocks), key=lambda r: r.request_id)

    # -- migration -----------------------------------------------------------------------------

    async def suspend(self, request_id: str) -> SuspendedRequest:
        """Stop decoding the request at the next step boundary and keep its KV (see the module docstring)."""
        assert self._step_lock is not None, "start() first"
        async with self._step_lock:
            req = self._requests.get(request_id)
            if req is None or req.state not in (_State.WAITING, _State.RUNNING):
                raise MigrationError(f"request {request_id!r} is not queued or running on this engine")
            if req.state is _State.WAITING:
                self._waiting.remove(req)
            else:
                self._running.remove(req)
            req.state = _State.SUSPENDED
            req.queue.put_nowait(None)
            self._wake()
            return SuspendedRequest(
                request_id=request_id,
                prompt_token_ids=tuple(req.prompt),
                output_token_ids=tuple(req.output),
                params=req.params,
                num_cached_tokens=req.num_cached,
            )

    async def export_kv(self, request_id: str, first_block: int = 0, end_block: int | None = None) -> KVBlocks:
        """Copy blocks [first_block, end_block) of the request's KV to the CPU (see the module docstring)."""
        req = self._requests.get(request_id)
        if req is None or not req.blocks:
            raise MigrationError(f"request {request_id!r} holds no KV on this engine")
        bs = self.info.block_size_tokens
        cached = req.num_cached
        written = _blocks_for(cached, bs)
        if end_block is None:
            # A running request keeps writing into its last, partial block: only full blocks are final.
            end_block = cached // bs if req.state is _State.RUNNING else written
        if not 0 <= first_block <= end_block <= written:
            raise MigrationError(f"blocks [{first_block}, {end_block}) of {request_id!r}: it has {written} written blocks")
        block_ids = req.blocks[first_block:end_block]
        num_tokens = max(0, min(cached, end_block * bs) - first_block * bs)
        cache = self._require_cache()
        # Queued behind any step in flight, so the copy sees every token counted in `cached`.
        data = await self._in_executor(lambda: cache.read_blocks(block_ids).cpu())
        return KVBlocks(request_id, first_block, num_tokens, bs, data)

    def reserve_kv(self, request_id: str, num_blocks: int) -> None:
        """Pre-allocate blocks [0, num_blocks) for KV about to be imported under request_id.

        A migration's destination reserves each stage's blocks before the bytes are sent, so a full
        destination refuses at once (MigrationError) instead of after the copy; `import_kv` then
        writes into the reserved blocks, and `release` frees them if the migration is abandoned.
        """
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} is already on this engine")
        self._require_cache()
        staged = self._staged.get(request_id) or _StagedKV()
        num_new = max(0, num_blocks - len(staged.blocks))
        if num_new > len(self._free_blocks):
            raise MigrationError(f"no room for {num_new} KV blocks of {request_id!r}: {len(self._free_blocks)} free")
        staged.blocks.extend(self._allocate(num_new))
        self._staged[request_id] = staged

    async def import_kv(self, request_id: str, kv: KVBlocks) -> None:
        """Allocate and fill blocks for a request about to be resumed here (see the module docstring)."""
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} is already on this engine")
        cache = self._require_cache()
        bs = self.info.block_size_tokens
        expected = (2, kv.num_blocks, *cache.block_shape)
        if kv.block_size_tokens != bs or tuple(kv.data.shape[1:]) != expected or kv.data.shape[0] != len(cache.layers):
            raise MigrationError(f"KV blocks of shape {tuple(kv.data.shape)} (block size {kv.block_size_tokens}) do not fit "
                                 f"this engine's cache ({len(cache.layers)}, {', '.join(map(str, expected))})")
        staged = self._staged.get(request_id) or _StagedKV()
        if kv.first_block > len(staged.blocks) or kv.first_block * bs > staged.num_tokens:
            raise MigrationError(f"KV of {request_id!r} from block {kv.first_block} leaves a gap: "
                                 f"{staged.num_tokens} tokens imported so far")
        num_new = max(0, kv.end_block - len(staged.blocks))
        if num_new > len(self._free_blocks):
            raise MigrationError(f"no room for {num_new} KV blocks of {request_id!r}: {len(self._free_blocks)} free")
        staged.blocks.extend(self._allocate(num_new))
        staged.num_tokens = max(staged.num_tokens, kv.end_token)
        self._staged[request_id] = staged
        block_ids = staged.blocks[kv.first_block:kv.end_block]
        await self._in_executor(lambda: cache.write_blocks(block_ids, kv.data))

    def resume(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
               params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Continue a request from its tokens and any KV held for it here (see the module docstring)."""
        own = self._requests.get(request_id)
        if own is not None and own.state is not _State.SUSPENDED:
            raise DuplicateRequest(f"request {request_id!r} is already running on this engine")
        if len(output_token_ids) >= params.max_tokens:
            raise MigrationError(f"request {request_id!r} already has all its {params.max_tokens} tokens")
        req = self._new_request(request_id, list(prompt_token_ids), list(output_token_ids), params)
        if own is not None:
            req.blocks, req.num_cached = own.blocks, own.num_cached
            own.blocks, own.state = [], _State.FINISHED
        elif request_id in self._staged:
            staged = self._staged.pop(request_id)
            req.blocks, req.num_cached = staged.blocks, staged.num_tokens
        # At least the last token is computed again: its logits give the next token.
        req.num_cached = min(req.num_cached, req.num_tokens - 1)
        self._requests[request_id] = req
        # Ahead of new requests: a migrated request is already late by its downtime.
        self._waiting.appendleft(req)
        self._wake()
        return self._stream(req)

    def release(self, request_id: str) -> None:
        """Free the KV of a suspended request, or KV imported for one (see the module docstring)."""
        req = self._requests.get(request_id)
        if req is not None:
            if req.state is not _State.SUSPENDED:
                raise MigrationError(f"request {request_id!r} is {req.state.value}: abort it instead")
            self._free(req.blocks)
            req.blocks, req.state = [], _State.FINISHED
            del self._requests[request_id]
        self._release_staged(request_id)
        self._wake()

    # -- bookkeeping -------------------------------------------------------------------------------

    def _require_cache(self) -> PagedKVCache:
        if self._cache is None:
            raise RuntimeError("the builtin engine is not started")
        return self._cache

    def _new_request(self, request_id: str, prompt: list[int], output: list[int], params: SamplingParams) -> _Request:
        info = self.info
        model = self._model
        if model is None:
            raise RuntimeError("the builtin engine is not started")
        if not prompt:
            raise EngineError("the prompt has no tokens")
        vocab_size = model.spec.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt + output):
            raise EngineError(f"token ids must be in [0, {vocab_size})")
        if len(prompt) + params.max_tokens > info.max_model_len:
            raise RequestTooLong(f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                                 f"model's context of {info.max_model_len} tokens")
        # The most KV it ever holds: every token but the last one sampled.
        most_blocks = _blocks_for(len(prompt) + params.max_tokens - 1, info.block_size_tokens)
        total_blocks = info.kv_capacity_bytes // (info.block_size_tokens * info.kv_bytes_per_token)
        if most_blocks > total_blocks:
            raise RequestTooLong(f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} need {most_blocks} KV "
                                 f"blocks; this engine has {total_blocks}")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return _Request(request_id, prompt, output, replace(params, seed=seed), seed)

    async def _stream(self, req: _Request) -> AsyncIterator[StepOutput]:
        try:
            while True:
                item = await req.queue.get()
                if item is None:  # suspended: the request goes on in the stream resume() returns
                    return
                if isinstance(item, EngineError):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # The consumer left early (or was cancelled): nobody reads this request any more.
            if req.state in (_State.WAITING, _State.RUNNING):
                self._abort_request(req)

    def _abort_request(self, req: _Request) -> None:
        if req.state is _State.FINISHED:
            return
        if req.state is _State.WAITING:
            self._waiting.remove(req)
        elif req.state is _State.RUNNING:
            self._running.remove(req)
        if req.state is not _State.SUSPENDED:  # a suspended request's stream has ended already
            req.queue.put_nowait(StepOutput(req.request_id, (), finished=True, finish_reason="abort",
                                            num_tokens=req.num_tokens))
        self._finish(req)

    def _finish(self, req: _Request) -> None:
        self._free(req.blocks)
        req.blocks = []
        req.state = _State.FINISHED
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]
        self._wake()

    def _release_staged(self, request_id: str) -> None:
        staged = self._staged.pop(request_id, None)
        if staged is not None:
            self._free(staged.blocks)

    def _allocate(self, num_blocks: int) -> list[int]:
        taken = self._free_blocks[len(self._free_blocks) - num_blocks:]
        del self._free_blocks[len(self._free_blocks) - num_blocks:]
        return taken

    def _free(self, blocks: list[int]) -> None:
        self._free_blocks.extend(blocks)

    def _wake(self) -> None:
        if self._wake_event is not None:
            self._wake_event.set()

    async def _in_executor(self, fn: Callable[[], T]) -> T:
        if self._executor is None:
            raise RuntimeError("the builtin engine is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # -- the scheduler -----------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake_event is not None and self._step_lock is not None
        while True:
            # Cleared before looking for work, so a wake-up during the step is not lost.
            self._wake_event.clear()
            async with self._step_lock:
                step = self._schedule()
                started_s = time.monotonic()
                if step is not None:
                    try:
                        tokens = await self._in_executor(functools.partial(self._execute, step))
                        self._process(step, tokens)
                    except Exception as err:  # a failed step fails its requests, not the engine
                        logger.exception("builtin engine step failed")
                        self._fail(step, EngineError(f"engine step failed: {err}"))
            if step is None:
                await self._wake_event.wait()
            else:
                # Let suspend/abort/HTTP handlers in between steps (for the rest of a paced step).
                await asyncio.sleep(max(0.0, self.config.min_step_s - (time.monotonic() - started_s)))

    def _schedule(self) -> _Step | None:
        bs = self.info.block_size_tokens
        budget_tokens = PREFILL_TOKENS_PER_STEP
        admitted: list[_Request] = []
        while self._waiting and len(self._running) + len(admitted) < self.config.max_num_seqs:
            req = self._waiting[0]
            num_new_tokens = req.num_tokens - req.num_cached
            num_new_blocks = _blocks_for(req.num_tokens, bs) - len(req.blocks)
            if num_new_blocks > len(self._free_blocks) or (admitted and num_new_tokens > budget_tokens):
                break
            self._waiting.popleft()
            req.blocks.extend(self._allocate(max(0, num_new_blocks)))
            req.state = _State.RUNNING
            req.admitted_seq = self._admissions
            self._admissions += 1
            admitted.append(req)
            budget_tokens -= num_new_tokens
            self.num_prefilled_tokens += num_new_tokens
        self._running.extend(admitted)
        if not self._running:
            return None
        requests = tuple(self._running)
        entries = tuple(SeqBatchEntry(tuple(req.context()[req.num_cached:]), req.num_cached, tuple(req.blocks))
                        for req in requests)
        samplings = tuple(_Sampling(req.params.temperature, req.params.top_p, req.seed, req.num_tokens)
                          for req in requests)
        return _Step(requests, entries, samplings)

    def _execute(self, step: _Step) -> list[int]:
        """The step's torch work, on the executor thread: one forward, then one token per request."""
        assert self._model is not None and self._cache is not None
        logits = self._model.forward(step.entries, self._cache)
        greedy = logits.argmax(dim=-1).tolist()
        return [int(greedy[i]) if s.temperature == 0 else sample_token(logits[i], s) for i, s in enumerate(step.samplings)]

    def _process(self, step: _Step, tokens: list[int]) -> None:
        for req, token in zip(step.requests, tokens):
            if req.state is not _State.RUNNING:  # aborted while the step ran
                continue
            req.num_cached = req.num_tokens
            req.output.append(token)
            reason: FinishReason | None = None
            if (token in self._eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids:
                reason = "stop"
            elif len(req.output) >= req.params.max_tokens:
                reason = "length"
            req.queue.put_nowait(StepOutput(req.request_id, (token,), finished=reason is not None,
                                            finish_reason=reason, num_tokens=req.num_tokens))
            if reason is not None:
                self._running.remove(req)
                self._finish(req)
        self._reserve_next_slots()

    def _reserve_next_slots(self) -> None:
        """Give every running request the block its next token goes to, preempting the newest if short."""
        bs = self.info.block_size_tokens
        for req in list(self._running):
            if req.state is not _State.RUNNING:  # preempted below for an older request
                continue
            num_new_blocks = _blocks_for(req.num_tokens, bs) - len(req.blocks)
            while num_new_blocks > len(self._free_blocks) and req.state is _State.RUNNING:
                self._preempt(self._running[-1])
            if req.state is _State.RUNNING and num_new_blocks > 0:
                req.blocks.extend(self._allocate(num_new_blocks))

    def _preempt(self, req: _Request) -> None:
        logger.debug("preempting %s (%d tokens) for KV blocks", req.request_id, req.num_tokens)
        self.num_preemptions += 1
        self._running.remove(req)
        self._free(req.blocks)
        req.blocks, req.num_cached, req.state = [], 0, _State.WAITING
        self._waiting.appendleft(req)

    def _fail(self, step: _Step, error: EngineError) -> None:
        for req in step.requests:
            if req.state in (_State.RUNNING, _State.WAITING):  # (waiting: preempted in the failed step)
                (self._running if req.state is _State.RUNNING else self._waiting).remove(req)
                req.queue.put_nowait(error)
                self._finish(req)
