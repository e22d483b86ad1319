"""Launchers for ScaleReduce: merge DistAttention partials (output, LSE) exactly.

Three forms, because partials arrive in three ways (Infinite-LLM section 4.6: queries are shipped to
the workers holding remote rBlocks and results come back for integration):
- `scale_reduce`: every row has the same number of parts, stacked as [num_parts, num_rows, ...];
- `scale_reduce_varlen`: rows have different numbers of parts, packed one after another and found
  through an index pointer (FlashInfer's `variable_length_merge_states` convention);
- `scale_reduce_pair`: merge two partials, for streaming (fold each peer's result in as it arrives)
  or tree merges across workers. The merge is associative, so any merge tree gives the same result
  up to fp32 rounding.

"Rows" are decode sequences or prefill query tokens; partial outputs and LSEs are fp32, LSEs natural
log. See scale_reduce_kernel.py for the rule and its edge cases.
"""

from __future__ import annotations

import torch

from kvfleet.kernels._checks import check_device, check_out, check_shape, check_tensor, next_power_of_2
from kvfleet.kernels.scale_reduce_kernel import scale_reduce_kernel, scale_reduce_pair_kernel

_F32 = (torch.float32,)


def _block_p(num_parts: int) -> int:
    # All parts in one iteration up to 64 (the decode launcher's most splits): 64 x 128 fp32 is 64
    # registers a thread at 4 warps. More parts loop in chunks of 64.
    return max(2, min(64, next_power_of_2(num_parts)))


def scale_reduce(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge o_parts [num_parts, num_rows, num_heads, head_dim] and lse_parts [num_parts, num_rows,
    num_heads] (fp32) into (out [num_rows, num_heads, head_dim], out_lse [num_rows, num_heads])."""
    check_tensor("o_parts", o_parts, ndim=4, dtypes=_F32)
    check_device("o_parts", o_parts)
    num_parts, num_rows, num_heads, head_dim = o_parts.shape
    check_tensor("lse_parts", lse_parts, ndim=3, dtypes=_F32, device=o_parts.device)
    check_shape("lse_parts", lse_parts, (num_parts, num_rows, num_heads))
    out = check_out("out", out, (num_rows, num_heads, head_dim), o_parts.device)
    out_lse = check_out("out_lse", out_lse, (num_rows, num_heads), o_parts.device)
    launch_scale_reduce(
        o_parts.permute(1, 2, 0, 3), lse_parts.permute(1, 2, 0), out, out_lse
    )
    return out, out_lse


def launch_scale_reduce(
    o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor
) -> None:
    """Unchecked dense merge over views o_parts [rows, heads, parts, dim] and lse_parts [rows, heads,
    parts] of any strides (last dim of o unit-stride); also merges the splits of one micro-attention."""
    num_rows, num_heads, num_parts, head_dim = o_parts.shape
    if num_rows == 0 or num_heads == 0:
        return
    scale_reduce_kernel[(num_rows, num_heads)](
        o_parts,
        lse_parts,
        lse_parts,  # no index pointer in the dense form; never read
        out,
        out_lse,
        num_parts,
        o_parts.stride(2),
        o_parts.stride(0),
        o_parts.stride(1),
        lse_parts.stride(2),
        lse_parts.stride(0),
        lse_parts.stride(1),
        out.stride(0),
        out.stride(1),
        out_lse.stride(0),
        out_lse.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_P=_block_p(num_parts),
        VARLEN=False,
    )


def scale_reduce_varlen(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    indptr: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge packed partials o_parts [total_parts, num_heads, head_dim], lse_parts [total_parts,
    num_heads]: row r merges parts indptr[r] .. indptr[r+1]-1 (int32 indptr [num_rows + 1],
    non-decreasing, indptr[0] == 0, indptr[-1] <= total_parts). A row without parts gets 0 and -inf."""
    check_tensor("o_parts", o_parts, ndim=3, dtypes=_F32)
    check_device("o_parts", o_parts)
    total_parts, num_heads, head_dim = o_parts.shape
    check_tensor("lse_parts", lse_parts, ndim=2, dtypes=_F32, device=o_parts.device)
    check_shape("lse_parts", lse_parts, (total_parts, num_heads))
    check_tensor("indptr", indptr, ndim=1, dtypes=(torch.int32,), device=o_parts.device)
    if indptr.numel() < 1:
        raise ValueError("indptr must have num_rows + 1 >= 1 entries, got an empty tensor")
    num_rows = indptr.numel() - 1
    out = check_out("out", out, (num_rows, num_heads, head_dim), o_parts.device)
    out_lse = check_out("out_lse", out_lse, (num_rows, num_heads), o_parts.device)
    if num_rows == 0 or num_heads == 0:
        return out, out_lse
    # The index pointer is validated on the host: a bad one would read other rows' memory. This costs a
    # device sync, accepted because merges happen once per step, not per layer tile.
    ptr = indptr.cpu()
    if int(ptr[0]) != 0 or bool((ptr[1:] < ptr[:-1]).any()) or int(ptr[-1]) > total_parts:
        raise ValueError(
            f"indptr must start at 0, never decrease and end at most at total_parts={total_parts}, "
            f"got {ptr.tolist()[:8]}{'...' if ptr.numel() > 8 else ''}"
        )
    scale_reduce_kernel[(num_rows, num_heads)](
        o_parts,
        lse_parts,
        indptr,
        out,
        out_lse,
        0,
        o_parts.stride(0),
        0,
        o_parts.stride(1),
        lse_parts.stride(0),
        0,
        lse_parts.stride(1),
        out.stride(0),
        out.stride(1),
        out_lse.stride(0),
        out_lse.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_P=_block_p(max(1, total_parts // max(1, num_rows))),
        VARLEN=True,
    )
    return out, out_lse


def scale_reduce_pair(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials o [..., head_dim], lse [...] of equal shapes. `out=o_a, out_lse=lse_a`
    merges in place (each element is read before it is written)."""
    if not isinstance(o_a, torch.Tensor) or o_a.dim() < 1:
        raise ValueError("o_a must be a tensor [..., head_dim] with at least one dimension")
    check_tensor("o_a", o_a, ndim=o_a.dim(), dtypes=_F32)
    check_device("o_a", o_a)
    check_tensor("o_b", o_b, ndim=o_a.dim(), dtypes=_F32, device=o_a.device)
    check_shape("o_b", o_b, o_a.shape)
    lse_shape = o_a.shape[:-1]
    check_tensor("lse_a", lse_a, ndim=len(lse_shape), dtypes=_F32, device=o_a.device)
    check_shape("lse_a", lse_a, lse_shape)
    check_tensor("lse_b", lse_b, ndim=len(lse_shape), dtypes=_F32, device=o_a.device)
    check_shape("lse_b", lse_b, lse_shape)
    out = check_out("out", out, o_a.shape, o_a.device)
    out_lse = check_out("out_lse", out_lse, lse_shape, o_a.device)
    num_rows = lse_a.numel()
    head_dim = o_a.shape[-1]
    if num_rows == 0:
        return out, out_lse
    scale_reduce_pair_kernel[(num_rows,)](
        o_a, lse_a, o_b, lse_b, out, out_lse, HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim)
    )
    return out, out_lse
