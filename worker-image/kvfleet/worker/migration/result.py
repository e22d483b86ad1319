"""What a migration reports: to its KVMigration's status, to Prometheus, and to MELL's §V planner.

Both sides of the executor record here (the source its moves, the destination the re-prefill speed
it measured), so the result and the metrics live apart from either side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfleet.mell.migration import MoveMode

# A re-prefill of this many tokens or fewer measures a decode step more than prefill: it gives the
# planner no re-prefill speed.
MIN_PREFILL_SAMPLE_TOKENS = 16


@dataclass(frozen=True)
class MigrationResult:
    """What a migration did, in the units KVMigration.status reports."""

    request_id: str
    succeeded: bool
    mode: MoveMode
    bytes_moved: int = 0
    tokens_moved: int = 0
    downtime_s: float | None = None
    message: str = ""
    # Measured on the way: KV payload bytes per second over the link, and the destination's
    # re-prefill speed (tokens per second) for the tokens it recomputed.
    link_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    # Data frames the KV crossed in (one per stage when aggregated; disaggregation's by-request layout
    # sends one per layer, K or V, and block), and leading blocks the destination had cached already
    # and was not sent (PrefixKV).
    sends: int = 0
    cached_blocks: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"requestId": self.request_id, "phase": "Succeeded" if self.succeeded else "Failed", "mode": str(self.mode),
                "bytesMoved": self.bytes_moved, "tokensMoved": self.tokens_moved, "downtimeSeconds": self.downtime_s,
                "message": self.message, "linkBytesPerSecond": self.link_bytes_per_s,
                "prefillTokensPerSecond": self.prefill_tokens_per_s, "sends": self.sends,
                "cachedBlocks": self.cached_blocks}


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
        self.migrations.labels(str(result.mode), "Succeeded" if result.succeeded else "Failed").inc()
        self.bytes.inc(result.bytes_moved)
        if result.downtime_s is not None:
            self.downtime.observe(result.downtime_s)
        if result.link_bytes_per_s is not None:
            self.link.set(result.link_bytes_per_s)


class TransferMetrics:
    """A disaggregated pool's KV hand-overs (docs/disaggregation.md), apart from MELL's migrations: a
    prefill worker hands every request over, and counting those as migrations would drown the moves
    MELL plans. Also the decode phase's KV sent back (PD-Caching-3), on both ends."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.transfers = Counter("kvfleet_worker_kv_transfers",
                                 "Requests this prefill worker handed to a decode worker, by layout and outcome "
                                 "(transferred, or decoded_here when no decode worker took it).",
                                 ["layout", "outcome"], registry=r)
        self.bytes = Counter("kvfleet_worker_kv_transfer_bytes", "KV bytes sent by hand-overs.", registry=r)
        self.sends = Counter("kvfleet_worker_kv_transfer_sends", "Data frames hand-overs sent KV in.", ["layout"],
                             registry=r)
        self.cached_blocks = Counter("kvfleet_worker_kv_transfer_cached_blocks",
                                     "Blocks a hand-over did not send: the decode worker's cache held them.", registry=r)
        self.seconds = Histogram("kvfleet_worker_kv_transfer_seconds",
                                 "Stop on the prefill worker to first token on the decode worker.",
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.returns = Counter("kvfleet_worker_kv_returns",
                               "Finished requests whose KV this worker sent back to the prefill worker, by outcome.",
                               ["outcome"], registry=r)
        self.returned_bytes = Counter("kvfleet_worker_kv_returned_bytes", "KV bytes sent back.", registry=r)
        self.received_blocks = Counter("kvfleet_worker_kv_returned_blocks",
                                       "Blocks of finished requests' KV other workers sent here, taken into the "
                                       "prefix cache.", registry=r)
        self.layer_parts = Counter("kvfleet_worker_kv_transfer_layer_parts",
                                   "Parts by-layer hand-overs streamed while the prompt was prefilled (one per "
                                   "layer and step, and one for a prefix held before it).", registry=r)
        self.alternates = Counter("kvfleet_worker_kv_transfer_alternates",
                                  "Hand-overs tried at another decode worker after the first one refused or was "
                                  "unreachable.", registry=r)
        self.count = 0  # transfers that landed, for the KV-load report

    def record(self, layout: str, result: MigrationResult) -> None:
        self.transfers.labels(layout, "transferred" if result.succeeded else "decoded_here").inc()
        if result.succeeded:
            self.count += 1
            self.bytes.inc(result.bytes_moved)
            self.sends.labels(layout).inc(result.sends)
            self.cached_blocks.inc(result.cached_blocks)
            if result.downtime_s is not None:
                self.seconds.observe(result.downtime_s)
