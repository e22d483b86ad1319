"""Shared by the router tests: real worker agents (builtin engine, tiny model) on loopback, and
routers in front of them through a StaticPoolView, so no API server is needed.

Everything async runs on one background loop (worker_testing.EngineLoop); tests talk HTTP to it
from the test thread, as clients do.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "worker"))

from worker_testing import TEST_KV_CAPACITY_BYTES, TEST_MAX_MODEL_LEN, EngineLoop  # noqa: E402

TOKEN = "router-test-pool-token"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """An aiohttp app on a loopback port, served from the background loop."""

    port: int
    runner: web.AppRunner
    agent: Any = None  # the worker agent, for a worker

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request(method, path, json.dumps(body).encode() if body is not None else None,
                     {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()

    def post(self, path: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
        status, _, raw = self.request("POST", path, body, headers)
        return status, json.loads(raw)

    def stream(self, path: str, body: dict[str, Any], **headers: str) -> list[Any]:
        status, _, raw = self.request("POST", path, {**body, "stream": True}, headers)
        assert status == 200, raw
        events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", raw[-500:]
        return [json.loads(e) for e in events[:-1]]


def serve(loop: EngineLoop, app: web.Application, ready_path: str | None = "/readyz") -> Server:
    port = free_port()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    server = Server(port, loop.run(start()))
    deadline = time.monotonic() + 120
    while ready_path is not None and server.request("GET", ready_path)[0] != 200:
        assert time.monotonic() < deadline, server.request("GET", ready_path)
        time.sleep(0.1)
    return server


def start_worker(loop: EngineLoop, model_dir: Path) -> Server:
    from kvfleet.serving.credentials import PoolCredentials
    from kvfleet.worker.agent import Agent, AgentConfig
    from kvfleet.worker.engines import EngineConfig, load_engine
    from kvfleet.worker.text import Tokenizer

    engine = load_engine("builtin", EngineConfig(model_path=model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                                                 max_model_len=TEST_MAX_MODEL_LEN, max_num_seqs=8, dtype="float32"))
    # No drain: a stopped worker drops its requests at once, as a killed pod does.
    agent = Agent(AgentConfig(model_name=MODEL, credentials=PoolCredentials.of(TOKEN), drain_timeout_s=0.0, migration_host="127.0.0.1",
                              migration_port=0), engine, Tokenizer(model_dir), None)
    server = serve(loop, agent.app())
    server.agent = agent
    deadline = time.monotonic() + 60
    while agent.migration_port is None:
        assert time.monotonic() < deadline, "the worker never listened for migrations"
        time.sleep(0.05)
    return server
