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

KV modes need the builtin engine on both sides (it is the one that exports and imports blocks). Where
either side runs vLLM the migration runs in token mode and says so in its message: vLLM exposes no
running request's KV through its public API (docs/migration.md).

What can go wrong, and what is left:
- the request holds no KV when the move starts (queued for blocks, or preempted): it moves by its
  tokens whatever the mode asked, and the status says so;
- the request finished, or the source preempted it during the copy: Failed, nothing changed on
  the source; the destination frees what it reserved;
- the destination is unreachable, refuses the token, or has no room: Failed; if the request was
  already stopped it resumes on the source from its own KV (rollback), so the client sees a pause;
- the connection dies or goes quiet: the destination frees its reservations
  (`PREALLOCATION_TIMEOUT_S`) and the source rolls back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfleet.worker.engines.base import Engine, EngineError, SamplingParams, StepOutput
from kvfleet.worker.engines.builtin import BuiltinEngine, KVBlocks, MigrationError
from kvfleet.worker.migration.handoff import (
    Adopted,
    Continue,
    HandedRequest,
    HandoffError,
    Handoffs,
    HandoffTarget,
    LiveRequest,
    Moved,
    Ticket,
)
from kvfleet.worker.migration.transport import Channel, Transport, TransportError

log = logging.getLogger(__name__)

Mode = Literal["kv", "token", "hybrid"]
MODES: tuple[Mode, ...] = ("kv", "token", "hybrid")
# The last stage starts when a stage found this many new full blocks or fewer (Llumnix stops at a
# few): small enough that the stopped part of a copy is a blink, large enough to end in ~2 stages.
LAST_STAGE_MAX_BLOCKS = 2
# A request that decodes faster than the link copies would never converge: stop after this many.
MAX_STAGES = 8
# The destination frees reserved blocks when the source says nothing for this long.
PREALLOCATION_TIMEOUT_S = 30.0
# How long a reply (a stage written, a commit done) may take before the source gives up.
REPLY_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
# How long the source waits for its own agent to flush the request's last tokens after stopping it.
STOP_TIMEOUT_S = 10.0


class TargetError(Exception):
    """The destination refused or failed a step (its message says why)."""


@dataclass(frozen=True)
class MigrationResult:
    """What a migration did, in the units KVMigration.status reports."""

    request_id: str
    succeeded: bool
    mode: Mode
    bytes_moved: int = 0
    tokens_moved: int = 0
    downtime_s: float | None = None
    message: str = ""
    # Measured on the way: KV payload bytes per second over the link, and the destination's
    # re-prefill speed (tokens per second) for the tokens it recomputed.
    link_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"requestId": self.request_id, "phase": "Succeeded" if self.succeeded else "Failed", "mode": self.mode,
                "bytesMoved": self.bytes_moved, "tokensMoved": self.tokens_moved, "downtimeSeconds": self.downtime_s,
                "message": self.message, "linkBytesPerSecond": self.link_bytes_per_s,
                "prefillTokensPerSecond": self.prefill_tokens_per_s}


class Host(Protocol):
    """What the executor needs from the agent it runs in."""

    @property
    def engine(self) -> Engine: ...

    @property
    def handoffs(self) -> Handoffs: ...

    def live_request(self, request_id: str) -> LiveRequest | None: ...

    def adopt(self, handed: HandedRequest, stream: AsyncIterator[StepOutput]) -> Adopted: ...

    def incoming(self, request_id: str, arriving: bool) -> None:
        """A migration towards this worker starts (True) or ends (False): keep it out of the reports."""
        ...

    def nudge_reporter(self) -> None: ...

    def accepts_migrations(self) -> bool:
        """False while loading or draining: a worker about to stop takes no request in."""
        ...


