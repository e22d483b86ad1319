"""Torch reference for the decode micro-attention: gathers each sequence's pages and computes the
softmax directly, in fp64 by default. It is the specification the Triton kernel is tested against
and what a caller without a GPU can run on the same inputs."""

from __future__ import annotations

import torch


def gather_pages(cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cache [num_blocks, block_size, heads, dim], the block ids of one sequence -> [num_tokens, heads, dim]."""
    block_size = cache.shape[1]
    num_pages = -(-num_tokens // block_size)
    pages = cache[block_ids[:num_pages].long()]
    return pages.reshape(-1, *cache.shape[2:])[:num_tokens]


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [num_q, q_heads, dim], k/v [num_kv, kv_heads, dim], mask [num_q, num_kv] (True = visible)
    -> (out [num_q, q_heads, dim], lse [num_q, q_heads]); rows seeing nothing get 0 and -inf."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # -inf for rows that see nothing
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(logits - lse_safe[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse.transpose(0, 1)


def empty_partials(
    q: torch.Tensor, scale: float | None, compute_dtype: torch.dtype
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(scale, or head_dim ** -0.5 when None; out 0 and lse -inf for every row and head of q): what a
    row that sees no key keeps."""
    rows, heads, head_dim = q.shape
    out = torch.zeros(rows, heads, head_dim, dtype=compute_dtype)
    lse = torch.full((rows, heads), float("-inf"), dtype=compute_dtype)
    return head_dim**-0.5 if scale is None else scale, out, lse


def micro_attention_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `micro_attention_decode`, results in compute_dtype."""
    scale, outs, lses = empty_partials(q, scale, compute_dtype)
    for seq_id in range(q.shape[0]):
        num_tokens = int(seq_lens[seq_id])
        if num_tokens == 0:
            continue
        k = gather_pages(k_cache.cpu(), block_table[seq_id].cpu(), num_tokens).to(compute_dtype)
        v = gather_pages(v_cache.cpu(), block_table[seq_id].cpu(), num_tokens).to(compute_dtype)
        out, lse = attention_with_lse(q[seq_id : seq_id + 1].cpu().to(compute_dtype), k, v, scale)
        outs[seq_id], lses[seq_id] = out[0], lse[0]
    return outs, lses
