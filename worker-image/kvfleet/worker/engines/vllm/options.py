"""The vLLM engine's own settings, beside the contract both engines share (`EngineConfig`).

Imports no vllm, so the worker's command line and load_engine can build them before vLLM is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvfleet.worker.distkv.options import DistKVOptions
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
    # DistKV (docs/distkv.md): lend up to `lend_cap_bytes` of vLLM's free KV blocks to requests of other
    # workers (vllm/lending.py). Lending needs "distattention" (a borrower's queries are answered with
    # kvfleet's kernels over vLLM's blocks) and a static cache; so does borrowing (vllm/borrowing.py).
    distkv: DistKVOptions = field(default_factory=DistKVOptions)

    def __post_init__(self) -> None:
        if self.attention not in VLLM_ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(VLLM_ATTENTIONS)}, got {self.attention!r}")
        distkv = self.distkv
        if distkv.lend_cap_bytes < 0:
            raise ValueError(f"the lending cap must be at least 0 bytes, not {distkv.lend_cap_bytes}")
        if distkv.lend_cap_bytes and self.attention != "distattention":
            raise ValueError("lending KV needs attention 'distattention': a borrower's queries are answered with "
                             "kvfleet's kernels over the lent blocks")
        if distkv.borrow and self.attention != "distattention":
            raise ValueError("borrowing KV (DistKV) needs attention 'distattention': remote KV is attended where it lives")
        if (distkv.lend_cap_bytes or distkv.borrow) and self.memory is not None and self.memory.elastic:
            raise ValueError("DistKV lending and borrowing need a static KV cache, not elastic memory (both grow and "
                             "shrink vLLM's block pool)")
