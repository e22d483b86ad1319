#!/usr/bin/env python3
"""Placement: what one request's choice of worker costs the router, at 100 workers and 1,000 in flight.

Why: the router places every request (kvfleet.router.placement) before it relays a byte. It used to
rebuild the cluster from every report and reservation and run the policy's Allocate on it per request
(`allocate_one`): time in the number of requests in flight, ~30 ms at a thousand, paid by every
request of a burst in turn. It now keeps each worker's totals as reports and placements arrive
(`PoolLoads`) and decides from them (`kvfleet.mell.allocate_on_totals`), rebuilding only where the
policy reads more than totals (a worker over its cap, or a policy other than the default).

The workload is the router's life in steady state, the same for both: `--workers` workers of C =
10 GiB each hold `--in-flight` requests (final sizes 0.2-1.4 GiB, about 80% full: below every cap, as
a pool whose operator keeps up); each step one request ends (its reservation released, its worker's
report re-published without it, as a report arrives), the next arrives and is placed, its
reservation made, and every tenth step a worker's report grows its requests. Timed per placement: the
view taken (`sync`: the re-published worker read again) and the choice (`place`). Measured in the same
run, on the same steps:

- `totals`: today's router (PoolLoads kept across steps);
- `rebuild`: the replaying router (the view rebuilt from the snapshot and every reservation, Allocate
  run on the rebuilt cluster), the baseline.

The replaying router meets the same steps after today's has run them all (timed apart, so neither
pays for the other's garbage), and must choose the same worker at every step (the run fails otherwise).

    python bench/placement.py            # 100 workers, 1,000 in flight, 3,000 placements
    python bench/placement.py --quick    # 20 workers, 200 in flight, 300 placements (make test)

Prints the machine first, a table, and as its last line one JSON object: workers, in_flight,
placements, totals_p50_ms, totals_p99_ms, rebuild_p50_ms, rebuild_p99_ms, rebuild_over_totals_p99,
decisions_differ.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
for sub in ("operator", "worker-image"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / sub))

from _machine import cpu_model  # noqa: E402

from kvfleet.mell import size_class  # noqa: E402
from kvfleet.router.placement import (  # noqa: E402
    NoRoute,
    PoolLoads,
    PoolSnapshot,
    ReportedRequest,
    Reservation,
    RouteChoice,
    WorkerState,
)

GIB = 1 << 30
CAPACITY_BYTES = 10 * GIB


@dataclass
class Pool:
    """The pool as the API shows it: each worker's reported requests (their KV so far)."""

    workers: list[str]
    reported: dict[str, dict[str, int]]

    def state(self, pod: str) -> WorkerState:
        index = self.workers.index(pod)
        requests = tuple(ReportedRequest(r, b, size_class(b, CAPACITY_BYTES)) for r, b in self.reported[pod].items())
        return WorkerState(pod, f"10.0.{index // 250}.{index % 250}:8000", True, index, CAPACITY_BYTES, requests)


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))]


