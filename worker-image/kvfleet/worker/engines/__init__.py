"""Engines behind one contract (`base.Engine`): the builtin torch engine and vLLM's AsyncLLM.

`load_engine` picks one by name without importing the other, so a worker that runs the builtin
engine never imports vllm (and the reverse).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfleet.worker.engines.base import Engine, EngineConfig, EngineError

if TYPE_CHECKING:
    from kvfleet.worker.engines.builtin.options import BuiltinOptions
    from kvfleet.worker.engines.vllm.options import VLLMOptions

ENGINE_NAMES = ("builtin", "vllm")


def load_engine(name: str, config: EngineConfig, options: BuiltinOptions | VLLMOptions | None = None) -> Engine:
    """An engine, not yet started (call `await engine.start()`); `options` the engine's own settings
    (an engine refuses the other's rather than ignore them)."""
    from kvfleet.worker.engines.builtin.options import BuiltinOptions
    from kvfleet.worker.engines.vllm.options import VLLMOptions

    if name == "builtin":
        from kvfleet.worker.engines.builtin.engine import BuiltinEngine

        if isinstance(options, VLLMOptions):
            raise EngineError("VLLMOptions given to the builtin engine")
        return BuiltinEngine(config, options)
    if name == "vllm":
        if isinstance(options, BuiltinOptions) and options != BuiltinOptions():
            # vLLM's attention is its own backends', which take no KV held on another worker; elastic
            # memory for vLLM comes through VLLMOptions. docs/elastic-memory.md, docs/distkv.md.
            raise EngineError("DistAttention and DistKV need the builtin engine (vLLM's attention takes no remote "
                              "KV); elastic memory for vLLM is VLLMOptions(memory=...)")
        from kvfleet.worker.engines.vllm.engine import VLLMEngine

        return VLLMEngine(config, options if isinstance(options, VLLMOptions) else None)
    raise ValueError(f"unknown engine {name!r}: expected one of {', '.join(ENGINE_NAMES)}")


__all__ = ["ENGINE_NAMES", "Engine", "EngineConfig", "load_engine"]
