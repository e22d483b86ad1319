"""The official `openai` client against a router over in-process workers, builtin and vLLM: what users of
vLLM send every day (n, logprobs, top_logprobs, echo, seed, penalties, response_format, tools) is
answered in the shapes the client parses, and bad values still get a 400 naming the field (the
exercises: e2e/kvfleet_e2e/openai_client.py; e2e/test_openai_client.py runs them on real pools)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from migration_testing import Worker, serve_app, start_worker
from worker_testing import TEST_KV_CAPACITY_BYTES, EngineLoop, SharedEngine, StartedEngine, start_engine

from kvfleet.router.app import Router, RouterConfig
from kvfleet.router.placement import PoolSnapshot, WorkerState
from kvfleet.router.pool import StaticPoolView
from kvfleet.serving.credentials import PoolCredentials
from kvfleet_e2e import openai_client as exercises

TOKEN = "s3cret-pool-token"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module", params=["builtin", "vllm"])
def client(request: pytest.FixtureRequest, tiny_model_dir: Path, engine_loop: EngineLoop,
           started_engines: dict[str, StartedEngine]) -> Iterator[openai.OpenAI]:
    """A router in front of one worker of the engine, and the official client pointed at the router."""
    engine = SharedEngine(start_engine(request.param, tiny_model_dir, started_engines, engine_loop))
    worker: Worker = start_worker(f"worker-{request.param}", tiny_model_dir, engine_loop, engine=engine)
    snapshot = PoolSnapshot((WorkerState("w0", worker.address, True, 0, TEST_KV_CAPACITY_BYTES),), {})
    router = Router(RouterConfig(pool_name="test", credentials=PoolCredentials.of(TOKEN)), StaticPoolView(snapshot))
    runner, port = serve_app(engine_loop, router.app())
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        engine_loop.run(runner.cleanup())
        engine_loop.run(worker.runner.cleanup())


def test_completions_n_seed_logprobs_echo_and_penalties(client: openai.OpenAI) -> None:
    exercises.completions(client)


def test_chat_logprobs_seed_and_response_format(client: openai.OpenAI) -> None:
    exercises.chat(client)


def test_tools(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    exercises.tools(client, tiny_model_dir)


def test_bad_values_are_a_400_naming_the_field(client: openai.OpenAI) -> None:
    exercises.bad_values(client)
