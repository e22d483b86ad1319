"""Launcher for the prefill micro-attention: sizes the grid and runs the kernel, on inputs checked by
the op's one validator (_checks.py), here or in dispatch.

Returns the same DistAttention partial as decode (fp32 output, natural-log fp32 LSE, per query token
and head), so the parts of a long prompt spread over several workers merge with `scale_reduce*`
(Infinite-LLM sections 4.2 and 4.6). See micro_attention_prefill_kernel.py for the causal offset.
"""

from __future__ import annotations

import torch

from kvfleet.kernels._checks import (
    PagedPrefill,
    Partial,
    check_block_table,
    check_query_starts,
    check_tile,
    interpreting,
    micro_attention_prefill_inputs,
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
) -> Partial:
    """Causal prefill attention on the Triton kernel. The contract (packed queries, the causal
    offset, shapes, dtypes, the (out, lse) partial, KV tokens past a row of the block table ignored
    rather than read out of bounds) is `_checks.micro_attention_prefill_inputs`'s, which checks the
    inputs.

    block_m, block_n: query and KV tile sizes (None: chosen by dtype and interpreter).
    check_bounds=True checks kv_lens, block ids and query_start_loc on the host (a device sync).
    """
    inputs = micro_attention_prefill_inputs(
        "triton", q, k_cache, v_cache, block_table, kv_lens, query_start_loc, causal_offsets=causal_offsets,
        max_q_len=max_q_len, scale=scale, out=out, out_lse=out_lse,
    )
    if check_bounds:
        check_block_table(inputs.block_table, inputs.lens, inputs.block_size, inputs.num_blocks)
        check_query_starts(inputs.query_start_loc, inputs.q.shape[0])
    return launch_prefill(inputs, block_m=block_m, block_n=block_n)


def launch_prefill(inputs: PagedPrefill, *, block_m: int | None = None, block_n: int | None = None) -> Partial:
    """Runs the kernel on inputs checked by the Triton rules (dispatch's, or the function above's)."""
    q, kv_lens, query_start_loc, out, out_lse = inputs.q, inputs.lens, inputs.query_start_loc, inputs.out, inputs.out_lse
    total_q, num_q_heads, head_dim = q.shape
    num_seqs = inputs.block_table.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    causal_offsets = inputs.causal_offsets
    if causal_offsets is None:
        causal_offsets = (kv_lens - q_lens).to(torch.int32)
    if num_seqs == 0 or total_q == 0:
        return out, out_lse
    max_q_len = inputs.max_q_len
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
    check_tile("block_m", block_m)
    check_tile("block_n", block_n)
    grid = (num_seqs, -(-max_q_len // block_m), num_q_heads)
    micro_attention_prefill_kernel[grid](
        q,
        inputs.k_cache,
        inputs.v_cache,
        inputs.block_table,
        kv_lens,
        query_start_loc,
        causal_offsets,
        out,
        out_lse,
        float(inputs.scale) * 1.4426950408889634,  # log2(e)
        inputs.max_num_tokens,
        *inputs.kernel_strides(),
        out.stride(0),
        out.stride(1),
        out_lse.stride(0),
        out_lse.stride(1),
        HEAD_DIM=head_dim,
        GROUP_SIZE=num_q_heads // inputs.num_kv_heads,
        BLOCK_SIZE=inputs.block_size,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
    )
    return out, out_lse
