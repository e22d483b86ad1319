"""Triton kernel: one prefill micro-attention, causal, of new query tokens over the paged KV blocks one
part holds.

Infinite-LLM section 4.6 plans a long prompt's rBlocks before the prefill runs, some local and some
borrowed from other instances, and overlaps attention with their transfer. With the same (output,
LSE) contract as decode, each part can compute its share where its blocks are and ScaleReduce merges
the parts (section 4.2, eq. (5)), so a prompt whose KV does not fit on one GPU can also be spread.

Causality across parts is expressed by one integer per sequence, the causal offset: query token i
(0-based among this sequence's new tokens) sees this part's KV token j iff j <= i + offset. For the
part holding the end of the sequence (the cached context followed by the new tokens themselves),
offset = kv_len - q_len; for a part holding only earlier tokens, any offset >= kv_len - 1 makes
everything visible. A query row that sees nothing in this part returns 0 and LSE -inf.

Prefill is compute bound (every K/V tile is reused by a whole tile of queries), so a program serves
one query head and a tile of query tokens; grouping the query heads of a KV head, as decode does,
would only save L2 traffic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet.kernels import _interpreter_compat
from kvfleet.kernels._online_softmax import attend_kv_tile, dot_operand, online_softmax_finish, online_softmax_start

# Interpreted loops with runtime bounds under Triton 3.6 and NumPy >= 2.4 (see _interpreter_compat).
_interpreter_compat.install()


@triton.jit
def micro_attention_prefill_kernel(
    q_ptr,  # [total_q_tokens, num_q_heads, head_dim], sequences packed one after another
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_table_ptr,  # int32 [num_seqs, max_num_blocks_per_seq]
    kv_lens_ptr,  # int32 [num_seqs]: KV tokens of each sequence held by this part
    query_start_loc_ptr,  # int32 [num_seqs + 1]: sequence s owns q rows start[s] .. start[s+1]-1
    causal_offsets_ptr,  # int32 [num_seqs]
    out_ptr,  # fp32 [total_q_tokens, num_q_heads, head_dim]
    lse_ptr,  # fp32 [total_q_tokens, num_q_heads]
    scale_log2,
    max_num_kv_tokens,  # block table width x BLOCK_SIZE: no sequence reads past its block table row
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_bt_seq,
    stride_out_tok,
    stride_out_head,
    stride_lse_tok,
    stride_lse_head,
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # KV tokens per loop iteration
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq_id = tl.program_id(0)
    q_tile_id = tl.program_id(1)
    q_head_id = tl.program_id(2)
    kv_head_id = q_head_id // GROUP_SIZE

    q_start = tl.load(query_start_loc_ptr + seq_id)
    q_len = tl.load(query_start_loc_ptr + seq_id + 1) - q_start
    kv_len = tl.minimum(tl.load(kv_lens_ptr + seq_id), max_num_kv_tokens)
    causal_offset = tl.load(causal_offsets_ptr + seq_id)

    q_idx = q_tile_id * BLOCK_M + tl.arange(0, BLOCK_M)  # position among this sequence's new tokens
    q_mask = q_idx < q_len
    dim_offs = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dim_offs < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + q_head_id * stride_q_head + dim_offs[None, :],
        mask=q_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    q = dot_operand(q, k_cache_ptr, UPCAST)

    m_i, l_i, acc = online_softmax_start(BLOCK_M, HEAD_DIM_PAD)
    # The last query row of the tile bounds what any row of it can see: skip the blocks past it.
    last_q = tl.minimum(q_tile_id * BLOCK_M + BLOCK_M, q_len) - 1
    kv_end = tl.minimum(kv_len, tl.maximum(last_q + causal_offset + 1, 0))
    # The grid is sized for the longest prompt: a tile past this sequence's end loops over nothing
    # and stores nothing (its q_mask is all false).
    kv_end = tl.where(q_tile_id * BLOCK_M < q_len, kv_end, 0)
    bt_row = block_table_ptr + seq_id.to(tl.int64) * stride_bt_seq
    k_head_ptr = k_cache_ptr + kv_head_id * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head_id * stride_v_head
    for kv0 in range(0, kv_end, BLOCK_N):
        kv_idx = kv0 + tl.arange(0, BLOCK_N)
        kv_in = kv_idx < kv_end
        visible = kv_in[None, :] & (kv_idx[None, :] <= q_idx[:, None] + causal_offset) & q_mask[:, None]
        # Unlike decode, a row can see nothing in a whole tile (the causal diagonal).
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, k_head_ptr, v_head_ptr, bt_row, kv_idx, kv_in, visible, dim_offs, dim_mask,
            stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, scale_log2, BLOCK_SIZE=BLOCK_SIZE, UPCAST=UPCAST,
            DOT_PRECISION=DOT_PRECISION, ROWS_MAY_SEE_NOTHING=True,
        )
    out, lse = online_softmax_finish(m_i, l_i, acc)
    tl.store(
        out_ptr + q_rows[:, None] * stride_out_tok + q_head_id * stride_out_head + dim_offs[None, :],
        out,
        mask=q_mask[:, None] & dim_mask[None, :],
    )
    tl.store(lse_ptr + q_rows * stride_lse_tok + q_head_id * stride_lse_head, lse, mask=q_mask)
