"""DGFM carried out (Infinite-LLM §4.5, §6.4): a pool's throughput over time with debt cycles resolved
by recall-and-swap, against the same run with the cycles left standing.

Infinite-LLM's Figure 10 runs a long mixed-length workload on four instances with DGFM on and off:
at first the two are alike, then the lending that mixed lengths cause turns into circles of debt,
every instance on one attends part of its own KV over the network, and throughput without DGFM
keeps falling. This bench runs that experiment on this machine, all engines in one process over
loopback TCP with the pool's real transport:

- N builtin workers (4, as in the paper) of C tokens of KV each, lending up to half of it, borrowing
  from the others;
- on each worker, one client sends long requests (0.4-0.6 C of prompt and 256-384 tokens of output:
  they outgrow their worker as they decode) and three send short ones, each with think time between
  its requests, so blocks come free here and there while a long request decodes, and other workers'
  long requests borrow them;
- a gManager every epoch builds the debt ledger from the workers' own counts, gives each worker its
  creditor candidates from it (most room first, §4.4, as the operator publishes them) and runs DGFM
  (kvfleet.mell.debt, Algorithm 1, as the operator does); with DGFM on, each debtor on a cycle is told
  to recall what the swap gives back (the engine's `KVBorrowing.recall`, as the operator's
  `status.distkv.dgfm.recalls` tell a worker), with DGFM off the cycles are only counted.

A cycle needs two workers each running a long request and each having had room for the other's:
in kvfleet only a request longer than its worker borrows, and a worker running one has free blocks
only as its short requests end, so cycles are rarer than in the paper (`cycle_epochs` counts the
epochs at which one stands). Two runs of one mode differ by a few percent on a busy machine; a full
run prints that spread beside the ratio.

Both modes send the same seeded requests for the same time (ABBA order in a full run, so drift on
the machine falls on both). Printed per window of time: tokens per second, and the KV that lives at
other workers. Last line: one JSON object (`throughput_on_over_off`, `second_half_on_over_off`,
`same_mode_spread`, `cycle_epochs`, `swaps_found`, `recalls`, `recalled_bytes`, `borrowed_kib_mean`,
`errors`, `windows`, `device`, ...).
Before the run, one swap alone: a request of 1.5 C on a worker that lends a quarter of its blocks
to a debtor and borrows from a creditor; its decode steps after the swap (its recall, its debtor's
lease freed, the recalled KV settling into the freed blocks) against the same steps of the same
request without the swap. Such a request is still longer than its worker: it keeps borrowing for its
newest blocks, so each layer still makes its round trip to a lender, which is what a borrowed step
costs (bench/distkv.py).

No target is asserted: the paper gives a curve, not a number, and this is a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402
from _shapes import shape  # noqa: E402

from kvfleet.mell.debt import (  # noqa: E402
    WorkerDebtReport,
    blocks_needed_for_bytes,
    build_ledger,
    creditor_candidates,
    eliminate_debt_cycles,
)
from kvfleet.serving.credentials import PoolCredentials, PoolSecrets  # noqa: E402
from kvfleet.worker.distkv.borrower import RemoteLease  # noqa: E402
from kvfleet.worker.distkv.creditors import Creditor  # noqa: E402
from kvfleet.worker.distkv.lender import serve_lease  # noqa: E402
from kvfleet.worker.distkv.options import DistKVOptions  # noqa: E402
from kvfleet.worker.distkv.parts import RemoteParts  # noqa: E402
from kvfleet.worker.engines.base import EngineConfig, EngineError, SamplingParams  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine  # noqa: E402
from kvfleet.worker.engines.builtin.model import read_architecture, torch_dtype  # noqa: E402
from kvfleet.worker.engines.builtin.options import BuiltinOptions  # noqa: E402
from kvfleet.worker.migration.transport import Channel, TCPTransport  # noqa: E402
from kvfleet.worker.model.tiny import make_tiny  # noqa: E402

TRANSPORT = TCPTransport(PoolCredentials(PoolSecrets("bench-dgfm-token", b"bench-dgfm-key")))
OPEN_LEASE = functools.partial(RemoteLease, TRANSPORT)
BLOCK_SIZE_TOKENS = 16  # the builtin engine's block
LEND_CAP_FRACTION = 0.5  # the LLMPool default (spec.distkv.lendCapFraction)
LONG_TOKENS = (0.4, 0.6)  # a long request's prompt, in C
LONG_OUTPUT = (256, 384)
LONG_THINK_S = (1.0, 3.0)
SHORT_PROMPT = (16, 48)
SHORT_OUTPUT = (16, 32)
SHORT_THINK_S = (0.1, 0.5)
SHORT_CLIENTS = 3
# After a refusal (the pool had no room for it) a client waits this long before its next request, as a
# caller backing off would.
BACKOFF_S = 1.0


@dataclass
class Tally:
    """One mode's run: when each token arrived, what was borrowed at each epoch, and what DGFM did."""

    token_times_s: list[float] = field(default_factory=list)
    borrowed_samples: list[tuple[float, int]] = field(default_factory=list)
    swaps_found: int = 0
    cycle_epochs: int = 0  # epochs at which DGFM found at least one cycle standing
    epochs: int = 0
    recalls: int = 0
    recalled_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    long_step_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Worker:
    name: str
    engine: BuiltinEngine
    port: int


