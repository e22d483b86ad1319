"""Torch reference for the prefill micro-attention: per sequence, gather the part's pages and apply
the causal-offset mask directly, in fp64 by default. The specification the Triton kernel is tested
against."""

from __future__ import annotations

import torch

from kvfleet.kernels.micro_attention_decode_reference import attention_with_lse, empty_partials, gather_pages


def micro_attention_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    causal_offsets: torch.Tensor | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `micro_attention_prefill`, results in compute_dtype."""
    scale, out, lse = empty_partials(q, scale, compute_dtype)
    starts = query_start_loc.tolist()
    for seq_id in range(len(starts) - 1):
        q0, q1 = starts[seq_id], starts[seq_id + 1]
        kv_len = int(kv_lens[seq_id])
        if q1 == q0 or kv_len == 0:
            continue
        offset = kv_len - (q1 - q0) if causal_offsets is None else int(causal_offsets[seq_id])
        k = gather_pages(k_cache.cpu(), block_table[seq_id].cpu(), kv_len).to(compute_dtype)
        v = gather_pages(v_cache.cpu(), block_table[seq_id].cpu(), kv_len).to(compute_dtype)
        q_idx = torch.arange(q1 - q0)[:, None]
        kv_idx = torch.arange(kv_len)[None, :]
        o, part_lse = attention_with_lse(q[q0:q1].cpu().to(compute_dtype), k, v, scale, mask=kv_idx <= q_idx + offset)
        out[q0:q1], lse[q0:q1] = o, part_lse
    return out, lse
