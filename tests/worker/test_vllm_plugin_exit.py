"""plugin.register in an EngineCore process: the interpreter's last garbage collection is skipped.

A cycle with a finalizer left at exit shows whether that collection ran: it runs the finalizer. In a
process named as vLLM names its EngineCore the finalizer must not run (the heap was frozen at exit);
in any other process, the worker's own included, exit stays as Python makes it.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from kvfleet.worker.engines.vllm import plugin


class Cycle:
    def __init__(self, mark: str) -> None:
        self.mark = mark
        self.me = self

    def __del__(self) -> None:
        Path(self.mark).write_text("collected")


def child(mark: str) -> None:
    plugin.register()
    Cycle(mark)  # unreachable at once, but a cycle: only a collection finalizes it


@pytest.mark.parametrize(("name", "collected"), [("EngineCore_DP0", False), ("EngineCore", False), ("Process-1", True)])
def test_an_engine_core_exits_without_the_last_collection(tmp_path: Path, name: str, collected: bool) -> None:
    mark = tmp_path / "mark"
    process = multiprocessing.get_context("spawn").Process(target=child, args=(str(mark),), name=name)
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert mark.exists() is collected
