"""Prometheus metrics of the operator (documented in docs/operator.md).

Names follow the Prometheus conventions (`kvfleet_` prefix, base units, `_total` counters) and are
labelled by pool (`namespace`, `pool`) so a dashboard can put GPUs in use next to the fluid lower
bound per pool, which is the one figure that says how well MELL packs.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)
POOL = ("namespace", "pool")

GPUS_DESIRED = Gauge("kvfleet_pool_gpus_desired", "Worker GPUs the pool wants (scheduler GPUs or the floor)", POOL)
GPUS_ACTIVE = Gauge("kvfleet_pool_gpus_active", "GPUs holding KV cache according to the scheduler", POOL)
GPUS_LOWER_BOUND = Gauge("kvfleet_pool_gpus_lower_bound", "Fluid lower bound ceil(sum of KV / capacity)", POOL)
WORKERS_READY = Gauge("kvfleet_pool_workers_ready", "Worker pods that are Ready", POOL)
KV_UTILIZATION = Gauge("kvfleet_pool_kv_utilization_ratio", "KV bytes used / capacity of the active GPUs", POOL)
KV_USED = Gauge("kvfleet_pool_kv_used_bytes", "KV bytes reported by the pool's workers", POOL)
MIGRATIONS_IN_FLIGHT = Gauge("kvfleet_migrations_in_flight", "KVMigrations not yet finished", POOL)
MIGRATIONS_PLANNED = Counter("kvfleet_migrations_planned_total", "KVMigrations created, by mode and reason",
                             (*POOL, "mode", "reason"))
MIGRATIONS_FINISHED = Counter("kvfleet_migrations_total", "KVMigrations seen finished, by mode and result",
                              (*POOL, "mode", "result"))
MIGRATION_BYTES = Counter("kvfleet_migration_bytes_total", "Bytes moved by succeeded KVMigrations", (*POOL, "mode"))
EPOCH_SECONDS = Histogram("kvfleet_epoch_duration_seconds", "Wall time of one scheduling epoch", POOL,
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
API_WRITES = Counter("kvfleet_api_writes_total", "Writes to the Kubernetes API, by kind of write", (*POOL, "kind"))


def serve(address: str, port: int) -> None:
    start_http_server(port, addr=address)
    log.info("metrics on http://%s:%d/metrics", address, port)
