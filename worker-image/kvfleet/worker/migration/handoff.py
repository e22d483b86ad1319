"""The agent's side of a migration: handing a request's stream over without a token lost or repeated.

A migration stops a request on the source engine and continues it on the target's; meanwhile the
source's agent is streaming that request to a client (or a router). This module holds what the two
need to agree on:
- `Handoffs` and `Ticket`: the executor announces a migration, the agent's stream tells it when it
  has sent every token the source generated (the stream position the target continues from), and
  the executor answers with the outcome: `Moved` (the target has it: end the router's stream with
  `kvfleet.migrated`, or relay the target for a direct client) or `Continue` (rolled back: go on
  with the stream the source resumed).
- `HandedRequest`: what crosses to the target besides KV: tokens, sampling parameters (with the seed
  the source drew), and the detokenizer and stop-string state, so the target's text continues the
  source's exactly.
- `Adopted`: the target's buffer of a handed-over request's outputs until a reader attaches
  (docs/migration.md: the target's `/internal/requests/{id}/stream`).
- `follow`: a reader of that stream, used by the source to relay a direct client's continuation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from kvfleet.serving.httpapi import MIGRATED_EVENT, Migrated, bearer, continuation_path, sse_events
from kvfleet.serving.openai_api import ResponseShape, TokenLogprob, token_meta
from kvfleet.serving.stops import StopStrings
from kvfleet.worker.engines.base import EngineError, SamplingParams, StepOutput, StructuredOutput
from kvfleet.worker.text import Detokenizer, Tokenizer

log = logging.getLogger(__name__)

# How long a handed-over request waits on the target for a reader before it is aborted.
HANDOFF_ATTACH_TIMEOUT_S = 30.0
# A continuation that sends nothing for this long is lost (a long re-prefill takes seconds, not minutes).
READ_TIMEOUT_S = 120.0


class HandoffError(EngineError):
    """A hand-off that cannot go on (a migration already in flight, a request this agent does not stream)."""


@dataclass(frozen=True)
class HandoffTarget:
    pod: str
    # The target's HTTP address (ip:port): where readers attach to the continued stream.
    address: str


@dataclass(frozen=True)
class Moved:
    """The request continues on the target from output index `index`."""

    request_id: str
    target: HandoffTarget
    index: int

    def event(self) -> bytes:
        """The `kvfleet.migrated` event that ends a router-mode stream (httpapi.Migrated: its wire form)."""
        return Migrated(self.request_id, self.index, self.target.pod, self.target.address).event()

    @classmethod
    def of(cls, migrated: Migrated) -> Moved:
        """The Moved a `kvfleet.migrated` event names."""
        return cls(migrated.request_id, HandoffTarget(migrated.target_pod, migrated.target_address), migrated.index)


@dataclass(frozen=True)
class Continue:
    """The migration was rolled back: the request goes on in this stream on the source."""

    stream: AsyncIterator[StepOutput]


Outcome = Moved | Continue | None


class RequestMoved(Exception):
    """Raised from the agent's token stream when a router-mode stream must end with the event."""

    def __init__(self, moved: Moved) -> None:
        super().__init__(f"request {moved.request_id} moved to {moved.target.pod}")
        self.moved = moved


@dataclass(frozen=True)
class TextState:
    """The detokenizer's window and the stop strings' held-back text: enough to continue the text."""

    window_token_ids: tuple[int, ...]
    # window_token_ids[:read_offset] have been turned into text already.
    read_offset: int
    pending_text: str

    @classmethod
    def of(cls, detok: Detokenizer, stops: StopStrings) -> TextState:
        return cls(tuple(detok.tokens[detok.prefix:]), detok.read - detok.prefix, stops.pending)

    def restore(self, tokenizer: Tokenizer, stops: tuple[str, ...], include_stop: bool = False
                ) -> tuple[Detokenizer, StopStrings]:
        detok = Detokenizer(tokenizer, list(self.window_token_ids))
        detok.read = self.read_offset
        return detok, StopStrings(stops, pending=self.pending_text, include=include_stop)


