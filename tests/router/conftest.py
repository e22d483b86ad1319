"""Fixtures for the router tests: two real worker agents per module (router_testing.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The tests share router_testing.py (and the worker tests' worker_testing.py); with
# --import-mode=importlib these folders are not on sys.path.
sys.path.insert(0, os.path.dirname(__file__))

from router_testing import EngineLoop, Server, start_worker  # noqa: E402


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[list[Server]]:
    started = [start_worker(engine_loop, tiny_model_dir) for _ in range(2)]
    yield started
    for server in started:
        engine_loop.run(server.runner.cleanup())
