"""KV capacity C has one formula (kvfleet.mell.models.kv_capacity_bytes), used by the spec and the simulator."""

from __future__ import annotations

import pytest

from kvfleet.api.models import LLMPoolSpec
from kvfleet.mell import kv_capacity_bytes
from kvfleet.sim.hardware import A100_40GB, BLOCK_SIZE_TOKENS, GIB, LLAMA2_13B, derive_capacity


def test_memory_less_weights_less_reserve_in_whole_blocks() -> None:
    assert kv_capacity_bytes(100, 30, 10) == 60
    assert kv_capacity_bytes(100, 30, 10, block_bytes=16) == 48
    with pytest.raises(ValueError, match="no room for the KV cache"):
        kv_capacity_bytes(100, 90, 10)


def test_the_pool_spec_and_the_simulator_agree_on_c() -> None:
    # The same GPU, weights and 10% reserve: the spec's C is the simulator's before rounding to blocks
    # (the spec does not know the model's KV bytes per token).
    spec = LLMPoolSpec.model_validate({
        "model": {"name": "m", "path": "/m"},
        "capacity": {"gpuMemory": "40Gi", "modelWeights": str(LLAMA2_13B.weight_bytes), "activationReserveFraction": 0.1},
    })
    sim = derive_capacity(LLAMA2_13B, A100_40GB)
    block_bytes = BLOCK_SIZE_TOKENS * LLAMA2_13B.kv_bytes_per_token
    assert spec.kv_capacity_per_worker_bytes() == kv_capacity_bytes(40 * GIB, LLAMA2_13B.weight_bytes, 4 * GIB)
    assert sim.capacity_bytes == spec.kv_capacity_per_worker_bytes() // block_bytes * block_bytes
