"""The builtin engine's own settings, beside the contract both engines share (`EngineConfig`).

`EngineConfig` holds what every engine takes (model, KV capacity, batch, dtype, prefix caching); what
only this engine implements is here, so a vLLM worker cannot be handed a setting it would ignore. The
feature groups (elastic memory, DistKV) are their mechanisms' own option types, ready for whichever
engine adapts them next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvfleet.worker.distkv.options import DistKVOptions
from kvfleet.worker.elastic.options import MemoryOptions

Attention = Literal["sdpa", "distattention"]


@dataclass(frozen=True)
class BuiltinOptions:
    """How the builtin engine attends, and which memory techniques it runs."""

    # "sdpa" (torch's fused attention over the local cache) or "distattention" (micro-attention partials
    # merged by ScaleReduce through kvfleet.kernels: Triton on a GPU; on the CPU the C decode kernel and
    # the torch backend's prefill; the path that can take KV held elsewhere, Infinite-LLM §4.2). Greedy
    # outputs are the same. sdpa stays the default for now: since the C decode kernel, DistAttention's
    # decode step measures 0.4-0.9x SDPA's on the CPU (bench/attention.py), but it needs a C compiler
    # at first use and has not yet run the e2e suites as the default.
    attention: Attention = "sdpa"
    # Elastic memory (eLLM, docs/elastic-memory.md): a pool of physical chunks for KV cache and
    # activations instead of a KV cache of `EngineConfig.kv_capacity_bytes`; None: no pool.
    memory: MemoryOptions | None = None
    # DistKV (Infinite-LLM §4.3, docs/distkv.md): lending needs a static cache; borrowing needs
    # attention "distattention" and a static cache.
    distkv: DistKVOptions = field(default_factory=DistKVOptions)
