"""The worker's measured speed: the recorder's buckets and means on synthetic steps, the builtin
engine's reading of a step's shape, and `GET /kvfleet/speed-profile` on a real builtin worker."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from worker_testing import TEST_KV_CAPACITY_BYTES, EngineLoop

from kvfleet.api.speed import DecodePoint, PrefillPoint, SpeedProfile, context_bucket
from kvfleet.serving.openai_api import APIError
from kvfleet.worker.agent import Agent, AgentConfig
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import EngineInfo
from kvfleet.worker.engines.builtin.engine import BuiltinEngine
from kvfleet.worker.engines.builtin.model import SeqBatchEntry
from kvfleet.worker.engines.builtin.scheduler import Step
from kvfleet.worker.engines.capabilities import EngineCapabilities
from kvfleet.worker.engines.speed import SpeedRecorder
from kvfleet.worker.text import Tokenizer

MODEL = "tiny"
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # the tiny model in float32 (worker_testing.py)

# -- the recorder ---------------------------------------------------------------------------------


def test_no_profile_before_the_first_step() -> None:
    recorder = SpeedRecorder("builtin")
    assert recorder.profile("m", 2048, 1 << 20) is None
    recorder.record_step(0, 0, 0, 0.5)  # an empty batch is no step
    recorder.record_step(1, 10, 0, 0.0)  # nor is one the clock did not see
    assert recorder.profile("m", 2048, 1 << 20) is None and recorder.num_samples == 0


def test_decode_steps_are_bucketed_by_batch_and_context_and_averaged() -> None:
    recorder = SpeedRecorder("builtin")
    # Contexts 8 and 11 share a bucket (7), 12 is the next (8); batch 2 is its own point.
    assert (context_bucket(8), context_bucket(11), context_bucket(12)) == (7, 7, 8)
    recorder.record_step(1, 8, 0, 0.010)
    recorder.record_step(1, 11, 0, 0.020)
    recorder.record_step(1, 11, 0, 0.030)
    recorder.record_step(1, 12, 0, 0.040)
    recorder.record_step(2, 8, 0, 0.050)
    profile = recorder.profile("tiny", 2048, 16 << 20)
    assert profile is not None
    assert (profile.engine, profile.model, profile.kv_bytes_per_token, profile.capacity_bytes) == (
        "builtin", "tiny", 2048, 16 << 20)
    assert profile.link_bytes_per_second is None and profile.prefill == []
    assert [(p.batch, p.context_tokens, p.samples) for p in profile.decode] == [(1, 10.0, 3), (1, 12.0, 1), (2, 8.0, 1)]
    assert [p.step_seconds for p in profile.decode] == pytest.approx([0.020, 0.040, 0.050])
    assert profile.num_samples == 5


def test_a_step_that_prefilled_is_a_prefill_point_by_its_prompt_tokens() -> None:
    recorder = SpeedRecorder("builtin")
    # 100 and 120 share a bucket (14); 200 is bucket 16. The batch and its context do not matter.
    assert (context_bucket(100), context_bucket(120), context_bucket(200)) == (14, 14, 16)
    recorder.record_step(1, 100, 100, 0.1)
    recorder.record_step(3, 400, 120, 0.3)
    recorder.record_step(1, 200, 200, 0.5)
    recorder.record_step(4, 300, 0, 0.01)  # decode
    profile = recorder.profile("tiny", 2048, 16 << 20)
    assert profile is not None
    assert [(p.tokens, p.samples) for p in profile.prefill] == [(110.0, 2), (200.0, 1)]
    assert [p.step_seconds for p in profile.prefill] == pytest.approx([0.2, 0.5])
    assert profile.decode == [DecodePoint(batch=4, context_tokens=300.0, step_seconds=0.01, samples=1)]


def test_memory_is_one_bucket_per_key_whatever_the_number_of_steps() -> None:
    recorder = SpeedRecorder("builtin")
    for i in range(10_000):
        recorder.record_step(2, 64 + i % 16, 0, 0.001)  # contexts 64..79: all bucket 13
        recorder.record_step(2, 2000, 1000, 0.002)
    profile = recorder.profile("tiny", 2048, 16 << 20)
    assert profile is not None
    assert len(profile.decode) == 1 and len(profile.prefill) == 1
    assert profile.decode[0].samples == 10_000 and profile.decode[0].context_tokens == 71.5
    assert (profile.prefill[0].tokens, profile.prefill[0].samples) == (1000.0, 10_000)
    assert profile.prefill[0].step_seconds == pytest.approx(0.002)


# -- the builtin engine's reading of a step ---------------------------------------------------------


def recorded(entries: list[SeqBatchEntry], seconds: float = 0.25) -> SpeedProfile:
    engine = BuiltinEngine(EngineConfig(model_path=Path("/nonexistent")))  # never started: no model needed
    engine._record_speed(Step((), tuple(entries), ()), seconds)
    profile = engine._speed.profile("m", 1, 1)
    assert profile is not None
    return profile


def test_a_decode_step_counts_every_token_the_batch_holds() -> None:
    # Three requests each writing their one new token after 10, 20 and 33 cached: 66 tokens of KV.
    profile = recorded([SeqBatchEntry([5], 10, [0]), SeqBatchEntry([6], 20, [1, 2]), SeqBatchEntry([7], 33, [3, 4, 5])])
    assert profile.prefill == []
    assert profile.decode == [DecodePoint(batch=3, context_tokens=66.0, step_seconds=0.25, samples=1)]


def test_a_step_with_a_prompt_is_a_prefill_of_its_prompt_tokens_only() -> None:
    # One request decodes (1 token after 40) while a 7-token prompt and a 3-token re-prefill go in.
    profile = recorded([SeqBatchEntry([1], 40, [0]), SeqBatchEntry(list(range(7)), 0, [1]),
                        SeqBatchEntry([1, 2, 3], 16, [2, 3])])
    assert profile.decode == []
    assert profile.prefill == [PrefillPoint(tokens=10.0, step_seconds=0.25, samples=1)]


# -- GET /kvfleet/speed-profile on a real worker ------------------------------------------------------


@dataclass
class Worker:
    port: int
    agent: Agent

    def get(self, path: str) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer: dict[str, Any] = json.loads(response.read())
        assert response.status == 200, answer
        return answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[Worker]:
    # Its own engine: the profile counts every step this engine ever ran, so no other test may share it.
    engine = load_engine("builtin", EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                                                 max_model_len=256))
    agent = Agent(AgentConfig(model_name=MODEL, migration_port=None), engine, Tokenizer(tiny_model_dir), None)
    port = free_port()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(agent.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = engine_loop.run(start())
    w = Worker(port, agent)
    deadline = time.monotonic() + 120
    while w.get("/readyz")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    yield w
    engine_loop.run(runner.cleanup())


def test_the_worker_serves_what_its_engine_measured(worker: Worker) -> None:
    status, body = worker.get("/kvfleet/speed-profile")
    assert status == 404, body
    assert body["error"]["code"] == "no_speed_profile"
    assert body["error"]["message"] == "the builtin engine has run no step yet: nothing measured"

    prompt, max_tokens = [1, 17, 300, 45, 99], 11
    answer = worker.complete({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": True})
    assert answer["usage"]["completion_tokens"] == max_tokens

    # The last step is recorded once its period ends, just after the response left: wait for it.
    deadline = time.monotonic() + 5
    while True:
        status, body = worker.get("/kvfleet/speed-profile")
        assert status == 200, body
        profile = SpeedProfile.model_validate(body)
        if profile.num_samples == max_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert (profile.kind, profile.engine, profile.model) == ("SpeedProfile", "builtin", MODEL)
    assert profile.kv_bytes_per_token == KV_BYTES_PER_TOKEN
    assert profile.capacity_bytes == worker.agent.engine.info.kv_capacity_bytes == TEST_KV_CAPACITY_BYTES
    assert body["kvBytesPerToken"] == KV_BYTES_PER_TOKEN and body["linkBytesPerSecond"] is None  # camelCase
    # Step 1 prefilled the 5 prompt tokens and sampled token 1; steps 2..11 each decoded one, the
    # request then holding 5 + k - 1 tokens: contexts 6..15, by bucket.
    assert [(p.tokens, p.samples) for p in profile.prefill] == [(5.0, 1)]
    contexts = [len(prompt) + k - 1 for k in range(2, max_tokens + 1)]
    buckets: dict[int, list[int]] = {}
    for c in contexts:
        buckets.setdefault(context_bucket(c), []).append(c)
    assert [(p.batch, p.context_tokens, p.samples) for p in profile.decode] == [
        (1, sum(cs) / len(cs), len(cs)) for _, cs in sorted(buckets.items())]
    assert [p.samples for p in profile.decode] == [2, 4, 4]  # contexts 6-7, 8-11, 12-15
    assert profile.num_samples == max_tokens


def test_the_profile_carries_the_latest_link_measurement(worker: Worker) -> None:
    worker.complete({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    worker.agent.migration_metrics.link.set(1.5e9)  # what the executor sets after a KV copy
    try:
        status, body = worker.get("/kvfleet/speed-profile")
        assert status == 200, body
        assert body["linkBytesPerSecond"] == 1.5e9
    finally:
        worker.agent.migration_metrics.link.set(0)  # unset again: a gauge at 0 is "never measured"


class NotMeasuring:
    """Just enough of an engine for the agent's handler: one that does not time its steps (vLLM's case)."""

    info = EngineInfo(engine="vllm", model_path="/m", max_model_len=256, block_size_tokens=16,
                      kv_bytes_per_token=KV_BYTES_PER_TOKEN, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES)

    capabilities = EngineCapabilities()

    def speed_profile(self) -> SpeedProfile | None:
        return None


def test_an_engine_that_does_not_measure_gets_a_404_that_says_so(tiny_model_dir: Path) -> None:
    agent = Agent(AgentConfig(model_name=MODEL, migration_port=None), NotMeasuring(),  # type: ignore[arg-type]
                  Tokenizer(tiny_model_dir), None)
    request = make_mocked_request("GET", "/kvfleet/speed-profile")
    with pytest.raises(APIError) as loading:
        asyncio.run(agent._speed_profile(request))
    assert (loading.value.status, loading.value.code) == (404, "no_speed_profile")
    assert loading.value.message == "the model is still loading: no step has run yet"
    agent._info = NotMeasuring.info
    with pytest.raises(APIError) as refused:
        asyncio.run(agent._speed_profile(request))
    assert (refused.value.status, refused.value.code) == (404, "speed_not_measured")
    assert refused.value.message == "the vllm engine does not measure its step speed"