def run(num_workers: int, in_flight: int, num_placements: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    pool = Pool([f"pool-worker-{i}" for i in range(num_workers)], {})
    for pod in pool.workers:
        pool.reported[pod] = {}
    reservations: dict[str, Reservation] = {}
    states = {pod: pool.state(pod) for pod in pool.workers}

    def snapshot() -> PoolSnapshot:
        return PoolSnapshot(tuple(states[p] for p in pool.workers), {}, policy="mell")

    def final_size() -> int:
        return rng.randint(GIB // 5, 7 * GIB // 5)

    # Fill: in_flight requests spread by the router itself (as it would have placed them).
    live = PoolLoads(snapshot())
    for i in range(in_flight):
        request_id = f"req-{i}"
        size = final_size()
        choice = live.place(size, default_capacity_bytes=CAPACITY_BYTES)
        assert isinstance(choice, RouteChoice), choice
        reservations[request_id] = Reservation(request_id, choice.pod_name, size)
        live.reserve(reservations[request_id])
        pool.reported[choice.pod_name][request_id] = size // 2  # half of its KV so far
        states[choice.pod_name] = pool.state(choice.pod_name)
        live.sync(snapshot())

    totals_ms: list[float] = []
    rebuild_ms: list[float] = []
    rules: dict[str, int] = {}
    # The steps as the replaying router meets them afterwards (timed apart, so that neither pays for
    # the other's garbage): the view, the reservations, the size, and today's choice.
    steps: list[tuple[PoolSnapshot, tuple[Reservation, ...], int, RouteChoice]] = []
    for step in range(num_placements):
        # One request ends; its worker's report comes without it.
        gone = rng.choice(list(reservations))
        pod = reservations.pop(gone).pod_name
        live.release(gone)
        pool.reported[pod].pop(gone, None)
        states[pod] = pool.state(pod)
        if step % 10 == 0:  # a worker reports its requests grown
            grower = rng.choice(pool.workers)
            for request_id in pool.reported[grower]:
                final = reservations[request_id].kv_bytes
                pool.reported[grower][request_id] = min(final, pool.reported[grower][request_id] + final // 10)
            states[grower] = pool.state(grower)
        view = snapshot()
        size = final_size()

        start = time.perf_counter()
        live.sync(view)
        chosen = live.place(size, default_capacity_bytes=CAPACITY_BYTES)
        totals_ms.append((time.perf_counter() - start) * 1e3)

        if isinstance(chosen, NoRoute):
            raise SystemExit(f"no worker for a request at step {step}: {chosen.message}")
        steps.append((view, tuple(reservations.values()), size, chosen))
        rules[chosen.rule] = rules.get(chosen.rule, 0) + 1
        request_id = f"req-{in_flight + step}"
        reservations[request_id] = Reservation(request_id, chosen.pod_name, size)
        live.reserve(reservations[request_id])
        pool.reported[chosen.pod_name][request_id] = 0
        states[chosen.pod_name] = pool.state(chosen.pod_name)

    differ = 0
    for view, reserved, size, chosen in steps:
        start = time.perf_counter()
        replayed = PoolLoads(view, reserved, rebuild=True).place(size, default_capacity_bytes=CAPACITY_BYTES)
        rebuild_ms.append((time.perf_counter() - start) * 1e3)
        differ += chosen != replayed
    return {
        "workers": num_workers, "in_flight": in_flight, "placements": num_placements,
        "totals_p50_ms": round(percentile(totals_ms, 50), 4), "totals_p99_ms": round(percentile(totals_ms, 99), 4),
        "rebuild_p50_ms": round(percentile(rebuild_ms, 50), 3), "rebuild_p99_ms": round(percentile(rebuild_ms, 99), 3),
        "rebuild_over_totals_p99": round(percentile(rebuild_ms, 99) / percentile(totals_ms, 99), 1),
        "decisions_differ": differ, "rules": rules,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 workers, 200 in flight, 300 placements")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--in-flight", type=int, default=None)
    p.add_argument("--placements", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    workers = args.workers or (20 if args.quick else 100)
    in_flight = args.in_flight or (200 if args.quick else 1000)
    placements = args.placements or (300 if args.quick else 3000)
    print(f"machine: {platform.platform()}; cpu: {cpu_model()}; python {platform.python_version()}; one core", flush=True)
    result = run(workers, in_flight, placements, args.seed)
    print(f"{'router':<10} {'p50 ms':>9} {'p99 ms':>9}   ({workers} workers, {in_flight} in flight, {placements} placements)")
    for name in ("totals", "rebuild"):
        print(f"{name:<10} {result[f'{name}_p50_ms']:>9} {result[f'{name}_p99_ms']:>9}")
    print(f"rebuild / totals at p99: {result['rebuild_over_totals_p99']}x; decisions that differ: "
          f"{result['decisions_differ']}; rules: {result['rules']}")
    summary = {"machine": platform.platform(), "cpu": cpu_model(), **result}
    print(json.dumps(summary))
    return 1 if result["decisions_differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
