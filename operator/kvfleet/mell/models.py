"""Domain values of the scheduling core: KV capacity, the TPOT load cap, events, plans.

Everything the scheduler consumes or produces is a frozen dataclass defined here, so that the
operator, the router, the simulator and the tests speak the same vocabulary (docs/mell.md). Sizes
are bytes of KV cache; C (``capacity_bytes``) is one worker's KV capacity (MELL §VI-A), computed by
`kv_capacity_bytes`. Size classes are size_classes.py's. Model shapes and GPU types, which only the simulator
and the benches need to turn a preset into bytes, live in kvfleet.sim.hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def kv_capacity_bytes(memory_bytes: int, weight_bytes: int, activation_reserve_bytes: int, block_bytes: int = 1) -> int:
    """MELL's C (§VI-A): memory - weights - activation reserve, rounded down to whole KV blocks.

    The one formula for C: the LLMPool spec derives a pool's C with it (kvfleet.api, where the block
    size is unknown, so `block_bytes` is 1) and the simulator a preset's (kvfleet.sim.hardware, which
    knows the model's shape and rounds to 16-token blocks, as vLLM allocates). The callers choose the
    reserve: a fraction of memory in the spec, 10% by default in the simulator.
    """
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, not {block_bytes}")
    raw_bytes = memory_bytes - weight_bytes - activation_reserve_bytes
    if raw_bytes <= 0:
        raise ValueError(f"no room for the KV cache: {memory_bytes} bytes of memory - {weight_bytes} of weights - "
                         f"{activation_reserve_bytes} of activation reserve = {raw_bytes}")
    return (raw_bytes // block_bytes) * block_bytes


def tpot_load_cap(tpot_s: float, weight_bytes: int, bandwidth_bytes_per_s: float,
                  per_sequence_s: float) -> tuple[int, int]:
    """A TPOT objective as a KV load cap: (max_load_bytes, load_bytes_per_request).

    A decode step reads the weights and the batch's KV once and pays a per-sequence overhead:
    step_s = (weights + kv) / bandwidth + n x per_sequence_s. It is within `tpot_s` exactly when
    kv + n x per_request <= max_load, with max_load = tpot x bandwidth - weights and per_request =
    per_sequence_s x bandwidth (rounded so the cap never allows a slower step). The one home of that
    arithmetic: the LLMPool's slo (kvfleet.api) and the simulator's setups (kvfleet.sim) both call it.
    """
    if tpot_s <= 0 or bandwidth_bytes_per_s <= 0 or per_sequence_s < 0:
        raise ValueError("tpot_s and bandwidth_bytes_per_s must be positive and per_sequence_s >= 0")
    max_load = math.floor(tpot_s * bandwidth_bytes_per_s - weight_bytes)
    per_request = math.ceil(per_sequence_s * bandwidth_bytes_per_s)
    if max_load < per_request:
        unloaded_ms = (weight_bytes / bandwidth_bytes_per_s + per_sequence_s) * 1000
        raise ValueError(f"a TPOT objective of {tpot_s * 1000:g} ms is below one request's decode step "
                         f"({unloaded_ms:.1f} ms with no KV)")
    return max_load, per_request


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
    # What the request will hold when its output budget is spent (prompt + max_tokens, what the router
    # reserves; the trace's output in the simulator), if known: the default policy reserves room for
    # each request's own remaining growth from it (MellDefaultConfig.growth_estimate). None: unknown.
    final_size_bytes: int | None = None
    # GPUs whose prefix caches hold the start of its prompt, grouped by how much of it they hold, the
    # longest cached prefix first (what a prefix-aware router reads from its prompt trees, MemServe §6).
    # The default policy places the request on the fullest GPU of the first group that holds it with
    # growth room (MellDefaultConfig.prefix_affinity); the other policies place by bytes alone. Empty:
    # none known.
    prefix_tiers: tuple[tuple[str, ...], ...] = ()


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
