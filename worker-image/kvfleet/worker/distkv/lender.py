"""The lender's side of a lease (rManager serving remote requests, Infinite-LLM §4.3): one channel,
one lease, until the borrower frees it or the channel ends; either way the blocks come back.

Errors of the borrower's making (a wrong op, a lease id that is not this channel's, too many tokens)
are answered {"ok": false} and end the session: a borrower that speaks nonsense holds nothing here.
"""

from __future__ import annotations

import logging

import torch

from kvfleet.worker.distkv.wire import LEND_OPS, LendingRefused, empty_like_header, pack_partial, tensor_header
from kvfleet.worker.engines.capabilities import KVLending, LendingError
from kvfleet.worker.migration.transport import Channel, Frame, TransportError
from kvfleet.worker.migration.wire import as_bytes

log = logging.getLogger(__name__)

# A lease lives as long as its request decodes: minutes between two calls are normal (a long prefill
# elsewhere, a slow client); an hour of silence is a borrower that is gone without closing.
IDLE_TIMEOUT_S = 3600.0


async def serve_lease(lending: KVLending | None, channel: Channel, first: Frame, block_size_tokens: int) -> None:
    """Serve one lease from its first frame (a `lend`) until it is freed or the channel ends."""
    lease_id = str(first.header.get("lease", ""))
    if lending is None:
        await channel.send({"ok": False, "error": "this worker's engine lends no KV"})
        return
    if first.header.get("op") != "lend" or not lease_id:
        await channel.send({"ok": False, "error": "a lease starts with lend"})
        return
    try:
        frame: Frame | None = first
        while frame is not None:
            frame = await _one(lending, channel, frame, lease_id, block_size_tokens)
    except (LendingRefused, LendingError) as err:
        await _refuse(channel, str(err))
    except TransportError as err:
        log.info("lease %s: the borrower went away: %s", lease_id, err)
    finally:
        freed = await lending.free(lease_id)
        if freed:
            log.info("lease %s ended: %d blocks back", lease_id, freed)


async def _one(lending: KVLending, channel: Channel, frame: Frame, lease_id: str, block_size_tokens: int) -> Frame | None:
    """Answer one frame; the next one, or None when the lease is freed."""
    header = frame.header
    op = header.get("op")
    if op not in LEND_OPS or header.get("lease") != lease_id:
        raise LendingRefused(f"unexpected {op!r} for lease {header.get('lease')!r} on lease {lease_id!r}'s channel")
    if op == "lend":
        blocks = header.get("blocks")
        if not isinstance(blocks, int):
            raise LendingRefused("lend needs a number of blocks")
        try:
            await lending.lend(lease_id, blocks)
        except LendingError as err:
            # Refused, not failed: the borrower takes what room there is, or asks another creditor,
            # and may come back to grow what it already holds here later.
            await _refuse(channel, str(err), err.room_blocks)
        else:
            await channel.send({"ok": True, "block_size_tokens": block_size_tokens, "lent": lending.lent_blocks(),
                                "cap": lending.cap_blocks})
    elif op == "lend-write":
        kv = await _tensor(channel, frame)
        await lending.write(lease_id, int(header.get("start", -1)), kv)
        await channel.send({"ok": True})
    elif op == "lend-attend":
        q = await _tensor(channel, frame)
        out, lse = await lending.attend(lease_id, int(header.get("layer", -1)), q, int(header.get("tokens", 0)))
        await channel.send({"ok": True, "shape": list(out.shape)},
                           as_bytes(pack_partial(out, lse)))
    elif op == "lend-read":
        kv = await lending.read(lease_id, int(header.get("start", -1)), int(header.get("tokens", 0)))
        kv = kv.contiguous()
        await channel.send({"ok": True, **tensor_header(kv)}, as_bytes(kv))
    elif op == "lend-trim":
        await channel.send({"ok": True, "blocks": await lending.trim(lease_id, int(header.get("tokens", -1)))})
    else:  # lend-free
        await channel.send({"ok": True, "freed": await lending.free(lease_id)})
        return None
    return await channel.recv(IDLE_TIMEOUT_S)


async def _tensor(channel: Channel, frame: Frame) -> torch.Tensor:
    tensor = empty_like_header(frame.header)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != frame.payload_nbytes:
        raise LendingRefused(f"a {list(tensor.shape)} {tensor.dtype} tensor is {nbytes} bytes, not {frame.payload_nbytes}")
    await channel.read_payload(nbytes, as_bytes(tensor) if nbytes else None)
    return tensor


async def _refuse(channel: Channel, error: str, room_blocks: int = 0) -> None:
    try:
        await channel.send({"ok": False, "error": error, **({"room": room_blocks} if room_blocks else {})})
    except TransportError:
        pass

