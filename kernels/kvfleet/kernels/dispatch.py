"""The DistAttention ops for serving: Triton kernels for CUDA tensors, the torch backend otherwise.

An engine calls these and never chooses a backend itself. The Triton launchers are imported only
when a CUDA tensor arrives, so a CPU worker neither loads triton nor needs it installed, and CPU
tensors never reach the Triton interpreter, which is for tests (tests/kernels), not for serving.
The signatures are the launchers' common ground; tuning knobs of one backend (split counts, tile
sizes) stay with that backend.
"""

from __future__ import annotations

import torch

from kvfleet.kernels import torch_backend


def on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def micro_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See micro_attention_decode_launcher.micro_attention_decode."""
    if on_gpu(q):
        from kvfleet.kernels.micro_attention_decode_launcher import micro_attention_decode as launch

        return launch(q, k_cache, v_cache, block_table, seq_lens, scale=scale, out=out, out_lse=out_lse)
    return torch_backend.micro_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale=scale, out=out,
                                                out_lse=out_lse)


def micro_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    causal_offsets: torch.Tensor | None = None,
    max_q_len: int | None = None,
    scale: float | None = None,
    max_logits_bytes: int | None = None,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See micro_attention_prefill_launcher.micro_attention_prefill. max_q_len spares the GPU path a
    device sync; max_logits_bytes bounds the torch backend's query tiles (the Triton kernel tiles on
    chip and needs no bound)."""
    if on_gpu(q):
        from kvfleet.kernels.micro_attention_prefill_launcher import micro_attention_prefill as launch

        return launch(q, k_cache, v_cache, block_table, kv_lens, query_start_loc, causal_offsets=causal_offsets,
                      max_q_len=max_q_len, scale=scale, out=out, out_lse=out_lse)
    return torch_backend.micro_attention_prefill(q, k_cache, v_cache, block_table, kv_lens, query_start_loc,
                                                 causal_offsets=causal_offsets, scale=scale,
                                                 max_logits_bytes=max_logits_bytes, out=out, out_lse=out_lse)


def scale_reduce(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See scale_reduce_launcher.scale_reduce."""
    if on_gpu(o_parts):
        from kvfleet.kernels.scale_reduce_launcher import scale_reduce as launch

        return launch(o_parts, lse_parts, out=out, out_lse=out_lse)
    return torch_backend.scale_reduce(o_parts, lse_parts, out=out, out_lse=out_lse)


def scale_reduce_varlen(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    indptr: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See scale_reduce_launcher.scale_reduce_varlen."""
    if on_gpu(o_parts):
        from kvfleet.kernels.scale_reduce_launcher import scale_reduce_varlen as launch

        return launch(o_parts, lse_parts, indptr, out=out, out_lse=out_lse)
    return torch_backend.scale_reduce_varlen(o_parts, lse_parts, indptr, out=out, out_lse=out_lse)


def scale_reduce_pair(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See scale_reduce_launcher.scale_reduce_pair."""
    if on_gpu(o_a):
        from kvfleet.kernels.scale_reduce_launcher import scale_reduce_pair as launch

        return launch(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
    return torch_backend.scale_reduce_pair(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
