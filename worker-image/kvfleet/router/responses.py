"""The client's answer from one relayed request: whole JSON or server-sent events, completion or chat.

Whatever the client asked for, the router reads the worker's router-mode stream (relay.py) and
converts it back here; a request for `n` samples is n relays, each one sample, merged here by choice
index (log-probabilities too: the workers send them in neutral form with each chunk's tokens). Stop
strings are applied by the worker, token by token (so the tokens after one are neither sent nor
counted), and again here, so that a request resumed on another worker still stops at a stop string
that spans the two workers' outputs. The first step
is awaited before any byte goes out, so a refusal is still a plain HTTP error; a failure after that
ends the stream with an error event and no `[DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from aiohttp import web

from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.relay import Relay, RelayFailed, Step, Unplaceable, WorkerRefused
from kvfleet.serving.aio import gather_all, merged
from kvfleet.serving.httpapi import REQUEST_ID_HEADER, SSE_DONE, SSE_HEADERS, sse_data
from kvfleet.serving.openai_api import (
    APIError,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    LogprobsLayout,
    ResponseShape,
    TokenLogprob,
    ToolReplies,
    now_s,
    usage,
)
from kvfleet.serving.stops import StopStrings

# Failures of the relay once the first step was read: the request failed midway.
_MIDWAY = (RelayFailed, Unplaceable, WorkerRefused)


async def respond(request: web.Request, relays: Sequence[Relay], body: CompletionRequest | ChatCompletionRequest,
                  chat: bool, metrics: RouterMetrics, arrived_s: float, request_id: str, *, stagger: bool = False
                  ) -> web.StreamResponse:
    """Relays the request's samples (one relay each, `n`) and answers the client in the shape it asked for;
    `stagger`: the first sample alone until its first output, the others then (they share its prompt)."""
    shape = ResponseShape(request_id, now_s(), body.model, chat)
    steps = [relay.steps() for relay in relays]
    try:
        try:
            # A refusal before any output is still a plain HTTP error.
            if stagger and len(steps) > 1:
                first = await anext(steps[0], None)
                heads = [first, *await gather_all([anext(s, None) for s in steps[1:]])]
            else:
                heads = await gather_all([anext(s, None) for s in steps])
        except WorkerRefused as err:
            metrics.errors.labels(str(err.status)).inc()
            return web.json_response(err.body, status=err.status)
        except Unplaceable as err:
            raise APIError(503, err.why.message, error_type="server_error", code=err.why.reason.replace("-", "_")) from None
        except RelayFailed as err:
            raise APIError(502, str(err), error_type="server_error", code="workers_failed") from None
        timer = _FirstText(metrics, arrived_s)
        texts = [_client_texts(head, s, StopStrings(body.stop_strings(), include=body.include_stop_str_in_output), timer)
                 for head, s in zip(heads, steps, strict=True)]
        wants_logprobs = body.top_logprobs_wanted() is not None
        replies = ToolReplies(body)
        if not body.stream:
            return await _whole(relays, shape, texts, wants_logprobs, replies)
        return await _stream(request, relays, shape, texts, body.include_usage_in_stream(), metrics, wants_logprobs,
                             replies)
    finally:
        for stream in steps:
            await stream.aclose()


class _FirstText:
    """Observes the time to the request's first text and to its second (whichever sample gives them):
    in a disaggregated pool the second comes after the hand-over to the decode worker."""

    def __init__(self, metrics: RouterMetrics, arrived_s: float) -> None:
        self.metrics = metrics
        self.arrived_s = arrived_s
        self.seen = 0

    def text(self) -> None:
        if self.seen < 2:
            self.seen += 1
            histogram = self.metrics.time_to_first_token if self.seen == 1 else self.metrics.time_to_second_token
            histogram.observe(time.monotonic() - self.arrived_s)


async def _client_texts(head: Step | None, steps: AsyncIterator[Step], stops: StopStrings, timer: _FirstText
                        ) -> AsyncGenerator[Step, None]:
    """The steps as the client gets them: cut at a stop string, the first text timed."""
    step = head
    while step is not None:
        text = stops.feed(step.text)
        finish = "stop" if stops.stopped else step.finish_reason
        if finish is not None and not stops.stopped:
            text += stops.finish()
        if text:
            timer.text()
        yield Step(text, finish, step.logprobs)
        if finish is not None:
            return
        step = await anext(steps, None)


def _counts(relays: Sequence[Relay]) -> dict[str, int]:
    return usage(len(relays[0].prompt_token_ids or []), sum(len(r.output_token_ids) for r in relays))


async def _whole(relays: Sequence[Relay], shape: ResponseShape, texts: list[AsyncGenerator[Step, None]],
                 wants_logprobs: bool, replies: ToolReplies) -> web.Response:
    async def one(steps: AsyncIterator[Step]) -> Choice:
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        finish_reason = "stop"
        async for step in steps:
            parts.append(step.text)
            logprobs.extend(step.logprobs)
            finish_reason = step.finish_reason or finish_reason
        return replies.whole("".join(parts), finish_reason, LogprobsLayout(shape.chat).of(logprobs) if wants_logprobs
                             else None)

    try:
        choices = await gather_all([one(t) for t in texts])
    except _MIDWAY as err:
        raise APIError(502, f"the request failed midway: {err}", error_type="server_error", code="workers_failed") from None
    return web.json_response(shape.whole(choices, _counts(relays)), headers={REQUEST_ID_HEADER: shape.request_id})


async def _stream(request: web.Request, relays: Sequence[Relay], shape: ResponseShape,
                  texts: list[AsyncGenerator[Step, None]], include_usage: bool, metrics: RouterMetrics,
                  wants_logprobs: bool, replies: ToolReplies) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, REQUEST_ID_HEADER: shape.request_id})
    await response.prepare(request)
    if shape.chat:
        for index in range(len(texts)):
            await response.write(sse_data(shape.first_chunk(index=index)))
    layouts = [LogprobsLayout(shape.chat) for _ in texts]
    tool_streams = [replies.stream() for _ in texts]
    try:
        async for index, step in merged(list(enumerate(texts))):
            logprobs = layouts[index].of(step.logprobs) if wants_logprobs and step.logprobs else None
            if replies.calls_tools:
                for part, finish in tool_streams[index].step(step.text, step.finish_reason):
                    await response.write(sse_data(shape.chunk(None, finish, index=index, logprobs=logprobs, delta=part)))
                    logprobs = None
            elif step.text or step.finish_reason is not None or logprobs is not None:
                await response.write(sse_data(shape.chunk(step.text, step.finish_reason, index=index, logprobs=logprobs)))
    except _MIDWAY as err:
        metrics.errors.labels("502").inc()
        await response.write(sse_data(APIError(502, f"the request failed midway: {err}", error_type="server_error",
                                               code="workers_failed").body()))
        return response
    if include_usage:
        await response.write(sse_data(shape.usage_chunk(_counts(relays))))
    await response.write(SSE_DONE)
    return response
