"""The builtin engine's model: a Llama-family forward in plain torch over a paged KV cache.

The builtin engine exists so that kvfleet can serve, account and migrate KV caches without vLLM
(tests, the demo, machines where vLLM does not install), and so that migration can read and write
KV blocks directly. It therefore owns its forward pass instead of borrowing transformers' model
classes, whose KV cache is contiguous per request: this module loads HF-format weights
(config.json + *.safetensors, sharded or not) and runs RMSNorm, RoPE (default, linear and llama3
scaling), grouped-query attention and the SwiGLU MLP on any torch device and dtype.

One `forward` call serves a whole engine step: the new tokens of every sequence (a prompt, a
re-prefilled tail or one decode token) go through the linear layers as one flat batch; attention
reads each sequence's context from the paged cache through its block table.

Attention takes one of two paths (`attention`):
- "distattention" (Infinite-LLM section 4.2): every sequence's attention is a ScaleReduce over
  micro-attention partials (output, log-sum-exp) of its context's parts: the stored part (tokens in
  the paged cache before this step, seen whole; for a decode, with its new token, written first), the
  in-hand part of a prefill (this step's own K and V, causal among themselves, straight from the
  layer) and any extra parts `SeqBatchEntry.extra_parts` supplies
  (KV held elsewhere, the seam for rManager's remote rBlocks, section 4.6's query shipping). The ops
  are kvfleet.kernels': Triton on a GPU, its torch backend elsewhere.
- "sdpa": torch's scaled_dot_product_attention over K and V gathered from the cache (the new tokens
  written first): decodes in one padded batch, prefills one at a time. Local KV only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from kvfleet.kernels import dispatch as distattention
from kvfleet.worker.engines.base import EngineError
from kvfleet.worker.engines.builtin.blocks import BLOCK_SIZE_TOKENS

AttentionPath = Literal["sdpa", "distattention"]
ATTENTION_PATHS: tuple[AttentionPath, ...] = ("sdpa", "distattention")

# Model types whose checkpoints use Llama's tensor names and block structure.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}: expected one of {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters, from either config spelling (transformers 4 or 5)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaArchitecture:
    """A Llama-family model's shape, as config.json gives it: what the forward and the KV cache need.

    (Not the LLMPool's `spec.model`, kvfleet.api.models.ModelSpec, which says where the weights are;
    nor the simulator's kvfleet.sim.hardware.ModelShape, which sizes GPUs, not tensors.)"""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def read_architecture(model_path: Path) -> LlamaArchitecture:
    """Parse config.json (and generation_config.json's EOS ids, which chat models often extend)."""
    try:
        config = json.loads((model_path / "config.json").read_text())
    except OSError as err:
        raise EngineError(f"no model at {model_path}: {err}") from err
    model_type = str(config.get("model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise EngineError(f"the builtin engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not {model_type!r}")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    # transformers 5 nests rope settings in rope_parameters; 4 has rope_theta and rope_scaling.
    rope_config = dict(config.get("rope_scaling") or {})
    rope_config.update(config.get("rope_parameters") or {})
    rope_type = str(rope_config.get("rope_type", rope_config.get("type", "default")))
    if rope_type not in ("default", "linear", "llama3"):
        raise EngineError(f"the builtin engine does not implement rope_type {rope_type!r}")
    rope = RopeSpec(
        theta=float(rope_config.get("rope_theta", config.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(rope_config.get("factor", 1.0)),
        low_freq_factor=float(rope_config.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope_config.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope_config.get("original_max_position_embeddings", 8192)),
    )
    eos = list(_eos_ids(config.get("eos_token_id")))
    generation_path = model_path / "generation_config.json"
    if generation_path.exists():
        for token_id in _eos_ids(json.loads(generation_path.read_text()).get("eos_token_id")):
            if token_id not in eos:
                eos.append(token_id)
    return LlamaArchitecture(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        intermediate_size=int(config["intermediate_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=rope,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        eos_token_ids=tuple(eos),
    )


def _read_safetensors(model_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index_path = model_path / "model.safetensors.index.json"
    if index_path.exists():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in model_path.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors in {model_path}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(model_path / name, device="cpu"))
    return tensors


def rope_inv_freq(arch: LlamaArchitecture) -> torch.Tensor:
    """Inverse frequencies exactly as transformers computes them (float32), scaling included."""
    rope, dim = arch.rope, arch.head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    # q, k and v stacked into one matrix (and gate with up): one matmul instead of three.
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True)
class SeqBatchEntry:
    """One sequence's part of a forward: tokens new to the cache and where they go.

    `block_table` lists the sequence's blocks in order and must already cover
    start_position + len(token_ids) tokens.
    """

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    # Elastic memory's offloaded prefill (eLLM §4.3.2): the sequence's K and V go here, [layers, 2,
    # tokens, kv_heads, head_dim] in host memory, instead of into the paged cache (it then has no
    # blocks: block_table is empty and start_position 0), and its attention reads them from the layer.
    offload_to: torch.Tensor | None = None
    # DistKV (Infinite-LLM sections 4.3 and 4.6): `remote_tokens` of the context's tokens are held
    # outside this cache, by `extra_parts`; the block table then holds the other
    # start_position - remote_tokens context tokens, then the new ones (cache slot p - remote_tokens
    # for position p). Attention over a set of keys does not depend on their order (positions are in
    # the rotated keys), so which tokens are remote is the providers' business. distattention only.
    extra_parts: Sequence[KVParts] = ()
    remote_tokens: int = 0


class KVParts(Protocol):
    """Part of a sequence's KV held elsewhere (another worker's rBlocks, host memory), attended where
    it lives: the query is shipped to the KV, not the KV to the query (Infinite-LLM section 4.6).

    This is the seam where rManager's remote blocks plug into the builtin engine's forward.
    """

    def submit(self, layer_index: int, q: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Start the micro-attention of q [rows, q_heads, head_dim] (rotated, the sequence's new tokens
        in order) over this part's K and V of layer `layer_index`, non-causal (every token of the part
        precedes the queries), and return how to wait for it: (out fp32 [rows, q_heads, head_dim], lse
        fp32 [rows, q_heads], natural log) on q's device; an empty part is out 0 and lse -inf. The
        forward computes its local parts while a remote one is in flight (section 4.6's overlap)."""
        ...


@dataclass(frozen=True)
class _DistPlan:
    """One step's DistAttention indices, built once and read by every layer (module docstring).

    Rows are rows of the step's flat batch. Decodes attend in groups bounded by the decode workspace
    (LlamaForward._decode_groups) to their stored part and their new token at once: the layer writes
    the new token's K and V into the cache before attention, so one micro-attention over the cache
    covers both (a separate in-hand part would cost a second kernel and a merge per layer, for one
    token). Prefills (packed in batch order) attend to their stored part with no mask (causal offset
    = its length) and to their in-hand part causally, a cache of one-token blocks.
    """

    decode_rows: torch.Tensor  # long [decodes]
    decode_groups: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]  # rows long, table, lens with the new token
    # Every row of the step is a decode, in one group, in order, none with extra parts: the group's
    # micro-attention is the layer's whole attention (the common decode step, with no copy or merge).
    decode_only: bool
    prefill_rows: torch.Tensor  # long [prefill tokens]
    prefill_starts: torch.Tensor  # int32 [prefills + 1]
    prefill_table: torch.Tensor  # int32 [prefills, blocks]
    prefill_stored_lens: torch.Tensor  # int32 [prefills]
    prefill_hand_table: torch.Tensor  # int32 [prefills, longest new]
    prefill_hand_lens: torch.Tensor  # int32 [prefills]
    max_prefill_tokens: int
    max_logits_bytes: int
    extras: tuple[tuple[slice, tuple[KVParts, ...]], ...]


# What any step allocates whatever its batch (index tensors, rotary tables' slices, the allocator's
# rounding), on top of the per-sequence shares below.
ACTIVATION_BASE_BYTES = 512 * 1024


def activation_bytes(arch: LlamaArchitecture, dtype: torch.dtype, new_tokens: int, context_tokens: int,
                     block_size_tokens: int) -> int:
    """An upper bound of the transient memory one sequence adds to a `forward` step (eLLM's
    requiredAct(r), §4.4.1), from the step's real shapes and what `forward` below allocates for them.

    Per new token, in the model's dtype: the residual stream, its norm and the sum (3 x hidden), the
    fused QKV and rotary temporaries (3 x (heads + 2 x kv_heads) x head_dim), the attention output
    (heads x head_dim) and the MLP (gate, up, silu, product: 4 x intermediate); per sequence one row
    of logits in the dtype and in float32. Attention is transient per layer: a decode gathers its
    blocks (K and V, and SDPA's contiguous copies of them) and a mask; a prefill gathers K and V likewise and builds its causal mask as bool and float32
    (5 bytes per query x key pair), plus SDPA's float32 output; a decode's gather is the step's
    decode workspace instead (`decode_workspace_bytes`, charged once per step). Checked against
    torch's profiler (tests/worker/test_elastic_engine.py): never less than what the CPU really
    allocates, and at most 1.6x it besides the fixed base and workspace.
    """
    s = dtype.itemsize
    h, kvh, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    per_token = s * (3 * arch.hidden_size + 3 * (h + 2 * kvh) * d + h * d + 4 * arch.intermediate_size)
    logits = arch.vocab_size * (s + 4)
    if new_tokens == 1:
        attention = 0  # in the step's decode workspace (decode_workspace_bytes), charged once per step
    else:
        attention = 4 * context_tokens * kvh * d * s + 5 * new_tokens * context_tokens + 2 * new_tokens * h * d * 4
    return new_tokens * per_token + logits + attention


def decode_gather_bytes_per_token(arch: LlamaArchitecture, dtype: torch.dtype) -> int:
    """A decode's attention transient per (padded) context token: K and V gathered from the blocks,
    SDPA's contiguous copies of them (the torch backend's head-major copies), the mask as bool and
    float32, and the torch backend's float32 logits, one per query head."""
    return 4 * arch.num_kv_heads * arch.head_dim * dtype.itemsize + 5 + 4 * arch.num_heads


# The decode attention workspace: the most K and V a step's decodes gather at once (more decodes attend
# in several groups). At least one request at the longest context, whatever the bound.
DECODE_WORKSPACE_BYTES = 32 * 1024 * 1024


def decode_workspace_bytes(arch: LlamaArchitecture, dtype: torch.dtype, max_model_len: int, block_size_tokens: int,
                           memory_bytes: int | None = None) -> int:
    """DECODE_WORKSPACE_BYTES, or an eighth of the memory it comes out of when that is less, and never
    less than one request at the longest context gathers."""
    longest = -(-max_model_len // block_size_tokens) * block_size_tokens
    bound = DECODE_WORKSPACE_BYTES if memory_bytes is None else min(DECODE_WORKSPACE_BYTES, memory_bytes // 8)
    return max(bound, longest * decode_gather_bytes_per_token(arch, dtype))


def block_major_shape(arch: LlamaArchitecture, num_blocks: int, block_size_tokens: int) -> tuple[int, ...]:
    """The shape of a cache whose blocks each hold all layers' K and V in one contiguous run:
    [num_blocks, layers, 2, block_size, kv_heads, head_dim]. Elastic memory maps such a cache a chunk
    of whole blocks at a time (a per-layer layout would spread a block over 2 x layers places)."""
    return (num_blocks, arch.num_layers, 2, block_size_tokens, arch.num_kv_heads, arch.head_dim)


class PagedKVCache:
    """One tensor of blocks per layer, K and V together: [2, num_blocks, block_size, kv_heads, head_dim].

    Allocation (which blocks belong to whom) is the engine's business; this is only the storage:
    its own zeroed tensors, or with `storage` (shaped `block_major_shape`) views of a tensor someone
    else owns, such as elastic memory's KV eTensor, whose unmapped blocks read as zero.
    """

    def __init__(self, arch: LlamaArchitecture, num_blocks: int, block_size_tokens: int, dtype: torch.dtype,
                 device: torch.device, storage: torch.Tensor | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        if storage is None:
            self.layers = [
                torch.zeros((2, num_blocks, block_size_tokens, arch.num_kv_heads, arch.head_dim), dtype=dtype, device=device)
                for _ in range(arch.num_layers)
            ]
        else:
            if tuple(storage.shape) != block_major_shape(arch, num_blocks, block_size_tokens):
                raise ValueError(f"cache storage of shape {tuple(storage.shape)}, expected "
                                 f"{block_major_shape(arch, num_blocks, block_size_tokens)}")
            # Strided views with the same indexing as the tensors above.
            self.layers = [storage[:, layer].transpose(0, 1) for layer in range(arch.num_layers)]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.layers[0].shape[2:])

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' K and V for all layers: [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        return torch.stack([layer.index_select(1, index) for layer in self.layers])

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        for layer, layer_data in zip(self.layers, data.to(device=self.layers[0].device, dtype=self.layers[0].dtype)):
            layer[:, index] = layer_data


class LlamaForward:
    """Weights on a device and the forward over a paged cache; no state between calls but the cache."""

    def __init__(self, arch: LlamaArchitecture, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 max_positions: int, attention: AttentionPath = "distattention") -> None:
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, got {attention!r}")
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.attention = attention

        def take(name: str) -> torch.Tensor:
            try:
                tensor = tensors[name]
            except KeyError:
                raise EngineError(f"the checkpoint has no tensor {name!r}") from None
            return tensor.to(device=device, dtype=dtype)

        self.embed = take("model.embed_tokens.weight")
        self.lm_head = self.embed if arch.tie_word_embeddings and "lm_head.weight" not in tensors else take("lm_head.weight")
        self.final_norm = take("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}"
            bias_names = [f"{p}.self_attn.{n}_proj.bias" for n in ("q", "k", "v")]
            qkv_bias = torch.cat([take(n) for n in bias_names]) if all(n in tensors for n in bias_names) else None
            self.layers.append(LayerWeights(
                input_norm=take(f"{p}.input_layernorm.weight"),
                qkv=torch.cat([take(f"{p}.self_attn.{n}_proj.weight") for n in ("q", "k", "v")]),
                qkv_bias=qkv_bias,
                o=take(f"{p}.self_attn.o_proj.weight"),
                post_norm=take(f"{p}.post_attention_layernorm.weight"),
                gate_up=torch.cat([take(f"{p}.mlp.gate_proj.weight"), take(f"{p}.mlp.up_proj.weight")]),
                down=take(f"{p}.mlp.down_proj.weight"),
            ))
        # cos/sin per position in float32, as transformers computes them, cast to the model dtype at use.
        self.max_positions = max_positions
        self._gather_bytes_per_token = decode_gather_bytes_per_token(arch, dtype)
        # What one step's decode attention may gather at once (module-level decode_workspace_bytes).
        self.decode_workspace_bytes = decode_workspace_bytes(arch, dtype, max_positions, BLOCK_SIZE_TOKENS)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(arch)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos().to(device)
        self.rope_sin = emb.sin().to(device)


    def _decode_groups(self, contexts: Sequence[int], block_size_tokens: int) -> list[list[int]]:
        """Consecutive runs of the decodes (indices into `contexts`) each gathering at most the workspace."""
        budget = self.decode_workspace_bytes
        groups: list[list[int]] = []
        longest = 0
        for j, context in enumerate(contexts):
            padded = -(-context // block_size_tokens) * block_size_tokens
            if groups and (len(groups[-1]) + 1) * max(longest, padded) * self._gather_bytes_per_token <= budget:
                groups[-1].append(j)
                longest = max(longest, padded)
            else:
                groups.append([j])
                longest = padded
        return groups

    def _dist_plan(self, seqs: Sequence[SeqBatchEntry], lengths: Sequence[int], offsets: Sequence[int],
                   decode: Sequence[int], prefill: Sequence[int], bs: int) -> _DistPlan:
        """The step's DistAttention indices (see _DistPlan); bs is the cache's block size in tokens."""
        device = self.device

        def int32(values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        def long(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        def tables(stored: Sequence[int], members: Sequence[int]) -> torch.Tensor:
            # Padding entries point at block 0; the part's length hides them.
            width = max([1, *(-(-n // bs) for n in stored)])
            rows = [list(seqs[i].block_table[: -(-n // bs)]) for i, n in zip(members, stored)]
            return int32([r + [0] * (width - len(r)) for r in rows])

        def stored_tokens(i: int) -> int:
            return seqs[i].start_position - seqs[i].remote_tokens

        groups = []
        # Grouped by the whole context, as the SDPA path: the workspace bound (decode_workspace_bytes)
        # holds for either path, and the local part is never longer.
        for group in self._decode_groups([seqs[i].start_position + 1 for i in decode], bs):
            members = [decode[j] for j in group]
            local = [stored_tokens(i) + 1 for i in members]  # with the new token, written before attention
            groups.append((long([offsets[i] for i in members]), tables(local, members), int32(local)))
        prefill_rows = [offsets[i] + j for i in prefill for j in range(lengths[i])]
        starts = [0]
        for i in prefill:
            starts.append(starts[-1] + lengths[i])
        longest_new = max([1, *(lengths[i] for i in prefill)])
        hand_table = [[starts[p] + j for j in range(lengths[i])] + [0] * (longest_new - lengths[i])
                      for p, i in enumerate(prefill)]
        stored_prefill = [stored_tokens(i) for i in prefill]
        # The prefill charge (activation_bytes) allows 5 bytes per query-key pair for SDPA's mask;
        # the torch backend's fp32 logits tile (4 bytes a pair and its bool mask) fits in it.
        pairs = sum(lengths[i] * (seqs[i].start_position + lengths[i]) for i in prefill)
        return _DistPlan(
            decode_rows=long([offsets[i] for i in decode]),
            decode_groups=tuple(groups),
            decode_only=not prefill and len(groups) == 1 and not any(s.extra_parts for s in seqs),
            prefill_rows=long(prefill_rows),
            prefill_starts=int32(starts),
            prefill_table=tables(stored_prefill, prefill) if prefill else int32([[0]])[:0],
            prefill_stored_lens=int32(stored_prefill),
            prefill_hand_table=int32(hand_table) if prefill else int32([[0]])[:0],
            prefill_hand_lens=int32([lengths[i] for i in prefill]),
            max_prefill_tokens=longest_new,
            max_logits_bytes=4 * pairs,
            extras=tuple((slice(offsets[i], offsets[i] + lengths[i]), tuple(s.extra_parts))
                         for i, s in enumerate(seqs) if s.extra_parts),
        )

    def _dist_attention(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv: torch.Tensor, plan: _DistPlan) -> torch.Tensor:
        """Every row's attention as ScaleReduce over its parts: stored, in-hand, then extra parts (sent
        first, so that they are computed where they live while the local parts are computed here)."""
        if plan.decode_only:
            # Rows 0..n-1 are the group's rows in order (offsets of one-token sequences).
            _, table, lens = plan.decode_groups[0]
            out, _ = distattention.micro_attention_decode(q, kv[0], kv[1], table, lens)
            return out.to(self.dtype)
        pending = [(span, part.submit(layer_index, q[span])) for span, parts in plan.extras for part in parts]
        num_rows, h, d = q.shape
        stored_o = torch.empty((num_rows, h, d), dtype=torch.float32, device=q.device)
        stored_lse = torch.empty((num_rows, h), dtype=torch.float32, device=q.device)
        for rows, table, lens in plan.decode_groups:
            o, lse = distattention.micro_attention_decode(q[rows], kv[0], kv[1], table, lens)
            stored_o[rows], stored_lse[rows] = o, lse
        if plan.prefill_rows.numel():
            # Decode rows have no in-hand part: an empty partial (0, -inf) leaves them as they are.
            hand_o = torch.zeros_like(stored_o)
            hand_lse = torch.full_like(stored_lse, float("-inf"))
            rows = plan.prefill_rows
            q_rows = q[rows]
            # Stored tokens all precede the new ones: causal offset = their count, so nothing is masked.
            o, lse = distattention.micro_attention_prefill(
                q_rows, kv[0], kv[1], plan.prefill_table, plan.prefill_stored_lens, plan.prefill_starts,
                causal_offsets=plan.prefill_stored_lens, max_q_len=plan.max_prefill_tokens,
                max_logits_bytes=plan.max_logits_bytes)
            stored_o[rows], stored_lse[rows] = o, lse
            o, lse = distattention.micro_attention_prefill(
                q_rows, k[rows][:, None], v[rows][:, None], plan.prefill_hand_table, plan.prefill_hand_lens,
                plan.prefill_starts, max_q_len=plan.max_prefill_tokens, max_logits_bytes=plan.max_logits_bytes)
            hand_o[rows], hand_lse[rows] = o, lse
            distattention.scale_reduce_pair(stored_o, stored_lse, hand_o, hand_lse, out=stored_o, out_lse=stored_lse)
            del hand_o, hand_lse
        for span, collect in pending:
            # Folded in one at a time, as peers' answers arrive (the merge is associative).
            o, lse = collect()
            distattention.scale_reduce_pair(stored_o[span], stored_lse[span], o, lse, out=stored_o[span],
                                            out_lse=stored_lse[span])
        return stored_o.to(self.dtype)

    @classmethod
    def load(cls, model_path: Path, dtype: torch.dtype, device: torch.device, max_positions: int,
             attention: AttentionPath = "distattention") -> LlamaForward:
        arch = read_architecture(model_path)
        return cls(arch, _read_safetensors(model_path), dtype, device, max_positions, attention)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the model dtype, as transformers' LlamaRMSNorm does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqBatchEntry], cache: PagedKVCache, *, all_logits: bool = False,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Write the new tokens' K and V into the cache and return float32 logits.

        One row per sequence (its last new token), or with all_logits one row per new token, in
        order. Sequences with several new tokens attend causally to their whole cached context.
        `on_layer(i)` is called once layer i's K and V are in the cache (a by-layer hand-over sends
        them while the next layers compute).
        """
        # Longer than the house's ~60 lines on purpose: the batch's index tensors (slots, block
        # tables, masks) are built once and read by every layer; split, they would travel as a bag.
        arch = self.arch
        device = self.device
        bs = cache.block_size_tokens
        lengths = [len(s.token_ids) for s in seqs]
        if min(lengths) < 1:
            raise ValueError("every sequence needs at least one new token")
        flat_ids = [t for s in seqs for t in s.token_ids]
        flat_positions = [s.start_position + i for s in seqs for i in range(len(s.token_ids))]
        # Where each new token's K and V go: (block, offset) of the cache, for every sequence that
        # keeps its KV there (an offloaded prefill writes to its own host tensor instead).
        dist = self.attention == "distattention"
        cached_rows, slot_blocks, slot_offsets = [], [], []
        row = 0
        for s in seqs:
            if not dist and (s.extra_parts or s.remote_tokens):
                raise ValueError("KV held outside the cache (extra_parts, remote_tokens) needs attention='distattention'")
            if not 0 <= s.remote_tokens <= s.start_position:
                raise ValueError(f"remote_tokens {s.remote_tokens} must lie in [0, start_position {s.start_position}]")
            for p in range(s.start_position, s.start_position + len(s.token_ids)):
                if s.offload_to is None:
                    cached_rows.append(row)
                    slot = p - s.remote_tokens
                    slot_blocks.append(s.block_table[slot // bs])
                    slot_offsets.append(slot % bs)
                row += 1
        ids = torch.tensor(flat_ids, dtype=torch.long, device=device)
        positions = torch.tensor(flat_positions, dtype=torch.long, device=device)
        all_cached = len(cached_rows) == len(flat_ids)
        cached_index = torch.tensor(cached_rows, dtype=torch.long, device=device)
        block_index = torch.tensor(slot_blocks, dtype=torch.long, device=device)
        offset_index = torch.tensor(slot_offsets, dtype=torch.long, device=device)
        cos = self.rope_cos[positions].to(self.dtype)[:, None, :]
        sin = self.rope_sin[positions].to(self.dtype)[:, None, :]
        context_lengths = [s.start_position + n for s, n in zip(seqs, lengths)]

        decode = [i for i, n in enumerate(lengths) if n == 1]
        prefill = [i for i, n in enumerate(lengths) if n > 1]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        plan = self._dist_plan(seqs, lengths, offsets, decode, prefill, bs) if dist else None
        # Decodes attend in groups whose gathered K and V (padded to the group's longest context)
        # stay within the decode workspace: a step's transient memory is then bounded whatever its
        # batch, which is what elastic memory charges it (activation_bytes).
        decode_groups = []
        for group in ([] if dist else self._decode_groups([context_lengths[i] for i in decode], bs)):
            members = [decode[j] for j in group]
            max_blocks = max(-(-context_lengths[i] // bs) for i in members)
            # Padding entries point at block 0; the mask hides them.
            padded_tables = [list(seqs[i].block_table[:max_blocks]) for i in members]
            tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in padded_tables], dtype=torch.long, device=device)
            group_lengths = torch.tensor([context_lengths[i] for i in members], dtype=torch.long, device=device)
            group_mask = (torch.arange(max_blocks * bs, device=device)[None, :] < group_lengths[:, None])[:, None, None, :]
            group_rows = torch.tensor([offsets[i] for i in members], dtype=torch.long, device=device)
            decode_groups.append((group_rows, tables, group_mask))

        h, kvh, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        x = self.embed[ids]
        for layer_index, (layer, kv) in enumerate(zip(self.layers, cache.layers)):
            normed = self._rms_norm(x, layer.input_norm)
            qkv = F.linear(normed, layer.qkv, layer.qkv_bias)
            q = qkv[:, : h * d].view(-1, h, d)
            k = qkv[:, h * d: (h + kvh) * d].view(-1, kvh, d)
            v = qkv[:, (h + kvh) * d:].view(-1, kvh, d)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            if all_cached:
                kv[0][block_index, offset_index] = k
                kv[1][block_index, offset_index] = v
            elif cached_rows:
                kv[0][block_index, offset_index] = k[cached_index]
                kv[1][block_index, offset_index] = v[cached_index]
            if on_layer is not None:
                on_layer(layer_index)
            if plan is not None:
                for i in prefill:
                    sink = seqs[i].offload_to
                    if sink is not None:
                        # Its KV goes to host memory (the copy on a GPU overlaps what follows); its
                        # attention reads the layer's K and V, its in-hand part.
                        rows = slice(offsets[i], offsets[i] + lengths[i])
                        sink[layer_index, 0, : lengths[i]].copy_(k[rows], non_blocking=True)
                        sink[layer_index, 1, : lengths[i]].copy_(v[rows], non_blocking=True)
                attn = self._dist_attention(layer_index, q, k, v, kv, plan)
            else:
                attn = torch.empty_like(q)
                for group_rows, tables, group_mask in decode_groups:
                    # [B, kv_heads, context, head_dim] gathered through the block tables.
                    keys = kv[0][tables].flatten(1, 2).transpose(1, 2)
                    values = kv[1][tables].flatten(1, 2).transpose(1, 2)
                    out = F.scaled_dot_product_attention(q[group_rows][:, :, None, :], keys, values,
                                                         attn_mask=group_mask, enable_gqa=True)
                    attn[group_rows] = out[:, :, 0, :]
                for i in prefill:
                    start, n, context = seqs[i].start_position, lengths[i], context_lengths[i]
                    rows = slice(offsets[i], offsets[i] + n)
                    sink = seqs[i].offload_to
                    if sink is not None:
                        # Its whole context is this step's tokens (start 0): attend over them from the
                        # layer and send them to host memory (the copy on a GPU overlaps what follows).
                        sink[layer_index, 0, :n].copy_(k[rows], non_blocking=True)
                        sink[layer_index, 1, :n].copy_(v[rows], non_blocking=True)
                        keys = k[rows].transpose(0, 1)[None]
                        values = v[rows].transpose(0, 1)[None]
                    else:
                        table = torch.tensor(list(seqs[i].block_table[: -(-context // bs)]), dtype=torch.long, device=device)
                        keys = kv[0][table].flatten(0, 1)[:context].transpose(0, 1)[None]
                        values = kv[1][table].flatten(0, 1)[:context].transpose(0, 1)[None]
                    if start == 0:
                        # The plain causal mask: said as is_causal, SDPA takes a fused kernel on a GPU
                        # (flash takes no mask, and with GQA and a mask a long prompt can fall back to
                        # the math kernel, whose scores are heads x n x n: 64 GiB at 32K tokens).
                        out = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys, values,
                                                             is_causal=True, enable_gqa=True)
                    else:
                        query_positions = torch.arange(start, start + n, device=device)
                        mask = torch.arange(context, device=device)[None, :] <= query_positions[:, None]
                        out = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys, values,
                                                             attn_mask=mask[None, None], enable_gqa=True)
                    attn[rows] = out[0].transpose(0, 1)
            x = x + F.linear(attn.reshape(-1, h * d), layer.o)
            normed = self._rms_norm(x, layer.post_norm)
            gate, up = F.linear(normed, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        if not all_logits:
            x = x[torch.tensor([offsets[i + 1] - 1 for i in range(len(seqs))], dtype=torch.long, device=device)]
        x = self._rms_norm(x, self.final_norm)
        return F.linear(x, self.lm_head).float()
