"""Moves one running request to another worker: KV copy, token re-prefill, or both (hybrid).

The operator decides what moves where and how (a KVMigration's `spec.mode`, chosen by MELL's §V
planner); this module carries it out between two agents, over the transport (transport.py), keeping
the client's stream whole through the agent's hand-off (handoff.py). Modes:

- **kv** (Llumnix): copy the request's full KV blocks in stages while it keeps decoding on the
  source; the destination reserves each stage's blocks before the bytes move. When a stage finds at
  most `LAST_STAGE_MAX_BLOCKS` new full blocks, stop the request, send the rest (the partial block
  included), commit at the destination, release the source. The request is stopped only for the last
  stage and the commit: downtime does not grow with its length.
- **token**: stop the request, send its token ids; the destination re-prefills prompt + output.
- **hybrid**: one KV stage of the full blocks while the request runs, then stop and commit; the
  destination re-prefills only the tail the blocks do not cover.

KV modes need engines with the KV migration capability (engines/capabilities.py) on both sides, in
KV formats that agree (`kv_format_mismatch`): the builtin engine has it, and vLLM through kvfleet's KV
connector. Where either side lacks it, or the formats differ, the migration runs in token mode and
says why in its message (docs/migration.md).

What can go wrong, and what is left:
- the request holds no KV when the move starts (queued for blocks, or preempted): it moves by its
  tokens whatever the mode asked, and the status says so;
- the request finished, or the source preempted it during the copy: Failed, nothing changed on
  the source; the destination frees what it reserved;
- the destination is unreachable, refuses the token, or has no room: Failed; if the request was
  already stopped it resumes on the source from its own KV (rollback), so the client sees a pause;
- the connection dies or goes quiet: the destination frees its reservations
  (`PREALLOCATION_TIMEOUT_S`) and the source rolls back.

This module is the executor's front: `Executor` takes moves from the agent and the watcher and
connections from the transport. The parts behind it: source.py (the source's steps and rollbacks),
target.py (the destination's), wire.py (the frames between them), host.py (what it needs from the
agent), result.py (what it reports).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from kvfleet.mell.migration import MoveMode
from kvfleet.worker.distkv.lender import serve_lease
from kvfleet.worker.distkv.wire import LEND_OPS
from kvfleet.worker.migration import kv_return
from kvfleet.worker.migration.handoff import Adopted, HandoffError, HandoffTarget
from kvfleet.worker.migration.host import Host
from kvfleet.worker.migration.layers import LayerStream, Prepared
from kvfleet.worker.migration.result import MigrationMetrics, MigrationResult, TransferMetrics
from kvfleet.worker.migration.source import SourceRun, Transfer
from kvfleet.worker.migration.target import PREALLOCATION_TIMEOUT_S, TargetRun
from kvfleet.worker.migration.transport import Channel, Transport

__all__ = ["Executor", "MigrationMetrics", "MigrationResult", "Transfer", "TransferMetrics", "parse_mode"]

log = logging.getLogger(__name__)


def parse_mode(value: object) -> MoveMode | None:
    """The mode a KVMigration or an HTTP body names ("kv", "token", "hybrid"), or None for anything else."""
    if not isinstance(value, str):
        return None
    try:
        return MoveMode(value)
    except ValueError:
        return None


class Executor:
    """Runs migrations from this worker (source side) and takes them in (destination side)."""

    def __init__(self, host: Host, transport: Transport, metrics: MigrationMetrics,
                 clock: Callable[[], float] = time.monotonic, transfers: TransferMetrics | None = None) -> None:
        self._host = host
        self._transport = transport
        self.metrics = metrics
        self.transfers = transfers
        self._clock = clock
        self._returns: set[asyncio.Task[None]] = set()

    async def migrate(self, request_id: str, target: HandoffTarget, migration_address: str, mode: MoveMode,
                      kv_bytes_limit: int | None = None) -> MigrationResult:
        """Moves the request; never raises for what a migration can meet (the result says it).

        `kv_bytes_limit`: in hybrid mode, the KV bytes the planner gave this move's link (the
        KVMigration's expectedBytes): whole blocks up to it are copied, the rest is re-prefilled."""
        move_mode = parse_mode(mode)  # callers may hand on what a client wrote
        if move_mode is None:
            return MigrationResult(request_id, False, MoveMode.TOKEN, message=f"unknown mode {mode!r}")
        try:
            ticket = self._host.handoffs.begin(request_id)
        except HandoffError as err:
            return MigrationResult(request_id, False, move_mode, message=str(err))
        run = SourceRun(self._host, self._transport, self._clock, ticket, target, migration_address, move_mode,
                        kv_bytes_limit)
        try:
            result = await run.go()
        except asyncio.CancelledError:
            await run.roll_back("cancelled")
            raise
        self.metrics.record(result)
        level = logging.INFO if result.succeeded else logging.WARNING
        log.log(level, "migration of %s to %s (%s): %s; %d bytes, %d tokens, downtime %s", request_id, target.pod,
                result.mode, "succeeded" if result.succeeded else f"failed: {result.message}", result.bytes_moved,
                result.tokens_moved, "-" if result.downtime_s is None else f"{result.downtime_s * 1000:.1f} ms")
        return result

    def layer_stream(self, request_id: str, migration_address: str, prompt_token_ids: Sequence[int],
                     return_to: str | None) -> LayerStream | None:
        """A by-layer hand-over's stream of the request's prompt KV, started now (before its prefill);
        None when this engine cannot stream layers."""
        engine = self._host.engine
        layer_kv = engine.capabilities.layer_kv
        if layer_kv is None:
            return None
        stream = LayerStream(engine, layer_kv, self._transport, request_id, migration_address, prompt_token_ids,
                             return_to)
        stream.start()
        return stream

    async def transfer(self, request_id: str, target: HandoffTarget, migration_address: str,
                       transfer: Transfer, prepared: Prepared | None = None) -> MigrationResult:
        """Hands a request just prefilled here to a decode worker (docs/disaggregation.md): a KV move
        that stops it once connected and sends its KV in one stage; a transfer, not a migration (the
        caller counts it in `transfers`). Never raises for what it can meet; when it fails the request
        goes on here (rolled back)."""
        try:
            ticket = self._host.handoffs.begin(request_id)
        except HandoffError as err:
            result = MigrationResult(request_id, False, MoveMode.KV, message=str(err))
        else:
            run = SourceRun(self._host, self._transport, self._clock, ticket, target, migration_address, MoveMode.KV,
                            transfer=transfer, prepared=prepared)
            try:
                result = await run.go()
            except asyncio.CancelledError:
                await run.roll_back("cancelled")
                raise
        if result.succeeded:
            log.debug("handed %s to %s: %d bytes in %d sends, %d blocks cached there", request_id, target.pod,
                      result.bytes_moved, result.sends, result.cached_blocks)
        else:
            log.warning("hand-over of %s to %s failed: %s", request_id, target.pod, result.message)
        return result

    def host_has(self, request_id: str) -> bool:
        """Whether the request still runs on this worker (after a hand-over that did not land)."""
        return self._host.live_request(request_id) is not None

    async def serve(self, channel: Channel) -> None:
        """One incoming connection on the migration port, authenticated: a migration (`begin`), a
        finished request's KV for the prefix cache (`cache`), or a lease of this worker's KV blocks to a
        request running elsewhere (DistKV: `lend`)."""
        first = await channel.recv(PREALLOCATION_TIMEOUT_S)
        op = first.header.get("op")
        engine = self._host.engine
        if op in LEND_OPS:
            await serve_lease(engine.capabilities.lending, channel, first, engine.info.block_size_tokens)
        elif op == "cache":
            inserted = await kv_return.receive(engine, channel, first)
            if self.transfers is not None:
                self.transfers.received_blocks.inc(inserted)
        else:
            await TargetRun(self._host, self.metrics, self._clock, channel, self._return_at_end).go(first)

    def _return_at_end(self, adopted: Adopted, address: str) -> None:
        """A handed-over request whose prefill worker wants its KV back (PD-Caching-3): once it ends
        well here, what this worker's cache holds of it goes to `address`."""
        task = adopted.task
        if task is None:
            return
        handed = adopted.handed

        def ended(_: asyncio.Task[None]) -> None:
            last = adopted.entries[-1] if adopted.entries else None
            if adopted.moved is not None or last is None or last.finish_reason not in ("stop", "length"):
                return  # moved on, aborted or failed: its KV is not where this would read it
            tokens = [*handed.prompt_token_ids, *handed.output_token_ids,
                      *(t for entry in adopted.entries for t in entry.token_ids)]
            returning = asyncio.get_running_loop().create_task(self._send_back(address, tokens))
            self._returns.add(returning)
            returning.add_done_callback(self._returns.discard)

        task.add_done_callback(ended)

    async def _send_back(self, address: str, tokens: list[int]) -> None:
        result = await kv_return.send_back(self._host.engine, self._transport, address, tokens)
        if self.transfers is not None:
            self.transfers.returns.labels("sent" if result.sent else "failed").inc()
            self.transfers.returned_bytes.inc(result.bytes_sent)
        if result.sent:
            log.debug("sent %d blocks of a finished request's KV back to %s (%d taken in)", result.blocks_sent, address,
                      result.blocks_inserted)
        else:
            log.info("sending a finished request's KV back to %s failed: %s", address, result.message)
