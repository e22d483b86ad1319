"""The worker agent over real HTTP with the builtin engine: OpenAI API, probes, metrics, bad input."""

from __future__ import annotations

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
from worker_testing import TEST_KV_CAPACITY_BYTES, EngineLoop

from kvfleet.api.reports import KVLoadReport
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.worker.agent import Agent, AgentConfig
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.text import Tokenizer

TOKEN = "s3cret-pool-token"
MODEL = "tiny"


@dataclass
class Worker:
    port: int
    agent: Agent
    reports: list[KVLoadReport]

    def request(self, method: str, path: str, body: bytes | dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()

    def post(self, path: str, body: bytes | dict[str, Any], **headers: str) -> tuple[int, Any]:
        status, raw = self.request("POST", path, body, headers)
        return status, json.loads(raw)

    def stream(self, path: str, body: dict[str, Any], **headers: str) -> list[Any]:
        status, raw = self.request("POST", path, {**body, "stream": True}, headers)
        assert status == 200, raw
        events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        return [json.loads(e) for e in events[:-1]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[Worker]:
    reports: list[KVLoadReport] = []

    async def write(report: KVLoadReport) -> None:
        annotation = report.to_annotation()  # what it would write
        reports.append(KVLoadReport.model_validate_json(annotation))

    engine = load_engine("builtin", EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                                                 max_model_len=256))
    agent = Agent(AgentConfig(model_name=MODEL, credentials=PoolCredentials.of(TOKEN), report_interval_s=0.05), engine,
                  Tokenizer(tiny_model_dir), write)
    port = free_port()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(agent.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = engine_loop.run(start())
    w = Worker(port, agent, reports)
    deadline = time.monotonic() + 120
    while w.request("GET", "/readyz")[0] != 200:
        assert time.monotonic() < deadline, w.request("GET", "/readyz")
        time.sleep(0.1)
    yield w
    engine_loop.run(runner.cleanup())


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def test_completion_whole_and_streamed_agree(worker: Worker) -> None:
    status, body = worker.post("/v1/completions", completion())
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8
    chunks = worker.stream("/v1/completions", completion(stream_options={"include_usage": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert len({c["id"] for c in chunks}) == 1


def test_chat_whole_and_streamed_agree(worker: Worker) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    status, whole = worker.post("/v1/chat/completions", body)
    assert status == 200, whole
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    chunks = worker.stream("/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


def test_token_stream_mode_carries_every_token_id_in_order(worker: Worker, tiny_model_dir: Path) -> None:
    """What the router resumes a request from: the prompt's ids, then each step's ids with its index."""
    _, whole = worker.post("/v1/completions", completion(max_tokens=12))
    chunks = worker.stream("/v1/completions", completion(max_tokens=12), **{"X-Kvfleet-Stream": "tokens"})
    tokenizer = Tokenizer(tiny_model_dir)
    assert chunks[0]["kvfleet"]["prompt_token_ids"] == tokenizer.encode("The quick brown fox")
    ids: list[int] = []
    for c in chunks:
        assert c["kvfleet"]["index"] == len(ids)
        ids += c["kvfleet"]["token_ids"]
    assert len(ids) == 12
    assert tokenizer.completion_text(ids) == whole["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    plain = worker.stream("/v1/completions", completion(max_tokens=12))
    assert all("kvfleet" not in c for c in plain)


def test_stop_string_cuts_the_text(worker: Worker) -> None:
    _, free = worker.post("/v1/completions", completion(max_tokens=24))
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    _, cut = worker.post("/v1/completions", completion(max_tokens=24, stop=[stop]))
    assert cut["choices"][0]["text"] == text[: text.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    chunks = worker.stream("/v1/completions", completion(max_tokens=24, stop=stop))
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[: text.find(stop)]


def test_the_request_id_header_names_the_request(worker: Worker) -> None:
    status, body = worker.post("/v1/completions", completion(), **{"X-Request-Id": "client-req-1"})
    assert status == 200 and body["id"] == "client-req-1"
    status, body = worker.post("/v1/completions", completion(), **{"X-Request-Id": "bad id with spaces"})
    assert status == 400 and body["error"]["param"] == "X-Request-Id"


BAD_REQUESTS: list[tuple[str, bytes | dict[str, Any], int, str]] = [
    ("malformed JSON", b'{"model": "tiny", "prompt": ', 400, "malformed JSON"),
    ("not UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    ("not an object", b"[1, 2]", 400, "JSON object"),
    ("unknown field", completion(frobnicate=1), 400, "unknown field 'frobnicate'"),
    ("negative max_tokens", completion(max_tokens=-5), 400, "max_tokens"),
    ("zero max_tokens", completion(max_tokens=0), 400, "max_tokens"),
    ("missing prompt", {"model": MODEL}, 400, "missing required field 'prompt'"),
    ("wrong type", completion(temperature="hot"), 400, "temperature"),
    ("n beyond 16", completion(n=17), 400, "n"),
    ("a regex that does not compile", completion(structured_outputs={"regex": "("}), 400, "regex"),
    ("min_tokens beyond max_tokens", completion(min_tokens=9), 400, "min_tokens"),
    ("prompt too long", completion(prompt="word " * 400), 400, "maximum context length is 256"),
    ("output too long", completion(max_tokens=10_000), 400, "maximum context length is 256"),
    ("token id out of vocabulary", completion(prompt=[1, 10**9]), 400, "vocabulary"),
    ("another model", completion(model="gpt-4"), 404, "does not exist"),
    ("too many stops", completion(stop=["a", "b", "c", "d", "e"]), 400, "at most 4"),
    ("image content", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "only text"),
    ("huge body", b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}', 413, "larger than"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error_and_the_worker_stays_up(worker: Worker, case: tuple[str, Any, int, str]) -> None:
    _, payload, expected_status, message = case
    path = "/v1/chat/completions" if isinstance(payload, dict) and "messages" in payload else "/v1/completions"
    status, body = worker.post(path, payload)
    assert status == expected_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert message in body["error"]["message"], body["error"]["message"]
    assert worker.request("GET", "/healthz")[0] == 200
    assert worker.post("/v1/completions", completion(max_tokens=2))[0] == 200


def test_internal_endpoints_require_the_pool_token(worker: Worker) -> None:
    assert worker.request("GET", "/internal/requests")[0] == 401
    assert worker.request("GET", "/internal/requests", headers={"Authorization": "Bearer wrong"})[0] == 401
    status, raw = worker.request("GET", "/internal/requests", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    assert json.loads(raw)["capacityBytes"] == worker.agent.engine.info.kv_capacity_bytes


def _metric_samples(worker: Worker) -> dict[str, float]:
    status, raw = worker.request("GET", "/metrics")
    assert status == 200
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in raw.decode().splitlines()
            if line and not line.startswith("#")}


def test_metrics_show_kv_capacity_and_tokens(worker: Worker) -> None:
    # The worker is shared with other tests: counters are compared with their values before.
    rejected = 'kvfleet_worker_rejected_requests_total{status="400"}'
    before = _metric_samples(worker)
    worker.post("/v1/completions", completion(max_tokens=4))
    assert worker.post("/v1/completions", completion(no_such_field=1))[0] == 400
    samples = _metric_samples(worker)
    assert samples["kvfleet_worker_kv_capacity_bytes"] == worker.agent.engine.info.kv_capacity_bytes
    assert samples["kvfleet_worker_generation_tokens_total"] - before.get("kvfleet_worker_generation_tokens_total", 0) == 4
    assert samples["kvfleet_worker_requests_running"] == 0
    length = 'kvfleet_worker_requests_total{finish_reason="length"}'
    assert samples[length] - before.get(length, 0) == 1
    assert samples[rejected] - before.get(rejected, 0) == 1


def test_reports_follow_a_request_in_and_out(worker: Worker) -> None:
    before = len(worker.reports)
    # ~200 decode steps last several report intervals (50 ms here), so the request is seen while it runs.
    status, _ = worker.post("/v1/completions", completion(max_tokens=200), **{"X-Request-Id": "reported-1"})
    assert status == 200
    deadline = time.monotonic() + 5
    while not (worker.reports and worker.reports[-1].requests == []) or len(worker.reports) == before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    seen = [r for r in worker.reports[before:] if any(q.id == "reported-1" for q in r.requests)]
    assert seen, "the request appeared in a report while it ran"
    entry = next(q for q in seen[0].requests if q.id == "reported-1")
    assert entry.tokens > 0 and entry.kv_bytes % (16 * 2048) == 0
    # 200 decode steps, but only the arrival and the finish are written (the request stays in class tiny).
    assert len(worker.reports) - before <= 4


def test_tokenize_detokenize_version_and_models_answer_as_vllms_server(worker: Worker, tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer(tiny_model_dir)
    status, body = worker.post("/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    ids = tokenizer.encode("Hello world")
    assert status == 200 and body == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                                      "token_strs": tokenizer.token_strs(ids)}
    assert worker.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False})[1]["tokens"] == \
        tokenizer.encode("Hello world", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi"}]
    status, body = worker.post("/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and body["tokens"] == tokenizer.encode_chat(messages) and body["token_strs"] is None
    assert worker.post("/tokenize", {"messages": messages, "add_generation_prompt": False})[1]["tokens"] == \
        tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert worker.post("/detokenize", {"model": MODEL, "tokens": ids}) == (200, {"prompt": tokenizer.decode(ids)})
    status, body = worker.post("/detokenize", {"tokens": [10**9]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body = worker.post("/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    for bad, param in (({"prompt": "x", "tools": []}, "tools"),
                       ({"messages": messages, "tools": [{"type": "function"}]}, "tools.0.function")):
        status, body = worker.post("/tokenize", bad)
        assert (status, body["error"]["param"]) == (400, param)
    status, raw = worker.request("GET", "/version")
    assert status == 200 and set(json.loads(raw)) == {"version"}
    status, raw = worker.request("GET", "/v1/models")
    card = json.loads(raw)["data"][0]
    assert status == 200 and (card["id"], card["root"], card["max_model_len"]) == (MODEL, MODEL, 256)
    assert card["permission"][0]["object"] == "model_permission"
