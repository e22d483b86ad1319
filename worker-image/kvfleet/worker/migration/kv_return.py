"""A finished request's KV sent to another worker's prefix cache: the decode phase's KV going back.

"MemServe: Flexible Mem Pool for Building Disaggregated LLM Serving with Caching" §5 (Figure 4, step
5, PD-Caching-3, "full-fledged" caching): when a request ends on the decode worker, the KV of its
decode phase goes back to the prefill worker, so that the session's next turn, which the router
sends there, prefills only its new tokens. Its prompt's KV is cached there already (the prefill
worker cached it as it handed the request over), so only the blocks it lacks cross: the receiver
says how many leading blocks it holds, the sender sends the rest of what its own cache holds.

Both ends work on their engines' prefix caches (capabilities.PrefixKV), over the migration
transport (authenticated, the frames in wire.py). Nothing is lost when it fails: the KV stays in the
decode worker's cache, and the next turn prefills more.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.worker.engines.base import Engine, EngineError
from kvfleet.worker.engines.capabilities import KVFormat, MigrationError, kv_format_mismatch
from kvfleet.worker.migration.transport import Channel, Frame, Transport, TransportError
from kvfleet.worker.migration.wire import (
    REPLY_TIMEOUT_S,
    TargetError,
    as_bytes,
    receive_stage_data,
    stage_blocks,
    stage_header,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ReturnResult:
    """What one send-back did: blocks and bytes sent, blocks the receiver took into its cache."""

    sent: bool
    bytes_sent: int = 0
    blocks_sent: int = 0
    blocks_inserted: int = 0
    message: str = ""


def _format_of(engine: Engine) -> KVFormat | None:
    migration = engine.capabilities.migration
    if migration is None:
        return None
    try:
        return migration.kv_format()
    except MigrationError:
        return None


async def send_back(engine: Engine, transport: Transport, address: str, tokens: Sequence[int]) -> ReturnResult:
    """Sends the blocks of `tokens` this engine's cache holds and the worker at `address` lacks."""
    prefix_kv, kv_format = engine.capabilities.prefix_kv, _format_of(engine)
    if prefix_kv is None or kv_format is None:
        return ReturnResult(False, message=f"the {engine.info.engine} engine here has no prefix cache to send from")
    block_size = engine.info.block_size_tokens
    full = list(tokens[: len(tokens) // block_size * block_size])
    channel: Channel | None = None
    try:
        channel = await transport.connect(address, CONNECT_TIMEOUT_S)
        await channel.send({"op": "cache", "tokens": full, "block_size_tokens": block_size,
                            "kv_format": kv_format.to_json()})
        held = int((await _reply(channel)).get("cached_blocks") or 0)
        kv = await prefix_kv.export_prefix(full, held)
        if kv is None:
            await channel.send({"op": "end"})
            return ReturnResult(True, message=f"the receiver holds {held} blocks, all this cache has")
        await channel.send(stage_header(kv))
        await _reply(channel)
        await channel.send({"op": "data"}, as_bytes(kv.data))
        inserted = int((await _reply(channel)).get("inserted_blocks") or 0)
        return ReturnResult(True, kv.nbytes, kv.num_blocks, inserted)
    except (TransportError, TargetError, EngineError, OSError, TimeoutError) as err:
        return ReturnResult(False, message=str(err) or type(err).__name__)
    finally:
        if channel is not None:
            channel.close()


async def _reply(channel: Channel) -> dict[str, Any]:
    frame = await channel.recv(REPLY_TIMEOUT_S)
    if not frame.header.get("ok"):
        raise TargetError(str(frame.header.get("error", "refused")))
    return frame.header


async def receive(engine: Engine, channel: Channel, first: Frame) -> int:
    """Answers a `cache` channel whose first frame the executor has read: inserts the blocks sent into
    this engine's prefix cache; how many it took in."""
    header = first.header
    prefix_kv, here = engine.capabilities.prefix_kv, _format_of(engine)
    tokens = header.get("tokens")
    refusal = None
    if prefix_kv is None or here is None:
        refusal = f"the {engine.info.engine} engine here has no prefix cache to take KV into"
    elif not isinstance(tokens, list) or header.get("block_size_tokens") != engine.info.block_size_tokens:
        refusal = f"KV is cached here in blocks of {engine.info.block_size_tokens} tokens"
    else:
        try:
            refusal = kv_format_mismatch(KVFormat.from_json(header["kv_format"]), here)
        except (KeyError, TypeError, ValueError) as err:
            refusal = f"no usable kv_format: {err}"
    if refusal is not None or prefix_kv is None or not isinstance(tokens, list):
        await channel.send({"ok": False, "error": refusal})
        return 0
    ids = [int(t) for t in tokens]
    await channel.send({"ok": True, "cached_blocks": prefix_kv.cached_blocks(ids)})
    frame = await channel.recv(REPLY_TIMEOUT_S)
    if frame.header.get("op") != "stage":
        return 0  # "end": it holds all the sender has
    await channel.send({"ok": True})
    data = await receive_stage_data(channel, frame.header)
    try:
        inserted = await prefix_kv.import_prefix(ids, stage_blocks("", frame.header, data))
    except EngineError as err:
        await channel.send({"ok": False, "error": str(err)})
        return 0
    await channel.send({"ok": True, "inserted_blocks": inserted})
    log.debug("took %d blocks of a finished request's KV into the prefix cache", inserted)
    return inserted