@asynccontextmanager
async def worker(name: str, model_dir: Path, capacity_tokens: int, kv_bytes_per_token: int) -> AsyncIterator[Worker]:
    """A started builtin engine that lends and borrows, its leases served on a loopback port."""
    capacity_bytes = capacity_tokens * kv_bytes_per_token
    engine = BuiltinEngine(EngineConfig(model_path=model_dir, kv_capacity_bytes=capacity_bytes, dtype="float32"),
                           BuiltinOptions(attention="distattention", distkv=DistKVOptions(
                               lend_cap_bytes=int(LEND_CAP_FRACTION * capacity_bytes), borrow=True)))
    await engine.start()

    async def handle(channel: Channel) -> None:
        await serve_lease(engine.capabilities.lending, channel, await channel.recv(5), BLOCK_SIZE_TOKENS)

    listener = await TRANSPORT.listen("127.0.0.1", 0, handle)
    try:
        yield Worker(name, engine, listener.port)
    finally:
        await listener.close()
        await engine.stop()


class PlanCreditors:
    """A worker's creditor candidates as the operator publishes them (§4.4: most room first, all in one
    zone here), renewed by the bench's gManager every epoch; a refusal holds until the next."""

    def __init__(self) -> None:
        self.creditors: tuple[Creditor, ...] = ()
        self._refused: set[str] = set()

    def candidates(self) -> Sequence[Creditor]:
        return tuple(c for c in self.creditors if c.address not in self._refused)

    def refused(self, address: str) -> None:
        self._refused.add(address)

    def renew(self, creditors: tuple[Creditor, ...]) -> None:
        self.creditors, self._refused = creditors, set()


def attach(workers: list[Worker], lend_bytes: int) -> dict[str, PlanCreditors]:
    """Every worker borrows from the others, in the order each epoch's plan gives (first: all, by name)."""
    plans = {}
    for w in workers:
        plan = plans[w.name] = PlanCreditors()
        plan.renew(tuple(Creditor(o.name, f"127.0.0.1:{o.port}", lend_bytes) for o in workers if o is not w))
        borrowing = w.engine.capabilities.borrowing
        assert borrowing is not None
        borrowing.attach(OPEN_LEASE, plan)
    return plans


def prompt_of(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(3, 1900) for _ in range(num_tokens)]


