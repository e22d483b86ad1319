"""The builtin engine's batch scheduler: its requests, their queues and blocks, and what each step runs.

Everything here runs on the event loop and touches no tensor (the engine, engine.py, runs the
step's torch work on its own thread between `schedule` and `process`), so the request state machine
can be read and tested apart from the model. Scheduling is vLLM-like:
- Each step admits waiting requests (FIFO) while max_num_seqs and free blocks allow, prefills them
  whole (no chunking; at most PREFILL_TOKENS_PER_STEP prompt tokens a step, but always at least
  one request), and decodes every running request, all in one forward.
- After a step each continuing request holds blocks for all its tokens, including the slot of the
  token it just sampled (the next step writes it), so kv_usage() counts prompt + generated tokens
  and whole blocks, as MELL sizes requests. When blocks run out, the most recently admitted request
  is preempted: its blocks are freed and it goes back to the front of the queue, to be re-prefilled
  from prompt + generated tokens (vLLM's recompute policy; its stream sees no gap but a delay).
- DistKV (Infinite-LLM §4.3, docs/distkv.md): a request larger than the whole local cache may still
  be admitted when other workers can lend the difference (the `RemoteKVHooks` it is built with). Such a request
  `spans`: it is prefilled in chunks that fit its local blocks, and before each step the engine's
  borrowing side (builtin/borrowing.py) moves its oldest full blocks into blocks lent elsewhere
  (`remote`), so its local blocks always hold its newest tokens. It is never preempted for others
  (its remote KV would be lost); a request short of blocks while only spanning requests could make
  room waits instead.
- With prefix caching (MemServe's context caching, builtin/prefix.py) a request admitted from
  scratch starts from its prompt's longest cached prefix, its full prompt blocks join the cache as
  soon as they are prefilled (it reads them from there on, so requests running at once with the same
  prompt hold it once), and the rest of its full blocks when it ends.
- A request without a seed gets one from the scheduler's RNG (seeded by EngineConfig.seed), and a
  suspend hands it on (builtin/sampling.py says why the seed is all a resume needs).
- Each step's `Sampling` reads the request's parameters and own tokens (builtin/sampling.py: vLLM's
  penalties, min_tokens, logit_bias, logprobs). A request with structured output carries its
  grammar (`Request.constraint`), built by the `make_constraint` factory the scheduler is given from
  the spec and the output tokens so far, so a request resumed from prompt + output (a migration, a
  suspend undone) continues its grammar; each delivered token advances it, and a complete grammar
  ends the request ("stop").

The scheduler is composed, not extended: the memory its blocks come from is a `KVSpace`
(builtin/blocks.py: a static `BlockPool`, or elastic memory's pool, which can grow and park a request's
KV in the CPU buffer), the prefix cache a `PrefixCache` part (builtin/prefix.py), and DistKV's
borrower side `RemoteKVHooks`, all handed in; `admit` is the one waiting -> running transition every
path takes. Elastic memory's scheduler (builtin/elastic.py) replaces only the batch choice (eLLM's
Algorithm 1) and what it observes of each step.

`num_preemptions` and `num_prefilled_tokens` count what recompute cost, for metrics and to check
what a resume re-prefilled.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from kvfleet.serving.prompt_tree import Match
from kvfleet.worker.engines.base import (
    EngineError,
    FinishReason,
    RequestKV,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
    blocks_for,
    kv_blocks_bytes,
)
from kvfleet.worker.engines.builtin.blocks import BlockPool, KVSpace, StagedKV
from kvfleet.worker.engines.builtin.model import KVParts, SeqBatchEntry
from kvfleet.worker.engines.builtin.sampling import MakeConstraint, Sampling, TokenConstraint

if TYPE_CHECKING:
    from kvfleet.worker.engines.builtin.prefix import PrefixCache

logger = logging.getLogger(__name__)

# Prefill is not chunked: this bounds how many prompt tokens one step adds (and so how long the
# running requests wait for their next token), except that a longer single prompt still goes alone.
PREFILL_TOKENS_PER_STEP = 2048


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SUSPENDED = "suspended"
    FINISHED = "finished"


class RemoteKV(KVParts, Protocol):
    """A spanning request's oldest KV, held in blocks other workers lent it (builtin/borrowing.py)."""

    @property
    def num_tokens(self) -> int:
        """Tokens of the request's context held there: its first `num_tokens` positions."""
        ...

    @property
    def lent_tokens(self) -> int:
        """Of those, the tokens that live at lenders (the rest were recalled and wait for local blocks)."""
        ...


