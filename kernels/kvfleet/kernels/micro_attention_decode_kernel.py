"""Triton kernel: one decode micro-attention (MA) over the paged KV blocks that one part holds.

DistAttention (Infinite-LLM, "Infinite-LLM: Efficient LLM Service for Long Context with DistAttention
and Distributed KVCache", arXiv 2401.02669, section 4.2) splits one request's attention into
micro-attentions, each over a sub-sequence of the KV cache that may live on another worker, and
merges them exactly afterwards (ScaleReduce, scale_reduce_kernel.py). For that merge each MA must
return its normalised output together with the log-sum-exp of its logits: eq. (5) rescales each MA by
exp(max_j - max) and divides by the global sum, which is what (output, LSE) carries.

Decode attention is a matrix-vector product and reads every KV byte once, so the kernel is bound by
HBM bandwidth (section 4.6 makes the same point). What matters is therefore:
- GQA: one program serves all query heads that share one KV head, so K and V are read once per group
  rather than once per query head;
- split-KV: a long context is cut into splits processed by separate programs so that even batch 1
  fills the GPU; the splits are merged by the same ScaleReduce as the parts (section 5 keeps three
  kernel templates by context length; here the split count adapts instead);
- the online softmax keeps the running max and sum in fp32 registers, so logits of +-1e4 neither
  overflow nor lose the small terms.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet.kernels import _interpreter_compat
from kvfleet.kernels._online_softmax import attend_kv_tile, dot_operand, online_softmax_finish, online_softmax_start

# Interpreted loops with runtime bounds under Triton 3.6 and NumPy >= 2.4 (see _interpreter_compat).
_interpreter_compat.install()


@triton.jit
def micro_attention_decode_kernel(
    q_ptr,  # [batch, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # int32 [batch, max_num_blocks_per_seq]: physical block ids of this part
    seq_lens_ptr,  # int32 [batch]: tokens of each sequence held by this part
    out_ptr,  # fp32 [batch, num_q_heads, (num_splits,) head_dim]
    lse_ptr,  # fp32 [batch, num_q_heads, (num_splits)]
    scale_log2,  # softmax scale * log2(e): logits are kept in base 2 inside, LSE leaves in natural log
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_bt_seq,
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    stride_lse_seq,
    stride_lse_head,
    stride_lse_split,
    num_tokens_per_split,  # a multiple of BLOCK_N
    max_num_tokens,  # block table width x BLOCK_SIZE: no sequence reads past its block table row
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block (a page)
    HEAD_DIM_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # >= 16: tl.dot needs 16 rows on tensor cores; padded rows are masked
    BLOCK_N: tl.constexpr,  # tokens per loop iteration
    UPCAST: tl.constexpr,  # compute from fp32 copies of the loads (the interpreter's bf16 is wrong)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no silent tf32), ignored for 16-bit ones
):
    seq_id = tl.program_id(0)
    kv_head_id = tl.program_id(1)
    split_id = tl.program_id(2)

    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq_id), max_num_tokens)
    tok_start = split_id * num_tokens_per_split
    tok_end = tl.minimum(tok_start + num_tokens_per_split, seq_len)

    group_offs = tl.arange(0, GROUP_PAD)
    dim_offs = tl.arange(0, HEAD_DIM_PAD)
    group_mask = group_offs < GROUP_SIZE
    dim_mask = dim_offs < HEAD_DIM
    # Query head h reads KV head h // GROUP_SIZE (the GQA layout of vLLM and torch SDPA enable_gqa).
    q_head_ids = kv_head_id * GROUP_SIZE + group_offs

    q = tl.load(
        q_ptr + seq_id * stride_q_seq + q_head_ids[:, None] * stride_q_head + dim_offs[None, :],
        mask=group_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    q = dot_operand(q, k_cache_ptr, UPCAST)

    m_i, l_i, acc = online_softmax_start(GROUP_PAD, HEAD_DIM_PAD)
    bt_row = block_table_ptr + seq_id.to(tl.int64) * stride_bt_seq
    k_head_ptr = k_cache_ptr + kv_head_id * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head_id * stride_v_head
    # Every iteration holds at least one real token (tok < tok_end) that every query head sees, so
    # m_i is finite after the first one and the tile update needs no guard against an all -inf max.
    for tok0 in range(tok_start, tok_end, BLOCK_N):
        tok = tok0 + tl.arange(0, BLOCK_N)
        tok_mask = tok < tok_end
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, k_head_ptr, v_head_ptr, bt_row, tok, tok_mask, tok_mask[None, :], dim_offs, dim_mask,
            stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, scale_log2, BLOCK_SIZE=BLOCK_SIZE, UPCAST=UPCAST,
            DOT_PRECISION=DOT_PRECISION, ROWS_MAY_SEE_NOTHING=False,
        )
    out, lse = online_softmax_finish(m_i, l_i, acc)

    out_offs = seq_id * stride_out_seq + q_head_ids * stride_out_head + split_id * stride_out_split
    tl.store(out_ptr + out_offs[:, None] + dim_offs[None, :], out, mask=group_mask[:, None] & dim_mask[None, :])
    lse_offs = seq_id * stride_lse_seq + q_head_ids * stride_lse_head + split_id * stride_lse_split
    tl.store(lse_ptr + lse_offs, lse, mask=group_mask)
