"""The official `openai` client against a pool's router, with builtin and with vLLM workers: what users of
vLLM send every day (n, logprobs, top_logprobs, echo, seed, penalties, response_format, tools) is
answered in the shapes the client parses, and bad values still get a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from migration_testing import Worker, free_port, start_worker
from worker_testing import TEST_KV_CAPACITY_BYTES, EngineLoop, StartedEngine, start_engine

from kvfleet.router.app import Router, RouterConfig
from kvfleet.router.placement import PoolSnapshot, WorkerState
from kvfleet.router.pool import StaticPoolView
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.worker.engines.base import EngineInfo
from kvfleet.worker.text import Tokenizer

TOKEN = "s3cret-pool-token"
PROMPT = "Once upon a time"


class SharedEngine:
    """The session's engine behind an agent that must not stop it (other tests use it too)."""

    def __init__(self, started: StartedEngine) -> None:
        self._engine = started.engine

    async def stop(self) -> None:
        pass

    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.fixture(scope="module", params=["builtin", "vllm"])
def client(request: pytest.FixtureRequest, tiny_model_dir: Path, engine_loop: EngineLoop,
           started_engines: dict[str, StartedEngine]) -> Iterator[openai.OpenAI]:
    """A router in front of one worker of the engine, and the official client pointed at the router."""
    engine = SharedEngine(start_engine(request.param, tiny_model_dir, started_engines, engine_loop))
    worker: Worker = start_worker(f"worker-{request.param}", tiny_model_dir, engine_loop, engine=engine)
    snapshot = PoolSnapshot((WorkerState("w0", worker.address, True, 0, TEST_KV_CAPACITY_BYTES),), {})
    router = Router(RouterConfig(pool_name="test", credentials=PoolCredentials.of(TOKEN)), StaticPoolView(snapshot))
    port = free_port()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(router.app(), shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = engine_loop.run(start())
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        engine_loop.run(runner.cleanup())
        engine_loop.run(worker.runner.cleanup())


def no_whitespace(model_dir: Path) -> dict[str, int]:
    """A logit_bias that keeps the random-weight tiny model from writing JSON's optional whitespace forever."""
    tokenizer = Tokenizer(model_dir)
    texts = tokenizer.token_texts(list(range(tokenizer.vocab_size)))
    return {str(i): -100 for i, text in enumerate(texts) if text and not text.strip()}


def test_completions_n_seed_logprobs_echo_and_penalties(client: openai.OpenAI) -> None:
    sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2, seed=3, temperature=1.0,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in sampled.choices] == [0, 1] and sampled.usage is not None
    assert sampled.usage.completion_tokens == 16
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, seed=4, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == sampled.choices[1].text, "sample 1 of seed 3 is seed 4's"
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2, temperature=0,
                                       presence_penalty=0.5, frequency_penalty=0.5,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.1, "top_k": 5,
                                                   "min_p": 0.05})
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == 6 and "".join(logprobs.tokens) == scored.choices[0].text.replace("\ufffd", "")
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, temperature=0,
                                       extra_body={"ignore_eos": True})
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_chat_logprobs_seed_and_response_format(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Say something"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, logprobs=True,
                                           top_logprobs=2, seed=1, temperature=0.7, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 5
    assert all(len(t.top_logprobs) == 2 for t in content.content)
    assert "".join(t.token for t in content.content) == (reply.choices[0].message.content or "").replace("\ufffd", "")
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=1, temperature=0.7,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == reply.choices[0].message.content
    picked = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": {"enum": ["left", "right"]}}})
    assert json.loads(picked.choices[0].message.content or "") in ("left", "right")


def test_tools(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    tools: Any = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "weather"}}, logit_bias=no_whitespace(tiny_model_dir))
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    call: Any = calls[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    follow_up = client.chat.completions.create(
        model="tiny", tools=tools, max_tokens=4, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
                      "name": "weather", "arguments": call.function.arguments}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow_up.choices[0].message.content


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 0}, "n"), ({"top_logprobs": 2}, "top_logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"tool_choice": "required"}, "tool_choice")])
def test_bad_values_are_a_400_naming_the_field(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       **kwargs)
    body: Any = refused.value.body
    assert body["param"] == param, body