class MigrationMetrics:
    """The executor's Prometheus metrics, and the measured inputs of MELL's §V planner."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.migrations = Counter("kvfleet_worker_migrations", "Migrations this worker ran as the source, by mode and result.",
                                  ["mode", "result"], registry=r)
        self.bytes = Counter("kvfleet_worker_migration_bytes", "KV bytes sent by migrations.", registry=r)
        self.downtime = Histogram("kvfleet_worker_migration_downtime_seconds",
                                  "Time a migrated request made no progress (stop at the source to first token at the target).",
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.link = Gauge("kvfleet_worker_migration_link_bytes_per_second",
                          "KV bytes per second of the last migration copy (the planner's link bandwidth).", registry=r)
        self.prefill = Gauge("kvfleet_worker_migration_prefill_tokens_per_second",
                             "Re-prefill speed of the last request migrated here (the planner's computation rate).",
                             registry=r)

    def record(self, result: MigrationResult) -> None:
        self.migrations.labels(result.mode, "Succeeded" if result.succeeded else "Failed").inc()
        self.bytes.inc(result.bytes_moved)
        if result.downtime_s is not None:
            self.downtime.observe(result.downtime_s)
        if result.link_bytes_per_s is not None:
            self.link.set(result.link_bytes_per_s)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy (any dtype, bfloat16 included)."""
    array: Any = tensor.contiguous().view(-1).view(torch.uint8).numpy()
    return memoryview(array)


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise TargetError(f"unknown dtype {name!r}")
    return value


def continue_on(engine: Engine, handed: HandedRequest) -> AsyncIterator[StepOutput]:
    """The request's continuation on this engine: from KV held here (builtin), else by re-prefill.

    vLLM has no resume: the request goes in as a new one whose prompt is prompt + output so far, with
    the rest of the output budget, which under greedy decoding gives the same tokens.
    """
    if isinstance(engine, BuiltinEngine):
        return engine.resume(handed.request_id, handed.prompt_token_ids, handed.output_token_ids, handed.params)
    remaining = handed.params.max_tokens - len(handed.output_token_ids)
    if remaining < 1:
        raise MigrationError(f"request {handed.request_id!r} already has all its {handed.params.max_tokens} tokens")
    return engine.generate(handed.request_id, [*handed.prompt_token_ids, *handed.output_token_ids],
                           replace(handed.params, max_tokens=remaining))


