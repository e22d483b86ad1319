"""The conversation between a migration's two executors, so that both sides read one description of it.

One migration is one transport channel (transport.py), opened by the source. Each frame is a JSON
header, the `data` frame with the KV blocks' bytes as its payload:

    source -> destination                            destination -> source
    {"op": "begin", "request_id", "mode",            {"ok", "engine", "kv", "block_size_tokens",
     "prefix": {"tokens", "block_size_tokens"},       "kv_bytes_per_token", "cached_blocks"}
     "return_to"?}                                   ("kv": it can import KV; "cached_blocks": the
                                                      prompt's leading blocks its prefix cache holds,
                                                      staged for the request and never sent)
    {"op": "stage", "first_block", "num_tokens",     {"ok"}  the stage's blocks are reserved
     "block_size_tokens", "shape", "dtype", "parts"?}
    {"op": "data"} + the blocks' bytes               {"ok"}  written (after the last part, with
      (or "parts" such frames, one per layer,                 "parts": by-request layout)
       K or V, and block, in that order)
    {"op": "commit", "handed": HandedRequest}        {"ok", "prefilled_tokens", "first_output_s"}
    {"op": "abort", "reason"}                        (no reply: the destination frees what it holds)

`return_to` (a disaggregated hand-over under PD-Caching-3): the source's migration address, where the
destination sends the request's KV back to be cached when it ends. That is a channel of its own:

    {"op": "cache", "tokens", "block_size_tokens",   {"ok", "cached_blocks"}  what it holds already
     "kv_format"}
    {"op": "stage", ...} then {"op": "data"}         {"ok", "inserted_blocks"}  in its prefix cache
    (or nothing more, when it holds them all)

Any reply may be {"ok": false, "error"} instead: the destination refused (TargetError at the source).
"""

from __future__ import annotations

from typing import Any

import torch

from kvfleet.worker.engines.capabilities import KVBlocks
from kvfleet.worker.migration.transport import Channel

# How long a reply (a stage written, a commit done) may take before the source gives up; the
# destination waits as long for a resumed request's first token before it answers a commit.
REPLY_TIMEOUT_S = 30.0


class TargetError(Exception):
    """The destination refused or failed a step (its message says why)."""


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy for a contiguous CPU tensor (any dtype, bfloat16 included).

    A tensor elsewhere (a GPU's) is copied to the CPU first, which is right for bytes to send; a buffer
    to receive into must be a contiguous CPU tensor (`empty_stage_tensor`), as the bytes land in the
    memory the view shows."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    array: Any = tensor.contiguous().view(-1).view(torch.uint8).numpy()
    return memoryview(array)


def kv_parts(data: torch.Tensor) -> int:
    """How many data frames the by-request layout sends a stage in: one per layer, K or V, and block."""
    return int(data.shape[0] * data.shape[1] * data.shape[2])


def split_parts(data: torch.Tensor) -> list[torch.Tensor]:
    """A stage's [layers, 2, blocks, ...] tensor as the by-request layout's parts, in wire order."""
    return [data[layer, kv, block] for layer in range(data.shape[0]) for kv in range(data.shape[1])
            for block in range(data.shape[2])]


def stage_header(kv: KVBlocks) -> dict[str, Any]:
    """The `stage` frame announcing these blocks (their bytes follow in a `data` frame)."""
    return {"op": "stage", "first_block": kv.first_block, "num_tokens": kv.num_tokens,
            "block_size_tokens": kv.block_size_tokens, "shape": list(kv.data.shape), "dtype": str(kv.data.dtype)}


def stage_shape(header: dict[str, Any]) -> tuple[int, ...]:
    """The announced blocks' tensor shape; its third dimension is the number of blocks."""
    return tuple(int(d) for d in header["shape"])


def empty_stage_tensor(header: dict[str, Any]) -> torch.Tensor:
    """A CPU tensor of the announced shape and dtype, for the `data` payload to be read into.

    On the CPU whatever torch's default device is: the transport writes into its memory, and the
    engine's import moves it to the cache's device."""
    name = str(header["dtype"])
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TargetError(f"unknown dtype {name!r}")
    return torch.empty(stage_shape(header), dtype=dtype, device="cpu")


async def receive_stage_data(channel: Channel, header: dict[str, Any], timeout_s: float = REPLY_TIMEOUT_S) -> torch.Tensor:
    """The bytes of the stage `header` announced, in one `data` frame or, with "parts" (by-request
    layout), in that many, each landing in its slice of one tensor; `timeout_s` for each frame."""
    data = empty_stage_tensor(header)
    parts = split_parts(data) if "parts" in header else [data]
    if len(parts) != int(header.get("parts", 1)):
        raise TargetError(f"a stage of shape {list(data.shape)} comes in {len(parts)} parts, not {header['parts']}")
    for part in parts:
        frame = await channel.recv(timeout_s)
        if frame.header.get("op") != "data":
            raise TargetError(f"expected the stage's data, got {frame.header.get('op')!r}")
        view = as_bytes(part)
        if frame.payload_nbytes != len(view):
            raise TargetError(f"a data frame of {frame.payload_nbytes} bytes for a part of {len(view)}")
        await channel.read_payload(frame.payload_nbytes, view)
    return data


def stage_blocks(request_id: str, header: dict[str, Any], data: torch.Tensor) -> KVBlocks:
    """The blocks a `stage` header announced, with the bytes its `data` frame carried."""
    return KVBlocks(request_id, int(header["first_block"]), int(header["num_tokens"]), int(header["block_size_tokens"]),
                    data)
