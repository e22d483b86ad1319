"""The relay's index bookkeeping against scripted workers: exact cases a real engine cannot be made to
produce on demand (a continuation that repeats a chunk, one that skips tokens, a stream that dies
while the detokenizer holds text back)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from kvfleet.router.placement import NoRoute, RouteChoice
from kvfleet.router.relay import Relay, Timeouts
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.serving.openai_api import ChatCompletionRequest, CompletionRequest, resume_fields, validated

PROMPT = [1, 2, 3]


def chunk(index: int, ids: list[int], text: str, finish: str | None = None, prompt: bool = False) -> bytes:
    meta: dict[str, Any] = {"index": index, "token_ids": ids}
    if prompt:
        meta["prompt_token_ids"] = PROMPT
    body = {"id": "r1", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "kvfleet": meta}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Scripted:
    """A fake worker answering each path with a scripted SSE body, recording what it was asked."""

    def __init__(self, scripts: dict[str, list[bytes] | dict[str, Any]]) -> None:
        self.scripts = scripts
        self.asked: list[tuple[str, dict[str, str], Any]] = []
        self.port = 0
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.method == "POST" else None
        self.asked.append((request.path, dict(request.query), body))
        if request.path.startswith("/internal/"):
            assert request.headers.get("Authorization") == "Bearer tok", "an internal path without the pool token"
        script = self.scripts[request.path]
        if isinstance(script, dict):
            return web.json_response(script)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for part in script:
            await response.write(part)
        return response

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return f"127.0.0.1:{self.port}"


async def relay_through(source: Scripted, others: list[Scripted], body: dict[str, Any],
                        path: str = "/v1/completions") -> tuple[str, Relay]:
    addresses = {"source": await source.start()}
    for i, other in enumerate(others):
        addresses[f"other{i}"] = await other.start()
    order = ["source", *addresses.keys() - {"source"}]

    def place(exclude: frozenset[str]) -> RouteChoice | NoRoute:
        for name in sorted(order, key=order.index):
            if name not in exclude:
                return RouteChoice(name, addresses[name], "test")
        return NoRoute("no-ready-worker", "none")

    try:
        async with aiohttp.ClientSession() as session:
            model = ChatCompletionRequest if path.endswith("/chat/completions") else CompletionRequest
            relay = Relay(session, "r1", path, body, resume=resume_fields(validated(model, body)), place=place,
                          credentials=PoolCredentials.of("tok"),
                          timeouts=Timeouts(connect_s=2, first_token_s=5, idle_s=5))
            text = "".join([step.text async for step in relay.steps()])
            return text, relay
    finally:
        for server in (source, *others):
            assert server.runner is not None
            await server.runner.cleanup()


BODY = {"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": 0}


def test_a_continuation_repeating_a_chunk_is_dropped_by_index() -> None:
    async def scenario() -> None:
        target = Scripted({"/internal/requests/r1/stream": [
            chunk(1, [11], "b"), chunk(2, [12], "c"), chunk(3, [13], "d", "length"), b"data: [DONE]\n\n"]})
        target_address = await target.start()
        source = Scripted({"/v1/completions": [
            chunk(0, [], "", prompt=True), chunk(0, [10], "a"), chunk(1, [11], "b"),
            b"event: kvfleet.migrated\ndata: " + json.dumps(
                {"request_id": "r1", "index": 2, "target": {"pod": "t", "address": target_address}}).encode() + b"\n\n"]})
        try:
            text, relay = await relay_through(source, [], BODY)
        finally:
            assert target.runner is not None
            await target.runner.cleanup()
        assert text == "abcd" and relay.output_token_ids == [10, 11, 12, 13] and relay.finish_reason == "length"
        assert target.asked == [("/internal/requests/r1/stream", {"after": "2"}, None)]
        assert source.asked[0][2]["stream"] is True

    asyncio.run(scenario())


def test_a_gap_is_resumed_by_tokens_from_what_the_client_has() -> None:
    async def scenario() -> None:
        # The resumed stream's indices count the whole output, the 2 tokens it carries included.
        resume = Scripted({"/internal/resume": [
            chunk(0, [], "", prompt=True), chunk(2, [12], "c"), chunk(3, [13], "d", "length"), b"data: [DONE]\n\n"]})
        source = Scripted({"/v1/completions": [chunk(0, [], "", prompt=True), chunk(0, [10], "a"), chunk(1, [11], "b"),
                                                chunk(3, [13], "d")]})
        text, relay = await relay_through(source, [resume], BODY)
        assert text == "abcd" and relay.output_token_ids == [10, 11, 12, 13]
        _, query, asked = resume.asked[0]
        # Continued after the 2 output tokens the client has: the worker counts them as output.
        assert query == {"output": "2"}
        assert asked["prompt"] == PROMPT + [10, 11] and asked["max_tokens"] == 2 and asked["temperature"] == 0

    asyncio.run(scenario())


def test_tokens_whose_text_was_held_back_are_generated_again_on_resume() -> None:
    async def scenario() -> None:
        # Token 11 came with no text (half a character): the client has seen only token 10's.
        resume = Scripted({"/internal/resume": [
            chunk(0, [], "", prompt=True), chunk(1, [11], "é"), chunk(2, [12], "z", "length"), b"data: [DONE]\n\n"]})
        source = Scripted({"/v1/completions": [chunk(0, [], "", prompt=True), chunk(0, [10], "a"), chunk(1, [11], "")]})
        text, relay = await relay_through(source, [resume], {**BODY, "max_tokens": 3})
        assert text == "aéz" and relay.output_token_ids == [10, 11, 12]
        _, query, asked = resume.asked[0]
        assert asked["prompt"] == PROMPT + [10] and asked["max_tokens"] == 2 and query == {"output": "1"}

    asyncio.run(scenario())


def test_a_chat_without_a_budget_resumes_with_the_rest_of_the_context() -> None:
    async def scenario() -> None:
        resume = Scripted({
            "/v1/models": {"object": "list", "data": [{"id": "tiny", "max_model_len": 10}]},
            "/internal/resume": [chunk(0, [], "", prompt=True), chunk(1, [11], "b", "stop"), b"data: [DONE]\n\n"]})
        delta = {"id": "r1", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}],
                 "kvfleet": {"index": 0, "token_ids": [10]}}
        source = Scripted({"/v1/chat/completions": [chunk(0, [], "", prompt=True),
                                                     b"data: " + json.dumps(delta).encode() + b"\n\n"]})
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        text, relay = await relay_through(source, [resume], chat, path="/v1/chat/completions")
        assert text == "ab" and relay.finish_reason == "stop"
        _, _, asked = resume.asked[-1]
        # 10 tokens of context, 3 of prompt, 1 already generated: 6 left. A resumed chat is a completion
        # of its rendered prompt's token ids, so the chat's own fields stay behind.
        assert asked["prompt"] == PROMPT + [10] and asked["max_tokens"] == 6 and "messages" not in asked

    asyncio.run(scenario())