class Executor:
    """Runs migrations from this worker (source side) and takes them in (destination side)."""

    def __init__(self, host: Host, transport: Transport, metrics: MigrationMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._host = host
        self._transport = transport
        self.metrics = metrics
        self._clock = clock

    # ======================================================================= the source's side

    async def migrate(self, request_id: str, target: HandoffTarget, migration_address: str, mode: Mode,
                      kv_bytes_limit: int | None = None) -> MigrationResult:
        """Moves the request; never raises for what a migration can meet (the result says it).

        `kv_bytes_limit`: in hybrid mode, the KV bytes the planner gave this move's link (the
        KVMigration's expectedBytes): whole blocks up to it are copied, the rest is re-prefilled."""
        if mode not in MODES:
            return MigrationResult(request_id, False, "token", message=f"unknown mode {mode!r}")
        try:
            ticket = self._host.handoffs.begin(request_id)
        except HandoffError as err:
            return MigrationResult(request_id, False, mode, message=str(err))
        run = _SourceRun(self, ticket, target, migration_address, mode, kv_bytes_limit)
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

    # ================================================================== the destination's side

    async def serve(self, channel: Channel) -> None:
        """One incoming migration on an authenticated channel."""
        host = self._host
        engine = host.engine
        frame = await channel.recv(PREALLOCATION_TIMEOUT_S)
        if frame.header.get("op") != "begin":
            await channel.send({"ok": False, "error": "expected begin"})
            return
        request_id = str(frame.header.get("request_id", ""))
        if not host.accepts_migrations():
            await channel.send({"ok": False, "error": "this worker is not ready or is shutting down"})
            return
        if request_id in {r.request_id for r in engine.kv_usage()} or host.live_request(request_id) is not None:
            await channel.send({"ok": False, "error": f"request {request_id!r} is already on this worker"})
            return
        kv_capable = isinstance(engine, BuiltinEngine)
        info = engine.info
        await channel.send({"ok": True, "engine": info.engine, "kv": kv_capable, "block_size_tokens": info.block_size_tokens,
                            "kv_bytes_per_token": info.kv_bytes_per_token})
        committed = False
        host.incoming(request_id, True)
        try:
            while True:
                frame = await channel.recv(PREALLOCATION_TIMEOUT_S)
                op = frame.header.get("op")
                if op == "stage" and isinstance(engine, BuiltinEngine):
                    await self._receive_stage(channel, engine, request_id, frame.header, frame.payload_nbytes)
                elif op == "commit":
                    committed = await self._commit(channel, request_id, frame.header)
                    return
                elif op == "abort":
                    log.info("migration of %s here abandoned by the source: %s", request_id, frame.header.get("reason", ""))
                    return
                else:
                    await channel.send({"ok": False, "error": f"unexpected {op!r}"})
                    return
        finally:
            host.incoming(request_id, False)
            if not committed and isinstance(engine, BuiltinEngine):
                try:
                    engine.release(request_id)  # reserved and imported blocks of a migration that will not land
                except MigrationError as err:
                    log.warning("freeing the KV staged for %s: %s", request_id, err)
                host.nudge_reporter()

    async def _receive_stage(self, channel: Channel, engine: BuiltinEngine, request_id: str, header: dict[str, Any],
                             payload_nbytes: int) -> None:
        shape = tuple(int(d) for d in header["shape"])
        first_block, num_blocks = int(header["first_block"]), int(shape[2])
        try:
            engine.reserve_kv(request_id, first_block + num_blocks)
        except EngineError as err:
            await channel.send({"ok": False, "error": str(err)})
            raise TargetError(str(err)) from None
        await channel.send({"ok": True})
        frame = await channel.recv(PREALLOCATION_TIMEOUT_S)
        if frame.header.get("op") != "data":
            raise TargetError(f"expected the stage's data, got {frame.header.get('op')!r}")
        data = torch.empty(shape, dtype=_dtype(str(header["dtype"])))
        await channel.read_payload(frame.payload_nbytes, _as_bytes(data))
        kv = KVBlocks(request_id, first_block, int(header["num_tokens"]), int(header["block_size_tokens"]), data)
        try:
            await engine.import_kv(request_id, kv)
        except EngineError as err:
            await channel.send({"ok": False, "error": str(err)})
            raise TargetError(str(err)) from None
        await channel.send({"ok": True})

    async def _commit(self, channel: Channel, request_id: str, header: dict[str, Any]) -> bool:
        handed = HandedRequest.from_json(header["handed"])
        engine = self._host.engine
        held_tokens = next((r.tokens for r in engine.kv_usage() if r.request_id == request_id), 0)
        started = self._clock()
        try:
            stream = continue_on(engine, handed)
        except EngineError as err:
            await channel.send({"ok": False, "error": str(err)})
            return False
        adopted = self._host.adopt(handed, stream)
        # The reply waits for the first token here, so the source measures the whole pause.
        try:
            await asyncio.wait_for(adopted.first_output.wait(), REPLY_TIMEOUT_S)
        except TimeoutError:
            pass
        elapsed_s = self._clock() - started
        total = len(handed.prompt_token_ids) + len(handed.output_token_ids)
        prefilled = max(1, total - min(held_tokens, total - 1))
        prefill_rate = prefilled / elapsed_s if elapsed_s > 0 else None
        if prefill_rate is not None and prefilled > 16:  # a one-token resume measures a decode step, not prefill
            self.metrics.prefill.set(prefill_rate)
        try:
            await channel.send({"ok": True, "prefilled_tokens": prefilled, "first_output_s": elapsed_s})
        except TransportError:
            # The source cannot know we took it and will resume it itself: one of the two must go.
            if adopted.task is not None:
                adopted.task.cancel()
            raise
        self._host.nudge_reporter()
        return True


class _SourceRun:
    """One migration from this worker, step by step."""

    def __init__(self, executor: Executor, ticket: Ticket, target: HandoffTarget, migration_address: str,
                 mode: Mode, kv_bytes_limit: int | None = None) -> None:
        self.x = executor
        self.kv_bytes_limit = kv_bytes_limit
        self.host = executor._host
        self.engine = self.host.engine
        self.ticket = ticket
        self.request_id = ticket.request_id
        self.target = target
        self.address = migration_address
        self.mode: Mode = mode
        self.channel: Channel | None = None
        self.stopped = False
        self.handed: HandedRequest | None = None
        self.bytes_moved = 0
        self.copy_s = 0.0
        self.notes: list[str] = []
        self.stopped_at = 0.0
        # Set by _stop: the sampling parameters the engine ran with (the builtin's with its drawn seed).
        self.params: SamplingParams | None = None

    def _result(self, succeeded: bool, message: str, **kw: Any) -> MigrationResult:
        link = self.bytes_moved / self.copy_s if self.copy_s > 0 and self.bytes_moved else None
        text = "; ".join([*self.notes, message]) if message else "; ".join(self.notes)
        return MigrationResult(self.request_id, succeeded, self.mode, bytes_moved=self.bytes_moved if succeeded else 0,
                               message=text, link_bytes_per_s=link, **kw)

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
            self.channel = await self.x._transport.connect(self.address, CONNECT_TIMEOUT_S)
            await self.channel.send({"op": "begin", "request_id": self.request_id, "mode": self.mode})
            hello = await self._reply()
            kv_here = isinstance(self.engine, BuiltinEngine)
            if self.mode != "token" and not (kv_here and hello.get("kv")):
                side = "source" if not kv_here else "target"
                self.notes.append(f"{self.mode} mode needs the builtin engine on both sides (the {side} runs "
                                  f"{self.engine.info.engine if not kv_here else hello.get('engine')}): moved as tokens")
                self.mode = "token"
            if self.mode != "token" and not any(r.request_id == self.request_id for r in self.engine.kv_usage()):
                # Queued for blocks, or preempted: there is no KV to copy, and its tokens are all it has.
                self.notes.append(f"{self.mode} mode asked, but the request holds no KV on the source (queued "
                                  "or preempted): moved as tokens")
                self.mode = "token"
            sent_block = await self._precopy() if self.mode != "token" else 0
            await self._stop(live)
            if self.mode == "kv":
                await self._send_stage(sent_block)
            return await self._commit()
        except (TransportError, TargetError, MigrationError, HandoffError, EngineError) as err:
            reason = _describe(err)
            await self.roll_back(reason)
            if isinstance(err, _SourceGone):
                return self._result(False, str(err))
            return self._result(False, reason + ("; the request keeps running on the source" if self.stopped else ""))

    async def _precopy(self) -> int:
        """KV stages while the request decodes; returns the first block not sent."""
        assert isinstance(self.engine, BuiltinEngine)
        limit_blocks = None
        if self.mode == "hybrid" and self.kv_bytes_limit is not None:
            info = self.engine.info
            limit_blocks = self.kv_bytes_limit // (info.block_size_tokens * info.kv_bytes_per_token)
        sent_block = 0
        for _ in range(MAX_STAGES):
            room = None if limit_blocks is None else limit_blocks - sent_block
            if room is not None and room <= 0:
                break
            num_blocks = await self._send_stage(sent_block, max_blocks=room)
            sent_block += num_blocks
            if self.mode == "hybrid" or num_blocks <= LAST_STAGE_MAX_BLOCKS:
                break
        return sent_block

    async def _send_stage(self, first_block: int, max_blocks: int | None = None) -> int:
        assert isinstance(self.engine, BuiltinEngine) and self.channel is not None
        try:
            kv = await self.engine.export_kv(self.request_id, first_block=first_block)
        except MigrationError as err:
            raise _SourceGone(f"the source has no KV to copy (finished or preempted): {err}") from None
        if max_blocks is not None and kv.num_blocks > max_blocks:
            # The planner's share of the link for this move (hybrid): the blocks past it are re-prefilled.
            kv = dataclasses.replace(kv, data=kv.data[:, :, :max_blocks].contiguous(),
                                     num_tokens=min(kv.num_tokens, max_blocks * kv.block_size_tokens))
        if kv.num_blocks == 0:
            return 0
        await self.channel.send({"op": "stage", "first_block": kv.first_block, "num_tokens": kv.num_tokens,
                                 "block_size_tokens": kv.block_size_tokens, "shape": list(kv.data.shape),
                                 "dtype": str(kv.data.dtype)})
        await self._reply()  # the destination reserved the blocks
        started = self.x._clock()
        await self.channel.send({"op": "data"}, _as_bytes(kv.data))
        await self._reply()
        self.copy_s += self.x._clock() - started
        self.bytes_moved += kv.nbytes
        return kv.num_blocks

    async def _stop(self, live: LiveRequest) -> None:
        """Stops the request on the source and waits until its agent stream has sent every token."""
        self.ticket.stopping = True
        engine = self.engine
        params = live.params
        if isinstance(engine, BuiltinEngine):
            try:
                state = await engine.suspend(self.request_id)
            except MigrationError as err:
                raise _SourceGone(f"the request is no longer running on the source: {err}") from None
            params = self.params = state.params
            self.stopped_at = self.x._clock()
            self.stopped = True
        else:
            await engine.abort(self.request_id)
            self.stopped_at = self.x._clock()
        try:
            position = await asyncio.wait_for(asyncio.shield(self.ticket.stopped), STOP_TIMEOUT_S)
        except TimeoutError:
            position = None
        if position is None:
            raise _SourceGone("the request finished on the source before it could be handed over")
        self.stopped = True
        if isinstance(engine, BuiltinEngine) and tuple(state.output_token_ids) != position.output_token_ids:
            raise MigrationError(f"the engine holds {len(state.output_token_ids)} output tokens but the stream sent "
                                 f"{len(position.output_token_ids)}")
        self.handed = HandedRequest(self.request_id, tuple(live.prompt_token_ids), position.output_token_ids, params,
                                    live.stops, live.created, live.model, position.text)

    async def _commit(self) -> MigrationResult:
        assert self.channel is not None and self.handed is not None
        handed = self.handed
        await self.channel.send({"op": "commit", "handed": handed.to_json()})
        reply = await self._reply()
        downtime_s = self.x._clock() - self.stopped_at
        if isinstance(self.engine, BuiltinEngine):
            self.engine.release(self.request_id)
        index = len(handed.output_token_ids)
        self.host.handoffs.done(self.ticket, Moved(self.request_id, self.target, index))
        self.host.nudge_reporter()
        self.channel.close()
        tokens = len(handed.prompt_token_ids) + index
        first_output_s = float(reply.get("first_output_s") or 0)
        prefilled = int(reply.get("prefilled_tokens") or 0)
        rate = prefilled / first_output_s if first_output_s > 0 and prefilled > 16 else None
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
            if self.stopped and isinstance(self.engine, BuiltinEngine):
                # Stopped but not flushed (no position): give the request back to itself from its KV.
                await self._resume_here_from_engine()
                return
            handoffs.done(self.ticket, None)
            return
        if self.ticket.abandoned:
            if isinstance(self.engine, BuiltinEngine):
                self.engine.release(self.request_id)
            handoffs.done(self.ticket, None)
            return
        try:
            stream = continue_on(self.engine, self.handed)
        except EngineError as err:
            log.error("rolling back %s failed: %s", self.request_id, err)
            handoffs.done(self.ticket, None)
            return
        handoffs.done(self.ticket, Continue(stream))

    async def _resume_here_from_engine(self) -> None:
        assert isinstance(self.engine, BuiltinEngine)
        handoffs = self.host.handoffs
        try:
            position = await asyncio.wait_for(asyncio.shield(self.ticket.stopped), STOP_TIMEOUT_S)
        except TimeoutError:
            position = None
        live = self.host.live_request(self.request_id)
        if position is None or live is None or self.ticket.abandoned:
            self.engine.release(self.request_id)
            handoffs.done(self.ticket, None)
            return
        handed = HandedRequest(self.request_id, tuple(live.prompt_token_ids), position.output_token_ids,
                               self.params or live.params, live.stops, live.created, live.model, position.text)
        try:
            handoffs.done(self.ticket, Continue(continue_on(self.engine, handed)))
        except EngineError as err:
            log.error("rolling back %s failed: %s", self.request_id, err)
            self.engine.release(self.request_id)
            handoffs.done(self.ticket, None)


class _SourceGone(MigrationError):
    """The request finished or lost its KV on the source: nothing to move, nothing to roll back."""


def _describe(err: Exception) -> str:
    if isinstance(err, TargetError):
        return f"the target refused: {err}"
    if isinstance(err, TransportError):
        return f"the target is unreachable: {err}"
    return str(err)


