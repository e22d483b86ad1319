"""Engines behind one contract (`base.Engine`): the builtin torch engine and vLLM's AsyncLLM.

`load_engine` picks one by name without importing the other, so a worker that runs the builtin
engine never imports vllm (and the reverse).
"""

from __future__ import annotations

from kvfleet.worker.engines.base import Engine, EngineConfig

ENGINE_NAMES = ("builtin", "vllm")


def load_engine(name: str, config: EngineConfig) -> Engine:
    """An engine, not yet started (call `await engine.start()`)."""
    if name == "builtin":
        from kvfleet.worker.engines.builtin.engine import BuiltinEngine

        return BuiltinEngine(config)
    if name == "vllm":
        from kvfleet.worker.engines.vllm.engine import VLLMEngine

        return VLLMEngine(config)
    raise ValueError(f"unknown engine {name!r}: expected one of {', '.join(ENGINE_NAMES)}")


__all__ = ["ENGINE_NAMES", "Engine", "EngineConfig", "load_engine"]
