"""Triton helpers: the online softmax over paged KV tiles that both micro-attention kernels run.

Decode and prefill differ in which queries a program holds (the query heads of one KV head for one
token; one query head for a tile of tokens) and in which keys a query sees (all of its part; the
causal ones), not in how a tile of keys is read and folded into the running softmax. That part is
written once here, so the two kernels cannot drift apart in the numerics their partials are merged
with (ScaleReduce assumes every part's (output, LSE) means the same thing).

The state per query row is the running max m (base 2), the running sum l of exp2(logit - m) and the
unnormalised output acc, all fp32, so logits of +-1e4 neither overflow nor lose the small terms.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A constexpr: jit code may read no other globals.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def dot_operand(x, k_cache_ptr, UPCAST: tl.constexpr):
    """q as the score dot's operand: an fp32 copy under UPCAST, else the cache's dtype, so a 16-bit
    cache runs on the tensor cores (the products accumulate in fp32)."""
    if UPCAST:
        operand = x.to(tl.float32)
    else:
        operand = x.to(k_cache_ptr.dtype.element_ty)
    return operand


@triton.jit
def online_softmax_start(ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """(m, l, acc) before the first tile: no key seen yet."""
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)  # running max, base 2
    l_i = tl.zeros([ROWS], dtype=tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def attend_kv_tile(
    q,  # [ROWS, HEAD_DIM_PAD], already in the dot's operand dtype
    m_i,
    l_i,
    acc,
    k_head_ptr,  # the K cache at this program's KV head: + block * stride_k_block + token * stride_k_tok
    v_head_ptr,
    bt_row,  # this sequence's row of the block table
    tok,  # [BLOCK_N] token positions of this part
    tok_mask,  # [BLOCK_N] positions that exist (are read)
    visible,  # [ROWS, BLOCK_N] or broadcastable: which query row sees which key
    dim_offs,
    dim_mask,
    stride_k_block,
    stride_k_tok,
    stride_v_block,
    stride_v_tok,
    scale_log2,  # softmax scale * log2(e): logits are kept in base 2 inside
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block (a page)
    UPCAST: tl.constexpr,  # compute from fp32 copies of the loads (the interpreter's bf16 is wrong)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no silent tf32), ignored for 16-bit ones
    ROWS_MAY_SEE_NOTHING: tl.constexpr,  # a row may see no key of a whole tile while its max is -inf
):
    """Reads one tile of keys and values through the block table and folds it into (m, l, acc)."""
    block_ids = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    in_block = (tok % BLOCK_SIZE).to(tl.int64)
    kv_mask = tok_mask[:, None] & dim_mask[None, :]

    k_rows = block_ids * stride_k_block + in_block * stride_k_tok
    k = tl.load(k_head_ptr + k_rows[:, None] + dim_offs[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    # The scale is applied to the fp32 logits, not to q, so a large scale cannot overflow fp16.
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if ROWS_MAY_SEE_NOTHING:
        # Measure against 0 while a row's max is still -inf, so no -inf - -inf appears. Where every
        # tile holds a visible key for every row (decode), the max is finite after the first tile and
        # the select is left out.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    v_rows = block_ids * stride_v_block + in_block * stride_v_tok
    v = tl.load(v_head_ptr + v_rows[:, None] + dim_offs[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def online_softmax_finish(m_i, l_i, acc):
    """(normalised output, natural-log LSE) of each row. A row that saw no key (an empty part, a split
    past a short sequence's end, a query before this part's keys) has l == 0: it returns output 0 and
    LSE -inf, which the merge weighs by exactly zero, and no NaN is ever formed."""
    has_tokens = l_i > 0.0
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    lse = tl.where(has_tokens, (m_i + tl.log2(tl.where(has_tokens, l_i, 1.0))) * LN2, float("-inf"))
    return out, lse
