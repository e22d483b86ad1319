"""Model shapes and GPU types for the simulator and the benches, and the paper's presets.

The scheduling core sees only bytes (a request's KV, a worker's capacity C); something must turn "a
LLaMA-2-13B on an A100-40GB" into those bytes and, for the simulator's speed model, into bandwidth and
FLOPs. That is this module. The operator never needs it: an LLMPool states its C or the numbers C is
derived from (kvfleet.api), and workers report what their engine really allocated. C itself comes
from the core's one formula, `kvfleet.mell.models.kv_capacity_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.mell.models import kv_capacity_bytes

GIB = 1 << 30
# vLLM's default KV block: C is rounded down to whole blocks of this many tokens.
BLOCK_SIZE_TOKENS = 16


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model config that decide KV bytes per token and weight bytes."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    dtype_bytes: int = 2
    # What a forward step's activations need (step_activation_bytes); 0 where not given.
    hidden_size: int = 0
    intermediate_size: int = 0
    num_heads: int = 0
    vocab_size: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, per layer, per KV head: 2 x layers x kv_heads x head_dim x dtype bytes.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes


@dataclass(frozen=True)
class GpuSpec:
    """A GPU type: memory, and the two numbers the simulator's speed model needs."""

    name: str
    memory_bytes: int
    mem_bandwidth_bytes_per_s: float
    peak_flops: float


@dataclass(frozen=True)
class CapacityDerivation:
    """How C was obtained, kept so that reports can print it."""

    memory_bytes: int
    weight_bytes: int
    activation_reserve_bytes: int
    capacity_bytes: int
    kv_bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_bytes // self.kv_bytes_per_token


def derive_capacity(model: ModelShape, gpu: GpuSpec, activation_reserve_bytes: int | None = None) -> CapacityDerivation:
    """C of `model` on `gpu` (the core's formula), in whole 16-token KV blocks.

    The default activation reserve is 10% of GPU memory: vLLM's default gpu_memory_utilization of 0.9
    leaves that much for the CUDA context, activations of the largest prefill batch and the allocator.
    """
    reserve = activation_reserve_bytes if activation_reserve_bytes is not None else gpu.memory_bytes // 10
    try:
        capacity = kv_capacity_bytes(gpu.memory_bytes, model.weight_bytes, reserve,
                                     block_bytes=BLOCK_SIZE_TOKENS * model.kv_bytes_per_token)
    except ValueError as err:
        raise ValueError(f"{model.name} does not fit on {gpu.name}: {err}") from None
    return CapacityDerivation(gpu.memory_bytes, model.weight_bytes, reserve, capacity, model.kv_bytes_per_token)


def step_activation_bytes(model: ModelShape, tokens: int, sequences: int) -> int:
    """Transient bytes of one forward step of `tokens` scheduled tokens over `sequences` sequences.

    The same upper bound as the vLLM worker's elastic-memory ActivationModel (worker-image/kvfleet/
    worker/engines/vllm/elastic.py; tests/sim/test_stacks.py checks they agree): per token a Llama
    layer's live tensors (residual and norm, fused QKV, rotary copies, attention and o_proj outputs,
    fused gate-up and its activation), per sequence one row of logits in the dtype and in float32.
    """
    if not (model.hidden_size and model.intermediate_size and model.num_heads and model.vocab_size):
        raise ValueError(f"{model.name}: no hidden/intermediate/heads/vocab sizes to size activations by")
    h, d = model.hidden_size, model.head_dim
    qkv = (model.num_heads + 2 * model.num_kv_heads) * d
    per_token = model.dtype_bytes * (2 * h + qkv + (model.num_heads + model.num_kv_heads) * d + model.num_heads * d
                                     + h + 3 * model.intermediate_size)
    per_sequence = model.vocab_size * (model.dtype_bytes + 4)
    return tokens * per_token + sequences * per_sequence


# The paper's two setups (MELL §VIII-B). Shapes from the LLaMA-2 configs (no GQA below 70B).
LLAMA2_7B = ModelShape("llama-2-7b", num_layers=32, num_kv_heads=32, head_dim=128, num_params=6_738_415_616,
                       hidden_size=4096, intermediate_size=11008, num_heads=32, vocab_size=32000)
LLAMA2_13B = ModelShape("llama-2-13b", num_layers=40, num_kv_heads=40, head_dim=128, num_params=13_015_864_320,
                        hidden_size=5120, intermediate_size=13824, num_heads=40, vocab_size=32000)
A100_40GB = GpuSpec("a100-40gb", memory_bytes=40 * GIB, mem_bandwidth_bytes_per_s=1.555e12, peak_flops=312e12)
RTX4090_24GB = GpuSpec("rtx4090-24gb", memory_bytes=24 * GIB, mem_bandwidth_bytes_per_s=1.008e12, peak_flops=165e12)