@dataclass
class LiveRequest:
    """What the agent knows of a request it is streaming (mutable, on the event loop only)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    created: int
    model: str
    detok: Detokenizer
    stopper: StopStrings
    output_token_ids: list[int] = field(default_factory=list)
    include_stop: bool = False


@dataclass(frozen=True)
class HandedRequest:
    """Everything but the KV that a target needs to continue a request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    params: SamplingParams
    stops: tuple[str, ...]
    created: int
    model: str
    text: TextState
    # OpenAI's include_stop_str_in_output (streams.Job).
    include_stop: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "output_token_ids": list(self.output_token_ids), "params": params_to_json(self.params),
                "stops": list(self.stops), "include_stop": self.include_stop, "created": self.created, "model": self.model,
                "text": {"window_token_ids": list(self.text.window_token_ids), "read_offset": self.text.read_offset,
                         "pending_text": self.text.pending_text}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HandedRequest:
        t = data["text"]
        return cls(request_id=str(data["request_id"]), prompt_token_ids=tuple(int(x) for x in data["prompt_token_ids"]),
                   output_token_ids=tuple(int(x) for x in data["output_token_ids"]),
                   params=params_from_json(data["params"]), stops=tuple(str(s) for s in data["stops"]),
                   created=int(data["created"]), model=str(data["model"]),
                   text=TextState(tuple(int(x) for x in t["window_token_ids"]), int(t["read_offset"]),
                                  str(t["pending_text"])),
                   include_stop=bool(data.get("include_stop", False)))


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    """A request's sampling parameters on the hand-off's wire: every field, so the target samples as
    the source did (its penalties and grammar state are rebuilt there from prompt + output)."""
    wire: dict[str, Any] = json.loads(json.dumps(asdict(params)))  # tuples to lists, the structured output to an object
    return wire


def params_from_json(p: dict[str, Any]) -> SamplingParams:
    structured = p.get("structured")
    return SamplingParams(
        max_tokens=int(p["max_tokens"]), temperature=float(p["temperature"]), top_p=float(p["top_p"]),
        top_k=int(p.get("top_k", 0)), min_p=float(p.get("min_p", 0.0)),
        presence_penalty=float(p.get("presence_penalty", 0.0)), frequency_penalty=float(p.get("frequency_penalty", 0.0)),
        repetition_penalty=float(p.get("repetition_penalty", 1.0)),
        logit_bias=tuple((int(t), float(b)) for t, b in p.get("logit_bias", ())), min_tokens=int(p.get("min_tokens", 0)),
        seed=None if p["seed"] is None else int(p["seed"]), stop_token_ids=tuple(int(t) for t in p["stop_token_ids"]),
        ignore_eos=bool(p["ignore_eos"]), logprobs=None if p.get("logprobs") is None else int(p["logprobs"]),
        structured=None if structured is None else StructuredOutput(structured["kind"], str(structured["spec"]),
                                                                    bool(structured.get("any_whitespace", True))))


@dataclass(frozen=True)
class StreamPosition:
    """Where the agent's stream stood when the engine stopped the request: all of it sent."""

    output_token_ids: tuple[int, ...]
    text: TextState


class Ticket:
    """One migration of one request in flight, between the executor and the agent's stream."""

    def __init__(self, request_id: str) -> None:
        loop = asyncio.get_running_loop()
        self.request_id = request_id
        # Set just before the executor stops the request: an engine whose only way to stop a request
        # is aborting it (vLLM) ends its stream with "abort", which is then ours, not the client's.
        self.stopping = False
        # The agent's stream reached the end of the engine's stream: its position, or None when the
        # request finished (or its client left) instead.
        self.stopped: asyncio.Future[StreamPosition | None] = loop.create_future()
        self.outcome: asyncio.Future[Outcome] = loop.create_future()
        # Nobody reads the request any more: a rollback should free it rather than resume it.
        self.abandoned = False


class Handoffs:
    """The migrations in flight on this worker, by request id."""

    def __init__(self) -> None:
        self._tickets: dict[str, Ticket] = {}

    def begin(self, request_id: str) -> Ticket:
        if request_id in self._tickets:
            raise HandoffError(f"request {request_id!r} is already being migrated")
        ticket = self._tickets[request_id] = Ticket(request_id)
        return ticket

    def get(self, request_id: str) -> Ticket | None:
        return self._tickets.get(request_id)

    def done(self, ticket: Ticket, outcome: Outcome) -> None:
        """The executor's last word on a migration."""
        if not ticket.outcome.done():
            ticket.outcome.set_result(outcome)
        if self._tickets.get(ticket.request_id) is ticket:
            del self._tickets[ticket.request_id]

    async def stopped(self, request_id: str, position: StreamPosition) -> Outcome:
        """Called by the agent's stream when the engine's stream ended unfinished; None: no migration."""
        ticket = self._tickets.get(request_id)
        if ticket is None:
            return None
        if not ticket.stopped.done():
            ticket.stopped.set_result(position)
        try:
            return await asyncio.shield(ticket.outcome)
        except asyncio.CancelledError:
            ticket.abandoned = True
            raise

    def ended(self, request_id: str) -> None:
        """The agent's stream of the request is over (finished, aborted, or its reader left)."""
        ticket = self._tickets.get(request_id)
        if ticket is not None:
            ticket.abandoned = True
            if not ticket.stopped.done():
                ticket.stopped.set_result(None)


