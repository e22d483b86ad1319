"""Speed of the scheduling core: operations per second, and one epoch at 10,000 GPUs / 1,000,000 requests.

    python bench/mell.py            # full size
    python bench/mell.py --quick    # a tenth of the size, for a smoke run

Two measurements, both on one core (the core is single-threaded Python):

1. Operations per second: a steady-state cluster (--ops-live live requests) receives a stream of
   arrivals, finishes and growth reports in epochs of --ops-batch events; MELL and best-fit (the
   baseline, measured in the same run on the same stream) are timed over the same events.
2. One epoch at scale: 1,000,000 live requests are loaded (about 10,000 GPUs), then one epoch with
   1% of the requests finishing, 1% arriving and 10% reporting growth is timed.

The loaded state is moved out of the cyclic garbage collector's reach with gc.freeze() before timing
(for both policies): millions of long-lived objects are not garbage, and a long-running operator can
do the same after it builds its state.

Sizes are KV bytes of LLaMA-2-13B on A100-40GB; 99% of requests are under C/80 (chat turns), the rest
T/S/M/L, so that a GPU holds about 100 requests. Prints the machine first; the last line is one JSON
object with the headline figures. No assertions: the numbers are the output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from _machine import cpu_model  # noqa: E402

from kvfleet.mell import Arrive, EventBatch, Finish, Grow, make_policy  # noqa: E402
from kvfleet.mell.cluster import ClusterPolicy  # noqa: E402
from kvfleet.sim.hardware import A100_40GB, LLAMA2_13B, derive_capacity  # noqa: E402

Event = Arrive | Finish | Grow


def draw_size(rng: random.Random, c: int) -> int:
    u = rng.random()
    if u < 0.99:
        return rng.randint(1, c // 80)
    if u < 0.998:
        return rng.randint(c // 8 + 1, c // 2)
    return rng.randint(c // 2 + 1, int(c * 0.9))


class Workload:
    """A deterministic stream of epochs over a live set."""

    def __init__(self, c: int, seed: int) -> None:
        self.c = c
        self.rng = random.Random(seed)
        self.live: dict[str, int] = {}
        self.n = 0

    def arrivals(self, count: int) -> list[Event]:
        out: list[Event] = []
        for _ in range(count):
            rid = f"r{self.n}"
            self.n += 1
            size = draw_size(self.rng, self.c)
            self.live[rid] = size
            out.append(Arrive(rid, size))
        return out

    def epoch(self, num_finish: int, num_arrive: int, num_grow: int) -> list[Event]:
        ids = list(self.live)
        picked = self.rng.sample(ids, min(len(ids), num_finish + num_grow))
        events: list[Event] = []
        for rid in picked[:num_finish]:
            del self.live[rid]
            events.append(Finish(rid))
        for rid in picked[num_finish:]:
            self.live[rid] += max(1, self.live[rid] // 50)
            events.append(Grow(rid, self.live[rid]))
        events.extend(self.arrivals(num_arrive))
        return events


def load(policy: ClusterPolicy, work: Workload, num_live: int, batch: int, t: float) -> float:
    while len(work.live) < num_live:
        policy.schedule(EventBatch(t, tuple(work.arrivals(min(batch, num_live - len(work.live))))))
        t += 1.0
    return t


def ops_per_s(name: str, c: int, num_live: int, batch: int, num_epochs: int, seed: int) -> tuple[float, int]:
    policy = make_policy(name, capacity_bytes=c)
    work = Workload(c, seed)
    t = load(policy, work, num_live, 10_000, 0.0)
    epochs = [work.epoch(batch // 4, batch // 4, batch // 2) for _ in range(num_epochs)]
    gc.collect()
    gc.freeze()  # the long-lived state is not garbage; a long-running operator can do the same
    start = time.perf_counter()
    for events in epochs:
        policy.schedule(EventBatch(t, tuple(events)))
        t += 1.0
    elapsed = time.perf_counter() - start
    gc.unfreeze()
    return sum(len(e) for e in epochs) / elapsed, policy.num_gpus()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the sizes")
    parser.add_argument("--ops-live", type=int, default=100_000)
    parser.add_argument("--ops-batch", type=int, default=2_000)
    parser.add_argument("--ops-epochs", type=int, default=50)
    parser.add_argument("--epoch-live", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    c = derive_capacity(LLAMA2_13B, A100_40GB).capacity_bytes
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core

    print(f"machine: {platform.platform()}; cpu: {cpu_model()}; python {platform.python_version()}; one core")
    print(f"C = {c} bytes (LLaMA-2-13B on A100-40GB)")

    results: dict[str, float] = {}
    num_live = args.ops_live // scale
    for name in ("bf", "mell"):
        rate, gpus = ops_per_s(name, c, num_live, args.ops_batch, args.ops_epochs, args.seed)
        results[name] = rate
        print(f"ops/s  {name:>4}: {rate:12,.0f}  ({num_live:,} live requests on {gpus:,} GPUs, "
              f"epochs of {args.ops_batch:,} events)")
    ratio = results["mell"] / results["bf"]
    print(f"ops/s ratio mell/bf (baseline, same run, same events): {ratio:.2f}")

    live = args.epoch_live // scale
    policy = make_policy("mell", capacity_bytes=c)
    work = Workload(c, args.seed)
    start = time.perf_counter()
    t = load(policy, work, live, 20_000, 0.0)
    load_s = time.perf_counter() - start
    events = work.epoch(live // 100, live // 100, live // 10)
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    plan = policy.schedule(EventBatch(t, tuple(events)))
    epoch_s = time.perf_counter() - start
    gpus = policy.num_gpus()
    print(f"epoch: {live:,} live requests on {gpus:,} GPUs; {len(events):,} events "
          f"({live // 100:,} finish, {live // 100:,} arrive, {live // 10:,} grow) in {epoch_s:.3f} s; "
          f"{len(plan.migrations):,} migrations, {len(plan.activate_gpu_ids)} GPUs activated, "
          f"{len(plan.terminate_gpu_ids)} terminated (loading the state took {load_s:.1f} s)")
    print(json.dumps({
        "machine": platform.platform(),
        "cpu": cpu_model(),
        "mell_ops_per_s": round(results["mell"]),
        "bf_ops_per_s": round(results["bf"]),
        "mell_over_bf": round(ratio, 3),
        "epoch_live_requests": live,
        "epoch_gpus": gpus,
        "epoch_events": len(events),
        "epoch_s": round(epoch_s, 4),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
