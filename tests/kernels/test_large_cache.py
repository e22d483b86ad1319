"""KV caches of more than 2**31 elements (GPU only: each cache here is 4 GiB).

A real GPU's KV cache passes 2**31 elements easily (an H200's 141 GB of bf16 is 70 x 2**30), and the
first H100 run of bench/kernels.py died with an illegal memory access at the first row whose caches
held 2**31 elements. The kernels compute K and V offsets in int64 so that any block id works; these
tests read blocks whose offsets pass 2**31 elements and compare with the fp64 reference over the
same blocks gathered into a small cache (the reference's own indexing stays small).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close

from kvfleet.kernels import micro_attention_decode, micro_attention_prefill
from kvfleet.kernels.micro_attention_decode_reference import micro_attention_decode_reference
from kvfleet.kernels.micro_attention_prefill_reference import micro_attention_prefill_reference

pytestmark = pytest.mark.gpu

BLOCK_SIZE, KV_HEADS, HEAD_DIM, Q_HEADS = 16, 8, 128, 32
# Just past 2**31 elements per cache, plus 64 blocks above the line for the sequences to use.
NUM_BLOCKS = 2**31 // (BLOCK_SIZE * KV_HEADS * HEAD_DIM) + 64


def big_cache(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised caches (only the blocks a test uses are filled): a full fill costs 8 GiB of writes."""
    k = torch.empty((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
    v = torch.empty_like(k)
    assert k.numel() > 2**31
    return k, v


def small_copy(cache: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks `table` names, as a compact cache and the table that indexes it."""
    used = torch.unique(table.flatten())
    remap = torch.full((NUM_BLOCKS,), -1, dtype=torch.int64, device=table.device)
    remap[used.long()] = torch.arange(used.numel(), device=table.device)
    return cache[used.long()].double().cpu(), remap[table.long()].to(torch.int32).cpu()


def test_decode_reads_blocks_past_2_31_elements(device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    k_cache, v_cache = big_cache(device)
    top = torch.arange(NUM_BLOCKS - 64, NUM_BLOCKS, device=device, dtype=torch.int32)
    # Sequence 0 lives wholly above 2**31 elements; sequence 1 mixes the lowest and the highest blocks.
    table = torch.stack([top[torch.randperm(64, generator=gen, device=device)][:40],
                         torch.cat([torch.arange(20, device=device, dtype=torch.int32), top[:20]])])
    for cache in (k_cache, v_cache):
        cache[table.flatten().long()] = torch.randn((table.numel(), BLOCK_SIZE, KV_HEADS, HEAD_DIM), generator=gen,
                                                    device=device).to(torch.bfloat16)
    seq_lens = torch.tensor([40 * BLOCK_SIZE - 3, 40 * BLOCK_SIZE], dtype=torch.int32, device=device)
    q = torch.randn((2, Q_HEADS, HEAD_DIM), generator=gen, device=device).to(torch.bfloat16)
    out, lse = micro_attention_decode(q, k_cache, v_cache, table, seq_lens)
    k_small, table_small = small_copy(k_cache, table)
    v_small, _ = small_copy(v_cache, table)
    ref_out, ref_lse = micro_attention_decode_reference(q.double().cpu(), k_small, v_small, table_small, seq_lens.cpu())
    assert_close(out, ref_out, torch.bfloat16)
    assert_close(lse, ref_lse, torch.bfloat16)


def test_prefill_reads_blocks_past_2_31_elements(device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(1)
    k_cache, v_cache = big_cache(device)
    table = torch.arange(NUM_BLOCKS - 8, NUM_BLOCKS, device=device, dtype=torch.int32)[None]
    for cache in (k_cache, v_cache):
        cache[table.flatten().long()] = torch.randn((8, BLOCK_SIZE, KV_HEADS, HEAD_DIM), generator=gen,
                                                    device=device).to(torch.bfloat16)
    kv_lens = torch.tensor([8 * BLOCK_SIZE], dtype=torch.int32, device=device)
    num_q = 37
    q = torch.randn((num_q, Q_HEADS, HEAD_DIM), generator=gen, device=device).to(torch.bfloat16)
    starts = torch.tensor([0, num_q], dtype=torch.int32, device=device)
    out, lse = micro_attention_prefill(q, k_cache, v_cache, table, kv_lens, starts, max_q_len=num_q)
    k_small, table_small = small_copy(k_cache, table)
    v_small, _ = small_copy(v_cache, table)
    ref_out, ref_lse = micro_attention_prefill_reference(q.double().cpu(), k_small, v_small, table_small, kv_lens.cpu(),
                                                         starts.cpu())
    assert_close(out, ref_out, torch.bfloat16)
    assert_close(lse, ref_lse, torch.bfloat16)
