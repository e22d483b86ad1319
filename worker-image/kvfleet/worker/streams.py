"""One request's life on this worker's engine, as a stream of text deltas that survives a migration.

Both HTTP shapes (whole JSON and SSE, completion and chat) and a request handed over to this worker
consume the same stream: `RequestStreams.deltas` turns the engine's token steps into text (the
detokenizer, stop strings), and when a migration stops the request here it asks the hand-off
(`migration.handoff`) what follows: the stream rolled back to this engine, the target's continuation
relayed for a direct client, or `RequestMoved` for a router, which follows the move itself. It also
keeps the bookkeeping the rest of the agent reads: which requests run here (drain, the executor) and
how many direct clients' streams are being relayed from elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import NamedTuple

import aiohttp

from kvfleet.serving.credentials import PoolCredentials
from kvfleet.serving.httpapi import REQUEST_ID_HEADER
from kvfleet.serving.openai_api import APIError, TokenLogprob, now_s
from kvfleet.serving.stops import StopStrings
from kvfleet.worker.engines.base import (
    DuplicateRequest,
    Engine,
    EngineError,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
)
from kvfleet.worker.metrics import RequestMeter, WorkerMetrics
from kvfleet.worker.migration.handoff import (
    Continue,
    HandedRequest,
    HandoffError,
    Handoffs,
    LiveRequest,
    Moved,
    RequestMoved,
    StreamPosition,
    TextState,
    follow,
)
from kvfleet.worker.migration.host import continue_request
from kvfleet.worker.text import Detokenizer, Tokenizer

log = logging.getLogger(__name__)


class Delta(NamedTuple):
    """What one engine step gave the client: text (maybe none yet), the finish reason on the last, the
    step's token ids and, when the request asked for them, their log-probabilities."""

    text: str
    finish_reason: str | None
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class Job:
    """One admitted request, ready for the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    model: str = ""
    created: int = field(default_factory=now_s)
    # OpenAI's include_stop_str_in_output: the stop string that ended the request stays in its text.
    include_stop: bool = False
    # Output the request already has from a worker that died (the router's resume): it continues after
    # it, which counts it where sampling depends on the output (penalties, min_tokens, a grammar).
    output_token_ids: list[int] = field(default_factory=list)
    # When the request reached this worker (time.monotonic): vLLM's time to first token starts here.
    arrived_s: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Resumed:
    """A request handed over to this worker: the stream its engine continues it in, and where it stood."""

    stream: AsyncIterator[StepOutput]
    handed: HandedRequest


class RequestStreams:
    """The requests running on this worker's engine, each read as text deltas."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: WorkerMetrics, handoffs: Handoffs,
                 credentials: PoolCredentials | None, nudge_reporter: Callable[[], None]) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.handoffs = handoffs
        self.credentials = credentials
        self.nudge_reporter = nudge_reporter
        self.live: dict[str, LiveRequest] = {}
        self.active: set[str] = set()
        # Direct clients' streams relayed from the worker their request moved to (drain waits for them).
        self.num_relays = 0
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def deltas(self, job: Job, follow_moves: bool = True, resumed: Resumed | None = None
                     ) -> AsyncGenerator[Delta, None]:
        """(text delta, finish reason or None, token ids of this step) until the request ends.

        Stop strings end the request here: the engine's stream is closed, which aborts it there.
        When a migration stops the request on this engine, the executor's outcome decides what
        follows: the stream the source resumed (rolled back), or the target's continuation, relayed
        (`follow_moves`, a direct client) or left to the reader (RequestMoved, a router). `resumed`
        continues a request handed over to this worker from where the source's stream stood.
        """
        request_id = job.request_id
        stream: AsyncIterator[StepOutput]
        if resumed is None:
            try:
                if job.output_token_ids:
                    stream = continue_request(self.engine, request_id, job.prompt_token_ids, job.output_token_ids,
                                              job.params)
                else:
                    stream = self.engine.generate(request_id, job.prompt_token_ids, job.params)
            except EngineError as err:  # refused before it starts (the builtin engine checks at once)
                raise _client_error(err) from None
            detok = self.tokenizer.detokenizer(job.prompt_token_ids + job.output_token_ids)
            stops = StopStrings(job.stops, include=job.include_stop)
            # A resumed request's stream goes on from the output it brings (a migration hands all of it on).
            outputs = list(job.output_token_ids)
            self.metrics.prompt_tokens.inc(len(job.prompt_token_ids))
            meter = self.metrics.request(job.arrived_s, len(job.prompt_token_ids))
        else:
            stream = resumed.stream
            detok, stops = resumed.handed.text.restore(self.tokenizer, job.stops, job.include_stop)
            outputs = list(resumed.handed.output_token_ids)
            # Its first token, and so its prompt and its latencies from arrival, were the source's.
            meter = self.metrics.request(None, len(job.prompt_token_ids))
        self.live[request_id] = live = LiveRequest(request_id, job.prompt_token_ids, job.params, job.stops, job.created,
                                                   job.model, detok, stops, outputs, include_stop=job.include_stop)
        self.active.add(request_id)
        self.nudge_reporter()
        finish: str | None = None
        relaying = False
        try:
            while True:
                async with aclosing(self._engine_deltas(request_id, stream, detok, stops, outputs, meter,
                                                        job.params)) as steps:
                    async for delta in steps:
                        finish = delta[1]
                        yield delta
                if finish is not None:
                    break
                # The engine's stream ended unfinished: a migration stopped it, or it was aborted.
                outcome = await self.handoffs.stopped(request_id, StreamPosition(tuple(outputs), TextState.of(detok, stops)))
                if isinstance(outcome, Continue):
                    log.info("migration of %s rolled back: it continues here", request_id)
                    stream = outcome.stream
                    continue
                if outcome is None:
                    break
                if not follow_moves:
                    raise RequestMoved(outcome)
                # The request lives elsewhere now (it may even come back here): only the relay is ours.
                self._leave(request_id, live)
                relaying = True
                self.num_relays += 1
                async for delta in self._relay(outcome):
                    outputs.extend(delta.token_ids)
                    finish = delta.finish_reason
                    yield delta
                break
        finally:
            if relaying:
                self.num_relays -= 1
            else:
                self._leave(request_id, live)
        if not relaying:  # a relayed request ends on, and is counted by, the worker it moved to
            self.metrics.requests.labels(finish or "abort").inc()
            meter.finished(finish or "abort")

    async def _engine_deltas(self, request_id: str, stream: AsyncIterator[StepOutput], detok: Detokenizer,
                             stops: StopStrings, outputs: list[int], meter: RequestMeter, params: SamplingParams
                             ) -> AsyncGenerator[Delta, None]:
        """Deltas of the engine's stream until the request finishes (the last one has the reason) or
        the stream ends unfinished (a migration stopped it, or it was aborted); appends to `outputs`.

        Stop strings are looked for token by token, as vLLM does: an engine output may hold several
        tokens (vLLM merges the outputs a slow reader has not taken), and the tokens after the one
        that completed a stop string are neither sent nor counted. The token that stopped a request
        (EOS, a stop token id) has no text, as in vLLM, unless include_stop_str_in_output."""
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids())
        async with aclosing(_checked(stream)) as outs:
            async for out in outs:
                ticket = self.handoffs.get(request_id)
                # An engine that can only stop a request by aborting it (vLLM): that abort is the migration's.
                handed_over = out.finished and out.finish_reason == "abort" and ticket is not None and ticket.stopping
                ids = out.new_token_ids
                texted = ids
                if out.finish_reason == "stop" and ids and ids[-1] in stop_ids and not stops.include:
                    texted = ids[:-1]
                text = ""
                for k, token in enumerate(texted):
                    text += stops.feed(detok.add((token,)))
                    if stops.stopped:
                        ids = ids[:k + 1]
                        break
                logprobs = self.token_logprobs(out.logprobs[:len(ids)], outputs)
                outputs.extend(ids)
                self.metrics.generated(len(ids))
                meter.tokens(len(ids))
                if stops.stopped:
                    yield Delta(text, "stop", ids, logprobs)
                    return
                if out.finished and not handed_over:
                    yield Delta(text + stops.feed(detok.flush()) + stops.finish(), out.finish_reason or "stop", ids, logprobs)
                    return
                if text or ids or not handed_over:
                    yield Delta(text, None, ids, logprobs)
                if handed_over:
                    return

    def token_logprobs(self, engine_logprobs: Sequence[TokenLogprobs], preceding: Sequence[int]
                       ) -> tuple[TokenLogprob, ...]:
        """The engine's log-probabilities (token ids) with each token's text as responses show them,
        given the output tokens before them (a byte of a multi-byte character is shown with the
        character it completes: Tokenizer.token_texts)."""
        entries = []
        context = list(preceding[-4:])
        for e in engine_logprobs:
            texts = self.tokenizer.token_texts([e.token_id, *(i for i, _ in e.top)], context)
            entries.append(TokenLogprob(e.token_id, texts[0], e.logprob,
                                        tuple((i, t, lp) for (i, lp), t in zip(e.top, texts[1:], strict=True))))
            context = [*context[-3:], e.token_id]
        return tuple(entries)

    def _eos_ids(self) -> frozenset[int]:
        info = self.engine.info
        return frozenset(info.eos_token_ids)

    def _leave(self, request_id: str, live: LiveRequest) -> None:
        """The request no longer runs on this engine for this stream (ended, or handed over)."""
        if self.live.get(request_id) is live:
            del self.live[request_id]
            self.handoffs.ended(request_id)
            self.active.discard(request_id)
        self.nudge_reporter()

    async def _relay(self, moved: Moved) -> AsyncGenerator[Delta, None]:
        """A direct client's continuation: the target's stream, read with the pool token, as deltas."""
        assert self.credentials is not None  # no token, no migration
        if self._session is None:
            self._session = aiohttp.ClientSession()
        log.info("relaying %s from %s (%s) from output index %d", moved.request_id, moved.target.pod,
                 moved.target.address, moved.index)
        try:
            async for chunk in follow(self._session, self.credentials.token, moved):
                yield Delta(chunk.text, chunk.finish_reason, chunk.token_ids, chunk.logprobs)
                if chunk.finish_reason is not None:
                    return
        except HandoffError as err:
            log.warning("the continuation of %s is lost: %s", moved.request_id, err)


def _client_error(err: EngineError) -> APIError:
    """An engine's refusal as the OpenAI-format client error that says it."""
    if isinstance(err, RequestTooLong):
        return APIError(400, str(err), code="context_length_exceeded")
    if isinstance(err, DuplicateRequest):
        return APIError(409, str(err), param=REQUEST_ID_HEADER, code="duplicate_request_id")
    return APIError(400, str(err))


async def _checked(stream: AsyncIterator[StepOutput]) -> AsyncGenerator[StepOutput, None]:
    """The engine's stream with its refusals turned into client errors."""
    try:
        async for out in stream:
            yield out
    except EngineError as err:
        raise _client_error(err) from None
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
