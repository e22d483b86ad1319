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
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from kvfleet.serving.httpapi import DecodeTarget
from kvfleet.worker.migration.executor import Executor, TransferMetrics
from kvfleet.worker.migration.handoff import HandoffTarget
from kvfleet.worker.migration.source import LAYOUTS, Layout, Transfer
from kvfleet.worker.migration.transport import MIGRATION_PORT, split_address

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
Caching = Literal["none", "prefill", "decode", "full"]
CACHINGS: tuple[Caching, ...] = ("none", "prefill", "decode", "full")


@dataclass(frozen=True)
class PDConfig:
    """This worker's role in a disaggregated pool (None: a colocated pool), the pool's caching milestone
    and transfer layout (the LLMPool's spec.disaggregation, passed by the operator in the environment)."""

    role: Role | None = None
    caching: Caching = "full"
    layout: Layout = "by-request-aggregated"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PDConfig:
        role = env.get("KVFLEET_ROLE") or None
        caching = env.get("KVFLEET_PD_CACHING") or "full"
        layout = env.get("KVFLEET_PD_LAYOUT") or "by-request-aggregated"
        if role not in (None, "prefill", "decode"):
            raise ValueError(f"KVFLEET_ROLE must be prefill or decode, not {role!r}")
        if caching not in CACHINGS:
            raise ValueError(f"KVFLEET_PD_CACHING must be one of {', '.join(CACHINGS)}, not {caching!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"KVFLEET_PD_LAYOUT must be one of {', '.join(LAYOUTS)}, not {layout!r}")
        return cls(cast(Role | None, role), caching, layout)


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

    def start(self, request_id: str, targets: tuple[DecodeTarget, ...]) -> None:
        """Hands the request over in the background, to the first of `targets` (best first) that takes
        it; its stream ends with the hand-off event when it lands, or it keeps decoding here."""
        return_to = self.own_migration_address if self.config.caching == "full" else None
        transfer = Transfer(self.config.layout, return_to)

        async def run() -> None:
            result = None
            for attempt, target in enumerate(targets):
                if attempt:
                    self.metrics.alternates.inc()
                result = await self.executor.transfer(request_id, HandoffTarget(target.pod, target.address),
                                                      self._migration_address(target), transfer)
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

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
