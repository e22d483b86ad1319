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
    {"op": "lend-free", "lease"}                             {"ok", "freed"}  (then either side closes)

A refused `lend` says how many blocks the lender could lend instead: {"ok": false, "error", "room"}.

`lend` is sent again to grow a lease. Any reply may be {"ok": false, "error"} (LendingRefused at the
borrower): a creditor without room says so at once and the borrower asks the next one (§4.4).
"""

from __future__ import annotations

from typing import Any

import torch

from kvfleet.worker.engines.capabilities import LendingError

LEND_OPS = ("lend", "lend-write", "lend-attend", "lend-free")
# A remote micro-attention or write waits behind the lender's own step at most this long.
REPLY_TIMEOUT_S = 30.0


class LendingRefused(LendingError):
    """The lender refused or failed a call (its message says why)."""


def tensor_header(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def empty_like_header(header: dict[str, Any]) -> torch.Tensor:
    """A CPU tensor of the announced shape and dtype, for a payload to be read into."""
    dtype = getattr(torch, str(header.get("dtype", "")), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise LendingRefused(f"unknown dtype {header.get('dtype')!r}")
    shape = header.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise LendingRefused(f"bad shape {shape!r}")
    return torch.empty(tuple(shape), dtype=dtype)
