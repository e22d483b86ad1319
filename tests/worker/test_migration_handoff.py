"""Live migration between two real agents over HTTP and the migration port: the client's stream stays whole.

Two workers with their own builtin engines run on the test's event loop. A client streams a long
greedy request from the source; mid-stream the source is told to move it (POST
/internal/requests/{id}/migrate, what the KVMigration watcher does). Whatever the mode, what the
client reads is token for token the unmigrated greedy output: in router mode by following the
`kvfleet.migrated` event to the target's stream, in direct mode through the source's relay.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from worker_testing import EngineLoop

from kvfleet.api.reports import KVLoadReport
from kvfleet.worker.agent import Agent, AgentConfig
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.text import Tokenizer

TOKEN = "pool-token-for-migrations"
MODEL = "tiny"
# Long enough that a request is still decoding when the migration starts, on any machine.
MAX_TOKENS = 300
KV_CAPACITY_BYTES = 8 * 1024 * 1024


@dataclass
class Worker:
    name: str
    port: int
    agent: Agent
    runner: web.AppRunner
    reports: list[KVLoadReport] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, token: str | None = TOKEN,
             **headers: str) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        all_headers = {"Content-Type": "application/json", **headers}
        if token:
            all_headers["Authorization"] = f"Bearer {token}"
        conn.request(method, path, json.dumps(body).encode() if body is not None else None, all_headers)
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw.startswith(b"{") else raw

    def migrate(self, request_id: str, target: Worker, mode: str) -> dict[str, Any]:
        status, result = self.call("POST", f"/internal/requests/{request_id}/migrate", {
            "target": {"pod": target.name, "address": target.address,
                       "migrationAddress": f"127.0.0.1:{target.agent.migration_port}"}, "mode": mode})
        assert status == 200, result
        assert isinstance(result, dict)
        return result


def start_worker(name: str, model_dir: Path, loop: EngineLoop, port: int) -> Worker:
    reports: list[KVLoadReport] = []

    async def write(annotation: str) -> None:
        reports.append(KVLoadReport.model_validate_json(annotation))

    engine = load_engine("builtin", EngineConfig(model_path=model_dir, kv_capacity_bytes=KV_CAPACITY_BYTES,
                                                 max_model_len=1024))
    agent = Agent(AgentConfig(model_name=MODEL, pool_token=TOKEN, report_interval_s=0.05, migration_host="127.0.0.1",
                              migration_port=0), engine, Tokenizer(model_dir), write)

    async def start() -> web.AppRunner:
        runner = web.AppRunner(agent.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    worker = Worker(name, port, agent, loop.run(start()), reports)
    deadline = time.monotonic() + 120
    while worker.call("GET", "/readyz")[0] != 200 or agent.migration_port is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return worker


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[tuple[Worker, Worker]]:
    a = start_worker("worker-a", tiny_model_dir, engine_loop, free_port())
    b = start_worker("worker-b", tiny_model_dir, engine_loop, free_port())
    yield a, b
    for w in (a, b):
        engine_loop.run(w.runner.cleanup())


def body(max_tokens: int = MAX_TOKENS, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time, in a land far away, there lived", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **kw}


@dataclass
class Streamed:
    """What a client read: SSE events in order, as (event name or "", data)."""

    events: list[tuple[str, str]]

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(d) for e, d in self.events if not e and d != "[DONE]"]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == ("", "[DONE]")

    @property
    def text(self) -> str:
        return "".join(c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content", "")) or ""
                       for c in self.chunks if c["choices"])


def read_sse(response: http.client.HTTPResponse, on_chunk: Any = None) -> Streamed:
    events: list[tuple[str, str]] = []
    event = ""
    while True:
        line = response.readline()
        if not line:
            return Streamed(events)
        text = line.decode().rstrip("\r\n")
        if text.startswith("event: "):
            event = text[len("event: "):]
        elif text.startswith("data: "):
            events.append((event, text[len("data: "):]))
            if on_chunk is not None:
                on_chunk(len(events))
        elif not text:
            event = ""


def stream_with_migration(source: Worker, target: Worker, request_id: str, mode: str, path: str = "/v1/completions",
                          payload: dict[str, Any] | None = None, router: bool = False, after_chunks: int = 4
                          ) -> tuple[Streamed, dict[str, Any]]:
    """Streams a request from the source and migrates it once the client has read `after_chunks` events."""
    conn = http.client.HTTPConnection("127.0.0.1", source.port, timeout=120)
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if router:
        headers["X-Kvfleet-Stream"] = "tokens"
    conn.request("POST", path, json.dumps({**(payload or body()), "stream": True}).encode(), headers)
    response = conn.getresponse()
    assert response.status == 200
    results: list[dict[str, Any]] = []
    migrating: list[threading.Thread] = []

    def on_chunk(n: int) -> None:
        if n == after_chunks:
            thread = threading.Thread(target=lambda: results.append(source.migrate(request_id, target, mode)))
            thread.start()
            migrating.append(thread)

    streamed = read_sse(response, on_chunk)
    for thread in migrating:
        thread.join(60)
    assert results, "the migration never ran"
    return streamed, results[0]


def reference(worker: Worker, payload: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """The unmigrated greedy output: text and token ids."""
    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**(payload or body()), "stream": True}).encode(),
                 {"Content-Type": "application/json", "X-Kvfleet-Stream": "tokens"})
    streamed = read_sse(conn.getresponse())
    ids = [t for c in streamed.chunks for t in c["kvfleet"]["token_ids"]]
    return streamed.text, ids


def follow_target(target: Worker, request_id: str, after: int) -> Streamed:
    conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=120)
    conn.request("GET", f"/internal/requests/{request_id}/stream?after={after}", headers={"Authorization": f"Bearer {TOKEN}"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return read_sse(response)


def wait_idle(*workers: Worker) -> None:
    """Both engines hold no KV and the agents stream nothing (the end state every test must reach)."""
    deadline = time.monotonic() + 30
    while any(w.agent.engine.kv_usage() or w.agent._active for w in workers):
        assert time.monotonic() < deadline, [(w.name, w.agent.engine.kv_usage(), w.agent._active) for w in workers]
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["kv", "token", "hybrid"])
def test_router_mode_stream_ends_with_the_handoff_and_the_target_continues_it(workers: tuple[Worker, Worker],
                                                                               mode: str) -> None:
    a, b = workers
    ref_text, ref_ids = reference(a)
    request_id = f"router-{mode}"
    streamed, result = stream_with_migration(a, b, request_id, mode, router=True)
    assert result["phase"] == "Succeeded", result
    assert result["mode"] == mode
    assert not streamed.done, "a handed-over router stream ends without [DONE]"
    event, data = streamed.events[-1]
    assert event == "kvfleet.migrated"
    moved = json.loads(data)
    source_ids = [t for c in streamed.chunks for t in c["kvfleet"]["token_ids"]]
    assert moved == {"request_id": request_id, "index": len(source_ids),
                     "target": {"pod": "worker-b", "address": b.address}}
    assert 0 < moved["index"] < MAX_TOKENS
    rest = follow_target(b, request_id, moved["index"])
    assert rest.done
    assert rest.chunks[0]["kvfleet"]["index"] == moved["index"]
    rest_ids = [t for c in rest.chunks for t in c["kvfleet"]["token_ids"]]
    assert source_ids + rest_ids == ref_ids
    assert streamed.text + rest.text == ref_text
    assert rest.chunks[-1]["choices"][0]["finish_reason"] == "length"
    if mode == "token":
        assert result["bytesMoved"] == 0
    else:
        assert result["bytesMoved"] > 0
    assert result["downtimeSeconds"] > 0
    wait_idle(a, b)


@pytest.mark.parametrize("mode", ["kv", "token"])
def test_direct_client_gets_the_whole_stream_through_the_source(workers: tuple[Worker, Worker], mode: str) -> None:
    a, b = workers
    ref_text, _ = reference(a)
    payload = body(stream_options={"include_usage": True})
    streamed, result = stream_with_migration(a, b, f"direct-{mode}", mode, payload=payload)
    assert result["phase"] == "Succeeded", result
    assert streamed.done
    assert all(e == "" for e, _ in streamed.events), "a direct client never sees the hand-off event"
    assert all("kvfleet" not in c for c in streamed.chunks)
    assert streamed.text == ref_text
    assert streamed.chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert [c["choices"][0]["finish_reason"] for c in streamed.chunks if c["choices"]][-1] == "length"
    wait_idle(a, b)


def test_direct_chat_stream_and_a_migration_back_again(workers: tuple[Worker, Worker]) -> None:
    """Chat chunks through the relay, and a second hand-off (b -> a) that the relay follows."""
    a, b = workers
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    status, whole = a.call("POST", "/v1/chat/completions", chat)
    assert status == 200, whole
    conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({**chat, "stream": True}).encode(),
                 {"Content-Type": "application/json", "X-Request-Id": "chat-twice"})
    response = conn.getresponse()
    results: list[dict[str, Any]] = []

    def migrate_twice() -> None:
        results.append(a.migrate("chat-twice", b, "kv"))
        # The request now runs on b (relayed by a): move it back to a's engine.
        deadline = time.monotonic() + 30
        while "chat-twice" not in {r.request_id for r in b.agent.engine.kv_usage()} and time.monotonic() < deadline:
            time.sleep(0.01)
        results.append(b.migrate("chat-twice", a, "kv"))

    threads: list[threading.Thread] = []

    def on_chunk(n: int) -> None:
        if n == 4:
            threads.append(threading.Thread(target=migrate_twice))
            threads[0].start()

    streamed = read_sse(response, on_chunk)
    threads[0].join(60)
    assert [r["phase"] for r in results] == ["Succeeded", "Succeeded"], results
    assert streamed.done
    assert streamed.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in streamed.chunks)
    assert streamed.text == whole["choices"][0]["message"]["content"]
    wait_idle(a, b)


def test_a_non_streaming_request_is_answered_whole_across_a_handoff(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    ref_text, _ = reference(a)
    answers: list[tuple[int, Any]] = []
    thread = threading.Thread(target=lambda: answers.append(a.call("POST", "/v1/completions", body(), token=None,
                                                                    **{"X-Request-Id": "whole-1"})))
    thread.start()
    deadline = time.monotonic() + 30
    while "whole-1" not in {r.request_id for r in a.agent.engine.kv_usage()}:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    result = a.migrate("whole-1", b, "hybrid")
    thread.join(60)
    assert result["phase"] == "Succeeded", result
    status, answer = answers[0]
    assert status == 200
    assert answer["choices"][0]["text"] == ref_text
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    wait_idle(a, b)


def test_the_target_stream_needs_the_pool_token_and_a_known_request(workers: tuple[Worker, Worker]) -> None:
    _, b = workers
    assert b.call("GET", "/internal/requests/nope/stream?after=0", token=None)[0] == 401
    assert b.call("GET", "/internal/requests/nope/stream?after=0", token="wrong")[0] == 401
    assert b.call("GET", "/internal/requests/nope/stream?after=0")[0] == 404
    assert b.call("POST", "/internal/requests/nope/migrate", {"target": {"pod": "x", "address": "127.0.0.1:1"}},
                  token=None)[0] == 401
