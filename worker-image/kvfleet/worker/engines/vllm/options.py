"""The vLLM engine's own settings, beside the contract both engines share (`EngineConfig`).

Imports no vllm, so the worker's command line and load_engine can build them before vLLM is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.worker.elastic.options import MemoryOptions


@dataclass(frozen=True)
class VLLMOptions:
    """Which memory techniques the vLLM engine runs."""

    # One memory budget for KV cache and activations (vllm/elastic.py, docs/elastic-memory.md): split
    # statically (vLLM's KV cache is the budget less the activation reserve of its largest step) or
    # elastically (the KV cache grows into what each step's activations leave); None: the KV cache
    # is `EngineConfig.kv_capacity_bytes`. vLLM runs no CPU buffer: `cpu_buffer_bytes` and the
    # latency objectives must stay unset.
    memory: MemoryOptions | None = None
