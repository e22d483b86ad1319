"""The destination's side of one migration: take the KV stages in, then the request itself.

The destination is passive: it answers the frames the source sends (wire.py) and never holds on to
anything it was not told to keep. Staged KV is reserved before its bytes move, so a full worker
refuses a stage at once; whatever a migration reserved or imported is released unless it commits,
including when the source goes quiet (`PREALLOCATION_TIMEOUT_S`) or the connection drops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvfleet.worker.engines.base import EngineError, blocks_for
from kvfleet.worker.engines.capabilities import KVMigratable, LayerKV, LayerPart, MigrationError
from kvfleet.worker.migration.handoff import Adopted, HandedRequest
from kvfleet.worker.migration.host import Host, continue_on
from kvfleet.worker.migration.result import MIN_PREFILL_SAMPLE_TOKENS, MigrationMetrics
from kvfleet.worker.migration.transport import Channel, Frame, TransportError
from kvfleet.worker.migration.wire import (
    REPLY_TIMEOUT_S,
    TargetError,
    receive_stage_data,
    stage_blocks,
    stage_shape,
)

log = logging.getLogger(__name__)

# Called when a handed-over request whose source wants its KV back runs here: (it, the source's address).
ReturnKV = Callable[[Adopted, str], None]

# The destination frees reserved blocks when the source says nothing for this long.
PREALLOCATION_TIMEOUT_S = 30.0


class TargetRun:
    """One incoming migration on an authenticated channel, from `begin` to `commit` or `abort`."""

    def __init__(self, host: Host, metrics: MigrationMetrics, clock: Callable[[], float], channel: Channel,
                 returns: ReturnKV | None = None) -> None:
        self.host = host
        # A hand-over whose source asks for the decode phase's KV back (`return_to`, PD-Caching-3):
        # called with the adopted request and that address once it runs here.
        self.returns = returns
        self.return_to: str | None = None
        self.engine = host.engine
        # None: this engine cannot import KV, and the source moves the request by its tokens.
        self.migration: KVMigratable | None = self.engine.capabilities.migration
        self.metrics = metrics
        self.clock = clock
        self.channel = channel

    async def go(self, first: Frame) -> None:
        """The migration whose first frame (`begin`) the executor has read."""
        host, channel = self.host, self.channel
        request_id = await self._hello(first)
        if request_id is None:
            return
        committed = False
        host.incoming(request_id, True)
        try:
            while True:
                frame = await channel.recv(PREALLOCATION_TIMEOUT_S)
                op = frame.header.get("op")
                if op == "stage" and self.migration is not None:
                    await self._receive_stage(self.migration, request_id, frame.header)
                elif op == "layer" and self.engine.capabilities.layer_kv is not None:
                    await self._receive_layer(self.engine.capabilities.layer_kv, request_id, frame.header)
                elif op == "layers_done":
                    await channel.send({"ok": True})  # every layer part before it is written
                elif op == "commit":
                    committed = await self._commit(request_id, frame.header)
                    return
                elif op == "abort":
                    log.info("migration of %s here abandoned by the source: %s", request_id, frame.header.get("reason", ""))
                    return
                else:
                    await channel.send({"ok": False, "error": f"unexpected {op!r}"})
                    return
        finally:
            host.incoming(request_id, False)
            if not committed and self.migration is not None:
                try:
                    self.migration.release(request_id)  # reserved and imported blocks of a migration that will not land
                except MigrationError as err:
                    log.warning("freeing the KV staged for %s: %s", request_id, err)
                host.nudge_reporter()

    async def _hello(self, frame: Frame) -> str | None:
        """Answers `begin`: the request id to take in, or None when this worker refused it."""
        host, engine, channel = self.host, self.engine, self.channel
        if frame.header.get("op") != "begin":
            await channel.send({"ok": False, "error": "expected begin"})
            return None
        request_id = str(frame.header.get("request_id", ""))
        if not host.accepts_migrations():
            await channel.send({"ok": False, "error": "this worker is not ready or is shutting down"})
            return None
        if request_id in {r.request_id for r in engine.kv_usage()} or host.live_request(request_id) is not None:
            await channel.send({"ok": False, "error": f"request {request_id!r} is already on this worker"})
            return None
        info = engine.info
        return_to = frame.header.get("return_to")
        self.return_to = return_to if isinstance(return_to, str) and return_to else None
        kv: dict[str, Any] = {"kv": False}
        if self.migration is not None:
            try:
                kv = {"kv": True, "kv_format": self.migration.kv_format().to_json()}
            except MigrationError as err:
                kv = {"kv": False, "kv_refusal": str(err)}
        cached = self._stage_prefix(request_id, frame.header.get("prefix"))
        await channel.send({"ok": True, "engine": info.engine, **kv, "cached_blocks": cached,
                            "layer_kv": kv.get("kv", False) and engine.capabilities.layer_kv is not None,
                            "block_size_tokens": info.block_size_tokens, "kv_bytes_per_token": info.kv_bytes_per_token})
        return request_id

    def _stage_prefix(self, request_id: str, prefix: object) -> int:
        """The request starts from the prompt's prefix this worker's cache holds (PrefixKV): blocks the
        source then does not send. Only where both cache by blocks of the same size."""
        prefix_kv = self.engine.capabilities.prefix_kv
        if prefix_kv is None or not isinstance(prefix, dict):
            return 0
        tokens = prefix.get("tokens")
        if prefix.get("block_size_tokens") != self.engine.info.block_size_tokens or not isinstance(tokens, list):
            return 0
        return prefix_kv.stage_prefix(request_id, [int(t) for t in tokens])

    async def _receive_stage(self, migration: KVMigratable, request_id: str, header: dict[str, Any]) -> None:
        channel = self.channel
        first_block, num_blocks = int(header["first_block"]), stage_shape(header)[2]
        try:
            # In this engine's blocks: the stage's may be of another size (KVFormat.any_block_size).
            end_token = (first_block + num_blocks) * int(header["block_size_tokens"])
            migration.reserve_kv(request_id, blocks_for(end_token, self.engine.info.block_size_tokens))
        except EngineError as err:
            await channel.send({"ok": False, "error": str(err)})
            raise TargetError(str(err)) from None
        await channel.send({"ok": True})
        data = await receive_stage_data(channel, header, PREALLOCATION_TIMEOUT_S)
        try:
            await migration.import_kv(request_id, stage_blocks(request_id, header, data))
        except EngineError as err:
            await channel.send({"ok": False, "error": str(err)})
            raise TargetError(str(err)) from None
        await channel.send({"ok": True})

    async def _receive_layer(self, layer_kv: LayerKV, request_id: str, header: dict[str, Any]) -> None:
        """One part of a by-layer stream (layers.py): written without a reply, unless it fails."""
        data = await receive_stage_data(self.channel, header, PREALLOCATION_TIMEOUT_S)
        layer = header.get("layer")
        part = LayerPart(None if layer is None else int(layer), int(header["first_block"]), int(header["num_tokens"]),
                         int(header["block_size_tokens"]), data)
        try:
            await layer_kv.import_layer(request_id, part)
        except EngineError as err:
            await self.channel.send({"ok": False, "error": str(err)})
            raise TargetError(str(err)) from None

    async def _commit(self, request_id: str, header: dict[str, Any]) -> bool:
        handed = HandedRequest.from_json(header["handed"])
        engine = self.engine
        held_tokens = next((r.tokens for r in engine.kv_usage() if r.request_id == request_id), 0)
        started = self.clock()
        try:
            stream = continue_on(engine, handed)
        except EngineError as err:
            await self.channel.send({"ok": False, "error": str(err)})
            return False
        adopted = self.host.adopt(handed, stream)
        if self.return_to is not None and self.returns is not None:
            self.returns(adopted, self.return_to)
        # The reply waits for the first token here, so the source measures the whole pause.
        try:
            await asyncio.wait_for(adopted.first_output.wait(), REPLY_TIMEOUT_S)
        except TimeoutError:
            pass
        elapsed_s = self.clock() - started
        total = len(handed.prompt_token_ids) + len(handed.output_token_ids)
        prefilled = max(1, total - min(held_tokens, total - 1))
        prefill_rate = prefilled / elapsed_s if elapsed_s > 0 else None
        if prefill_rate is not None and prefilled > MIN_PREFILL_SAMPLE_TOKENS:
            self.metrics.prefill.set(prefill_rate)
        notes = self.migration.resume_notes(request_id) if self.migration is not None else []
        try:
            await self.channel.send({"ok": True, "prefilled_tokens": prefilled, "first_output_s": elapsed_s,
                                     "notes": notes})
        except TransportError:
            # The source cannot know we took it and will resume it itself: one of the two must go.
            if adopted.task is not None:
                adopted.task.cancel()
            raise
        self.host.nudge_reporter()
        return True