class RemoteKVHooks(Protocol):
    """DistKV's borrower side as the scheduler sees it (builtin/borrowing.py's `Lenders`)."""

    def borrowable_blocks(self, block_bytes: int) -> int:
        """Blocks of `block_bytes` other workers could lend now (a hint for admission)."""
        ...

    def release_remote(self, req: Request) -> None:
        """Give back a request's remote KV (it finished, or was preempted and is prefilled again)."""
        ...


# What a request's stream receives: an output, an error, or None when it was suspended.
StreamItem = StepOutput | EngineError | None


@dataclass(eq=False)
class Request:
    """The engine's mutable bookkeeping of one request (lives on the event loop only)."""

    request_id: str
    prompt: list[int]
    output: list[int]
    params: SamplingParams
    seed: int
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    state: RequestState = RequestState.WAITING
    blocks: list[int] = field(default_factory=list)
    # Tokens whose K and V are written in `blocks`.
    num_cached: int = 0
    admitted_seq: int = -1
    # Elastic memory's CPU buffer (builtin/cpu_buffer.py): the request's KV parked in host memory, in
    # PagedKVCache.read_blocks' layout, while it holds no blocks; None when it is not parked.
    parked: torch.Tensor | None = None
    # The prefix cache's blocks it reads (pinned in the prompt tree): the first len(shared.nodes) of
    # `blocks` belong to the cache, not to the request, and are never freed with it. Set when it is
    # admitted from a cached prefix, and extended to its full prompt blocks once its prompt is
    # prefilled (`Scheduler.share_prompt`), or imported (a migration's or a hand-over's destination).
    shared: Match[int] | None = None
    # DistKV: the request is larger than this engine's whole cache and borrows (module docstring);
    # `remote` holds its first remote_tokens tokens' KV, and `blocks` the rest from there on.
    spans: bool = False
    remote: RemoteKV | None = None
    # Structured output: the request's grammar, at its output so far; None without one.
    constraint: TokenConstraint | None = None
    # What min_tokens holds back: the model's EOS ids and the request's stop_token_ids (sampling.py).
    stop_ids: frozenset[int] = frozenset()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remote_tokens(self) -> int:
        return self.remote.num_tokens if self.remote is not None else 0

    def context(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True)
class Step:
    """One step's batch: the requests, what the forward reads for each, and how each samples."""

    requests: tuple[Request, ...]
    entries: tuple[SeqBatchEntry, ...]
    samplings: tuple[Sampling, ...]


@dataclass(frozen=True)
class ModelLimits:
    """What a started engine's model allows a request (set by `Scheduler.open`)."""

    max_model_len: int
    vocab_size: int
    kv_bytes_per_token: int