async def client(w: Worker, tally: Tally, rng: random.Random, long: bool, capacity_tokens: int, until_s: float,
                 tag: str) -> None:
    """Requests one after another until `until_s` (monotonic): long ones back to back, or short ones with
    think time. Tokens are tallied as they stream; a request still running at the end is aborted."""
    seq = 0
    while time.monotonic() < until_s:
        await asyncio.sleep(rng.uniform(*(LONG_THINK_S if long else SHORT_THINK_S)))
        if long:
            prompt = prompt_of(rng, int(rng.uniform(*LONG_TOKENS) * capacity_tokens))
            max_tokens = rng.randint(*LONG_OUTPUT)
        else:
            prompt = prompt_of(rng, rng.randint(*SHORT_PROMPT))
            max_tokens = rng.randint(*SHORT_OUTPUT)
        seq += 1
        request_id = f"{w.name}-{tag}-{seq}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        times: list[float] = []

        async def run(rid: str = request_id, p: list[int] = prompt, sp: SamplingParams = params,
                      t: list[float] = times) -> None:
            async for step in w.engine.generate(rid, p, sp):
                now = time.monotonic()
                for _ in step.new_token_ids:
                    tally.token_times_s.append(now)
                    t.append(now)

        try:
            await asyncio.wait_for(run(), max(0.1, until_s - time.monotonic()))
        except TimeoutError:
            await w.engine.abort(request_id)
            return
        except EngineError as err:
            tally.errors.append(f"{request_id}: {err}")
            await asyncio.sleep(BACKOFF_S)
        if long and len(times) > 1:
            tally.long_step_s.append((times[-1] - times[0]) / (len(times) - 1))


async def gmanager(workers: list[Worker], plans: dict[str, PlanCreditors], tally: Tally, execute: bool, epoch_s: float,
                   block_bytes: int, started_s: float, until_s: float, seed: int) -> None:
    """Every epoch: the debt ledger from the workers' counts, each worker's creditor candidates from it
    (the contract protocol's answer, §4.4), DGFM on it, and (on) the recalls carried out."""
    rng = random.Random(seed)
    by_name = {w.name: w for w in workers}
    while time.monotonic() < until_s:
        await asyncio.sleep(epoch_s)
        reports = []
        borrowed_total = 0
        for w in workers:
            borrowing, lending = w.engine.capabilities.borrowing, w.engine.capabilities.lending
            assert borrowing is not None and lending is not None
            borrowed = dict(borrowing.borrowed_bytes())
            borrowed_total += sum(borrowed.values())
            reports.append(WorkerDebtReport(w.name, len(w.engine.scheduler.space.free), lending.cap_blocks,
                                            {c: blocks_needed_for_bytes(n, block_bytes) for c, n in borrowed.items() if n}))
        tally.borrowed_samples.append((time.monotonic() - started_s, borrowed_total))
        ledger = build_ledger(reports, block_bytes)
        for w in workers:
            ranked = creditor_candidates(ledger, w.name, 1, lambda _a, _b: 0, count=len(workers))
            plans[w.name].renew(tuple(Creditor(c, f"127.0.0.1:{by_name[c].port}", ledger.room_blocks(c) * block_bytes)
                                      for c in ranked))
        dgfm = eliminate_debt_cycles(ledger, rng, min_swap_blocks=1)
        tally.swaps_found += len(dgfm.swaps)
        tally.epochs += 1
        tally.cycle_epochs += bool(dgfm.swaps)
        if not execute or not dgfm.swaps:
            continue
        orders = dgfm.recalls()
        results = await asyncio.gather(*(by_name[d.debtor_id].engine.capabilities.borrowing.recall(  # type: ignore[union-attr]
            d.creditor_id, d.num_blocks * block_bytes) for d in orders), return_exceptions=True)
        for order, result in zip(orders, results, strict=True):
            if isinstance(result, BaseException):
                tally.errors.append(f"recall {order.debtor_id} <- {order.creditor_id}: {result}")
            elif result:
                tally.recalls += 1
                tally.recalled_bytes += result


