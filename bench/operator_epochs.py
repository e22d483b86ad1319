"""API writes and CPU time of one operator epoch for pools of 10, 100 and 1,000 scripted workers.

The claim under test: an epoch writes in proportion to what changed (arrivals, finishes, class
changes, moves), not to the number of workers, and its CPU time stays small at 1,000 workers. The
operator's real reconcile (kvfleet.operator.reconcile.reconcile_pool) runs against kvfleet.operator.memory's
in-memory API, which counts every write as the real client does; scripted workers keep a steady load (a fixed share of requests finishes,
arrives where the routing table says, and grows each epoch) and execute migrations at once.

Baseline, measured in the same run: a level-triggered reconcile that rewrote every worker's pod and
the pool status each epoch would make `workers + 1` writes; the ratio printed is writes / that.
The API server's latency is not part of the CPU time (no network here); the e2e tests cover the
real API. First line: the machine it ran on. Last line: one JSON object with `writes_per_epoch` and
`epoch_cpu_ms` keyed by pool size. `--quick` (pools of 10 and 100, a few epochs; seconds) is what
`make test` runs, through tests/unit/test_bench_operator_epochs.py.

(Not `bench/operator.py`: a script of that name shadows the standard library's `operator` module for
every script in this folder, since a script's folder comes first on sys.path.)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import time
from typing import Any

from kvfleet.api.reports import KVLoadReport, RequestLoad, kvload_object, size_class_name
from kvfleet.operator import reconcile
from kvfleet.operator.memory import MemoryKube

CAPACITY_BYTES = 1_000_000


class ScriptedWorkers:
    """The workers' side: requests, reports in their KVLoads, and migrations executed at once."""

    def __init__(self, api: MemoryKube, seed: int) -> None:
        self.api = api
        self.rng = random.Random(seed)
        self.requests: dict[str, dict[str, int]] = {}  # pod -> request id -> bytes
        self.next_id = 0
        self.report_writes = 0

    def new_size(self) -> int:
        # A mix of all classes: tiny, T, S, M and L requests.
        return int(CAPACITY_BYTES * self.rng.choice([0.05, 0.1, 0.2, 0.28, 0.4, 0.6]))

    def place(self, size_bytes: int) -> str:
        table: dict[str, str] = {r["sizeClass"]: r["worker"]
                                 for r in (self.api.pool.get("status") or {}).get("routingTable", [])}
        cls = size_class_name(size_bytes, CAPACITY_BYTES)
        wanted = table.get(cls if cls in ("L", "M", "S") else "T")
        if wanted is not None and wanted in self.api.pods:
            return wanted
        return self.rng.choice(sorted(self.api.pods))

    def add(self, count: int) -> None:
        for _ in range(count):
            pod = self.place(size := self.new_size())
            self.requests.setdefault(pod, {})[f"r{self.next_id}"] = size
            self.next_id += 1

    def churn(self, finish_share: float, grow_share: float) -> int:
        """One epoch of decoding: some requests finish, as many arrive, some grow. Returns the changes."""
        live = [(pod, rid) for pod, reqs in self.requests.items() for rid in reqs]
        self.rng.shuffle(live)
        num_finish = max(1, int(len(live) * finish_share))
        for pod, rid in live[:num_finish]:
            del self.requests[pod][rid]
        num_grow = int(len(live) * grow_share)
        for pod, rid in live[num_finish:num_finish + num_grow]:
            self.requests[pod][rid] = min(CAPACITY_BYTES, int(self.requests[pod][rid] * 1.1))
        self.add(num_finish)
        return 2 * num_finish + num_grow

    def execute_migrations(self) -> None:
        for mig in self.api.migrations.values():
            if (mig.get("status") or {}).get("phase", "Pending") != "Pending":
                continue
            spec = mig["spec"]
            size = self.requests.get(spec["sourcePod"], {}).pop(spec["requestId"], None)
            if size is None or spec["targetPod"] not in self.api.pods:
                mig["status"] = {"phase": "Failed", "message": "gone"}
                continue
            self.requests.setdefault(spec["targetPod"], {})[spec["requestId"]] = size
            mig["status"] = {"phase": "Succeeded", "bytesMoved": size,
                             "completionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def report(self) -> None:
        """Each worker writes its report when its requests or their classes changed."""
        for name, pod in self.api.pods.items():
            reqs = self.requests.get(name, {})
            loads = [RequestLoad(id=rid, kv_bytes=size, tokens=size // 1000,
                                 size_class=size_class_name(size, CAPACITY_BYTES))
                     for rid, size in sorted(reqs.items())]
            report = KVLoadReport(capacity_bytes=CAPACITY_BYTES, used_bytes=sum(reqs.values()), requests=loads,
                                  sequence=0)
            if KVLoadReport.from_kvload(self.api.kvloads.get(name)) != report:
                self.api.kvloads[name] = kvload_object(name, pod["metadata"]["uid"], "bench", report)
                self.report_writes += 1


def pool_body(max_workers: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool",
        "metadata": {"name": "bench", "namespace": "bench", "uid": "bench-uid", "generation": 1},
        "spec": {"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": str(CAPACITY_BYTES)},
                 "workers": {"min": 1, "max": max_workers}, "migration": {"mode": "kv"},
                 "scheduling": {"epochSeconds": 1}, "autoscaling": {"scaleDownDelaySeconds": 0}},
    }


