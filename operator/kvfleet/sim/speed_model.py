"""What a replay runs on (`Setup`): a worker's KV capacity C, its speed model and its links.

The speed model answers the replay's two questions, how long a decode step and a prefill take. It is
the datasheet's (`BandwidthSpeed`: a decode step reads the weights and the batch's KV once, so
step_s = (weight_bytes + kv_bytes) / (bandwidth x efficiency) + batch x per-sequence overhead;
prefill is compute-bound, 2 x params x tokens / (peak FLOPs x MFU)) or what workers measured
(`ProfileSpeed`, kvfleet.sim.profile). Kept apart from the replay (run.py) so that the benches and
the CLI can build setups and TPOT caps without the replay's machinery.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.api.speed import SpeedProfile
from kvfleet.mell.models import tpot_load_cap as tpot_load_cap_core
from kvfleet.sim.hardware import CapacityDerivation, GpuSpec, ModelShape, derive_capacity
from kvfleet.sim.profile import ProfileSpeed

# The §VIII-B links, for setups whose own are unknown (every hardware setup; a profile without them).
INTRA_NODE_BYTES_PER_S = 25e9  # PCIe 4.0 x16
INTER_NODE_BYTES_PER_S = 1.25e9  # 10 Gbps


@dataclass(frozen=True)
class BandwidthSpeed:
    """The datasheet speed model (module docstring): a decode step reads the weights and the batch's
    KV at a share of the GPU's bandwidth, a prefill is compute-bound at a share of its peak FLOPs."""

    model: ModelShape
    gpu: GpuSpec
    bandwidth_efficiency: float = 0.8
    per_sequence_overhead_s: float = 0.0002
    mfu: float = 0.5

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.gpu.mem_bandwidth_bytes_per_s * self.bandwidth_efficiency

    def step_s(self, batch: int, kv_bytes: int) -> float:
        return (self.model.weight_bytes + kv_bytes) / self.bandwidth_bytes_per_s + batch * self.per_sequence_overhead_s

    def prefill_s(self, tokens: int) -> float:
        return 2.0 * self.model.num_params * tokens / (self.gpu.peak_flops * self.mfu)

    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_s(1)


# Where a setup's speed comes from: the datasheet, or what workers measured (kvfleet.sim.profile).
SpeedModel = BandwidthSpeed | ProfileSpeed


@dataclass(frozen=True)
class Setup:
    """What a replay runs on: a worker's KV capacity C, its speed, and the links between workers.

    `make_setup` builds one from a model on a GPU type (C derived from them, kept in `capacity` for
    reports), `profile_setup` from a measured speed profile (C as the profile states it).
    """

    name: str
    speed: SpeedModel
    capacity_bytes: int
    kv_bytes_per_token: int
    capacity: CapacityDerivation | None = None  # how C was derived, for a hardware setup
    intra_node_bytes_per_s: float = INTRA_NODE_BYTES_PER_S
    inter_node_bytes_per_s: float = INTER_NODE_BYTES_PER_S

    def step_s(self, batch: int, kv_bytes: int) -> float:
        return self.speed.step_s(batch, kv_bytes)

    def prefill_s(self, tokens: int) -> float:
        return self.speed.prefill_s(tokens)

    def prefill_tokens_per_s(self) -> float:
        return self.speed.prefill_tokens_per_s()


def tpot_load_cap(setup: Setup, tpot_s: float) -> tuple[int, int]:
    """A TPOT objective as the default policy's load cap (MellDefaultConfig.max_load_bytes and
    load_bytes_per_request) on this setup's speed model: the core's computation
    (kvfleet.mell.tpot_load_cap), given this setup's speed as the core's linear step.

    The core's step is linear, (weights + kv) / bandwidth + batch x per-sequence; a measured profile
    is fitted to one, step = a + b x batch + c x kv (`ProfileSpeed.linear_decode`), read as bandwidth
    1 / c, weights a / c (rounded up, so the cap never allows a slower step) and per-sequence b (at
    least 0: a fit in which more requests step faster would loosen the cap on noise).
    """
    speed = setup.speed
    try:
        if isinstance(speed, BandwidthSpeed):
            return tpot_load_cap_core(tpot_s, speed.model.weight_bytes, speed.bandwidth_bytes_per_s,
                                      speed.per_sequence_overhead_s)
        fit = speed.linear_decode()
        if fit.per_kv_byte_s <= 0:
            raise ValueError(f"the speed profile's decode steps do not grow with KV (fitted {fit.per_kv_byte_s:.3g} "
                             "s per byte): no load keeps a TPOT objective")
        return tpot_load_cap_core(tpot_s, math.ceil(fit.intercept_s / fit.per_kv_byte_s), 1.0 / fit.per_kv_byte_s,
                                  max(fit.per_sequence_s, 0.0))
    except ValueError as err:
        raise ValueError(f"{setup.name}: {err}") from None


def tpot_knobs(setup: Setup, tpot_ms: float) -> dict[str, int]:
    """A TPOT objective in milliseconds as the default policy's knobs (MellDefaultConfig.max_load_bytes and
    load_bytes_per_request) on this setup (`tpot_load_cap`; ValueError where no load keeps it)."""
    max_load, per_request = tpot_load_cap(setup, tpot_ms / 1000.0)
    return {"max_load_bytes": max_load, "load_bytes_per_request": per_request}


def make_setup(name: str, model: ModelShape, gpu: GpuSpec, activation_reserve_bytes: int | None = None) -> Setup:
    capacity = derive_capacity(model, gpu, activation_reserve_bytes)
    return Setup(name, BandwidthSpeed(model, gpu), capacity.capacity_bytes, model.kv_bytes_per_token, capacity)


def profile_setup(profile: SpeedProfile) -> Setup:
    """A setup that runs at a measured speed: `profile-<model>`, C and bytes per token as the profile
    states them, both links at its measured link speed where it has one."""
    link = profile.link_bytes_per_second
    return Setup(
        f"profile-{profile.model}", ProfileSpeed.from_profile(profile), profile.capacity_bytes,
        profile.kv_bytes_per_token,
        intra_node_bytes_per_s=INTRA_NODE_BYTES_PER_S if link is None else link,
        inter_node_bytes_per_s=INTER_NODE_BYTES_PER_S if link is None else link,
    )
