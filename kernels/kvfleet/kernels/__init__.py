"""DistAttention kernels (Triton), their launchers and torch references.

DistAttention is from Infinite-LLM ("Infinite-LLM: Efficient LLM Service for Long Context with
DistAttention and Distributed KVCache", Lin et al., arXiv 2401.02669).

One request's KV cache can live on several workers: each part computes a micro-attention over its own
blocks and returns (output, log-sum-exp), and ScaleReduce merges the parts exactly (section 4.2).

- `micro_attention_decode`: decode over a paged KV cache, GQA-grouped, split-KV for long contexts;
- `micro_attention_prefill`: causal prefill of new tokens with the same partial contract;
- `scale_reduce`, `scale_reduce_varlen`, `scale_reduce_pair`: the merge, dense, varlen, pairwise.

Each op has three modules: `*_kernel` (Triton), `*_launcher` (grid, tiles, launch), `*_reference`
(torch, fp64). `_checks` holds each op's contract and its input checks, written once for every entry
point (the launchers, `torch_backend`, `dispatch`); `_online_softmax` the tile update both attention
kernels run. The names below are imported on first use, so importing the package loads neither
torch nor triton and never touches a GPU.
"""

from __future__ import annotations

import importlib
from typing import Any

# Only the launchers: a reference function shares its module's name (micro_attention_decode_reference),
# and the import system would overwrite a lazily exported function with the module of that name.
# Import references from their modules.
_EXPORTS = {
    "micro_attention_decode": "kvfleet.kernels.micro_attention_decode_launcher",
    "micro_attention_prefill": "kvfleet.kernels.micro_attention_prefill_launcher",
    "scale_reduce": "kvfleet.kernels.scale_reduce_launcher",
    "scale_reduce_varlen": "kvfleet.kernels.scale_reduce_launcher",
    "scale_reduce_pair": "kvfleet.kernels.scale_reduce_launcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