async def run_mode(args: argparse.Namespace, model_dir: Path, kv_bytes_per_token: int, execute: bool) -> Tally:
    """One run of the workload, on fresh workers, with DGFM carried out or not."""
    capacity = args.capacity_tokens
    block_bytes = BLOCK_SIZE_TOKENS * kv_bytes_per_token
    tally = Tally()
    async with AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(worker(f"w{i}", model_dir, capacity, kv_bytes_per_token))
                   for i in range(args.workers)]
        plans = attach(workers, int(LEND_CAP_FRACTION * capacity * kv_bytes_per_token))
        started_s = time.monotonic()
        until_s = started_s + args.duration_s
        tasks = [gmanager(workers, plans, tally, execute, args.epoch_s, block_bytes, started_s, until_s, args.seed)]
        for i, w in enumerate(workers):
            # The same seeds in both modes: the same requests in the same order on each worker.
            tasks.append(client(w, tally, random.Random(args.seed * 1000 + i * 10), True, capacity, until_s, "long"))
            tasks += [client(w, tally, random.Random(args.seed * 1000 + i * 10 + 1 + k), False, capacity, until_s, f"s{k}")
                      for k in range(SHORT_CLIENTS)]
        await asyncio.gather(*tasks)
        tally.token_times_s = [t - started_s for t in tally.token_times_s]
    return tally


def windows(tally: Tally, duration_s: float, window_s: float) -> list[tuple[float, float, float]]:
    """(window start s, tokens/s, mean KiB of KV at other workers) per window."""
    out = []
    start = 0.0
    while start < duration_s - 1e-9:
        end = min(duration_s, start + window_s)
        tokens = sum(1 for t in tally.token_times_s if start <= t < end)
        borrowed = [b for t, b in tally.borrowed_samples if start <= t < end]
        out.append((start, tokens / (end - start), statistics.fmean(borrowed) / 1024 if borrowed else 0.0))
        start = end
    return out


def merge(tallies: list[Tally]) -> Tally:
    """Repeated runs of one mode as one (tokens of each run on the same clock: their counts add)."""
    merged = Tally()
    for t in tallies:
        merged.token_times_s += t.token_times_s
        merged.borrowed_samples += t.borrowed_samples
        merged.swaps_found += t.swaps_found
        merged.cycle_epochs += t.cycle_epochs
        merged.epochs += t.epochs
        merged.recalls += t.recalls
        merged.recalled_bytes += t.recalled_bytes
        merged.errors += t.errors
        merged.long_step_s += t.long_step_s
    return merged


@dataclass(frozen=True)
class SwapTrial:
    """One run of the one-swap request: token times, output, and what the swap moved (0s without it)."""

    times: list[float]
    tokens: list[int]
    owed_bytes: int
    recalled_bytes: int
    settled_bytes: int
    lent_again_bytes: int