# -------------------------------------------------------------------------------- the target's buffer


@dataclass(frozen=True)
class Chunk:
    """One chunk of a handed-over request's stream: what the target buffers and what a follower reads."""

    # Output index of its first token.
    index: int
    text: str
    finish_reason: str | None
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


class Adopted:
    """A handed-over request's outputs on the target, kept until a reader takes them."""

    def __init__(self, handed: HandedRequest) -> None:
        self.handed = handed
        self.start_index = len(handed.output_token_ids)
        self.next_index = self.start_index
        self.entries: list[Chunk] = []
        self.moved: Moved | None = None
        self.ended = False
        self.reader_attached = False
        self.ever_attached = False
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.first_output = asyncio.Event()

    def add(self, text: str, finish_reason: str | None, token_ids: tuple[int, ...],
            logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        self.entries.append(Chunk(self.next_index, text, finish_reason, token_ids, logprobs))
        self.next_index += len(token_ids)
        self.first_output.set()
        self._changed.set()

    def end(self, moved: Moved | None = None) -> None:
        self.moved = moved
        self.ended = True
        self.first_output.set()
        self._changed.set()

    def boundaries(self) -> list[int]:
        return [self.start_index] + [e.index + len(e.token_ids) for e in self.entries]

    async def read(self, after: int) -> AsyncIterator[Chunk | Moved]:
        """Entries from output index `after` (a chunk boundary), then the Moved if it moved on."""
        position = next(i for i, e in enumerate(self.entries + [None]) if e is None or e.index >= after)
        while True:
            while position < len(self.entries):
                yield self.entries[position]
                position += 1
            if self.ended:
                if self.moved is not None:
                    yield self.moved
                return
            self._changed.clear()
            await self._changed.wait()

    def chunk(self, entry: Chunk) -> dict[str, Any]:
        """The entry as a router-mode chunk; a continuation is always a completion stream (relay.py reads both)."""
        h = self.handed
        shape = ResponseShape(h.request_id, h.created, h.model, chat=False)
        return shape.chunk(entry.text, entry.finish_reason, token_meta(entry.index, entry.token_ids, logprobs=entry.logprobs))


# ----------------------------------------------------------------------------- reading a continuation


async def follow(session: aiohttp.ClientSession, token: str, moved: Moved) -> AsyncIterator[Chunk]:
    """The request's continuation, read from its target (and the targets after it, if it moves on).

    Ends after the chunk with a finish reason; raises HandoffError when a target cannot be read.
    """
    while True:
        url = f"http://{moved.target.address}{continuation_path(moved.request_id)}"
        next_moved: Moved | None = None
        try:
            async with session.get(url, params={"after": str(moved.index)}, headers=bearer(token),
                                   timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=READ_TIMEOUT_S)) as response:
                if response.status != 200:
                    raise HandoffError(f"{moved.target.pod} answered {response.status}: {(await response.text())[:200]}")
                async for event, data in sse_events(response.content):
                    if event == MIGRATED_EVENT:
                        next_moved = Moved.of(Migrated.parse(data))
                    elif data == "[DONE]":
                        return
                    else:
                        body = json.loads(data)
                        choice = body["choices"][0]
                        meta = body["kvfleet"]
                        yield Chunk(int(meta["index"]), str(choice["text"]), choice["finish_reason"],
                                    tuple(int(t) for t in meta["token_ids"]),
                                    tuple(TokenLogprob.from_wire(e) for e in meta.get("logprobs", ())))
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HandoffError(f"reading the continuation from {moved.target.pod}: {err}") from err
        if next_moved is None:
            raise HandoffError(f"{moved.target.pod} ended the stream of {moved.request_id} without [DONE]")
        log.info("request %s moved on from %s to %s", moved.request_id, moved.target.pod, next_moved.target.pod)
        moved = next_moved
