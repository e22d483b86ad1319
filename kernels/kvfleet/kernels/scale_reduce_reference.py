"""Torch reference for ScaleReduce (Infinite-LLM section 4.2, eq. (5)): the specification the Triton
merge is tested against. Computes in fp64 by default so that a test's tolerance measures the kernel's
error, not the reference's."""

from __future__ import annotations

import torch


def _clean(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(lse) | (lse == float("inf")), torch.full_like(lse, float("-inf")), lse)


def scale_reduce_reference(
    o_parts: torch.Tensor, lse_parts: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """o_parts [num_parts, ..., head_dim], lse_parts [num_parts, ...] -> (out [..., head_dim], lse [...])."""
    o = o_parts.to(compute_dtype)
    lse = _clean(lse_parts.to(compute_dtype))
    if lse.shape[0] == 0:
        return torch.zeros(o.shape[1:], dtype=compute_dtype), torch.full(lse.shape[1:], float("-inf"), dtype=compute_dtype)
    m = lse.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)
    w_sum = w.sum(dim=0)
    weighted = torch.where(w[..., None] > 0, w[..., None] * o, torch.zeros_like(o)).sum(dim=0)
    nonempty = w_sum > 0
    out = weighted / torch.where(nonempty, w_sum, torch.ones_like(w_sum))[..., None]
    out_lse = torch.where(nonempty, m_safe + torch.log(torch.where(nonempty, w_sum, torch.ones_like(w_sum))),
                          torch.full_like(w_sum, float("-inf")))
    return out, out_lse


def scale_reduce_varlen_reference(
    o_parts: torch.Tensor, lse_parts: torch.Tensor, indptr: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed o_parts [total_parts, heads, dim], lse_parts [total_parts, heads], indptr [rows + 1]."""
    ptr = indptr.tolist()
    outs, lses = [], []
    for start, end in zip(ptr[:-1], ptr[1:]):
        o, lse = scale_reduce_reference(o_parts[start:end], lse_parts[start:end], compute_dtype=compute_dtype)
        outs.append(o)
        lses.append(lse)
    num_heads, head_dim = o_parts.shape[1:]
    if not outs:
        return torch.zeros(0, num_heads, head_dim, dtype=compute_dtype), torch.zeros(0, num_heads, dtype=compute_dtype)
    return torch.stack(outs), torch.stack(lses)
