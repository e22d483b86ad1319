"""Model shapes the GPU benchmarks build with random weights (a helper, not a benchmark).

A GPU figure means something only at a real model's shape: the per-layer sizes (hidden, heads, KV
heads, head dim, MLP width) decide the matmul and attention work and the KV bytes per token. These
are the published configs of Llama 3.2 1B and Llama 3 8B. Models that run behind a worker (agents,
tokenizers, streams) keep the tiny tokenizer's 2,048-token vocabulary, since a BPE tokenizer trained
on the local corpus cannot reach Llama's 128,256 tokens: only the embedding and the LM head are
smaller than the real model's (`vocab` says which). `tiny` is the CPU dry run's shape.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvfleet.worker.model.tiny import TINY, TinySpec

# Positions of the Llama shapes: 32K-token contexts with room for their outputs. One value for every
# benchmark, so that they all build the same model (make_tiny's identity includes it) and a GPU run
# that passes them one --model-dir builds it once (about 1B parameters take tens of seconds to write).
LLAMA_POSITIONS = 40960
# Llama 3.2 1B and Llama 3 8B (config.json of the published checkpoints), at the tiny vocabulary.
SHAPES: dict[str, TinySpec] = {
    "tiny": TINY,
    "llama-1b": replace(TINY, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                        intermediate_size=8192, rope_theta=500000.0, max_position_embeddings=LLAMA_POSITIONS,
                        model_max_length=LLAMA_POSITIONS),
    "llama-8b": replace(TINY, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        intermediate_size=14336, rope_theta=500000.0, max_position_embeddings=LLAMA_POSITIONS,
                        model_max_length=LLAMA_POSITIONS),
}
LLAMA3_VOCAB = 128256


def shape(name: str, context_tokens: int) -> TinySpec:
    """The named shape with room for `context_tokens` positions (the tokenizer's limit too)."""
    try:
        spec = SHAPES[name]
    except KeyError:
        raise SystemExit(f"unknown model shape {name!r}: expected one of {', '.join(SHAPES)}") from None
    positions = max(spec.max_position_embeddings, context_tokens)
    return replace(spec, max_position_embeddings=positions, model_max_length=positions)


def describe(spec: TinySpec) -> dict[str, Any]:
    """What a benchmark prints about the model it built."""
    return {"hidden": spec.hidden_size, "layers": spec.num_layers, "heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "intermediate": spec.intermediate_size,
            "vocab": spec.vocab_size}
