"""The one contract every engine keeps, so the agent, the router and migration never ask which.

An engine takes token ids in and gives token ids out; the agent owns text (tokenizer, stop strings,
the OpenAI format). Engines account the KV cache of every request they hold, in tokens and in bytes
of the blocks really allocated to it, because MELL packs pods by those bytes (docs/worker.md).
Everything here is asyncio: `generate` is an async iterator of per-step outputs, one per engine
step in which the request produced tokens.

What only some engines can do (moving a request's KV for live migration, and the features to come:
elastic capacity, lending KV blocks, a prefix cache) is not in this contract but declared by each
engine as a capability: `engine.capabilities` is an `EngineCapabilities` whose fields are each
feature's implementation or None (capabilities.py says how to add one). Callers use the capability,
never the engine's type.

An engine may also measure its own speed (`speed_profile`: step periods against batch and context,
engines/speed.py); one that does not returns None, and the worker says so to whoever asks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from kvfleet.api.speed import SpeedProfile

if TYPE_CHECKING:
    # capabilities.py builds on this module's types; only the annotation below points back.
    from kvfleet.worker.engines.capabilities import EngineCapabilities

FinishReason = Literal["stop", "length", "abort"]


class EngineError(Exception):
    """An engine refused a request; the message is meant for the client."""


class RequestTooLong(EngineError):
    """The prompt plus max_tokens does not fit the model's context (or the engine's whole KV cache)."""


class DuplicateRequest(EngineError):
    """A request id already running on this engine."""


@dataclass(frozen=True)
class EngineConfig:
    """What a worker knows when it starts its engine (the pod's environment, see resources.py): the
    settings every engine takes. An engine's own settings are its options (engines/builtin/options.py)."""

    model_path: Path
    # Bytes of KV cache the engine allocates; None lets the engine choose (tests, the bench).
    kv_capacity_bytes: int | None = None
    # Longest prompt + output, in tokens; None means the model's own max_position_embeddings.
    max_model_len: int | None = None
    # Most requests decoded in one step.
    max_num_seqs: int = 64
    # torch dtype name of weights and KV cache: "float32" on the CPU keeps logits comparable to
    # transformers; GPUs use "bfloat16" or "float16".
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    # A floor on one engine step's wall time (0 in production; vLLM's steps are paced by kvfleet's KV
    # connector, which vLLM calls once a step). It emulates a
    # slower accelerator, so that on a fast CPU a tiny model's requests live long enough for the
    # control loop (epochs of seconds) to act on them: the migration e2e test and the demo use it.
    min_step_s: float = 0.0
    # Context caching (MemServe): finished requests' full KV blocks stay, indexed by their tokens, until
    # their memory is needed; a new request starts after its prompt's cached prefix (the builtin engine's
    # prompt tree; vLLM's own prefix caching).
    prefix_caching: bool = False


StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate (OpenAI's `response_format`, vLLM's structured outputs).

    `spec` is the constraint as text: a JSON schema as JSON (json_schema), a regular expression
    (regex), a JSON list of strings (choice), a Lark grammar (grammar); "" for any JSON object."""

    kind: StructuredKind
    spec: str = ""
    # JSON kinds: whitespace anywhere JSON allows it (vLLM's default; its `disable_any_whitespace`
    # turns it off, which keeps a weak model from writing spaces until its budget runs out).
    any_whitespace: bool = True


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, with vLLM's meaning for every field (its `SamplingParams`).

    temperature 0 is greedy; a seed makes sampling reproducible per request. The processing order
    is vLLM's: the structured-output mask, min_tokens (no stop token yet), logit_bias, the
    penalties (repetition over prompt and output, presence and frequency over the output), then
    temperature, min_p, top_k and top_p. Every input is the request's own tokens, so a request
    moved to another engine continues with the same state: the penalty counts and the grammar
    (engines/grammar.py, applied by kvfleet on both engines) are rebuilt from prompt + output."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    # 0: every token (vLLM's -1 is normalised to 0 by the API layer).
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias added to its logit), sorted by token id.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Output tokens before EOS or a stop token may end the request.
    min_tokens: int = 0
    seed: int | None = None
    # Finishing tokens besides the model's EOS (which ends a request unless ignore_eos).
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no log-probabilities; k >= 0: each output token's, and the k most likely at its place
    # (of the model's raw distribution, as vLLM's default `raw_logprobs`).
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0: every token)")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability, its rank, and the most likely tokens at its place."""

    token_id: int
    logprob: float
    # 1 for the most likely token (vLLM's rank).
    rank: int
    # (token id, logprob), most likely first; as many as the request's `logprobs` asked for.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepOutput:
    """What one request produced in one engine step: new tokens, and whether it is done."""

    request_id: str
    # The token that finished a request (EOS or a stop token) is included, as vLLM does; the agent
    # leaves it out of the text.
    new_token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    # Tokens whose KV the request holds after this step (prompt + generated so far).
    num_tokens: int = 0
    # One per new token when the request asked for logprobs, else empty.
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class RequestKV:
    """One request's KV footprint: tokens cached and bytes of the blocks allocated to it.

    With a prefix cache several requests read the same blocks: each block is counted once in a
    worker's usage, in `kv_bytes` of the oldest request reading it, and in `shared_bytes` of the
    others. So the sum of `kv_bytes` is what the worker holds, and `kv_bytes + shared_bytes` is the
    request's whole KV, what a move carries and its target must hold."""

    request_id: str
    tokens: int
    kv_bytes: int
    # Output tokens it may still write (max_tokens less those written): with the tokens reported at two
    # epochs the operator tells a request about to finish, whose move would land after it ended.
    remaining_tokens: int | None = None
    shared_bytes: int = 0
    # DistKV (docs/distkv.md): KV of this request held in blocks other workers lent it; kv_bytes is
    # only what this worker holds.
    borrowed_bytes: int = 0
    # Larger than the engine's whole cache: it borrows (or will) and is never moved.
    spans: bool = False


@dataclass(frozen=True)
class EngineInfo:
    """Facts about a started engine that the agent reports and the scheduler sizes with."""

    engine: str
    model_path: str
    max_model_len: int
    block_size_tokens: int
    # 2 x layers x kv_heads x head_dim x dtype bytes: one token's K and V over all layers.
    kv_bytes_per_token: int
    kv_capacity_bytes: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Whether `speed_profile` ever returns one (the engine times its steps), so that a caller can
    # tell "does not measure" from "has run no step yet".
    measures_speed: bool = False


@runtime_checkable
class Engine(Protocol):
    """A running LLM engine. All methods are called from one asyncio event loop."""

    async def start(self) -> EngineInfo:
        """Load the model and allocate the KV cache; returns what was really allocated."""
        ...

    async def stop(self) -> None:
        """Abort what runs, free memory, stop background work. Idempotent."""
        ...

    @property
    def info(self) -> EngineInfo:
        """The started engine's facts (raises RuntimeError before start)."""
        ...

    @property
    def capabilities(self) -> EngineCapabilities:
        """The optional features this engine has (capabilities.py); the same before and after start."""
        ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Queue a request and stream its outputs; the last one has finished=True.

        Raises RequestTooLong or DuplicateRequest (before yielding anything) for requests it cannot
        take. Leaving the iterator early (the client went away) aborts the request and frees its KV.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV; its stream ends with finish_reason "abort". Unknown ids are ignored."""
        ...

    def kv_usage(self) -> list[RequestKV]:
        """Every request holding KV now (running or preempted-but-cached), sorted by id."""
        ...

    def num_waiting(self) -> int:
        """Requests queued but not yet holding KV (waiting for blocks or a batch slot)."""
        ...

    def queued(self) -> list[RequestKV]:
        """The requests of num_waiting(), sorted by id: the tokens each will hold once admitted and
        the whole blocks that takes. The worker reports them so that MELL sees demand a full worker
        cannot take yet (and allocates it a GPU) instead of the queue hiding it."""
        ...

    def speed_profile(self) -> SpeedProfile | None:
        """The step speed measured since start (engines/speed.py), its `model` the engine's model
        path; None from an engine that does not measure (`info.measures_speed` False), before start,
        or before its first step."""
        ...


def blocks_for(num_tokens: int, block_size_tokens: int) -> int:
    """Blocks that hold `num_tokens` tokens (the last one may be partial): requests are sized in whole
    blocks, as a paged cache allocates them and as MELL sizes them, by every engine and the migration
    that reserves blocks for one."""
    return -(-num_tokens // block_size_tokens)


def kv_blocks_bytes(num_tokens: int, block_size_tokens: int, kv_bytes_per_token: int) -> int:
    """Bytes of the paged blocks that hold num_tokens: whole blocks, as a paged cache allocates."""
    return blocks_for(num_tokens, block_size_tokens) * block_size_tokens * kv_bytes_per_token
