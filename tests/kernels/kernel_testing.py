"""Builders of paged KV caches and tolerances shared by the kernel tests."""

from __future__ import annotations

import torch

# Tolerances against the fp64 references, per input dtype. fp32: the kernels accumulate in fp32 over
# at most a few hundred tokens. fp16/bf16: on a GPU the probabilities are rounded to the input dtype
# before P @ V (as in FlashAttention), which dominates; under the interpreter the loads are upcast and
# the errors are fp32-sized, so these bounds are loose there.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *, scale: float = 1.0) -> None:
    """Compare a kernel's fp32 result with an fp64 reference; -inf must match -inf exactly."""
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    assert not torch.isnan(actual).any(), "NaN in the kernel's result"
    torch.testing.assert_close(actual, expected, atol=ATOL[dtype] * scale, rtol=RTOL[dtype], equal_nan=False)


def make_paged(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    *,
    block_size: int,
    num_spare_blocks: int,
    generator: torch.Generator,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay out per-sequence K/V [num_tokens, kv_heads, dim] in a paged cache with a random block table.

    Returns (k_cache, v_cache, block_table int32, seq_lens int32). Unused blocks hold random values
    so that reading a wrong block shows up as a wrong result.
    """
    kv_heads, head_dim = keys[0].shape[1:]
    dtype = keys[0].dtype
    blocks_per_seq = [-(-k.shape[0] // block_size) for k in keys]
    width = max([1, *blocks_per_seq]) if width is None else width
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    perm = torch.randperm(num_blocks, generator=generator)
    block_table = torch.zeros(len(keys), width, dtype=torch.int32)
    # Entries past a sequence's last block point at random blocks: the kernel must not read them.
    block_table[:] = torch.randint(0, num_blocks, (len(keys), width), generator=generator, dtype=torch.int32)
    next_block = 0
    for seq_id, (k, v) in enumerate(zip(keys, values)):
        for page in range(blocks_per_seq[seq_id]):
            block_id = int(perm[next_block])
            next_block += 1
            block_table[seq_id, page] = block_id
            chunk = slice(page * block_size, min((page + 1) * block_size, k.shape[0]))
            n = chunk.stop - chunk.start
            k_cache[block_id, :n] = k[chunk]
            v_cache[block_id, :n] = v[chunk]
    seq_lens = torch.tensor([k.shape[0] for k in keys], dtype=torch.int32)
    return k_cache, v_cache, block_table, seq_lens


def to(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in tensors)
