"""A small Llama-architecture model built on this machine, so tests and the demo need no model hub.

Engines are tested against a real model, not a mock, but nothing may
be downloaded at test or run time. `make_tiny` writes an HF-format directory that transformers,
vLLM and the builtin engine all load offline: a Llama config, seeded random float32 weights, and a
byte-level BPE tokenizer trained on `corpus.txt` (this repository's own docs, shipped in the package
so the tokenizer is the same everywhere).

Random weights give near-uniform logits, where greedy decoding is decided by rounding noise and two
correct engines disagree. The init scales below are chosen so that every layer changes the residual
stream by about as much as the embedding (the KV cache really matters to the next token) and the
lm_head spreads logits widely enough that the top-1 token usually wins by a clear margin
(`measure_top1_margin`).

The output is byte-identical for the same seed and spec; a manifest with the files' sha256 lets a
second call on a directory that already holds the same model return at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

# Bump when the files written for a given (seed, spec) change, so old directories are not mistaken
# for the current model.
FORMAT_VERSION = 1
MANIFEST_NAME = "kvfleet-tiny.json"
CORPUS_NAME = "corpus.txt"

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
# Ids follow from the order the trainer is given the special tokens in.
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2

# One line per message, then "assistant:" for the reply: enough for /v1/chat/completions to work.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class TinyModelError(Exception):
    """make_tiny cannot write where it was asked to (the message says why and what to do)."""


@dataclass(frozen=True)
class TinySpec:
    """The model's shape and init scales. head_dim 64 because vLLM's CPU attention refuses less."""

    vocab_size: int = 2048
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 688
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Embeddings of unit scale, projections at 1/sqrt(fan_in): each block adds about as much to the
    # residual as the token embedding, so attention over the cache decides a good part of the output.
    embed_std: float = 1.0
    # Logit std is about lm_head_std * sqrt(hidden) (the final norm makes the hidden state unit-RMS):
    # 8 here, which puts the median gap between the best two of 2048 logits at about 1.56 (measured
    # with measure_top1_margin; 0.25 gave 0.78), far above float32 or bf16 rounding.
    lm_head_std: float = 0.5
    # Norm weights near 1 but not 1, so an engine that forgot to apply them is caught.
    norm_weight_std: float = 0.1
    model_max_length: int = 2048


TINY = TinySpec()


def _corpus_bytes() -> bytes:
    return resources.files("kvfleet.worker.model").joinpath(CORPUS_NAME).read_bytes()


def _json_bytes(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _config(spec: TinySpec) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }


def _tokenizer_json(spec: TinySpec) -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _corpus_bytes().decode().splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if tokenizer.get_vocab_size() != spec.vocab_size:
        # A shorter vocabulary would leave embedding rows no token reaches; grow the corpus instead.
        raise TinyModelError(f"the corpus gives {tokenizer.get_vocab_size()} tokens, not {spec.vocab_size}")
    # Like Llama's tokenizers: encoding a text starts it with <s>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    text: str = tokenizer.to_str(pretty=True)
    return (text + "\n").encode()


def _tokenizer_config(spec: TinySpec) -> dict[str, Any]:
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, token in ((PAD_TOKEN_ID, PAD_TOKEN), (BOS_TOKEN_ID, BOS_TOKEN), (EOS_TOKEN_ID, EOS_TOKEN))
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": spec.model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _weights(spec: TinySpec, seed: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal((spec.hidden_size,), spec.norm_weight_std)

    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((spec.vocab_size, hidden), spec.embed_std)}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = norm_weight()
        tensors[f"{prefix}.self_attn.q_proj.weight"] = normal((q_out, hidden), 1 / math.sqrt(hidden))
        tensors[f"{prefix}.self_attn.k_proj.weight"] = normal((kv_out, hidden), 1 / math.sqrt(hidden))
        tensors[f"{prefix}.self_attn.v_proj.weight"] = normal((kv_out, hidden), 1 / math.sqrt(hidden))
        tensors[f"{prefix}.self_attn.o_proj.weight"] = normal((hidden, q_out), 1 / math.sqrt(q_out))
        tensors[f"{prefix}.post_attention_layernorm.weight"] = norm_weight()
        tensors[f"{prefix}.mlp.gate_proj.weight"] = normal((inter, hidden), 1 / math.sqrt(hidden))
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal((inter, hidden), 1 / math.sqrt(hidden))
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal((hidden, inter), 1 / math.sqrt(inter))
    tensors["model.norm.weight"] = norm_weight()
    tensors["lm_head.weight"] = normal((spec.vocab_size, hidden), spec.lm_head_std)
    return tensors


def _model_files(spec: TinySpec, seed: int) -> dict[str, bytes]:
    from safetensors.torch import save

    config = _config(spec)
    generation_config = {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }
    special_tokens_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    return {
        "config.json": _json_bytes(config),
        "generation_config.json": _json_bytes(generation_config),
        "model.safetensors": save(_weights(spec, seed), metadata={"format": "pt"}),
        "tokenizer.json": _tokenizer_json(spec),
        "tokenizer_config.json": _json_bytes(_tokenizer_config(spec)),
        "special_tokens_map.json": _json_bytes(special_tokens_map),
    }


def _identity(spec: TinySpec, seed: int) -> dict[str, Any]:
    """What decides the bytes written: a directory built from the same identity holds the same model."""
    return {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "spec": asdict(spec),
        "corpus_sha256": hashlib.sha256(_corpus_bytes()).hexdigest(),
    }


def _holds_model(directory: Path, identity: dict[str, Any]) -> bool:
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("identity") != identity:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict):
        return False
    for name, digest in files.items():
        try:
            if hashlib.sha256((directory / name).read_bytes()).hexdigest() != digest:
                return False
        except OSError:
            return False
    return True


def make_tiny(directory: Path, *, seed: int = 0, spec: TinySpec = TINY) -> Path:
    """Write the tiny model into `directory` (created if missing) and return it.

    Idempotent: a directory that already holds this (seed, spec) model is left alone. A directory
    that holds anything else raises TinyModelError rather than being overwritten.
    """
    directory = Path(directory)
    identity = _identity(spec, seed)
    if _holds_model(directory, identity):
        return directory
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        what = "is not a directory" if not directory.is_dir() else "is not empty and holds no tiny model of this seed"
        raise TinyModelError(f"{directory} {what}; remove it or choose another directory")
    files = _model_files(spec, seed)
    manifest = {
        "identity": identity,
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
    }
    files[MANIFEST_NAME] = _json_bytes(manifest)
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and move it in whole, so an interrupted run leaves no half model
    # that a later call (or an engine) would take for a real one.
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        try:
            if directory.exists():
                directory.rmdir()  # empty, checked above
            os.replace(staging, directory)
        except OSError:
            # Another process (a parallel test run) moved the same model in first: that one is ours too.
            if not _holds_model(directory, identity):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return directory


def measure_top1_margin(directory: Path, *, num_contexts: int = 64, context_tokens: int = 32, seed: int = 0) -> float:
    """Median gap between the best and second-best logit over random contexts (float32, transformers).

    The larger it is, the less greedy decoding depends on the rounding of a particular engine.
    """
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    generator = torch.Generator().manual_seed(seed)
    vocab_size = int(model.config.vocab_size)
    ids = torch.randint(3, vocab_size, (num_contexts, context_tokens), generator=generator)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    top2 = logits.topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).flatten()
    return float(margins.median())
