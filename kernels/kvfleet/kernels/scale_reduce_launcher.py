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

from kvfleet.kernels._checks import (
    Merge,
    PairMerge,
    Partial,
    entry_point,
    next_power_of_2,
    scale_reduce_inputs,
    scale_reduce_pair_inputs,
    scale_reduce_varlen_inputs,
)
from kvfleet.kernels.scale_reduce_kernel import scale_reduce_kernel, scale_reduce_pair_kernel


def _block_p(num_parts: int) -> int:
    # All parts in one iteration up to 64 (the decode launcher's most splits): 64 x 128 fp32 is 64
    # registers a thread at 4 warps. More parts loop in chunks of 64.
    return max(2, min(64, next_power_of_2(num_parts)))


def launch_merge(inputs: Merge) -> Partial:
    """Runs `scale_reduce` or `scale_reduce_varlen` on inputs checked by the Triton rules."""
    o_parts, lse_parts, out, out_lse = inputs.o_parts, inputs.lse_parts, inputs.out, inputs.out_lse
    if inputs.indptr is None:
        launch_scale_reduce(o_parts.permute(1, 2, 0, 3), lse_parts.permute(1, 2, 0), out, out_lse)
        return out, out_lse
    total_parts, num_heads, _ = o_parts.shape
    num_rows = out.shape[0]
    # Packed parts: the index pointer finds a row's parts, so a row has no stride of its own.
    _launch(o_parts, lse_parts, inputs.indptr, out, out_lse, 0, (o_parts.stride(0), 0, o_parts.stride(1)),
            (lse_parts.stride(0), 0, lse_parts.stride(1)), _block_p(max(1, total_parts // max(1, num_rows))))
    return out, out_lse


def launch_scale_reduce(
    o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor
) -> None:
    """Unchecked dense merge over views o_parts [rows, heads, parts, dim] and lse_parts [rows, heads,
    parts] of any strides (last dim of o unit-stride); also merges the splits of one micro-attention."""
    num_parts = o_parts.shape[2]
    _launch(o_parts, lse_parts, None, out, out_lse, num_parts, (o_parts.stride(2), o_parts.stride(0), o_parts.stride(1)),
            (lse_parts.stride(2), lse_parts.stride(0), lse_parts.stride(1)), _block_p(num_parts))


def _launch(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    indptr: torch.Tensor | None,
    out: torch.Tensor,
    out_lse: torch.Tensor,
    num_parts: int,
    o_strides: tuple[int, int, int],
    lse_strides: tuple[int, int, int],
    block_p: int,
) -> None:
    """One (row, head) program each; strides are (part, row, head) and num_parts the dense form's."""
    num_rows, num_heads = out_lse.shape
    if num_rows == 0 or num_heads == 0:
        return
    head_dim = out.shape[-1]
    scale_reduce_kernel[(num_rows, num_heads)](
        o_parts,
        lse_parts,
        lse_parts if indptr is None else indptr,  # the dense form has no index pointer; never read
        out,
        out_lse,
        num_parts,
        *o_strides,
        *lse_strides,
        out.stride(0),
        out.stride(1),
        out_lse.stride(0),
        out_lse.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_P=block_p,
        VARLEN=indptr is not None,
    )


def launch_pair(inputs: PairMerge) -> Partial:
    """Runs `scale_reduce_pair` on inputs checked by the Triton rules."""
    out, out_lse = inputs.out, inputs.out_lse
    num_rows = inputs.lse_a.numel()
    head_dim = inputs.o_a.shape[-1]
    if num_rows == 0:
        return out, out_lse
    scale_reduce_pair_kernel[(num_rows,)](
        inputs.o_a, inputs.lse_a, inputs.o_b, inputs.lse_b, out, out_lse, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
    )
    return out, out_lse


# The public launchers: the contract (signature, docstring, checks) is the op's validator's.
scale_reduce = entry_point(scale_reduce_inputs, "triton", launch_merge)
scale_reduce_varlen = entry_point(scale_reduce_varlen_inputs, "triton", launch_merge)
scale_reduce_pair = entry_point(scale_reduce_pair_inputs, "triton", launch_pair)
