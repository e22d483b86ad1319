"""The client's answer from one relayed request: whole JSON or server-sent events, completion or chat.

Whatever the client asked for, the router reads the worker's router-mode stream (relay.py) and
converts it back here. Stop strings are applied here, not by the worker, so that a request resumed
on another worker still stops at a stop string that spans the two workers' outputs. The first step
is awaited before any byte goes out, so a refusal is still a plain HTTP error; a failure after that
ends the stream with an error event and no `[DONE]`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator

from aiohttp import web

from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.relay import Relay, RelayFailed, Step, Unplaceable, WorkerRefused
from kvfleet.serving.httpapi import REQUEST_ID_HEADER, SSE_DONE, SSE_HEADERS, sse_data
from kvfleet.serving.openai_api import APIError, ChatCompletionRequest, CompletionRequest, ResponseShape, now_s, usage
from kvfleet.serving.stops import StopStrings

# Failures of the relay once the first step was read: the request failed midway.
_MIDWAY = (RelayFailed, Unplaceable, WorkerRefused)


async def respond(request: web.Request, relay: Relay, body: CompletionRequest | ChatCompletionRequest, chat: bool,
                  metrics: RouterMetrics, arrived_s: float) -> web.StreamResponse:
    """Relays the request and answers the client in the shape it asked for."""
    shape = ResponseShape(relay.request_id, now_s(), body.model, chat)
    async with contextlib.aclosing(relay.steps()) as steps:
        try:
            head = await anext(steps, None)
        except WorkerRefused as err:
            metrics.errors.labels(str(err.status)).inc()
            return web.json_response(err.body, status=err.status)
        except Unplaceable as err:
            raise APIError(503, err.why.message, error_type="server_error", code=err.why.reason.replace("-", "_")) from None
        except RelayFailed as err:
            raise APIError(502, str(err), error_type="server_error", code="workers_failed") from None
        texts = _client_texts(head, steps, StopStrings(body.stop_strings()), metrics, arrived_s)
        if not body.stream:
            return await _whole(relay, shape, texts)
        return await _stream(request, relay, shape, texts, body.include_usage_in_stream(), metrics)


async def _client_texts(head: Step | None, steps: AsyncIterator[Step], stops: StopStrings, metrics: RouterMetrics,
                        arrived_s: float) -> AsyncGenerator[tuple[str, str | None], None]:
    """(text, finish reason or None) as the client gets them: cut at a stop string, the first text timed."""
    first_text_seen = False
    step = head
    while step is not None:
        text = stops.feed(step.text)
        finish = "stop" if stops.stopped else step.finish_reason
        if finish is not None and not stops.stopped:
            text += stops.finish()
        if text and not first_text_seen:
            first_text_seen = True
            metrics.time_to_first_token.observe(time.monotonic() - arrived_s)
        yield text, finish
        if finish is not None:
            return
        step = await anext(steps, None)


def _counts(relay: Relay) -> dict[str, int]:
    return usage(len(relay.prompt_token_ids or []), len(relay.output_token_ids))


async def _whole(relay: Relay, shape: ResponseShape, texts: AsyncIterator[tuple[str, str | None]]) -> web.Response:
    parts: list[str] = []
    finish_reason = "stop"
    try:
        async for text, finish in texts:
            parts.append(text)
            finish_reason = finish or finish_reason
    except _MIDWAY as err:
        raise APIError(502, f"the request failed midway: {err}", error_type="server_error", code="workers_failed") from None
    return web.json_response(shape.whole("".join(parts), finish_reason, _counts(relay)),
                             headers={REQUEST_ID_HEADER: relay.request_id})


async def _stream(request: web.Request, relay: Relay, shape: ResponseShape, texts: AsyncIterator[tuple[str, str | None]],
                  include_usage: bool, metrics: RouterMetrics) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, REQUEST_ID_HEADER: relay.request_id})
    await response.prepare(request)
    if shape.chat:
        await response.write(sse_data(shape.first_chunk()))
    try:
        async for text, finish in texts:
            if text or finish is not None:
                await response.write(sse_data(shape.chunk(text, finish)))
    except _MIDWAY as err:
        metrics.errors.labels("502").inc()
        await response.write(sse_data(APIError(502, f"the request failed midway: {err}", error_type="server_error",
                                               code="workers_failed").body()))
        return response
    if include_usage:
        await response.write(sse_data(shape.usage_chunk(_counts(relay))))
    await response.write(SSE_DONE)
    return response
