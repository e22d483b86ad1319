"""The DistAttention ops in vectorised torch, for serving where there is no GPU.

The builtin engine attends through micro-attention partials merged by ScaleReduce (Infinite-LLM
section 4.2) on every device. On a GPU that is the Triton kernels; on the CPU the Triton interpreter
would run them in numpy, a thousand times too slow to serve, so these functions implement the same
contracts (`micro_attention_decode`, `micro_attention_prefill`, `scale_reduce*`, each written once
with its checks in _checks.py: shapes, fp32 results, natural-log LSE, `out=`, empty parts as 0 and
-inf) with batched torch ops. `kvfleet.kernels.dispatch` picks between the two by the tensors'
device, checks the inputs once and calls `decode`, `prefill`, `merge` and `merge_pair` here, which
trust their checked inputs; the public functions at the end check, then call the same.

Unlike the fp64 references these compute in the inputs' dtype with fp32 softmax: the score and
value products run in the model dtype (the CPU's BLAS accumulates 16-bit products in fp32), the
logits, their LSE and the probabilities are fp32, as in FlashAttention.
"""

from __future__ import annotations

import torch

from kvfleet.kernels._checks import (
    Merge,
    PagedAttention,
    PagedPrefill,
    PairMerge,
    Partial,
    entry_point,
    micro_attention_decode_inputs,
    micro_attention_prefill_inputs,
    scale_reduce_inputs,
    scale_reduce_pair_inputs,
    scale_reduce_varlen_inputs,
)

# The fp32 logits one prefill tile may hold when the caller sets no bound: 16 MiB keeps a tile in the
# last-level cache's neighbourhood while still covering thousands of keys per row.
DEFAULT_MAX_LOGITS_BYTES = 16 * 1024 * 1024


