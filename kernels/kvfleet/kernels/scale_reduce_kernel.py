"""Triton kernels: ScaleReduce, the exact merge of micro-attention partials (output, LSE).

Infinite-LLM section 4.2, eq. (5): the attention over a whole sequence equals the sum of the
micro-attentions of its sub-sequences, each scaled by exp(max_j - max) and divided by the global sum.
With normalised partial outputs o_i and natural-log LSEs lse_i, that is (the rule FlashInfer, SGLang,
vLLM and tree attention share):

    m = max_i lse_i;  w_i = exp(lse_i - m);  o = sum_i w_i o_i / sum_i w_i;  lse = m + log(sum_i w_i)

Partials stay fp32 (vLLM's paged_attention_v2 keeps them in fp16/bf16 and loses precision there).
An LSE that is NaN or +inf (a peer's failed or garbage result) counts as -inf, i.e. an empty part;
an empty part's output is never multiplied in (0 * NaN would be NaN); when every part is empty the
result is output 0 and LSE -inf. The paper's ScaleReduce operator is section 5.

Two kernels: `scale_reduce_kernel` merges a run of partials per (row, head), either a dense
[parts, rows] grid or a variable number of parts per row given by a FlashInfer-style index pointer;
`scale_reduce_pair_kernel` merges two partials, for streaming and tree merges across workers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet.kernels import _interpreter_compat

# Interpreted loops with runtime bounds under Triton 3.6 and NumPy >= 2.4 (see _interpreter_compat).
_interpreter_compat.install()


@triton.jit
def _clean_lse(lse):
    # NaN != NaN, and +inf is no valid log-sum-exp of finite logits: both become "empty".
    bad = (lse != lse) | (lse == float("inf"))
    return tl.where(bad, float("-inf"), lse)


@triton.jit
def scale_reduce_kernel(
    o_ptr,  # fp32 partial outputs
    lse_ptr,  # fp32 partial LSEs (natural log)
    indptr_ptr,  # int32 [num_rows + 1] when VARLEN: row r merges parts indptr[r] .. indptr[r+1]-1
    out_ptr,  # fp32 [num_rows, num_heads, head_dim] (strided)
    out_lse_ptr,  # fp32 [num_rows, num_heads] (strided)
    num_parts,  # parts per row when not VARLEN
    stride_o_part,
    stride_o_row,
    stride_o_head,
    stride_lse_part,
    stride_lse_row,
    stride_lse_head,
    stride_out_row,
    stride_out_head,
    stride_out_lse_row,
    stride_out_lse_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr,  # parts read per iteration
    VARLEN: tl.constexpr,
):
    row_id = tl.program_id(0)
    head_id = tl.program_id(1)

    if VARLEN:
        part_start = tl.load(indptr_ptr + row_id)
        part_end = tl.load(indptr_ptr + row_id + 1)
        o_base = o_ptr + head_id * stride_o_head
        lse_base = lse_ptr + head_id * stride_lse_head
    else:
        part_start = 0
        part_end = num_parts
        o_base = o_ptr + row_id.to(tl.int64) * stride_o_row + head_id * stride_o_head
        lse_base = lse_ptr + row_id.to(tl.int64) * stride_lse_row + head_id * stride_lse_head

    dim_offs = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dim_offs < HEAD_DIM

    # One pass with a running max (the online softmax applied to partials): every weight is <= 1, so
    # the sums cannot overflow whatever the LSE magnitudes, and the LSE and output loads of a chunk
    # are issued together. With the launcher's BLOCK_P every split-KV merge is a single iteration:
    # the merge is latency-bound, and one round trip to memory is what it costs.
    m = tl.full([], float("-inf"), dtype=tl.float32)
    w_sum = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    for p0 in range(part_start, part_end, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        part_mask = parts < part_end
        lse = _clean_lse(
            tl.load(lse_base + parts.to(tl.int64) * stride_lse_part, mask=part_mask, other=float("-inf"))
        )
        o = tl.load(
            o_base + parts.to(tl.int64)[:, None] * stride_o_part + dim_offs[None, :],
            mask=part_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        # While every part so far is empty, weigh against 0 so exp never sees -inf - -inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        w = tl.exp(lse - m_use)
        # An empty part's output may be garbage (NaN from a failed peer): never multiply it in.
        acc = acc * alpha + tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0), axis=0)
        w_sum = w_sum * alpha + tl.sum(w, axis=0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    nonempty = w_sum > 0.0
    out = acc / tl.where(nonempty, w_sum, 1.0)
    out_lse = tl.where(nonempty, m_safe + tl.log(tl.where(nonempty, w_sum, 1.0)), float("-inf"))
    tl.store(
        out_ptr + row_id.to(tl.int64) * stride_out_row + head_id * stride_out_head + dim_offs, out, mask=dim_mask
    )
    tl.store(out_lse_ptr + row_id.to(tl.int64) * stride_out_lse_row + head_id * stride_out_lse_head, out_lse)


@triton.jit
def scale_reduce_pair_kernel(
    o_a_ptr,  # fp32 [num_rows * num_heads, head_dim], contiguous
    lse_a_ptr,  # fp32 [num_rows * num_heads]
    o_b_ptr,
    lse_b_ptr,
    out_ptr,  # may alias o_a or o_b: each program reads its row fully before writing it
    out_lse_ptr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dim_offs = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dim_offs < HEAD_DIM

    lse_a = _clean_lse(tl.load(lse_a_ptr + row))
    lse_b = _clean_lse(tl.load(lse_b_ptr + row))
    o_a = tl.load(o_a_ptr + row * HEAD_DIM + dim_offs, mask=dim_mask, other=0.0)
    o_b = tl.load(o_b_ptr + row * HEAD_DIM + dim_offs, mask=dim_mask, other=0.0)

    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    w_sum = w_a + w_b
    nonempty = w_sum > 0.0
    acc = tl.where(w_a > 0.0, w_a * o_a, 0.0) + tl.where(w_b > 0.0, w_b * o_b, 0.0)
    out = acc / tl.where(nonempty, w_sum, 1.0)
    out_lse = tl.where(nonempty, m_safe + tl.log(tl.where(nonempty, w_sum, 1.0)), float("-inf"))
    tl.store(out_ptr + row * HEAD_DIM + dim_offs, out, mask=dim_mask)
    tl.store(out_lse_ptr + row, out_lse)
