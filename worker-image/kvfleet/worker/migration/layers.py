"""A by-layer hand-over's first half: a prompt's KV sent layer by layer while it is prefilled.

"MemServe: Flexible Mem Pool for Building Disaggregated LLM Serving with Caching" §5.2 (Figure 5):
by-layer transfer streams each layer's KV as the prefill computes it, so that the copy overlaps the
prefill instead of following it. Here the prefill worker opens the migration channel to the decode
worker when the request arrives, before its prefill (`begin` with `"layers": true`), watches the
request's prefill through its engine (capabilities.LayerKV), and sends each part as it comes
(`layer` frames, no reply each: the channel is ordered, and the decode worker answers once, at
`layers_done`). When the first token is out the hand-over goes on as any other on the same channel
(source.py, `Prepared`): it stops the request and sends, all layers at once, only what the stream
did not cover (the prompt's last, partial block and any token decoded since).

Whatever goes wrong here only costs the overlap: a stream that could not start, or did not finish
by the first token, leaves the hand-over to send the KV whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.worker.engines.base import Engine
from kvfleet.worker.engines.capabilities import KVFormat, LayerKV, LayerPart, MigrationError, kv_format_mismatch
from kvfleet.worker.migration.transport import Channel, Transport, TransportError
from kvfleet.worker.migration.wire import REPLY_TIMEOUT_S, as_bytes

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Prepared:
    """The channel a by-layer stream opened, for the hand-over to go on with: the decode worker's hello,
    and the first block the stream did not send in its final form (all blocks before it are there)."""

    channel: Channel
    hello: dict[str, Any]
    streamed_block: int


def part_header(part: LayerPart) -> dict[str, Any]:
    return {"op": "layer", "layer": part.layer, "first_block": part.first_block, "num_tokens": part.num_tokens,
            "block_size_tokens": part.block_size_tokens, "shape": list(part.data.shape), "dtype": str(part.data.dtype)}


def trimmed(part: LayerPart, from_block: int) -> LayerPart | None:
    """The part without the blocks before `from_block` (the decode worker's cache holds them), or None."""
    skip = from_block - part.first_block
    if skip <= 0:
        return part
    axis = 2 if part.layer is None else 1
    if skip >= part.data.shape[axis]:
        return None
    data = part.data[:, :, skip:] if axis == 2 else part.data[:, skip:]
    return LayerPart(part.layer, from_block, part.num_tokens - skip * part.block_size_tokens, part.block_size_tokens,
                     data.contiguous())


class LayerStream:
    """Streams one request's prompt KV to a decode worker while it is prefilled (module docstring)."""

    def __init__(self, engine: Engine, layer_kv: LayerKV, transport: Transport, request_id: str, address: str,
                 prompt_token_ids: Sequence[int], return_to: str | None) -> None:
        self.engine = engine
        self.layer_kv = layer_kv
        self.transport = transport
        self.request_id = request_id
        self.address = address
        self.prompt_token_ids = list(prompt_token_ids)
        self.return_to = return_to
        # Registered now, before the request reaches the engine, so its first step is seen.
        self.queue = layer_kv.watch_layers(request_id, 0)
        self.channel: Channel | None = None
        self.hello: dict[str, Any] = {}
        self.complete = False
        self.parts_sent = 0
        self.bytes_sent = 0
        self.connected = asyncio.Event()
        self.stopping = False
        self._waiting = False  # the pump waits for a part (nothing half sent): it may be cancelled
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run(), name=f"kvfleet-layers-{self.request_id}")

    async def finish(self) -> Prepared | None:
        """Stops the stream after the parts already queued (all of the prompt's, once its first token is
        out) and returns the channel for the hand-over."""
        task = self.task
        if task is not None and not task.done():
            self.stopping = True
            if self._waiting and self.queue.empty():
                task.cancel()  # between frames: the channel carries no half of one
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return self.prepared()

    async def run(self) -> None:
        """Connect, then send every part until the prompt is prefilled; never raises (the hand-over
        then sends the KV whole)."""
        try:
            if await self._open():
                await self._pump()
        except (TransportError, OSError, TimeoutError) as err:
            log.info("by-layer stream of %s to %s stopped: %s", self.request_id, self.address, err)
        finally:
            self.layer_kv.unwatch(self.request_id)
            self.connected.set()

    async def _open(self) -> bool:
        block_size = self.engine.info.block_size_tokens
        channel = await self.transport.connect(self.address, CONNECT_TIMEOUT_S)
        begin: dict[str, Any] = {"op": "begin", "request_id": self.request_id, "mode": "kv", "layers": True,
                                 "prefix": {"tokens": self.prompt_token_ids, "block_size_tokens": block_size}}
        if self.return_to is not None:
            begin["return_to"] = self.return_to
        await channel.send(begin)
        hello = (await channel.recv(REPLY_TIMEOUT_S)).header
        self.channel, self.hello = channel, hello
        refusal = self._refusal(hello)
        self.connected.set()
        if refusal is not None:
            log.info("no by-layer stream of %s to %s: %s", self.request_id, self.address, refusal)
            return False
        return True

    def _refusal(self, hello: dict[str, Any]) -> str | None:
        if not hello.get("ok"):
            return str(hello.get("error", "refused"))
        if not hello.get("kv") or not hello.get("layer_kv"):
            return f"the decode worker ({hello.get('engine')}) takes no KV layer by layer"
        migration = self.engine.capabilities.migration
        if migration is None or "kv_format" not in hello:
            return "no KV format to agree on"
        try:
            here = migration.kv_format()
        except MigrationError as err:
            return str(err)
        there = KVFormat.from_json(hello["kv_format"])
        return kv_format_mismatch(here, there) or (
            None if there.block_size_tokens == here.block_size_tokens else "the block sizes differ")

    async def _pump(self) -> None:
        channel = self.channel
        assert channel is not None
        cached = int(self.hello.get("cached_blocks") or 0)
        while True:
            if self.stopping and self.queue.empty():
                return  # the hand-over goes on without the end: it sends what the stream may lack
            self._waiting = True
            try:
                part = await self.queue.get()
            finally:
                self._waiting = False
            if part is None:  # the prompt is prefilled: every part of it is sent
                self.complete = True
                return
            part = trimmed(part, cached)
            if part is None:
                continue
            await channel.send(part_header(part))
            await channel.send({"op": "data"}, as_bytes(part.data))
            self.parts_sent += 1
            self.bytes_sent += int(part.data.numel() * part.data.element_size())

    def prepared(self) -> Prepared | None:
        """The channel for the hand-over, or None when there is none to go on with (it never opened, the
        decode worker refused, or it broke)."""
        if self.channel is None or not self.hello.get("ok"):
            return None
        block_size = self.engine.info.block_size_tokens
        cached = int(self.hello.get("cached_blocks") or 0)
        streamed = max(cached, len(self.prompt_token_ids) // block_size) if self.complete else cached
        return Prepared(self.channel, self.hello, streamed)