def run(num_workers: int, epochs: int, seed: int) -> dict[str, float]:
    logger = logging.getLogger("bench")
    api = MemoryKube(pool_body(max_workers=num_workers * 2))
    states = reconcile.PoolStates()  # a fresh scheduler for each pool size
    workers = ScriptedWorkers(api, seed)
    reconcile.reconcile_pool("bench", "bench", logger, api, states)
    # Fill to about num_workers GPUs (each request averages ~0.27 C; MELL packs about 3 per GPU).
    # Filled in steps, as a router following the routing table would, then left to settle.
    target = int(num_workers * 2.8)
    for step in range(40):
        if step < 20:
            workers.add(target // 20)
        workers.report()
        reconcile.reconcile_pool("bench", "bench", logger, api, states)
        workers.execute_migrations()
    api.writes()
    writes: list[int] = []
    cpu_ms: list[float] = []
    changes: list[int] = []
    gpus: list[int] = []
    for _ in range(epochs):
        changes.append(workers.churn(finish_share=0.02, grow_share=0.05))
        workers.execute_migrations()
        workers.report()
        started = time.process_time()
        reconcile.reconcile_pool("bench", "bench", logger, api, states)
        cpu_ms.append((time.process_time() - started) * 1000)
        state = states.get("bench", "bench")
        assert state is not None
        writes.append(sum(state.last_writes.values()))
        gpus.append(api.pool["status"]["gpusInUse"])
    return {
        "workers": statistics.mean(gpus),
        "writes_per_epoch": statistics.mean(writes),
        "changes_per_epoch": statistics.mean(changes),
        "epoch_cpu_ms": statistics.median(cpu_ms),
        "baseline_writes_per_epoch": statistics.mean(gpus) + 1,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None, help="measured epochs per pool (default 20; 5 with --quick)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="pool sizes in workers (default 10 100 1000; 10 100 with --quick)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small pools and few epochs: seconds, for make test")
    args = parser.parse_args()
    epochs = args.epochs if args.epochs is not None else (5 if args.quick else 20)
    sizes = args.sizes if args.sizes is not None else ([10, 100] if args.quick else [10, 100, 1000])
    print(f"machine: {platform.platform()}; cpu: {platform.processor() or platform.machine()}; python {platform.python_version()}")
    print(f"{'workers':>8} {'GPUs':>6} {'changes/epoch':>14} {'writes/epoch':>13} {'writes/change':>14} "
          f"{'vs rewrite-all':>15} {'epoch CPU ms':>13}")
    results: dict[int, dict[str, float]] = {}
    for size in sizes:
        r = run(size, epochs, args.seed)
        results[size] = r
        print(f"{size:>8} {r['workers']:>6.0f} {r['changes_per_epoch']:>14.1f} {r['writes_per_epoch']:>13.1f} "
              f"{r['writes_per_epoch'] / max(1, r['changes_per_epoch']):>14.2f} "
              f"{r['writes_per_epoch'] / r['baseline_writes_per_epoch']:>15.3f} {r['epoch_cpu_ms']:>13.1f}")
    print(json.dumps({
        "machine": platform.platform(),
        "writes_per_epoch": {str(k): round(v["writes_per_epoch"], 2) for k, v in results.items()},
        "changes_per_epoch": {str(k): round(v["changes_per_epoch"], 2) for k, v in results.items()},
        "writes_vs_rewrite_all": {str(k): round(v["writes_per_epoch"] / v["baseline_writes_per_epoch"], 4)
                                  for k, v in results.items()},
        "epoch_cpu_ms": {str(k): round(v["epoch_cpu_ms"], 2) for k, v in results.items()},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
