"""Fixtures for the worker tests: engines shared per session (worker_testing.py); the tiny model and the loop are in tests/conftest.py.

vLLM's EngineCores start as forks of a server that imported vLLM once (vllm_forkserver.py), not by
spawn; KVFLEET_TEST_VLLM_SPAWN=1 keeps vLLM's spawn."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The tests share worker_testing.py; with --import-mode=importlib this folder is not on sys.path.
sys.path.insert(0, os.path.dirname(__file__))

import vllm_forkserver  # noqa: E402
from worker_testing import EngineLoop, StartedEngine, start_engine  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def vllm_engines_fork_from_a_server() -> Iterator[None]:
    """Each vLLM engine start forks its EngineCore from one server instead of spawning an interpreter
    that imports vLLM again (~10 s of CPU each here): vllm_forkserver.py says why and what stays as it was."""
    with vllm_forkserver.installed():
        yield


@pytest.fixture(scope="session")
def started_engines(engine_loop: EngineLoop) -> Iterator[dict[str, StartedEngine]]:
    engines: dict[str, StartedEngine] = {}
    yield engines
    for started in engines.values():
        engine_loop.run(started.engine.stop())


@pytest.fixture(scope="session", params=["builtin", "builtin-elastic", "vllm", "vllm-elastic"])
def any_engine(request: pytest.FixtureRequest, tiny_model_dir: Path, engine_loop: EngineLoop,
               started_engines: dict[str, StartedEngine]) -> StartedEngine:
    return start_engine(request.param, tiny_model_dir, started_engines, engine_loop)


@pytest.fixture(scope="session")
def builtin_engine(tiny_model_dir: Path, engine_loop: EngineLoop, started_engines: dict[str, StartedEngine]) -> StartedEngine:
    return start_engine("builtin", tiny_model_dir, started_engines, engine_loop)