class Scheduler:
    """The requests of one builtin engine and the choice of what each step computes."""

    def __init__(self, max_num_seqs: int, block_size_tokens: int, seed: int | None, *,
                 prefix: PrefixCache | None = None, remote: RemoteKVHooks | None = None,
                 make_constraint: MakeConstraint | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.block_size_tokens = block_size_tokens
        # The memory blocks come from; none until `open` (a stopped engine has no cache).
        self.space: KVSpace = BlockPool(0, 0)
        self.limits: ModelLimits | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        # Waiting requests whose KV is in host memory (parked by the space), in the order they resume.
        self.parked: deque[Request] = deque()
        self.staged: dict[str, StagedKV] = {}
        # Context caching (MemServe §4.1-4.2); None when off.
        self.prefix = prefix
        # DistKV's borrower side; None when this engine does not borrow.
        self.remote = remote
        # Structured outputs' grammars (module docstring); None: requests with one are refused.
        self.make_constraint = make_constraint
        # Set when there may be work for the engine's step loop.
        self.wake_event: asyncio.Event | None = None
        self._admissions = 0
        self._rng = random.Random(seed)
        # Counters for metrics and benchmarks: how much recompute preemption and re-prefill cost.
        self.num_preemptions = 0
        self.num_prefilled_tokens = 0
        # Requests parked in host memory instead of recomputed (elastic memory's CPU buffer).
        self.num_parked = 0
        # Prompt tokens whose KV came from the prefix cache instead of a prefill.
        self.num_cache_hit_tokens = 0

    def open(self, space: KVSpace, limits: ModelLimits, eos_ids: frozenset[int]) -> None:
        """Take a started engine's KV space and model limits."""
        self.space = space
        self.limits = limits
        self.eos_ids = eos_ids
        self.wake_event = asyncio.Event()
        if self.prefix is not None:  # block ids of another cache mean nothing here
            self.prefix.reset()

    def abort_all(self) -> None:
        """Abort every request and free staged KV (the engine is stopping)."""
        for req in list(self.requests.values()):
            self.abort(req)
        for request_id in list(self.staged):
            self.release_staged(request_id)

    def close(self) -> None:
        """Let go of the stopped engine's cache: new requests are refused until the next `open`."""
        self.space = BlockPool(0, 0)
        self.limits = None

    def wake(self) -> None:
        if self.wake_event is not None:
            self.wake_event.set()

    # -- requests ------------------------------------------------------------------------------------

    def get(self, request_id: str) -> Request | None:
        """The request of that id that is waiting, running or suspended here."""
        return self.requests.get(request_id)

    def has(self, request_id: str) -> bool:
        """Whether the id is taken here: by a request, or by KV staged for one."""
        return request_id in self.requests or request_id in self.staged

    @property
    def num_free_blocks(self) -> int:
        return len(self.space.free)

    def new_request(self, request_id: str, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
        """A request checked against the model's limits, with a seed and its grammar at `output` (not
        queued yet)."""
        limits = self.limits
        if limits is None:
            raise RuntimeError("the builtin engine is not started")
        if not prompt:
            raise EngineError("the prompt has no tokens")
        vocab_size = limits.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt + output):
            raise EngineError(f"token ids must be in [0, {vocab_size})")
        if any(not 0 <= t < vocab_size for t, _ in params.logit_bias):
            # (vLLM refuses these too; a step would index past the logits.)
            raise EngineError(f"logit_bias token ids must be in [0, {vocab_size})")
        if params.structured is not None and self.make_constraint is None:
            raise EngineError("this engine has no structured-output support")
        if len(prompt) + params.max_tokens > limits.max_model_len:
            raise RequestTooLong(f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                                 f"model's context of {limits.max_model_len} tokens")
        # The most KV it ever holds: every token but the last one sampled.
        most_blocks = blocks_for(len(prompt) + params.max_tokens - 1, self.block_size_tokens)
        space = self.space
        spans = most_blocks > space.num_blocks
        if spans:
            # Infinite-LLM §4.3: the difference may live in blocks other workers lend.
            remote = self.remote
            borrowable = remote.borrowable_blocks(space.block_bytes) if remote is not None and space.num_blocks > 0 else 0
            if most_blocks > space.num_blocks + borrowable:
                lend = f" and the pool can lend it {borrowable} more" if borrowable else ""
                raise RequestTooLong(f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} need {most_blocks} KV "
                                     f"blocks; this engine has {space.num_blocks}{lend}")
        constraint = None
        if params.structured is not None:
            assert self.make_constraint is not None
            try:
                constraint = self.make_constraint(params.structured, output)
            except ValueError as err:  # a spec the grammar cannot take, or output it does not match
                raise EngineError(f"structured output {params.structured.kind}: {err}") from err
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        stop_ids = self.eos_ids | frozenset(params.stop_token_ids) if params.stop_token_ids else self.eos_ids
        return Request(request_id, prompt, output, replace(params, seed=seed), seed, spans=spans,
                       constraint=constraint, stop_ids=stop_ids)

    def enqueue(self, req: Request, *, front: bool = False) -> AsyncIterator[StepOutput]:
        """Queue a request (at the front: it is already late) and return its stream; one whose KV is
        still in host memory (a migration rolled back) waits parked."""
        self.requests[req.request_id] = req
        queue = self.waiting if req.parked is None else self.parked
        if front:
            queue.appendleft(req)
        else:
            queue.append(req)
        self.wake()
        return self._stream(req)

    async def _stream(self, req: Request) -> AsyncIterator[StepOutput]:
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
            if req.state in (RequestState.WAITING, RequestState.RUNNING):
                self.abort(req)

    def detach(self, req: Request) -> None:
        """Take a waiting or running request out of its queue (it is being aborted or suspended)."""
        if req.state is RequestState.WAITING:
            if req.parked is not None and req in self.parked:
                self.parked.remove(req)
            else:
                self.waiting.remove(req)
        elif req.state is RequestState.RUNNING:
            self.running.remove(req)

    def abort(self, req: Request) -> None:
        if req.state is RequestState.FINISHED:
            return
        self.detach(req)
        if req.state is not RequestState.SUSPENDED:  # a suspended request's stream has ended already
            req.queue.put_nowait(StepOutput(req.request_id, (), finished=True, finish_reason="abort",
                                            num_tokens=req.num_tokens))
        self.finish(req)

    def finish(self, req: Request) -> None:
        self._free_blocks(req)
        req.parked = None
        req.state = RequestState.FINISHED
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
        self.wake()

    # -- KV staged for a request that is not here yet (a migration's destination) --------------------

    def staged_kv(self, request_id: str) -> StagedKV | None:
        return self.staged.get(request_id)

    def stage(self, request_id: str, num_blocks: int) -> StagedKV | None:
        """Grow the KV staged for `request_id` to at least `num_blocks` blocks; None (nothing changed)
        if they cannot be made free."""
        staged = self.staged.get(request_id) or StagedKV()
        num_new = max(0, num_blocks - len(staged.blocks))
        if not self.ensure_free(num_new):
            return None
        staged.blocks.extend(self.space.allocate(num_new))
        self.staged[request_id] = staged
        return staged

    def take_staged(self, request_id: str) -> StagedKV | None:
        """The KV staged for a request that is resumed now: its blocks become the request's."""
        return self.staged.pop(request_id, None)

    def release_staged(self, request_id: str) -> None:
        staged = self.staged.pop(request_id, None)
        if staged is not None:
            self.space.release(staged.blocks[staged.num_shared:])
            if staged.shared is not None and self.prefix is not None:
                self.prefix.unlock(staged.shared)

    # -- accounting ----------------------------------------------------------------------------------

    def kv_usage(self) -> list[RequestKV]:
        """Every request holding blocks; a cached block that several read is counted once, to the
        oldest of them (RequestKV says why), and blocks only the cache holds to none (they are
        evictable: `num_evictable_blocks`)."""
        block_bytes = self.space.block_bytes
        usage = []
        counted: set[int] = set()  # ids of the shared prompt-tree nodes counted already
        for req in sorted(self.requests.values(), key=lambda r: (r.admitted_seq, r.request_id)):
            if req.blocks:
                tokens = req.num_cached if req.state is RequestState.WAITING else req.num_tokens
                nodes = req.shared.nodes if req.shared is not None else ()
                num_elsewhere = sum(1 for node in nodes if id(node) in counted)
                counted.update(id(node) for node in nodes)
                usage.append(RequestKV(req.request_id, tokens, (len(req.blocks) - num_elsewhere) * block_bytes,
                                       max(0, req.params.max_tokens - len(req.output)), num_elsewhere * block_bytes,
                                       blocks_for(req.remote.lent_tokens if req.remote is not None else 0,
                                                  self.block_size_tokens) * block_bytes, req.spans))
        for request_id, staged in self.staged.items():
            if staged.blocks:
                # Cached blocks it starts from are the cache's until it runs (counted like a waiting
                # request's shared prefix: once, and not to it).
                num_shared = staged.num_shared
                usage.append(RequestKV(request_id, staged.num_tokens, (len(staged.blocks) - num_shared) * block_bytes,
                                       shared_bytes=num_shared * block_bytes))
        return sorted(usage, key=lambda r: r.request_id)

    def num_waiting(self) -> int:
        return sum(1 for req in self.waiting if not req.blocks) + len(self.parked)

    def queued(self) -> list[RequestKV]:
        """Waiting requests and parked ones: both hold no blocks and need them to run (MELL's demand)."""
        if self.limits is None:
            return []
        kv_bytes_per_token = self.limits.kv_bytes_per_token
        return sorted((RequestKV(req.request_id, req.num_tokens,
                                 kv_blocks_bytes(req.num_tokens, self.block_size_tokens, kv_bytes_per_token))
                       for req in (*self.waiting, *self.parked) if not req.blocks), key=lambda r: r.request_id)

    # -- steps ---------------------------------------------------------------------------------------

    def schedule(self) -> Step | None:
        """Admit what fits and return the step's batch, or None when nothing runs."""
        bs = self.block_size_tokens
        free = self.space.free
        budget_tokens = PREFILL_TOKENS_PER_STEP
        num_running = len(self.running)
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            admitted = len(self.running) > num_running
            if req.spans:
                if not self._admit_spanning(req, admitted):
                    break
                budget_tokens = 0  # its chunk takes the step's prefill budget
                continue
            # Its prompt's cached prefix (Table 1's match): pinned first, so making room cannot evict it.
            match = self.match_prefix(req)
            num_cached = match.num_tokens if match is not None else req.num_cached
            num_new_tokens = req.num_tokens - num_cached
            num_new_blocks = blocks_for(req.num_tokens, bs) - (len(match.nodes) if match is not None else len(req.blocks))
            if num_new_blocks > len(free):
                self._make_room(num_new_blocks)
            if num_new_blocks > len(free) or (admitted and num_new_tokens > budget_tokens):
                if match is not None and self.prefix is not None:
                    self.prefix.unlock(match)
                break
            self.admit(req, num_new_blocks, match)
            budget_tokens -= num_new_tokens
        for req in self.running:
            if req.spans:
                self._top_up(req)
        batch = [(req, n) for req in self.running if (n := self.step_tokens(req)) > 0]
        if not batch:
            return None
        requests = tuple(req for req, _ in batch)
        entries = tuple(SeqBatchEntry(tuple(req.context()[req.num_cached: req.num_cached + n]), req.num_cached,
                                      tuple(req.blocks), extra_parts=(req.remote,) if req.remote is not None and req.remote_tokens else (),
                                      remote_tokens=req.remote_tokens)
                        for req, n in batch)
        return Step(requests, entries, tuple(self.sampling(req) for req in requests))

    @staticmethod
    def sampling(req: Request) -> Sampling:
        """How a scheduled request's next token is chosen (builtin/sampling.py): its own lists by
        reference, which nothing appends to until the step's tokens are delivered."""
        return Sampling(req.params, req.seed, req.num_tokens, req.prompt, req.output, req.stop_ids, req.constraint)

    def admit(self, req: Request, num_new_blocks: int, match: Match[int] | None = None) -> None:
        """The one waiting -> running transition: the request leaves the queue, starts from its cached
        prefix `match` (locked by `match_prefix`) if any, takes `num_new_blocks` blocks more (the
        caller checked they are free; 0 for a prefill whose KV goes elsewhere) and runs last.

        A spanning request's prompt is counted as prefilled chunk by chunk (`process`), the others' here."""
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        if match is not None:
            assert self.prefix is not None
            self.prefix.start(req, match, self.space)
            self.num_cache_hit_tokens += match.num_tokens
        if num_new_blocks > 0:
            req.blocks.extend(self.space.allocate(num_new_blocks))
        req.state = RequestState.RUNNING
        req.admitted_seq = self._admissions
        self._admissions += 1
        if not req.spans:
            self.num_prefilled_tokens += req.num_tokens - req.num_cached
        self.running.append(req)

    def _admit_spanning(self, req: Request, others: bool) -> bool:
        """Admit a spanning request with the blocks its first chunk needs, or as many as are free (at
        least one); its later chunks get theirs as its borrowing side makes room (module docstring)."""
        if others:
            return False  # its chunk is the step's whole prefill budget
        want = self.next_chunk_blocks(req)
        self._make_room(want)
        if not self.space.free:
            return False
        self.admit(req, min(want, len(self.space.free)))
        return True

    def step_tokens(self, req: Request) -> int:
        """How many of a running request's tokens the next step computes: all it has not cached, or for
        a spanning request the chunk its local blocks hold; 0 while it waits for blocks."""
        pending = req.num_tokens - req.num_cached
        room = len(req.blocks) * self.block_size_tokens - (req.num_cached - req.remote_tokens)
        if not req.spans:
            return pending if room >= pending else 0
        return min(pending, room, PREFILL_TOKENS_PER_STEP)

    def next_chunk_blocks(self, req: Request) -> int:
        """Local blocks a spanning request lacks for its next chunk (or decode token), free or not."""
        local = req.num_cached - req.remote_tokens
        want = min(req.num_tokens - req.num_cached, PREFILL_TOKENS_PER_STEP)
        return blocks_for(local + want, self.block_size_tokens) - len(req.blocks)

    def _top_up(self, req: Request) -> None:
        """Give a spanning request what is free toward its next chunk or token; the rest comes of moving
        its oldest blocks to lenders before the next step (builtin/borrowing.py), never of preempting."""
        num_new_blocks = min(self.next_chunk_blocks(req), len(self.space.free))
        if num_new_blocks > 0:
            req.blocks.extend(self.space.allocate(num_new_blocks))

    def spanning_shortfall(self, req: Request) -> int:
        """Blocks a running spanning request lacks for its next chunk (or decode) beyond the free ones."""
        return max(0, self.next_chunk_blocks(req) - len(self.space.free))

    def process(self, step: Step, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs | None] = ()) -> None:
        """Hand each request its sampled token (and its logprobs, where asked: one per row, or none at
        all), finish those that are done, and reserve the next slots."""
        self.deliver(step, tokens, logprobs)
        self.reserve_next_slots()

    def deliver(self, step: Step, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs | None] = ()) -> None:
        """Hand each request its sampled token and finish those that are done (`process`'s first half)."""
        eos_ids = self.eos_ids
        for row, (req, entry, token) in enumerate(zip(step.requests, step.entries, tokens)):
            if req.state is not RequestState.RUNNING:  # aborted while the step ran
                continue
            written = entry.start_position + len(entry.token_ids)
            if written < req.num_tokens:  # a chunk of a spanning request's prefill: no token yet
                self.num_prefilled_tokens += len(entry.token_ids)
                req.num_cached = written
                continue
            if req.spans and len(entry.token_ids) > 1:
                self.num_prefilled_tokens += len(entry.token_ids)
            req.num_cached = req.num_tokens
            req.output.append(token)
            if not self._advance_constraint(req, token):
                continue
            reason: FinishReason | None = None
            if ((token in eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids
                    or (req.constraint is not None and req.constraint.finished)):
                reason = "stop"
            elif len(req.output) >= req.params.max_tokens:
                reason = "length"
            token_logprobs = logprobs[row] if logprobs else None
            req.queue.put_nowait(StepOutput(req.request_id, (token,), finished=reason is not None,
                                            finish_reason=reason, num_tokens=req.num_tokens,
                                            logprobs=(token_logprobs,) if token_logprobs is not None else ()))
            if reason is not None:
                self.running.remove(req)
                self._cache_blocks(req)
                self.finish(req)
            elif entry.start_position < len(req.prompt):  # this step finished its prompt's prefill
                self.share_prompt(req)

    def _advance_constraint(self, req: Request, token: int) -> bool:
        """Feed a delivered token to the request's grammar; False (the request failed alone) if the
        grammar refuses it, which only a grammar whose mask allowed the token could cause."""
        if req.constraint is None:
            return True
        try:
            req.constraint.advance(token)
        except Exception as err:  # the grammar is another module's code: its error ends this request only
            logger.exception("structured output of %s refused token %d", req.request_id, token)
            self.running.remove(req)
            req.queue.put_nowait(EngineError(f"structured output failed: {err}"))
            self.finish(req)
            return False
        return True

    def reserve_next_slots(self) -> None:
        """Give every running request the block its next token goes to, preempting the newest if short
        (`process`'s second half)."""
        bs = self.block_size_tokens
        free = self.space.free
        for req in list(self.running):
            if req.state is not RequestState.RUNNING:  # preempted below for an older request
                continue
            if req.spans:
                self._top_up(req)
                continue
            num_new_blocks = blocks_for(req.num_tokens, bs) - len(req.blocks)
            if num_new_blocks > len(free):
                self._make_room(num_new_blocks)
            while num_new_blocks > len(free) and req.state is RequestState.RUNNING:
                victim = next((r for r in reversed(self.running) if not r.spans), None)
                if victim is None:
                    break  # only spanning requests could make room: it waits (module docstring)
                self.evict(victim)
            if req.state is RequestState.RUNNING and 0 < num_new_blocks <= len(free):
                req.blocks.extend(self.space.allocate(num_new_blocks))

    def ensure_free(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks are free, after growing the space if it can (elastic memory)."""
        if num_blocks > len(self.space.free):
            self._make_room(num_blocks)
        return num_blocks <= len(self.space.free)

    def match_prefix(self, req: Request) -> Match[int] | None:
        """The longest cached prefix a request about to be prefilled from scratch can start from,
        locked; at least its last token is computed (its logits give the next token)."""
        if self.prefix is None or req.blocks or req.num_cached or req.parked is not None or req.spans:
            return None
        return self.prefix.match(req.context()[: req.num_tokens - 1])

    def _make_room(self, num_blocks: int) -> None:
        """Try to have `num_blocks` free blocks before preempting or refusing: grow the space if it can
        (elastic memory inflates, eLLM §4.3.1), then evict cached blocks nobody reads
        (`evict_cached`)."""
        self.space.grow_for(num_blocks)
        self.evict_cached(num_blocks - len(self.space.free))

    def evict_cached(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks the prefix cache holds and nobody reads, least recently used
        first (MemServe's MemPool keeps history only while it is free memory); how many were freed."""
        if num_blocks <= 0 or self.prefix is None:
            return 0
        freed = self.prefix.evict(num_blocks)
        self.space.release(freed)
        return len(freed)

    def _free_blocks(self, req: Request) -> None:
        """The request lets go of its blocks: its own go back to the space, the cache's are unlocked."""
        shared = req.shared
        num_shared = len(shared.nodes) if shared is not None else 0
        self.space.release(req.blocks[num_shared:])
        if shared is not None and self.prefix is not None:
            self.prefix.unlock(shared)
        req.blocks, req.shared = [], None
        if req.remote is not None:
            if self.remote is not None:
                self.remote.release_remote(req)
            req.remote = None

    def share_prompt(self, req: Request) -> None:
        """A running request whose prompt was just prefilled puts its full prompt blocks in the cache
        and reads them from there (`PrefixCache.share`), so a request admitted with the same prompt
        while it still runs (OpenAI `n` samples, the same system prompt under load) matches them
        instead of prefilling and holding its own copy: vLLM caches a block as soon as it is full, and
        MemServe's context caching ("MemServe: Flexible Mem Pool for Building Disaggregated LLM
        Serving with Caching", §4) indexes a prompt's KV for reuse. Only the prompt's blocks: the
        output's are cached when the request ends (`_cache_blocks`), which inserts what lies past
        them. Its copies of blocks cached already go back to the space (the KV is the same).

        Not a spanning request (its blocks do not start at its first token), nor one whose prefill
        wrote its KV elsewhere (elastic memory's offloaded prefill holds no blocks yet)."""
        if self.prefix is None or req.spans:
            return
        full = len(req.prompt) // self.block_size_tokens
        num_shared = len(req.shared.nodes) if req.shared is not None else 0
        if full <= num_shared or len(req.blocks) < full or req.num_cached < full * self.block_size_tokens:
            return
        self.space.release(self.prefix.share(req, full))

    def _cache_blocks(self, req: Request) -> None:
        """A request that ended well leaves its full, written blocks in the cache (Table 1's insert):
        they move from the request to the tree; copies of blocks cached already go back to the pool."""
        if self.prefix is None or req.spans:  # a spanning request's blocks do not start at its first token
            return
        full = min(req.num_cached, req.num_tokens) // self.block_size_tokens
        shared = req.shared
        num_shared = len(shared.nodes) if shared is not None else 0
        if full <= num_shared:
            return
        kept = req.blocks[:full]
        duplicates = self.prefix.insert(req.context()[: full * self.block_size_tokens], kept, num_shared)
        self.space.release(duplicates)
        # The blocks now the tree's (inserted, or its own already) leave the request's list, so
        # _free_blocks frees only what is past them; the shared prefix is unpinned as usual.
        req.blocks = req.blocks[:num_shared] + req.blocks[full:]

    def preempt(self, req: Request) -> None:
        """Free a running request's KV and queue it first, to be prefilled again (DistKV's lost lease)."""
        self._recompute(req)

    def evict(self, req: Request) -> None:
        """A running request leaves the device: its written KV parked in host memory if the space has
        room there (it resumes from it, eLLM §4.3.2), else freed, to be prefilled again (recompute)."""
        written = blocks_for(req.num_cached, self.block_size_tokens)
        host = self.space.park(req.request_id, req.blocks[:written]) if written else None
        if host is None:
            self._recompute(req)
            return
        # All its blocks were copied, the cached prefix it shares too: it gives up its lock on those
        # (they may be evicted while it waits) and comes back with its whole KV in blocks of its own.
        self.running.remove(req)
        self._free_blocks(req)
        req.parked, req.state = host, RequestState.WAITING
        self.parked.appendleft(req)
        self.num_parked += 1
        logger.debug("parked %s (%d tokens) in the CPU buffer", req.request_id, req.num_cached)

    def fail_request(self, req: Request, error: EngineError) -> None:
        """End one running or waiting request with an error (its stream raises it)."""
        if req.state in (RequestState.RUNNING, RequestState.WAITING):
            self.detach(req)
            req.queue.put_nowait(error)
            self.finish(req)

    def _recompute(self, req: Request) -> None:
        logger.debug("preempting %s (%d tokens) for KV blocks", req.request_id, req.num_tokens)
        self.num_preemptions += 1
        self.running.remove(req)
        self._free_blocks(req)
        req.num_cached, req.state = 0, RequestState.WAITING
        self.waiting.appendleft(req)

    def fail(self, step: Step, error: EngineError) -> None:
        """A step that raised fails its requests (not the engine); one preempted in it is waiting."""
        for req in step.requests:
            self.fail_request(req, error)
