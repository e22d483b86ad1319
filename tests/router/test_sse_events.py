"""`kvfleet.serving.httpapi.sse_events`: events as the worker wrote them, and its idle limit, which
counts the stream's silence and not the reader's own time over an event."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvfleet.serving.httpapi import sse_data, sse_event, sse_events


def stream_server(pieces: list[tuple[float, bytes]]) -> web.Application:
    """Writes each piece after its pause (seconds), then ends the body."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for pause_s, piece in pieces:
            await asyncio.sleep(pause_s)
            await response.write(piece)
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    return app


async def read(pieces: list[tuple[float, bytes]], idle_s: float | None, think_s: float = 0.0) -> list[tuple[str, str]]:
    async with TestServer(stream_server(pieces)) as server, aiohttp.ClientSession() as session, \
            session.get(server.make_url("/")) as response:
        events = []
        async for event in sse_events(response.content, idle_s):
            events.append(event)
            await asyncio.sleep(think_s)
        return events


def test_events_with_names_and_data_as_written() -> None:
    pieces = [(0.0, sse_data({"a": 1})), (0.0, sse_event("kvfleet.migrated", {"to": "w1"})), (0.0, b"data: [DONE]\n\n")]
    assert asyncio.run(read(pieces, 5.0)) == [("message", '{"a":1}'), ("kvfleet.migrated", '{"to":"w1"}'),
                                              ("message", "[DONE]")]


def test_a_silence_longer_than_the_limit_fails_the_stream() -> None:
    pieces = [(0.0, sse_data({"a": 1})), (1.5, sse_data({"a": 2}))]
    events: list[tuple[str, str]] = []

    async def go() -> None:
        async with TestServer(stream_server(pieces)) as server, aiohttp.ClientSession() as session, \
                session.get(server.make_url("/")) as response:
            async for event in sse_events(response.content, 0.4):
                events.append(event)

    with pytest.raises(TimeoutError, match="no data for"):
        asyncio.run(go())
    assert events == [("message", '{"a":1}')]


def test_the_readers_own_time_over_an_event_does_not_count() -> None:
    # The reader spends 0.6 s on each event, past the 0.3 s limit, while the stream has the next ready.
    pieces = [(0.0, sse_data({"a": i})) for i in range(3)]
    assert [data for _, data in asyncio.run(read(pieces, 0.3, think_s=0.6))] == ['{"a":0}', '{"a":1}', '{"a":2}']
    # And pauses under the limit, many times over, never add up to one.
    pieces = [(0.15, sse_data({"a": i})) for i in range(6)]
    assert len(asyncio.run(read(pieces, 0.4))) == 6
