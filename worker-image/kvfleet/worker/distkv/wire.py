"""The lending conversation on the migration port, so that both sides read one description of it.

One lease is one channel (migration/transport.py: authenticated with the pool's migration key),
opened by the borrower and kept for the request's life; the lender frees the lease when the channel
ends, however it ends, so a borrower that dies leaves nothing lent behind (§4.3). Frames:

    borrower -> lender                                       lender -> borrower
    {"op": "lend", "lease", "blocks"}                        {"ok", "block_size_tokens", "lent", "cap"}
    {"op": "lend-write", "lease", "start", "shape", "dtype"} {"ok"}      the tokens are stored
      + kv [layers, 2, tokens, kv_heads, head_dim] bytes
    {"op": "lend-attend", "lease", "layer", "tokens",        {"ok", "shape"} + out [rows, heads, dim]
     "shape", "dtype"} + q [rows, heads, dim] bytes           and lse [rows, heads] as float32 bytes
    {"op": "lend-read", "lease", "start", "tokens"}          {"ok", "shape", "dtype"} + kv [layers, 2,
                                                               tokens, kv_heads, head_dim] bytes
    {"op": "lend-trim", "lease", "tokens"}                   {"ok", "blocks"}  the lease keeps its first
                                                               `tokens` tokens; "blocks" it still holds
    {"op": "lend-free", "lease"}                             {"ok", "freed"}  (then either side closes)

A refused `lend` says how many blocks the lender could lend instead: {"ok": false, "error", "room"}.

`lend-read` and `lend-trim` are DGFM's recall (§4.5): the borrower reads some of its tokens back
and the lender gives back the blocks they filled. `lend` is sent again to grow a lease. Any reply may be {"ok": false, "error"} (LendingRefused at the
borrower): a creditor without room says so at once and the borrower asks the next one (§4.4).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvfleet.worker.engines.base import blocks_for
from kvfleet.worker.engines.capabilities import LendingError

LEND_OPS = ("lend", "lend-write", "lend-attend", "lend-read", "lend-trim", "lend-free")
# A remote micro-attention or write waits behind the lender's own step at most this long.
REPLY_TIMEOUT_S = 30.0


class LendingRefused(LendingError):
    """The lender refused or failed a call (its message says why)."""


def tensor_header(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def pack_partial(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """A micro-attention's (out [rows, heads, dim], lse [rows, heads]) as one float32 tensor, out first:
    how a lender answers `lend-attend` (and a vLLM EngineCore and its agent pass it along)."""
    return torch.cat([out.float().reshape(-1), lse.float().reshape(-1)])


def unpack_partial(data: torch.Tensor | None, rows: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_partial`'s tensor back as (out, lse); LendingRefused when it is not one of that shape."""
    if data is None or data.numel() != rows * heads * (dim + 1):
        raise LendingRefused(f"the lender answered {0 if data is None else data.numel()} floats for a "
                             f"{rows}x{heads}x{dim} result")
    return data[: rows * heads * dim].view(rows, heads, dim), data[rows * heads * dim:].view(rows, heads)


def attend_lease(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                 num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [rows, heads, dim] over the first `num_tokens` tokens of a lease whose blocks are `blocks` (in
    token order) in a paged cache [blocks, block_size, kv_heads, dim]: the lender's micro-attention
    (§4.6). Every row reads the whole lease, one decode row each with the lease as its block table: a
    lease holds context older than any query, so no causal mask."""
    from kvfleet.kernels.dispatch import micro_attention_decode

    rows = q.shape[0]
    table = blocks.to(device=k_cache.device, dtype=torch.int32).expand(rows, -1).contiguous()
    lens = torch.full((rows,), num_tokens, dtype=torch.int32, device=k_cache.device)
    return micro_attention_decode(q.to(device=k_cache.device, dtype=k_cache.dtype).contiguous(), k_cache, v_cache,
                                  table, lens)


def lease_blocks(leases: Mapping[str, list[int]], lease_id: str, num_tokens: int, block_size_tokens: int) -> list[int]:
    """A lender's blocks of lease `lease_id` that hold its first `num_tokens` tokens, in token order;
    LendingError when there is no such lease or it holds fewer."""
    blocks = leases.get(lease_id)
    if blocks is None:
        raise LendingError(f"no lease {lease_id!r} here")
    needed = blocks_for(num_tokens, block_size_tokens)
    if needed > len(blocks):
        raise LendingError(f"{num_tokens} tokens need {needed} blocks; lease {lease_id!r} holds {len(blocks)}")
    return blocks[:needed]


def trimmed_blocks(leases: Mapping[str, list[int]], lease_id: str, num_tokens: int,
                   block_size_tokens: int) -> list[int]:
    """`lend-trim` at a lender: the blocks of lease `lease_id` past those its first `num_tokens` tokens
    fill, which go back (the lender drops them from the lease once its pool has them)."""
    if lease_id not in leases:
        raise LendingError(f"no lease {lease_id!r} here")
    if num_tokens < 0:
        raise LendingError(f"a lease keeps at least 0 tokens, not {num_tokens}")
    return leases[lease_id][blocks_for(num_tokens, block_size_tokens):]


def empty_like_header(header: dict[str, Any]) -> torch.Tensor:
    """A CPU tensor of the announced shape and dtype, for a payload to be read into."""
    dtype = getattr(torch, str(header.get("dtype", "")), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise LendingRefused(f"unknown dtype {header.get('dtype')!r}")
    shape = header.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise LendingRefused(f"bad shape {shape!r}")
    return torch.empty(tuple(shape), dtype=dtype)
