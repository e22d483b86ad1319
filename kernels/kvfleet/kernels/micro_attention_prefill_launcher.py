"""Launcher for the prefill micro-attention: checks inputs, sizes the grid and runs the kernel.

Returns the same DistAttention partial as decode (fp32 output, natural-log fp32 LSE, per query token
and head), so the parts of a long prompt spread over several workers merge with `scale_reduce*`
(Infinite-LLM sections 4.2 and 4.6). See micro_attention_prefill_kernel.py for the causal offset.
"""

from __future__ import annotations

import torch

from kvfleet.kernels._checks import (
    ATTENTION_DTYPES,
    check_block_table,
    check_out,
    check_paged_kv,
    check_shape,
    check_tensor,
    interpreting,
    next_power_of_2,
)
from kvfleet.kernels.micro_attention_prefill_kernel import micro_attention_prefill_kernel


def micro_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    causal_offsets: torch.Tensor | None = None,
    max_q_len: int | None = None,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    check_bounds: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of new tokens over the KV blocks this part holds.

    q [total_q_tokens, num_q_heads, head_dim] (sequences packed; sequence s owns rows
    query_start_loc[s] .. query_start_loc[s+1]-1, int32 [num_seqs + 1]); k_cache, v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] already holding the new tokens' K/V where this
    part holds them; block_table int32 [num_seqs, max_num_blocks]; kv_lens int32 [num_seqs].
    causal_offsets int32 [num_seqs]: query i sees KV j iff j <= i + offset; default kv_lens - q_lens
    (this part ends with the new tokens). max_q_len: longest q_len, read from query_start_loc (one
    device sync) when not given.

    Returns (out fp32 [total_q_tokens, num_q_heads, head_dim], lse fp32 [total_q_tokens, num_q_heads]).
    KV tokens past a row of the block table are ignored rather than read out of bounds;
    check_bounds=True checks kv_lens, block ids and query_start_loc on the host (a device sync).
    """
    num_blocks, block_size, num_kv_heads, _ = check_paged_kv(q, k_cache, v_cache, block_table, ATTENTION_DTYPES)
    total_q, num_q_heads, head_dim = q.shape
    device = q.device
    num_seqs = block_table.shape[0]
    check_tensor("kv_lens", kv_lens, ndim=1, dtypes=(torch.int32,), device=device)
    check_shape("kv_lens", kv_lens, (num_seqs,))
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if check_bounds:
        check_block_table(block_table, kv_lens, block_size, num_blocks)
        starts = query_start_loc.cpu()
        if int(starts[0]) != 0 or bool((starts[1:] < starts[:-1]).any()) or int(starts[-1]) != total_q:
            raise ValueError(f"query_start_loc must start at 0, never decrease and end at {total_q} (rows of q)")
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if causal_offsets is None:
        causal_offsets = (kv_lens - q_lens).to(torch.int32)
    else:
        check_tensor("causal_offsets", causal_offsets, ndim=1, dtypes=(torch.int32,), device=device)
        check_shape("causal_offsets", causal_offsets, (num_seqs,))
    out = check_out("out", out, (total_q, num_q_heads, head_dim), device)
    out_lse = check_out("out_lse", out_lse, (total_q, num_q_heads), device)
    if num_seqs == 0 or total_q == 0:
        return out, out_lse
    if max_q_len is None:
        max_q_len = int(q_lens.max())
    if max_q_len <= 0:
        return out, out_lse

    upcast = interpreting() or q.dtype == torch.float32
    # Small tiles under the interpreter keep the numpy work per program low. On a GPU 64x64, or
    # 32x64 for fp32, whose tiles take twice the shared memory.
    if block_m is None:
        block_m = 16 if interpreting() else (32 if q.dtype == torch.float32 else 64)
    if block_n is None:
        block_n = 32 if interpreting() else 64
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if scale is None:
        scale = head_dim**-0.5
    grid = (num_seqs, -(-max_q_len // block_m), num_q_heads)
    micro_attention_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_table,
        kv_lens,
        query_start_loc,
        causal_offsets,
        out,
        out_lse,
        float(scale) * 1.4426950408889634,  # log2(e)
        block_table.shape[1] * block_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        out_lse.stride(0),
        out_lse.stride(1),
        HEAD_DIM=head_dim,
        GROUP_SIZE=num_q_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
    )
    return out, out_lse
