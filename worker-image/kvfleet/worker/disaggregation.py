"""A worker's part in a disaggregated pool: prefill a request, then hand it to a decode worker.

"MemServe: Flexible Mem Pool for Building Disaggregated LLM Serving with Caching" §5 (Figure 4):
prefill workers compute prompts, decode workers generate, and KV crosses between them per request.
The router picks both workers and sends the request to the prefill worker with the decode worker
named in `X-Kvfleet-Decode-Target` (kvfleet.serving.httpapi.DecodeTarget). Once the prompt is
prefilled and the first token streamed, the worker hands the request over on the migration
transport (the executor's `transfer`: stop at once, the KV in one stage, minus the blocks the decode
worker's cache holds), and its router-mode stream ends with the usual `kvfleet.migrated` event, which
the router follows to the decode worker: the client sees one stream. When no decode worker takes it
the request decodes here (counted). The caching milestones are the pool's (`KVFLEET_PD_CACHING`):
with `full` the decode worker sends the decode phase's KV back here at the end (PD-Caching-3).

The role itself changes nothing else in the worker: any worker honours the header, so the router may
also prefill a request on its decode worker (no hand-over) when its cost model says that is sooner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvfleet.api.models import Role
from kvfleet.serving.httpapi import DecodeTarget
from kvfleet.worker.migration.executor import Executor, TransferMetrics
from kvfleet.worker.migration.handoff import HandoffTarget
from kvfleet.worker.migration.layers import LayerStream
from kvfleet.worker.migration.source import Layout, Transfer
from kvfleet.worker.migration.transport import MIGRATION_PORT, split_address

log = logging.getLogger(__name__)

Caching = Literal["none", "prefill", "decode", "full"]
CACHINGS: tuple[Caching, ...] = ("none", "prefill", "decode", "full")


@dataclass(frozen=True)
class PDConfig:
    """This worker's role in a disaggregated pool (None: a colocated pool), the pool's caching milestone
    and transfer layout (the LLMPool's spec.disaggregation, passed by the operator in the environment,
    which the worker's command line reads: `--role`, `--pd-caching`, `--pd-layout`)."""

    role: Role | None = None
    caching: Caching = "full"
    layout: Layout = "by-request-aggregated"


class HandOvers:
    """Starts the hand-overs of this worker's requests to decode workers, one task each."""

    def __init__(self, config: PDConfig, executor: Executor, own_migration_address: str | None,
                 migration_port: int = MIGRATION_PORT) -> None:
        self.config = config
        self.executor = executor
        # Where the decode phase's KV comes back to (PD-Caching-3); None: it cannot come back.
        self.own_migration_address = own_migration_address
        self.migration_port = migration_port
        self._tasks: set[asyncio.Task[None]] = set()
        # By-layer hand-overs whose prompt KV is streaming to their first decode worker.
        self._streams: dict[str, LayerStream] = {}

    def prepare(self, request_id: str, prompt_token_ids: Sequence[int], targets: tuple[DecodeTarget, ...]) -> None:
        """Before the request's prefill: under the by-layer layout, start streaming its prompt's KV to the
        first decode worker as the prefill computes it (migration/layers.py)."""
        if self.config.layout != "by-layer" or not targets or request_id in self._streams:
            return
        stream = self.executor.layer_stream(request_id, self._migration_address(targets[0]), prompt_token_ids,
                                            self._return_to())
        if stream is not None:
            self._streams[request_id] = stream

    def _return_to(self) -> str | None:
        return self.own_migration_address if self.config.caching == "full" else None

    def start(self, request_id: str, targets: tuple[DecodeTarget, ...]) -> None:
        """Hands the request over in the background, to the first of `targets` (best first) that takes
        it; its stream ends with the hand-off event when it lands, or it keeps decoding here."""
        transfer = Transfer(self.config.layout, self._return_to())
        stream = self._streams.pop(request_id, None)

        async def run() -> None:
            prepared = await stream.finish() if stream is not None else None
            if stream is not None:
                self.metrics.layer_parts.inc(stream.parts_sent)
                self.metrics.bytes.inc(stream.bytes_sent)
            result = None
            for attempt, target in enumerate(targets):
                if attempt:
                    self.metrics.alternates.inc()
                result = await self.executor.transfer(request_id, HandoffTarget(target.pod, target.address),
                                                      self._migration_address(target), transfer,
                                                      prepared if attempt == 0 else None)
                # Refused or unreachable (no room, gone): the next decode worker. A request that ended,
                # or was lost, while it was being handed over has nothing left to hand.
                if result.succeeded or not self.executor.host_has(request_id):
                    break
            if result is not None:
                self.metrics.record(self.config.layout, result)

        task = asyncio.get_running_loop().create_task(run(), name=f"kvfleet-handover-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _migration_address(self, target: DecodeTarget) -> str:
        if target.migration_address:
            return target.migration_address
        host, _ = split_address(target.address)
        return f"{host}:{self.migration_port}"

    @property
    def metrics(self) -> TransferMetrics:
        assert self.executor.transfers is not None, "the agent's executor counts transfers"
        return self.executor.transfers

    def forget(self, request_id: str) -> None:
        """A request that ended before its hand-over (finished at its first token, or failed): its
        stream, if any, is closed."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            task = asyncio.get_running_loop().create_task(self._close(stream))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _close(stream: LayerStream) -> None:
        prepared = await stream.finish()
        if prepared is not None:
            prepared.channel.close()  # the decode worker frees what it staged when the connection drops

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for stream in self._streams.values():
            if stream.task is not None:
                stream.task.cancel()
        self._streams.clear()
