"""Shared by the migration tests: agents with builtin engines on the test loop, SSE reading, the reference.

Each worker is a real Agent over HTTP with its own engine and migration port, started on the
session's event loop (worker_testing.EngineLoop), as a pod runs it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from worker_testing import EngineLoop

from kvfleet.api.reports import KVLoadReport
from kvfleet.serving.credentials import PoolCredentials, PoolSecrets
from kvfleet.worker.agent import Agent, AgentConfig
from kvfleet.worker.disaggregation import PDConfig
from kvfleet.worker.distkv.creditors import Creditors
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import Engine
from kvfleet.worker.migration.transport import Channel, TCPTransport
from kvfleet.worker.text import Tokenizer

TOKEN = "pool-token-for-migrations"
CREDENTIALS = PoolCredentials(PoolSecrets(TOKEN, TOKEN.encode()))
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

    def migrate(self, request_id: str, target: Worker, mode: str, kv_bytes: int | None = None) -> dict[str, Any]:
        status, result = self.call("POST", f"/internal/requests/{request_id}/migrate", {
            "target": {"pod": target.name, "address": target.address,
                       "migrationAddress": f"127.0.0.1:{target.agent.migration_port}"}, "mode": mode,
            **({"kvBytes": kv_bytes} if kv_bytes is not None else {})})
        assert status == 200, result
        assert isinstance(result, dict)
        return result


def start_worker(name: str, model_dir: Path, loop: EngineLoop, port: int | None = None,
                 kv_capacity_bytes: int = KV_CAPACITY_BYTES, engine: Engine | None = None,
                 disaggregation: PDConfig | None = None, creditors: Creditors | None = None) -> Worker:
    reports: list[KVLoadReport] = []
    port = port or free_port()

    async def write(report: KVLoadReport) -> None:
        reports.append(report)

    if engine is None:
        engine = load_engine("builtin", EngineConfig(model_path=model_dir, kv_capacity_bytes=kv_capacity_bytes,
                                                     max_model_len=1024))
    agent = Agent(AgentConfig(model_name=MODEL, credentials=PoolCredentials.of(TOKEN), report_interval_s=0.05,
                              migration_host="127.0.0.1", migration_port=0, creditors=creditors,
                              disaggregation=disaggregation or PDConfig()), engine, Tokenizer(model_dir), write)

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


def serve_app(loop: EngineLoop, app: web.Application, port: int | None = None) -> tuple[web.AppRunner, int]:
    """An aiohttp app (a router, mostly) served on loopback from the test loop: its runner and port."""
    port = port or free_port()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    return loop.run(start()), port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_workers(model_dir: Path, loop: EngineLoop) -> Iterator[tuple[Worker, Worker]]:
    a = start_worker("worker-a", model_dir, loop)
    b = start_worker("worker-b", model_dir, loop)
    yield a, b
    for w in (a, b):
        loop.run(w.runner.cleanup())


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
                          payload: dict[str, Any] | None = None, router: bool = False, after_chunks: int = 4,
                          kv_bytes: int | None = None) -> tuple[Streamed, dict[str, Any]]:
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
            thread = threading.Thread(target=lambda: results.append(source.migrate(request_id, target, mode, kv_bytes)))
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
    while any(w.agent.engine.kv_usage() or w.agent.streams.active for w in workers):
        assert time.monotonic() < deadline, [(w.name, w.agent.engine.kv_usage(), w.agent.streams.active) for w in workers]
        time.sleep(0.05)


class FixedPort:
    """Stands in for a listener only to tell the test helper which migration port to aim at."""

    def __init__(self, port: int | None) -> None:
        self.port = port
        self.original = port

    async def close(self) -> None:
        pass


def fake_destination(loop: EngineLoop, die_at: str) -> tuple[int, Any]:
    """A peer that speaks the protocol (it holds the token) and dies at `die_at`: "data" or "commit"."""
    transport = TCPTransport(CREDENTIALS)

    async def handler(channel: Channel) -> None:
        await channel.recv(5)
        await channel.send({"ok": True, "engine": "builtin", "kv": True})
        while True:
            frame = await channel.recv(5)
            if frame.header.get("op") == "stage":
                await channel.send({"ok": True})
                data = await channel.recv(5)
                await channel.read_payload(data.payload_nbytes)
                if die_at == "data":
                    return  # the connection drops mid-copy
                await channel.send({"ok": True})
            elif frame.header.get("op") == "commit" and die_at == "commit":
                return
            else:
                return

    listener = loop.run(transport.listen("127.0.0.1", 0, handler))
    return listener.port, listener
