"""Fixtures for the fuzz tests: one real worker agent (builtin engine, tiny model) and a router in front
of it, on loopback, shared by the whole session (tests/router/router_testing.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# router_testing.py and worker_testing.py; with --import-mode=importlib these folders are not on sys.path.
_TESTS = os.path.dirname(os.path.dirname(__file__))
sys.path.insert(0, os.path.join(_TESTS, "router"))
sys.path.insert(0, os.path.join(_TESTS, "worker"))

from router_testing import TOKEN, EngineLoop, Server, serve, start_worker  # noqa: E402
from worker_testing import TEST_KV_CAPACITY_BYTES  # noqa: E402


@pytest.fixture(scope="session")
def fuzz_worker(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[Server]:
    server = start_worker(engine_loop, tiny_model_dir)
    yield server
    engine_loop.run(server.runner.cleanup())


@pytest.fixture(scope="session")
def fuzz_router(fuzz_worker: Server, engine_loop: EngineLoop) -> Iterator[Server]:
    from kvfleet.router.app import Router, RouterConfig
    from kvfleet.router.placement import PoolSnapshot, WorkerState
    from kvfleet.router.pool import StaticPoolView
    from kvfleet.serving.credentials import PoolCredentials

    view = StaticPoolView(PoolSnapshot((WorkerState("w0", fuzz_worker.address, True, 0, TEST_KV_CAPACITY_BYTES),), {}))
    server = serve(engine_loop, Router(RouterConfig(pool_name="fuzz", credentials=PoolCredentials.of(TOKEN)), view).app())
    yield server
    engine_loop.run(server.runner.cleanup())
