"""Runs the kernel tests on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is imported (triton.jit picks the interpreter when the
kernel is defined), so it is set here, at collection, before any test module imports a kernel.
On a GPU machine, `KVFLEET_KERNELS_ON_GPU=1 pytest tests/kernels` leaves it unset: the same tests
then compile the kernels for the GPU and run on CUDA tensors, and the `gpu`-marked ones (bf16) run too.
"""

from __future__ import annotations

import os
import sys

import pytest

# The tests share kernel_testing.py; with --import-mode=importlib this folder is not on sys.path.
sys.path.insert(0, os.path.dirname(__file__))

ON_GPU = os.environ.get("KVFLEET_KERNELS_ON_GPU", "0") == "1"
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402  (after the interpreter switch)


def pytest_collection_finish(session: pytest.Session) -> None:
    # The kernels are defined (collected) by now, in interpreter mode. Other test folders run in the
    # same session and start subprocesses (workers, engines): do not hand them TRITON_INTERPRET.
    # The kernel tests get it back through the fixture below.
    if _INTERPRET_BEFORE is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _INTERPRET_BEFORE


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Triton also reads the switch while running an interpreted kernel, not only when defining it.
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    if ON_GPU and torch.cuda.is_available():
        return
    if ON_GPU:
        for item in items:
            if item.path.is_relative_to(here):
                item.add_marker(pytest.mark.skip(reason="KVFLEET_KERNELS_ON_GPU=1 but no CUDA device"))
        return
    reason = (
        "needs CUDA (no GPU here)"
        if not torch.cuda.is_available()
        else "compiled kernels need KVFLEET_KERNELS_ON_GPU=1 (this run uses the interpreter)"
    )
    for item in items:
        if "gpu" in item.keywords and item.path.is_relative_to(here):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device() -> torch.device:
    """Where the kernels' inputs live: the CPU under the interpreter, the GPU otherwise."""
    return torch.device("cuda" if ON_GPU else "cpu")
