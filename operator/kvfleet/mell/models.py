"""Domain values of the scheduling core: model and GPU specs, KV capacity, size classes, events, plans.

Everything the scheduler consumes or produces is a frozen dataclass defined here, so that the
operator, the simulator and the tests speak the same vocabulary (DESIGN.md, "The scheduling core").
Sizes are bytes of KV cache; C (``capacity_bytes``) is one worker's KV capacity (MELL §VI-A).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

GIB = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    """The parts of a model config that decide KV bytes per token and weight bytes."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, per layer, per KV head (DESIGN.md: 2 x layers x kv_heads x head_dim x dtype bytes).
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


def derive_capacity(model: ModelSpec, gpu: GpuSpec, activation_reserve_bytes: int | None = None) -> CapacityDerivation:
    """C = GPU memory - weights - activation reserve, rounded down to whole 16-token KV blocks.

    The default activation reserve is 10% of GPU memory: vLLM's default gpu_memory_utilization of 0.9
    leaves that much for the CUDA context, activations of the largest prefill batch and the allocator.
    """
    reserve = activation_reserve_bytes if activation_reserve_bytes is not None else gpu.memory_bytes // 10
    raw = gpu.memory_bytes - model.weight_bytes - reserve
    if raw <= 0:
        raise ValueError(f"{model.name} does not fit on {gpu.name}: {raw} bytes left for the KV cache")
    block_bytes = 16 * model.kv_bytes_per_token
    capacity = (raw // block_bytes) * block_bytes
    return CapacityDerivation(gpu.memory_bytes, model.weight_bytes, reserve, capacity, model.kv_bytes_per_token)


# The paper's two setups (MELL §VIII-B). Shapes from the LLaMA-2 configs (no GQA below 70B).
LLAMA2_7B = ModelSpec("llama-2-7b", num_layers=32, num_kv_heads=32, head_dim=128, num_params=6_738_415_616)
LLAMA2_13B = ModelSpec("llama-2-13b", num_layers=40, num_kv_heads=40, head_dim=128, num_params=13_015_864_320)
A100_40GB = GpuSpec("a100-40gb", memory_bytes=40 * GIB, mem_bandwidth_bytes_per_s=1.555e12, peak_flops=312e12)
RTX4090_24GB = GpuSpec("rtx4090-24gb", memory_bytes=24 * GIB, mem_bandwidth_bytes_per_s=1.008e12, peak_flops=165e12)


class SizeClass(enum.IntEnum):
    """MELL §VI-C size classes, ordered so that a GPU's category is the max over its items."""

    TINY = 0  # (0, C/8]: grouped into multi-items
    T = 1  # (C/8, C/4]
    S = 2  # (C/4, C/3]
    M = 3  # (C/3, C/2]
    L = 4  # (C/2, C]
    X = 5  # (C, inf): spans GPUs with DistAttention; not a failure


def size_class(size_bytes: int, capacity_bytes: int) -> SizeClass:
    """Classify with exact integer arithmetic (MELL §VI-C, "Priority-aware GPU Categories")."""
    c = capacity_bytes
    if size_bytes > c:
        return SizeClass.X
    if 2 * size_bytes > c:
        return SizeClass.L
    if 3 * size_bytes > c:
        return SizeClass.M
    if 4 * size_bytes > c:
        return SizeClass.S
    if 8 * size_bytes > c:
        return SizeClass.T
    return SizeClass.TINY


def num_span_gpus(size_bytes: int, capacity_bytes: int) -> int:
    return max(1, math.ceil(size_bytes / capacity_bytes))


@dataclass(frozen=True)
class Location:
    """Where a GPU is, for the distance term of MELL's GPU-to-GPU priority (§VI-C)."""

    node_id: str
    zone_id: str


# ---- events (inputs of one epoch, Algorithm 1) ----


@dataclass(frozen=True)
class Arrive:
    request_id: str
    size_bytes: int


@dataclass(frozen=True)
class Finish:
    request_id: str


@dataclass(frozen=True)
class Grow:
    """A running request's KV reservation grew (sizes only grow, §VI-A: S_i^t >= S_i^{t-1})."""

    request_id: str
    size_bytes: int


Event = Arrive | Finish | Grow


@dataclass(frozen=True)
class EventBatch:
    now_s: float
    events: tuple[Event, ...]


# ---- outputs ----


@dataclass(frozen=True)
class Placement:
    request_id: str
    gpu_id: str


@dataclass(frozen=True)
class Migration:
    request_id: str
    source_gpu_id: str
    target_gpu_id: str
    size_bytes: int
    cause: str


@dataclass(frozen=True)
class Span:
    """A request larger than C: its KV lives on `gpu_ids` and is attended with DistAttention."""

    request_id: str
    gpu_ids: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """What one epoch decided. Migrations are net moves after batching cancelled redundant ones."""

    now_s: float
    placements: tuple[Placement, ...]
    migrations: tuple[Migration, ...]
    preemptions: tuple[Migration, ...]
    spans: tuple[Span, ...]
    activate_gpu_ids: tuple[str, ...]
    terminate_gpu_ids: tuple[str, ...]
    # Item moves caused by each single operation before cancellation (MELL Theorem 3 counts these).
    moves_per_operation: tuple[int, ...] = field(default=())
    num_moves_cancelled: int = 0