async def swap_trial(model_dir: Path, capacity: int, kv_bytes_per_token: int, prompt: list[int], max_tokens: int,
                     debtor_blocks: int, swap: bool) -> SwapTrial:
    """Worker A lends `debtor_blocks` to a debtor's lease (the other edge of the cycle) and runs the request,
    which borrows from B. With `swap`, a third of the way through its output A recalls all B holds of it
    and the debtor's lease is freed (the other half of the swap), so the recalled KV settles into A's
    freed blocks (as many as fit; the rest stays held in host memory, attended there all the same)."""
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(worker("a", model_dir, capacity, kv_bytes_per_token))
        b = await stack.enter_async_context(worker("b", model_dir, 4 * capacity, kv_bytes_per_token))
        borrowing, lending = a.engine.capabilities.borrowing, a.engine.capabilities.lending
        assert borrowing is not None and lending is not None
        await lending.lend("debtor-of-a", debtor_blocks)
        plan = PlanCreditors()
        plan.renew((Creditor("b", f"127.0.0.1:{b.port}", 4 * capacity * kv_bytes_per_token),))
        borrowing.attach(OPEN_LEASE, plan)
        times: list[float] = []
        got: list[int] = []

        async def run() -> None:
            async for step in a.engine.generate("long", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
                got.extend(step.new_token_ids)
                times.extend(time.perf_counter() for _ in step.new_token_ids)

        async def reach(num_tokens: int) -> None:
            while len(times) < num_tokens and not stream.done():
                await asyncio.sleep(0.001)

        stream = asyncio.create_task(run())
        await reach(max_tokens // 3)
        owed = recalled = settled = lent_again = 0
        if swap:
            owed = borrowing.borrowed_bytes().get("b", 0)
            recalled = await borrowing.recall("b", owed)  # A's half of the swap
            await lending.free("debtor-of-a")  # its debtor's half: the blocks A lent come free
            request = a.engine.scheduler.requests.get("long")
            remote = request.remote if request is not None else None
            await reach(max_tokens // 3 + 8)
            held = sum(h.num_tokens for h in remote.held) if isinstance(remote, RemoteParts) else 0
            settled = recalled - held * kv_bytes_per_token
            await reach(2 * max_tokens // 3)
            lent_again = borrowing.borrowed_bytes().get("b", 0)  # it still outgrows A: its newest blocks move out
        await stream
    return SwapTrial(times, got, owed, recalled, settled, lent_again)


async def one_swap(args: argparse.Namespace, model_dir: Path, kv_bytes_per_token: int) -> dict[str, object]:
    """What one swap does for a request on a cycle: its decode steps after the swap against the same
    steps of the same request without it (the context grows, so later steps cost more either way), in
    alternating trials, median kept. Greedy output is checked against one big worker's."""
    capacity = args.capacity_tokens
    debtor_blocks = capacity // BLOCK_SIZE_TOKENS // 4
    prompt = prompt_of(random.Random(args.seed), capacity + capacity // 2 - debtor_blocks * BLOCK_SIZE_TOKENS)
    max_tokens = args.swap_tokens
    big = BuiltinEngine(EngineConfig(model_path=model_dir, kv_capacity_bytes=4 * capacity * kv_bytes_per_token,
                                     dtype="float32"), BuiltinOptions(attention="distattention"))
    await big.start()
    try:
        want: list[int] = []
        async for step in big.generate("ref", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
            want.extend(step.new_token_ids)
    finally:
        await big.stop()
    trials: dict[bool, list[SwapTrial]] = {False: [], True: []}
    for swap in [False, True] * args.swap_rounds:
        trials[swap].append(await swap_trial(model_dir, capacity, kv_bytes_per_token, prompt, max_tokens,
                                             debtor_blocks, swap))
    after_from = max_tokens // 3 + 10  # past the swap and the settling

    def step_ms(trial: SwapTrial) -> float:
        gaps = [t1 - t0 for t0, t1 in zip(trial.times[after_from:], trial.times[after_from + 1:], strict=False)]
        return statistics.median(gaps) * 1e3

    without = statistics.median(step_ms(t) for t in trials[False])
    with_swap = statistics.median(step_ms(t) for t in trials[True])
    last = trials[True][-1]
    equal = all(t.tokens == want for ts in trials.values() for t in ts)
    print(f"one swap: request of {len(prompt) + max_tokens} tokens on a worker of {capacity}; "
          f"{last.owed_bytes // 1024} KiB at the creditor recalled ({last.recalled_bytes // 1024} KiB home, "
          f"{last.settled_bytes // 1024} KiB of it in the freed blocks, the rest held; "
          f"{last.lent_again_bytes // 1024} KiB lent again as it grows); decode step after it "
          f"{with_swap:.2f} ms against {without:.2f} ms without the swap ({with_swap / without:.2f}x, "
          f"median of {args.swap_rounds}); outputs equal: {equal}", flush=True)
    return {"with_swap_ms": round(with_swap, 3), "without_swap_ms": round(without, 3),
            "with_over_without": round(with_swap / without, 4), "rounds": args.swap_rounds,
            "recalled_bytes": last.recalled_bytes, "owed_bytes": last.owed_bytes, "outputs_equal": equal,
            "settled_bytes": last.settled_bytes, "lent_again_bytes": last.lent_again_bytes}


async def measure(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    kv_bytes_per_token = read_architecture(model_dir).kv_bytes_per_token(torch_dtype("float32"))
    swap = await one_swap(args, model_dir, kv_bytes_per_token)
    order = [False, True] if args.quick else [False, True, True, False]
    runs: dict[bool, list[Tally]] = {False: [], True: []}
    for execute in order:
        began = time.perf_counter()
        tally = await run_mode(args, model_dir, kv_bytes_per_token, execute)
        runs[execute].append(tally)
        print(f"DGFM {'on ' if execute else 'off'}: {len(tally.token_times_s)} tokens in {args.duration_s:.0f} s, "
              f"a cycle standing at {tally.cycle_epochs} of {tally.epochs} epochs ({tally.swaps_found} swaps found), "
              f"{tally.recalls} recalls ({tally.recalled_bytes // 1024} KiB), "
              f"{len(tally.errors)} errors ({time.perf_counter() - began:.1f} s)", flush=True)
        for error in tally.errors[:3]:
            print(f"  error: {error}", flush=True)
    off, on = merge(runs[False]), merge(runs[True])
    n_runs = len(runs[False])
    w_off, w_on = windows(off, args.duration_s, args.window_s), windows(on, args.duration_s, args.window_s)
    print(f"\n{'window (s)':>12} {'tok/s off':>10} {'tok/s on':>10} {'on/off':>7} {'KiB lent off':>13} {'KiB lent on':>12}")
    for (start, tps_off, kib_off), (_, tps_on, kib_on) in zip(w_off, w_on, strict=True):
        ratio = tps_on / tps_off if tps_off else 0.0
        print(f"{start:5.0f}-{start + args.window_s:<6.0f} {tps_off / n_runs:10.1f} {tps_on / n_runs:10.1f} {ratio:7.2f} "
              f"{kib_off / n_runs:13.1f} {kib_on / n_runs:12.1f}")
    half = args.duration_s / 2

    def tokens(t: Tally, lo: float, hi: float) -> int:
        return sum(1 for x in t.token_times_s if lo <= x < hi)

    total_ratio = len(on.token_times_s) / len(off.token_times_s) if off.token_times_s else 0.0
    second_off = tokens(off, half, args.duration_s)
    second_ratio = tokens(on, half, args.duration_s) / second_off if second_off else 0.0
    borrowed_off = statistics.fmean(b for _, b in off.borrowed_samples) / 1024 if off.borrowed_samples else 0.0
    borrowed_on = statistics.fmean(b for _, b in on.borrowed_samples) / 1024 if on.borrowed_samples else 0.0
    step_off = statistics.median(off.long_step_s) * 1e3 if off.long_step_s else 0.0
    step_on = statistics.median(on.long_step_s) * 1e3 if on.long_step_s else 0.0
    # The noise to read the ratio against: how far apart two runs of one mode are (a full run has two each).
    spread = max((abs(len(a.token_times_s) - len(b.token_times_s)) / statistics.fmean(
        [len(a.token_times_s), len(b.token_times_s)]) for a, b in (runs[False], runs[True]) if len(a.token_times_s)
        and len(b.token_times_s)), default=None) if n_runs == 2 else None
    print(f"\nthroughput, DGFM on / off: {total_ratio:.3f} over the run, {second_ratio:.3f} over its second half"
          + (f" (two runs of one mode differ by up to {spread:.1%})" if spread is not None else "") + "; "
          f"KV at other workers {borrowed_on:.0f} KiB on against {borrowed_off:.0f} KiB off (mean over epochs); "
          f"a long request's decode step {step_on:.2f} ms on, {step_off:.2f} ms off (median)")
    return {
        "one_swap": swap,
        "throughput_on_over_off": round(total_ratio, 4),
        "second_half_on_over_off": round(second_ratio, 4),
        "tokens": {"off": len(off.token_times_s), "on": len(on.token_times_s)},
        "same_mode_spread": None if spread is None else round(spread, 4),
        "swaps_found": {"off": off.swaps_found, "on": on.swaps_found},
        "cycle_epochs": {"off": off.cycle_epochs, "on": on.cycle_epochs},
        "epochs": {"off": off.epochs, "on": on.epochs},
        "recalls": on.recalls,
        "recalled_bytes": on.recalled_bytes,
        "borrowed_kib_mean": {"off": round(borrowed_off, 1), "on": round(borrowed_on, 1)},
        "long_decode_ms_per_token": {"off": round(step_off, 3), "on": round(step_on, 3)},
        "errors": {"off": len(off.errors), "on": len(on.errors)},
        "windows": [{"start_s": s, "tokens_per_s_off": round(a / n_runs, 2), "tokens_per_s_on": round(b / n_runs, 2)}
                    for (s, a, _), (_, b, _) in zip(w_off, w_on, strict=True)],
        "runs_per_mode": n_runs,
        "workers": args.workers,
        "capacity_tokens": args.capacity_tokens,
        "duration_s": args.duration_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, once each (the test suite's run)")
    parser.add_argument("--workers", type=int, default=4, help="workers in the pool (default 4, as in the paper's §6.4)")
    parser.add_argument("--capacity-tokens", type=int, default=256, help="C, KV tokens per worker (default 256)")
    parser.add_argument("--duration-s", type=float, help="seconds each run lasts (default 60; quick 9)")
    parser.add_argument("--window-s", type=float, help="seconds per printed window (default 10; quick 3)")
    parser.add_argument("--epoch-s", type=float, default=0.5, help="seconds between two gManager epochs (default 0.5)")
    parser.add_argument("--seed", type=int, default=1, help="the workload's seed (default 1)")
    parser.add_argument("--swap-tokens", type=int, help="output tokens of the one-swap request (default 300; quick 90)")
    parser.add_argument("--swap-rounds", type=int, help="one-swap trials with and without it (default 3; quick 1)")
    args = parser.parse_args()
    args.duration_s = args.duration_s or (9.0 if args.quick else 60.0)
    args.window_s = args.window_s or (3.0 if args.quick else 10.0)
    args.swap_tokens = args.swap_tokens or (90 if args.quick else 300)
    args.swap_rounds = args.swap_rounds or (1 if args.quick else 3)
    if args.capacity_tokens % BLOCK_SIZE_TOKENS or args.capacity_tokens < 4 * BLOCK_SIZE_TOKENS:
        parser.error(f"--capacity-tokens must be a multiple of {BLOCK_SIZE_TOKENS}, at least four blocks")
    if args.workers < 2:
        parser.error("--workers needs at least 2: a debt cycle takes two")
    print(f"host: {platform.node()} ({cpu_model()}, {torch.get_num_threads()} torch threads), device: cpu, "
          f"torch {torch.__version__}", flush=True)
    print(f"{args.workers} builtin workers of C = {args.capacity_tokens} tokens, lending up to "
          f"{LEND_CAP_FRACTION:.0%}; per worker one client of long requests ({LONG_TOKENS[0]}-{LONG_TOKENS[1]} C) "
          f"and {SHORT_CLIENTS} of short ones; gManager epoch {args.epoch_s} s", flush=True)
    positions = max(int(LONG_TOKENS[1] * args.capacity_tokens) + LONG_OUTPUT[1],
                    2 * args.capacity_tokens + args.swap_tokens) + BLOCK_SIZE_TOKENS
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(Path(tmp) / "model", seed=0, spec=shape("tiny", positions))
        summary = asyncio.run(measure(args, model_dir))
    summary["device"] = "cpu"
    summary["quick"] = args.quick
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
