"""The vLLM engine's own settings, beside the contract both engines share (`EngineConfig`).

Imports no vllm, so the worker's command line and load_engine can build them before vLLM is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvfleet.worker.elastic.options import MemoryOptions

# vLLM's own attention backends, or kvfleet's DistAttention backend (vllm/attention.py).
VLLMAttention = Literal["vllm", "distattention"]
VLLM_ATTENTIONS: tuple[VLLMAttention, ...] = ("vllm", "distattention")


@dataclass(frozen=True)
class VLLMOptions:
    """Which memory techniques and which attention the vLLM engine runs."""

    # One memory budget for KV cache and activations (vllm/elastic.py, docs/elastic-memory.md): split
    # statically (vLLM's KV cache is the budget less the activation reserve of its largest step) or
    # elastically (the KV cache grows into what each step's activations leave); None: the KV cache
    # is `EngineConfig.kv_capacity_bytes`. The CPU buffer and the latency objectives need `elastic`.
    memory: MemoryOptions | None = None
    # "distattention": every layer attends through kvfleet.kernels as DistAttention partials, over
    # vLLM's NHD block layout (vllm/attention.py); "vllm": vLLM's own backend for the platform.
    attention: VLLMAttention = "vllm"

    def __post_init__(self) -> None:
        if self.attention not in VLLM_ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(VLLM_ATTENTIONS)}, got {self.attention!r}")