def _softmax_lse_(logits: torch.Tensor) -> torch.Tensor:
    """Turn masked fp32 logits [..., keys] into probabilities in place; returns the LSE [...].

    Rows that see no key get -inf LSE and all-zero probabilities (exp(-inf - 0)), so their output is
    0: the partial of an empty part."""
    lse = torch.logsumexp(logits, dim=-1)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    logits.sub_(lse_safe[..., None]).exp_()
    return lse


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache [blocks, block_size, kv_heads, dim], table long [seqs, pages] -> [seqs, kv_heads, tokens, dim].

    The head-major copy is what lets one batched matmul per sequence and kv head read K and V."""
    num_seqs, num_pages = table.shape
    _, block_size, kv_heads, dim = cache.shape
    pages = cache[table]  # [seqs, pages, block_size, kv_heads, dim]
    return pages.view(num_seqs, num_pages * block_size, kv_heads, dim).transpose(1, 2).contiguous()


def decode(inputs: PagedAttention) -> Partial:
    """`micro_attention_decode` on checked inputs, all sequences in one batch padded to the longest.
    Transient memory: K and V of the padded batch twice (the page gather and its head-major copy)
    plus fp32 logits, 4 x q_heads bytes per padded token."""
    q, k_cache, v_cache, block_table, out, out_lse = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_table,
                                                      inputs.out, inputs.out_lse)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads, scale, device = inputs.block_size, inputs.num_kv_heads, inputs.scale, q.device
    # Tokens past a row of the table are ignored, as the kernel does.
    lens = inputs.lens.long().clamp(max=inputs.max_num_tokens)
    # A host read of the longest length: free on the CPU, and it trims the gather to what is used.
    max_len = int(lens.max()) if num_seqs else 0
    if num_seqs == 0 or num_q_heads == 0 or max_len <= 0:
        out.zero_()
        out_lse.fill_(float("-inf"))
        return out, out_lse
    group = num_q_heads // num_kv_heads
    table = block_table[:, : -(-max_len // block_size)].long()
    if max_len == 1:
        # At most one token a sequence (the engine's in-hand decode part): its softmax weight is 1,
        # so out is its V and lse its logit; a few elementwise ops instead of two matmuls.
        key = k_cache[table[:, 0]][:, 0].float()  # [seqs, kv_heads, dim]
        value = v_cache[table[:, 0]][:, 0].float()
        logit = (q.view(num_seqs, num_kv_heads, group, head_dim).float() * key[:, :, None]).sum(-1).mul_(scale)
        present = (lens > 0)[:, None, None]
        out.view(num_seqs, num_kv_heads, group, head_dim).copy_(torch.where(present[..., None], value[:, :, None], 0.0))
        out_lse.view(num_seqs, num_kv_heads, group).copy_(torch.where(present, logit, float("-inf")))
        return out, out_lse
    keys = _gather(k_cache, table)  # [seqs, kv_heads, tokens, dim]
    logits = torch.matmul(q.view(num_seqs, num_kv_heads, group, head_dim), keys.transpose(-1, -2)).float()
    del keys
    logits.mul_(scale)
    hidden = torch.arange(logits.shape[-1], device=device)[None, :] >= lens[:, None]
    logits.masked_fill_(hidden[:, None, None, :], float("-inf"))
    lse = _softmax_lse_(logits)  # [seqs, kv_heads, group]
    values = _gather(v_cache, table)
    o = torch.matmul(logits.to(values.dtype), values)  # [seqs, kv_heads, group, dim]
    out.copy_(o.view(num_seqs, num_q_heads, head_dim))
    out_lse.copy_(lse.view(num_seqs, num_q_heads))
    return out, out_lse


def prefill(inputs: PagedPrefill) -> Partial:
    """`micro_attention_prefill` on checked inputs: query i of a sequence sees key j of its part iff
    j <= i + causal_offsets[s] (default kv_lens - q_lens).

    One sequence at a time (prompts differ too much in length to pad), its keys gathered once and its
    queries in tiles whose fp32 logits stay within max_logits_bytes (default DEFAULT_MAX_LOGITS_BYTES;
    at least one query row): a step's transient memory is bounded whatever the prompt's length."""
    q, k_cache, v_cache, block_table, out, out_lse = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_table,
                                                      inputs.out, inputs.out_lse)
    total_q, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads, scale, device = inputs.block_size, inputs.num_kv_heads, inputs.scale, q.device
    num_seqs = block_table.shape[0]
    out.zero_()
    out_lse.fill_(float("-inf"))
    budget = DEFAULT_MAX_LOGITS_BYTES if inputs.max_logits_bytes is None else inputs.max_logits_bytes
    group = num_q_heads // num_kv_heads
    starts = inputs.query_start_loc.tolist()
    capacity = inputs.max_num_tokens
    lens = inputs.lens.tolist()
    offsets = None if inputs.causal_offsets is None else inputs.causal_offsets.tolist()
    for s in range(num_seqs):
        q0, q1 = starts[s], starts[s + 1]
        kv_len = min(lens[s], capacity)
        if q1 <= q0 or kv_len <= 0:
            continue
        offset = lens[s] - (q1 - q0) if offsets is None else offsets[s]
        table = block_table[s : s + 1, : -(-kv_len // block_size)].long()
        keys = _gather(k_cache, table)[0, :, :kv_len]  # [kv_heads, kv_len, dim]
        values = _gather(v_cache, table)[0, :, :kv_len]
        key_index = torch.arange(kv_len, device=device)
        rows_per_tile = max(1, budget // (4 * num_q_heads * kv_len))
        for t0 in range(q0, q1, rows_per_tile):
            t1 = min(q1, t0 + rows_per_tile)
            m = t1 - t0
            # [m, q_heads, dim] -> [kv_heads, group * m, dim]: one matmul per kv head.
            q_tile = q[t0:t1].view(m, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(
                num_kv_heads, group * m, head_dim)
            logits = torch.matmul(q_tile, keys.transpose(-1, -2)).float().mul_(scale)
            query_index = torch.arange(t0 - q0, t1 - q0, device=device)
            hidden = key_index[None, :] > query_index[:, None] + offset  # [m, kv_len]
            logits = logits.view(num_kv_heads, group, m, kv_len).masked_fill_(hidden, float("-inf"))
            lse = _softmax_lse_(logits)  # [kv_heads, group, m]
            o = torch.matmul(logits.view(num_kv_heads, group * m, kv_len).to(values.dtype), values)
            out[t0:t1] = o.view(num_kv_heads, group, m, head_dim).permute(2, 0, 1, 3).reshape(m, num_q_heads, head_dim)
            out_lse[t0:t1] = lse.permute(2, 0, 1).reshape(m, num_q_heads)
    return out, out_lse


def _clean_lse(lse: torch.Tensor) -> torch.Tensor:
    """NaN and +inf LSEs (a failed peer's answer) count as empty parts, as in the Triton merge."""
    return torch.where(torch.isnan(lse) | (lse == float("inf")), torch.full_like(lse, float("-inf")), lse)


def _merge(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (5) over dim 0: o [parts, ..., dim], lse [parts, ...] -> (out [..., dim], lse [...])."""
    lse = _clean_lse(lse_parts)
    top = lse.amax(dim=0)
    top_safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top_safe)  # 0 for empty parts
    total = weights.sum(dim=0)
    # where(), not a product: an empty part's output may be garbage (NaN) and must not leak in.
    weighted = torch.where(weights[..., None] > 0, weights[..., None] * o_parts, torch.zeros_like(o_parts)).sum(dim=0)
    nonempty = total > 0
    safe_total = torch.where(nonempty, total, torch.ones_like(total))
    merged = weighted / safe_total[..., None]
    merged_lse = torch.where(nonempty, top_safe + torch.log(safe_total), torch.full_like(total, float("-inf")))
    return merged, merged_lse


def merge(inputs: Merge) -> Partial:
    """`scale_reduce` (dense) or `scale_reduce_varlen` on checked inputs."""
    if inputs.indptr is not None:
        return _merge_varlen(inputs, inputs.indptr)
    out, out_lse = inputs.out, inputs.out_lse
    if inputs.o_parts.shape[0] == 0:
        out.zero_()
        out_lse.fill_(float("-inf"))
        return out, out_lse
    merged, merged_lse = _merge(inputs.o_parts, inputs.lse_parts)
    out.copy_(merged)
    out_lse.copy_(merged_lse)
    return out, out_lse


def _merge_varlen(inputs: Merge, indptr: torch.Tensor) -> Partial:
    """Row r merges the packed parts indptr[r]..indptr[r+1]-1: scatter-reductions by row, no loop."""
    o_parts, lse_parts, out, out_lse = inputs.o_parts, inputs.lse_parts, inputs.out, inputs.out_lse
    num_heads, head_dim = o_parts.shape[1:]
    device = o_parts.device
    num_rows = indptr.numel() - 1
    ptr = indptr.long()
    used = int(ptr[-1])
    row_of_part = torch.repeat_interleave(torch.arange(num_rows, device=device), ptr[1:] - ptr[:-1])
    lse = _clean_lse(lse_parts[:used])
    top = torch.full((num_rows, num_heads), float("-inf"), device=device).scatter_reduce_(
        0, row_of_part[:, None].expand_as(lse), lse, "amax", include_self=True)
    top_safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top_safe[row_of_part])
    total = torch.zeros(num_rows, num_heads, device=device).index_add_(0, row_of_part, weights)
    contribution = torch.where(weights[..., None] > 0, weights[..., None] * o_parts[:used], torch.zeros_like(o_parts[:used]))
    weighted = torch.zeros(num_rows, num_heads, head_dim, device=device).index_add_(0, row_of_part, contribution)
    nonempty = total > 0
    safe_total = torch.where(nonempty, total, torch.ones_like(total))
    out.copy_(weighted / safe_total[..., None])
    out_lse.copy_(torch.where(nonempty, top_safe + torch.log(safe_total), torch.full_like(total, float("-inf"))))
    return out, out_lse


def merge_pair(inputs: PairMerge) -> Partial:
    """`scale_reduce_pair` on checked inputs."""
    o_a, o_b, out, out_lse = inputs.o_a, inputs.o_b, inputs.out, inputs.out_lse
    # No stacked copy of the two outputs: the engine folds every layer's parts through here, and a
    # prefill's partials are the largest attention tensors it holds. Each output is read before out
    # is written, so out may alias either input.
    la, lb = _clean_lse(inputs.lse_a), _clean_lse(inputs.lse_b)
    top = torch.maximum(la, lb)
    top_safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    wa, wb = torch.exp(la - top_safe), torch.exp(lb - top_safe)
    total = wa + wb
    nonempty = total > 0
    safe_total = torch.where(nonempty, total, torch.ones_like(total))
    ca, cb = (wa / safe_total)[..., None], (wb / safe_total)[..., None]
    # where(), not a product alone: an empty part's output may be garbage (NaN) and must not leak in.
    merged = torch.where(ca > 0, o_a, 0.0).mul_(ca)
    merged.add_(torch.where(cb > 0, o_b, 0.0).mul_(cb))
    out.copy_(merged)
    out_lse.copy_(torch.where(nonempty, top_safe + torch.log(safe_total), torch.full_like(total, float("-inf"))))
    return out, out_lse


# The public functions: the contract (signature, docstring, checks) is the op's validator's, by the
# torch backend's rules (any device, caches that are strided views).
micro_attention_decode = entry_point(micro_attention_decode_inputs, "torch", decode)
micro_attention_prefill = entry_point(micro_attention_prefill_inputs, "torch", prefill)
scale_reduce = entry_point(scale_reduce_inputs, "torch", merge)
scale_reduce_varlen = entry_point(scale_reduce_varlen_inputs, "torch", merge)
scale_reduce_pair = entry_point(scale_reduce_pair_inputs, "torch", merge_pair)
