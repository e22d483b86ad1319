"""Engines behind one contract (`base.Engine`): the builtin torch engine and vLLM's AsyncLLM.

`load_engine` picks one by name without importing the other, so a worker that runs the builtin
engine never imports vllm (and the reverse).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfleet.worker.engines.base import Engine, EngineConfig, EngineError

if TYPE_CHECKING:
    from kvfleet.worker.engines.builtin.options import BuiltinOptions

ENGINE_NAMES = ("builtin", "vllm")


def load_engine(name: str, config: EngineConfig, builtin: BuiltinOptions | None = None) -> Engine:
    """An engine, not yet started (call `await engine.start()`); `builtin` the builtin engine's own
    settings (the vLLM engine refuses them rather than ignore them)."""
    if name == "builtin":
        from kvfleet.worker.engines.builtin.engine import BuiltinEngine

        return BuiltinEngine(config, builtin)
    if name == "vllm":
        from kvfleet.worker.engines.builtin.options import BuiltinOptions

        if builtin is not None and builtin != BuiltinOptions():
            # vLLM sizes its KV cache once at start (kv_cache_memory_bytes): sleep/wake_up and
            # release_kv_cache_memory drop all of it at once (a paused engine, no request), and the CPU
            # worker ignores sleep mode. Its CPU offloading (OffloadingConnector, SimpleCPUOffloadConnector)
            # refuses the CPU platform ("CPU Offloading is currently only supported on CUDA-alike and
            # XPU GPUs", vllm/v1/kv_offload/cpu/spec.py) and copies on CUDA streams. Its attention is its
            # own backends', which take no KV held on another worker. docs/elastic-memory.md.
            raise EngineError("elastic memory, a CPU buffer, DistAttention and DistKV need the builtin engine: "
                              "vLLM's KV cache cannot grow or shrink while it serves, its CPU offloading runs on "
                              "CUDA or XPU GPUs only, and its attention takes no remote KV")
        from kvfleet.worker.engines.vllm.engine import VLLMEngine

        return VLLMEngine(config)
    raise ValueError(f"unknown engine {name!r}: expected one of {', '.join(ENGINE_NAMES)}")


__all__ = ["ENGINE_NAMES", "Engine", "EngineConfig", "load_engine"]
