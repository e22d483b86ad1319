"""The source's side of one migration: copy, stop, commit, or roll back.

The source drives a migration (executor.py describes the modes): it copies KV stages while the
request decodes, stops the request and waits for its agent stream to flush, sends the last stage
and the request, and releases its own copy once the destination took it. Whatever fails before the
commit's reply rolls back: the request goes on here, from its own KV where the engine kept it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvfleet.mell.migration import MoveMode
from kvfleet.worker.engines.base import EngineError, SamplingParams
from kvfleet.worker.engines.capabilities import (
    KVFormat,
    KVMigratable,
    MigrationError,
    SuspendedRequest,
    kv_format_mismatch,
    split_blocks,
)
from kvfleet.worker.migration.handoff import (
    Continue,
    HandedRequest,
    HandoffError,
    HandoffTarget,
    LiveRequest,
    Moved,
    Ticket,
)
from kvfleet.worker.migration.host import Host, continue_on
from kvfleet.worker.migration.layers import Prepared
from kvfleet.worker.migration.result import MIN_PREFILL_SAMPLE_TOKENS, MigrationResult
from kvfleet.worker.migration.transport import Channel, Transport, TransportError
from kvfleet.worker.migration.wire import (
    REPLY_TIMEOUT_S,
    TargetError,
    as_bytes,
    kv_parts,
    split_parts,
    stage_header,
)

log = logging.getLogger(__name__)

# The last stage starts when a stage found this many new full blocks or fewer (Llumnix stops at a
# few): small enough that the stopped part of a copy is a blink, large enough to end in ~2 stages.
LAST_STAGE_MAX_BLOCKS = 2
# A request that decodes faster than the link copies would never converge: stop after this many.
MAX_STAGES = 8
CONNECT_TIMEOUT_S = 5.0
# How long the source waits for its own agent to flush the request's last tokens after stopping it.
STOP_TIMEOUT_S = 10.0


# How a disaggregated hand-over's KV crosses ("MemServe: Flexible Mem Pool for Building Disaggregated
# LLM Serving with Caching" §5.2, Figure 5): by-request-aggregated sends a stage as one buffer (one
# send per request), by-request one send per layer, K or V, and block (2 x layers x blocks).
# by-layer streams each layer's KV while the prefill computes it (layers.py), then sends the rest as
# by-request-aggregated does.
Layout = Literal["by-request-aggregated", "by-request", "by-layer"]
LAYOUTS: tuple[Layout, ...] = ("by-request-aggregated", "by-request", "by-layer")


@dataclass(frozen=True)
class Transfer:
    """A disaggregated hand-over (docs/disaggregation.md) rather than a MELL move: the request has just
    been prefilled here, so it is stopped at once and its KV sent in one stage (a prefill worker does not
    decode while it copies), in `layout`; `return_to` is this worker's migration address when the
    decode worker is to send the decode phase's KV back at the request's end (PD-Caching-3)."""

    layout: Layout = "by-request-aggregated"
    return_to: str | None = None


class SourceGone(MigrationError):
    """The request finished or lost its KV on the source: nothing to move, nothing to roll back."""


class SourceRun:
    """One migration from this worker, step by step."""

    def __init__(self, host: Host, transport: Transport, clock: Callable[[], float], ticket: Ticket,
                 target: HandoffTarget, migration_address: str, mode: MoveMode, kv_bytes_limit: int | None = None,
                 transfer: Transfer | None = None, prepared: Prepared | None = None) -> None:
        self.host = host
        self.transport = transport
        self.clock = clock
        self.kv_bytes_limit = kv_bytes_limit
        self.transfer = transfer
        # A by-layer hand-over's channel, its prompt's KV streamed already (layers.py).
        self.prepared = prepared
        # Leading blocks the target holds in its prefix cache already (its hello): never sent.
        self.cached_blocks = 0
        self.sends = 0
        self.engine = host.engine
        # None: this engine cannot export KV, so the request moves by its tokens (abort here, re-prefill there).
        self.migration: KVMigratable | None = self.engine.capabilities.migration
        self.ticket = ticket
        self.request_id = ticket.request_id
        self.target = target
        self.address = migration_address
        self.mode = mode
        self.channel: Channel | None = None
        # The target's KV format (from its hello), when KV moves.
        self.target_format: KVFormat | None = None
        self.stopped = False
        self.handed: HandedRequest | None = None
        self.bytes_moved = 0
        self.copy_s = 0.0
        self.notes: list[str] = []
        self.stopped_at = 0.0
        # Set by _stop: the sampling parameters the engine ran with (with the seed it drew, if it suspended).
        self.params: SamplingParams | None = None

    def _result(self, succeeded: bool, message: str, **kw: Any) -> MigrationResult:
        link = self.bytes_moved / self.copy_s if self.copy_s > 0 and self.bytes_moved else None
        text = "; ".join([*self.notes, message]) if message else "; ".join(self.notes)
        return MigrationResult(self.request_id, succeeded, self.mode, bytes_moved=self.bytes_moved if succeeded else 0,
                               message=text, link_bytes_per_s=link, sends=self.sends, cached_blocks=self.cached_blocks,
                               **kw)

    async def _reply(self) -> dict[str, Any]:
        assert self.channel is not None
        frame = await self.channel.recv(REPLY_TIMEOUT_S)
        if not frame.header.get("ok"):
            raise TargetError(str(frame.header.get("error", "refused")))
        return frame.header

    async def go(self) -> MigrationResult:
        live = self.host.live_request(self.request_id)
        if live is None:
            self.host.handoffs.done(self.ticket, None)
            return self._result(False, "the request is not running on the source (finished, or never here)")
        try:
            hello = await self._open(live)
            self._fall_back_to_tokens(hello)
            # The target starts the request from the prefix its cache holds (PrefixKV.stage_prefix), in
            # every mode: KV stages begin after it, and a re-prefill computes only what lies past it.
            self.cached_blocks = int(hello.get("cached_blocks") or 0)
            sent_block = self.cached_blocks
            if self.prepared is not None and self.mode == MoveMode.KV:
                sent_block = max(sent_block, self.prepared.streamed_block)
            if self.mode != MoveMode.TOKEN and self.transfer is None:
                sent_block = await self._precopy(sent_block)
            await self._stop(live)
            if self.mode == MoveMode.KV:
                await self._send_stage(sent_block)
            return await self._commit()
        except (TransportError, TargetError, MigrationError, HandoffError, EngineError) as err:
            reason = _describe(err)
            await self.roll_back(reason)
            if isinstance(err, SourceGone):
                return self._result(False, str(err))
            return self._result(False, reason + ("; the request keeps running on the source" if self.stopped else ""))

    async def _open(self, live: LiveRequest) -> dict[str, Any]:
        """The channel and the target's hello: a by-layer stream's, once the target confirms it wrote
        every part (`layers_done`), or a new one."""
        prepared = self.prepared
        if prepared is not None:
            self.channel = prepared.channel
            if not prepared.hello.get("ok"):
                raise TargetError(str(prepared.hello.get("error", "refused")))
            await self.channel.send({"op": "layers_done"})
            await self._reply()
            return prepared.hello
        self.channel = await self.transport.connect(self.address, CONNECT_TIMEOUT_S)
        await self.channel.send(self._begin(live))
        return await self._reply()

    def _begin(self, live: LiveRequest) -> dict[str, Any]:
        """The `begin` frame: with the prompt, for the target to find its cached prefix, where the target
        caches by blocks of this engine's size; with where to send the KV back, for a transfer."""
        begin: dict[str, Any] = {"op": "begin", "request_id": self.request_id, "mode": str(self.mode),
                                 "prefix": {"tokens": list(live.prompt_token_ids),
                                            "block_size_tokens": self.engine.info.block_size_tokens}}
        if self.transfer is not None and self.transfer.return_to is not None:
            begin["return_to"] = self.transfer.return_to
        return begin

    def _fall_back_to_tokens(self, hello: dict[str, Any]) -> None:
        """Token mode where a KV mode cannot run: an engine without KV migration, or no KV to copy."""
        if self.mode == MoveMode.TOKEN:
            return
        reason = self._kv_refusal(hello)
        if reason is not None:
            self.notes.append(f"{self.mode} mode needs KV migration on both sides ({reason}): moved as tokens")
            self.mode = MoveMode.TOKEN
        elif not any(r.request_id == self.request_id for r in self.engine.kv_usage()):
            # Queued for blocks, or preempted: there is no KV to copy, and its tokens are all it has.
            self.notes.append(f"{self.mode} mode asked, but the request holds no KV on the source (queued "
                              "or preempted): moved as tokens")
            self.mode = MoveMode.TOKEN

    def _kv_refusal(self, hello: dict[str, Any]) -> str | None:
        """Why KV cannot move from this engine to the target's, or None; keeps the target's format."""
        if self.migration is None:
            return f"the source runs {self.engine.info.engine}, which cannot export or import KV"
        if not hello.get("kv"):
            refusal = hello.get("kv_refusal")
            engine = hello.get("engine")
            return f"the target runs {engine}: {refusal}" if refusal else \
                f"the target runs {engine}, which cannot export or import KV"
        try:
            here = self.migration.kv_format()
        except MigrationError as err:
            return f"the source cannot move KV: {err}"
        # A target that states no format predates formats: it takes blocks like ours, as all did then.
        self.target_format = KVFormat.from_json(hello["kv_format"]) if "kv_format" in hello else here
        return kv_format_mismatch(here, self.target_format)

    async def _precopy(self, sent_block: int) -> int:
        """KV stages from `sent_block` while the request decodes; returns the first block not sent."""
        limit_blocks = None
        if self.mode == MoveMode.HYBRID and self.kv_bytes_limit is not None:
            info = self.engine.info
            limit_blocks = self.kv_bytes_limit // (info.block_size_tokens * info.kv_bytes_per_token)
        for _ in range(MAX_STAGES):
            room = None if limit_blocks is None else limit_blocks - sent_block
            if room is not None and room <= 0:
                break
            num_blocks = await self._send_stage(sent_block, max_blocks=room)
            sent_block += num_blocks
            if self.mode == MoveMode.HYBRID or num_blocks <= LAST_STAGE_MAX_BLOCKS:
                break
        return sent_block

    async def _send_stage(self, first_block: int, max_blocks: int | None = None) -> int:
        migration, channel = self.migration, self.channel
        assert migration is not None and channel is not None  # KV modes only run with the capability
        try:
            kv = await migration.export_kv(self.request_id, first_block=first_block)
        except MigrationError as err:
            raise SourceGone(f"the source has no KV to copy (finished or preempted): {err}") from None
        if max_blocks is not None and kv.num_blocks > max_blocks:
            # The planner's share of the link for this move (hybrid): the blocks past it are re-prefilled.
            kv = dataclasses.replace(kv, data=kv.data[:, :, :max_blocks].contiguous(),
                                     num_tokens=min(kv.num_tokens, max_blocks * kv.block_size_tokens))
        if kv.num_blocks == 0:
            return 0
        sent = kv.num_blocks
        target = self.target_format
        if target is not None and not target.any_block_size:
            kv = split_blocks(kv, target.block_size_tokens)
        by_request = self.transfer is not None and self.transfer.layout == "by-request"
        await channel.send({**stage_header(kv), **({"parts": kv_parts(kv.data)} if by_request else {})})
        await self._reply()  # the destination reserved the blocks
        started = self.clock()
        if by_request:
            for part in split_parts(kv.data):
                await channel.send({"op": "data"}, as_bytes(part))
                self.sends += 1
        else:
            await channel.send({"op": "data"}, as_bytes(kv.data))
            self.sends += 1
        await self._reply()
        self.copy_s += self.clock() - started
        self.bytes_moved += kv.nbytes
        return sent

    async def _stop(self, live: LiveRequest) -> None:
        """Stops the request on the source and waits until its agent stream has sent every token."""
        self.ticket.stopping = True
        params = live.params
        state: SuspendedRequest | None = None
        if self.migration is not None:
            try:
                state = await self.migration.suspend(self.request_id)
            except MigrationError as err:
                raise SourceGone(f"the source did not stop the request: {err}") from None
            params = self.params = state.params
            self.stopped_at = self.clock()
            self.stopped = True
        else:
            # Without the capability the engine cannot keep a stopped request: it aborts it, and the
            # agent's stream, seeing the ticket, takes that abort for the hand-over.
            await self.engine.abort(self.request_id)
            self.stopped_at = self.clock()
        try:
            position = await asyncio.wait_for(asyncio.shield(self.ticket.stopped), STOP_TIMEOUT_S)
        except TimeoutError:
            position = None
        if position is None:
            raise SourceGone("the request finished on the source before it could be handed over")
        self.stopped = True
        if state is not None and tuple(state.output_token_ids) != position.output_token_ids:
            raise MigrationError(f"the engine holds {len(state.output_token_ids)} output tokens but the stream sent "
                                 f"{len(position.output_token_ids)}")
        self.handed = HandedRequest(self.request_id, tuple(live.prompt_token_ids), position.output_token_ids, params,
                                    live.stops, live.created, live.model, position.text, include_stop=live.include_stop)

    async def _commit(self) -> MigrationResult:
        assert self.channel is not None and self.handed is not None
        handed = self.handed
        await self.channel.send({"op": "commit", "handed": handed.to_json()})
        reply = await self._reply()
        downtime_s = self.clock() - self.stopped_at
        if self.migration is not None:
            self.migration.release(self.request_id)
        index = len(handed.output_token_ids)
        self.host.handoffs.done(self.ticket, Moved(self.request_id, self.target, index))
        self.host.nudge_reporter()
        self.channel.close()
        tokens = len(handed.prompt_token_ids) + index
        self.notes += [str(note) for note in reply.get("notes") or ()]
        first_output_s = float(reply.get("first_output_s") or 0)
        prefilled = int(reply.get("prefilled_tokens") or 0)
        rate = prefilled / first_output_s if first_output_s > 0 and prefilled > MIN_PREFILL_SAMPLE_TOKENS else None
        return self._result(True, f"moved to {self.target.pod} in {self.mode} mode", tokens_moved=tokens,
                            downtime_s=downtime_s, prefill_tokens_per_s=rate)

    async def roll_back(self, reason: str) -> None:
        """Leaves the request running on the source and frees what the destination holds for it."""
        channel, self.channel = self.channel, None
        if channel is not None:
            try:
                await asyncio.wait_for(channel.send({"op": "abort", "reason": reason}), 1.0)
            except (TransportError, TimeoutError, OSError):
                pass  # the destination also frees its reservations when the connection drops
            channel.close()
        handoffs = self.host.handoffs
        if not self.stopped or self.handed is None:
            if self.stopped and self.migration is not None:
                # Stopped but not flushed (no position): give the request back to itself from its KV.
                await self._resume_here_from_engine(self.migration)
                return
            handoffs.done(self.ticket, None)
            return
        if self.ticket.abandoned:
            if self.migration is not None:
                self.migration.release(self.request_id)
            handoffs.done(self.ticket, None)
            return
        try:
            stream = continue_on(self.engine, self.handed)
        except EngineError as err:
            log.error("rolling back %s failed: %s", self.request_id, err)
            handoffs.done(self.ticket, None)
            return
        handoffs.done(self.ticket, Continue(stream))

    async def _resume_here_from_engine(self, migration: KVMigratable) -> None:
        handoffs = self.host.handoffs
        try:
            position = await asyncio.wait_for(asyncio.shield(self.ticket.stopped), STOP_TIMEOUT_S)
        except TimeoutError:
            position = None
        live = self.host.live_request(self.request_id)
        if position is None or live is None or self.ticket.abandoned:
            migration.release(self.request_id)
            handoffs.done(self.ticket, None)
            return
        handed = HandedRequest(self.request_id, tuple(live.prompt_token_ids), position.output_token_ids,
                               self.params or live.params, live.stops, live.created, live.model, position.text,
                               include_stop=live.include_stop)
        try:
            handoffs.done(self.ticket, Continue(continue_on(self.engine, handed)))
        except EngineError as err:
            log.error("rolling back %s failed: %s", self.request_id, err)
            migration.release(self.request_id)
            handoffs.done(self.ticket, None)


def _describe(err: Exception) -> str:
    if isinstance(err, TargetError):
        return f"the target refused: {err}"
    if isinstance(err, TransportError):
        return f"the target is unreachable: {err}"
    return str(err)
