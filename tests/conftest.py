"""Session fixtures the worker and router tests share: the tiny local model and the event loop the
engines run on (tests/worker/worker_testing.py), made once per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# worker_testing.py is shared by tests/worker and tests/router; with --import-mode=importlib its
# folder is not on sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "worker"))

from worker_testing import EngineLoop  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvfleet.worker.model.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def engine_loop() -> Iterator[EngineLoop]:
    loop = EngineLoop()
    yield loop
    loop.close()
