"""DistKV on the builtin engine (Infinite-LLM §4.2-4.6): how long a context a few small workers serve
together, what borrowed KV costs a decode step, and how few bytes cross the wire for it.

DistKV makes three claims for borrowing KV blocks from other workers; this bench measures each on
this machine, all engines in one process talking over loopback TCP with the pool's real transport:
1. Longest context against the number of workers N = 1, 2, 4, each with C tokens of KV cache and
   lenders lending all of theirs (N = 1: the borrower alone). The longest prompt + output, in block
   steps, whose greedy output equals one big worker's (found by bisection; each size is checked
   against the big worker). Target: >= 0.8 x N x C.
2. Decode time per token of the same 2C-token prompt on one big worker holding it all (with the
   same DistAttention path, the fair baseline; also against SDPA) and on a worker of capacity C that
   borrows about half of it from one lender. The three run in alternating rounds (median kept), so
   load from elsewhere on the machine slows all alike; prefill is excluded (first to last streamed
   token). Target: borrowed / local <= 1.5. Where vLLM is installed, a fourth row borrows the same
   half from a vLLM worker (kvfleet's DistAttention backend, blocks of 128 tokens: a vLLM lender
   answers from its EngineCore through a socket of its own, engines/vllm/lending.py), against the
   same target. That lender is of C_v tokens where C_v holds 2C (the default and quick sizes), and
   then serves as the first lender of the same claims on vLLM workers (`measure_vllm`): one vLLM
   engine start less.
3. Bytes on the wire per decode step (the borrower's `wire_bytes()` deltas: queries out, partial
   outputs and log-sum-exps back, and the newest blocks spilled to the lender as the request grows)
   against the bytes that fetching the remote KV every step would move (§4.6, Fig. 12's argument).
   Target: well under 1 (< 0.1 here).

A missed target is printed as MISS, not raised: this is a measurement. Last line: one JSON object
(`max_context_tokens` keyed by "1", "2", "4", `borrowed_over_local_step`, `wire_bytes_query_over_kv`,
`device`, `capacity_tokens`, the targets and the rest of the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402
from _shapes import describe, shape  # noqa: E402

from kvfleet.serving.credentials import PoolCredentials, PoolSecrets  # noqa: E402
from kvfleet.worker.distkv.borrower import RemoteLease  # noqa: E402
from kvfleet.worker.distkv.creditors import Creditor, StaticCreditors  # noqa: E402
from kvfleet.worker.distkv.lender import serve_lease  # noqa: E402
from kvfleet.worker.distkv.options import DistKVOptions  # noqa: E402
from kvfleet.worker.engines.base import Engine, EngineConfig, EngineError, SamplingParams  # noqa: E402
from kvfleet.worker.engines.builtin.borrowing import BuiltinKVBorrowing  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine  # noqa: E402
from kvfleet.worker.engines.builtin.model import read_architecture, torch_dtype  # noqa: E402
from kvfleet.worker.engines.builtin.options import BuiltinOptions  # noqa: E402
from kvfleet.worker.engines.vllm.borrowing import VLLMKVBorrowing  # noqa: E402
from kvfleet.worker.migration.transport import Channel, Listener, TCPTransport  # noqa: E402
from kvfleet.worker.model.tiny import make_tiny  # noqa: E402

TRANSPORT = TCPTransport(PoolCredentials(PoolSecrets("bench-distkv-token", b"bench-distkv-key")))
BLOCK_SIZE_TOKENS = 16  # the builtin engine's block
VLLM_BLOCK_TOKENS = 128  # vLLM's on the CPU
WORKER_COUNTS = (1, 2, 4)
CONTEXT_TARGET = 0.8
STEP_TARGET = 1.5
# On a GPU, with the Triton kernels, the issue asks for less: 1.2.
GPU_STEP_TARGET = 1.2
WIRE_TARGET = 0.1


@dataclass
class WriteTally:
    """Bytes of KV the borrower wrote into leases (its oldest blocks moving out as the request grows):
    `wire_bytes()` counts them with the queries, and the per-step query traffic is the rest."""

    written_bytes: int = 0


class CountingLease(RemoteLease):
    """The real lease, counting what `write` ships (the bench's view; the engine's own counters stay as they are)."""

    def __init__(self, tally: WriteTally, transport: TCPTransport, address: str, lease_id: str) -> None:
        super().__init__(transport, address, lease_id)
        self._tally = tally

    async def write(self, start_token: int, kv: torch.Tensor) -> None:
        await super().write(start_token, kv)
        self._tally.written_bytes += kv.numel() * kv.element_size()


TALLY = WriteTally()
OPEN_LEASE = functools.partial(CountingLease, TALLY, TRANSPORT)


@dataclass(frozen=True)
class Served:
    """One request as its client saw it, with the borrower's wire and borrowed figures while it decoded."""

    tokens: list[int]
    decode_s_per_token: float
    # (sent, received, of which KV written) at the first and at the last streamed token: the decode
    # steps' traffic between them.
    wire_first: tuple[int, int, int]
    wire_last: tuple[int, int, int]
    # Bytes of this request's KV held by lenders, sampled at each streamed token but the last (the
    # last one is sent as the request ends and its leases go).
    borrowed_bytes: list[int]


@dataclass(frozen=True)
class Trial:
    """One context size tried against N workers: served with the big worker's output, or why not."""

    context_tokens: int
    ok: bool
    why: str


def prompt_of(num_tokens: int) -> list[int]:
    # Ids well inside the tiny model's vocabulary, a deterministic mix (no BOS needed by the engine).
    return [(7 * i + 3) % 1900 + 3 for i in range(num_tokens)]


def engine_config(model_dir: Path, device: str, dtype: str, capacity_tokens: int,
                  attention: Literal["sdpa", "distattention"], kv_bytes_per_token: int,
                  lend_cap_bytes: int = 0, borrow: bool = False) -> tuple[EngineConfig, BuiltinOptions]:
    return (EngineConfig(model_path=model_dir, kv_capacity_bytes=capacity_tokens * kv_bytes_per_token, dtype=dtype,
                         device=device),
            BuiltinOptions(attention=attention, distkv=DistKVOptions(lend_cap_bytes=lend_cap_bytes, borrow=borrow)))


@asynccontextmanager
async def started(config: tuple[EngineConfig, BuiltinOptions]) -> AsyncIterator[BuiltinEngine]:
    engine = BuiltinEngine(*config)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


# A lending engine and the loopback port its leases are served on.
Lender = tuple[Engine, Listener]


@asynccontextmanager
async def serving_leases(engine: Engine) -> AsyncIterator[Lender]:
    """Leases of a started engine's blocks served on a loopback port (as a worker's migration port does)."""
    async def handle(channel: Channel) -> None:
        await serve_lease(engine.capabilities.lending, channel, await channel.recv(5), engine.info.block_size_tokens)

    listener = await TRANSPORT.listen("127.0.0.1", 0, handle)
    try:
        yield engine, listener
    finally:
        await listener.close()


@asynccontextmanager
async def lender(config: tuple[EngineConfig, BuiltinOptions]) -> AsyncIterator[Lender]:
    """A started builtin engine lending its blocks."""
    async with started(config) as engine, serving_leases(engine) as served:
        yield served


@asynccontextmanager
async def vllm_started(model_dir: Path, dtype: str, capacity_tokens: int, kv_bytes_per_token: int,
                       lend_cap_tokens: int = 0, borrow: bool = False) -> AsyncIterator[Engine]:
    """A started vLLM engine attending through kvfleet's DistAttention backend, of `capacity_tokens` of KV
    (whole blocks of VLLM_BLOCK_TOKENS), lending up to `lend_cap_tokens` of it, borrowing if asked."""
    from kvfleet.worker.engines.vllm.engine import VLLMEngine
    from kvfleet.worker.engines.vllm.options import VLLMOptions

    engine = VLLMEngine(EngineConfig(model_path=model_dir, kv_capacity_bytes=capacity_tokens * kv_bytes_per_token,
                                     max_num_seqs=4, dtype=dtype),
                        VLLMOptions(attention="distattention", distkv=DistKVOptions(
                            lend_cap_bytes=lend_cap_tokens * kv_bytes_per_token, borrow=borrow)))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@asynccontextmanager
async def vllm_lender(model_dir: Path, dtype: str, capacity_tokens: int, kv_bytes_per_token: int) -> AsyncIterator[Lender]:
    """A started vLLM engine lending all of its `capacity_tokens` of KV (whole blocks of VLLM_BLOCK_TOKENS)."""
    async with (vllm_started(model_dir, dtype, capacity_tokens, kv_bytes_per_token, lend_cap_tokens=capacity_tokens)
                as engine, serving_leases(engine) as served):
        yield served


def lent_blocks(lenders: Sequence[Lender]) -> int:
    total = 0
    for engine, _ in lenders:
        lending = engine.capabilities.lending
        assert lending is not None
        total += lending.lent_blocks()
    return total


async def settle(lenders: Sequence[Lender], timeout_s: float = 10.0) -> None:
    """Until every lease of the last request is back (freed as it ends, asynchronously): the next trial
    must find the lenders empty."""
    deadline = time.monotonic() + timeout_s
    while lent_blocks(lenders) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    if lent_blocks(lenders):
        raise RuntimeError(f"{lent_blocks(lenders)} blocks still lent {timeout_s:.0f} s after the request ended")


def attach(borrower: Engine, lenders: Sequence[Lender], lend_bytes: int) -> None:
    """Fresh creditors for each request, so a refusal in one trial does not hide a lender from the next."""
    borrowing = borrower.capabilities.borrowing
    assert borrowing is not None
    borrowing.attach(OPEN_LEASE, StaticCreditors([Creditor(f"lender-{i}", f"127.0.0.1:{listener.port}", lend_bytes)
                                                  for i, (_, listener) in enumerate(lenders)]))


async def serve(engine: Engine, request_id: str, prompt: list[int], max_tokens: int, timeout_s: float) -> Served:
    """Greedy decode; the request is aborted if it has not ended within `timeout_s`."""
    # wire_bytes() is each engine's own counter, not part of the KVBorrowing capability.
    borrowing = engine.capabilities.borrowing
    wire_bytes = borrowing.wire_bytes if isinstance(borrowing, BuiltinKVBorrowing | VLLMKVBorrowing) else None
    tokens: list[int] = []
    times_s: list[float] = []
    wires: list[tuple[int, int, int]] = []
    borrowed: list[int] = []

    async def run() -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for step in engine.generate(request_id, prompt, params):
            if not step.new_token_ids:
                continue
            times_s.append(time.perf_counter())
            tokens.extend(step.new_token_ids)
            sent, received = wire_bytes() if wire_bytes is not None else (0, 0)
            wires.append((sent, received, TALLY.written_bytes))
            if not step.finished:
                borrowed.append(sum(r.borrowed_bytes for r in engine.kv_usage() if r.request_id == request_id))

    try:
        await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        await engine.abort(request_id)
        raise
    per_token_s = (times_s[-1] - times_s[0]) / (len(times_s) - 1) if len(times_s) > 1 else 0.0
    return Served(tokens, per_token_s, wires[0], wires[-1], borrowed)


async def try_context(borrower: Engine, reference: Engine, lenders: Sequence[Lender],
                      lend_bytes: int, context_tokens: int, output_tokens: int, timeout_s: float, seq: int) -> Trial:
    prompt = prompt_of(context_tokens - output_tokens)
    attach(borrower, lenders, lend_bytes)
    try:
        got = await serve(borrower, f"ctx{seq}", prompt, output_tokens, timeout_s)
    except TimeoutError:
        return Trial(context_tokens, False, f"not done within {timeout_s:.0f} s")
    except EngineError as err:  # refused at admission (RequestTooLong) or failed while borrowing
        return Trial(context_tokens, False, f"{type(err).__name__}: {err}")
    finally:
        await settle(lenders)
    want = await serve(reference, f"ref{seq}", prompt, output_tokens, timeout_s)
    if got.tokens != want.tokens:
        return Trial(context_tokens, False, f"greedy output differs from one big worker's: {got.tokens} != {want.tokens}")
    return Trial(context_tokens, True, "served, output equal")


async def longest_context(borrower: Engine, reference: Engine, lenders: Sequence[Lender],
                          capacity_tokens: int, kv_bytes_per_token: int, output_tokens: int,
                          timeout_s: float, block_tokens: int = BLOCK_SIZE_TOKENS) -> tuple[int, list[Trial]]:
    """The longest context (prompt + output, in whole blocks) N = len(lenders) + 1 workers serve, by
    bisection over block counts; the size one block past N x C is tried first, as the upper bound."""
    trials: list[Trial] = []

    async def ok(num_blocks: int) -> bool:
        trial = await try_context(borrower, reference, lenders, capacity_tokens * kv_bytes_per_token,
                                  num_blocks * block_tokens, output_tokens, timeout_s, len(trials))
        trials.append(trial)
        return trial.ok

    total_blocks = (len(lenders) + 1) * capacity_tokens // block_tokens
    low = -(-(output_tokens + 1) // block_tokens)  # the smallest context with a prompt
    if not await ok(low):
        return 0, trials
    high = total_blocks + 1
    while await ok(high):  # more than N x C served: a surprise, so find the real bound
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        if await ok(mid):
            low = mid
        else:
            high = mid
    return low * block_tokens, trials


async def decode_rounds(engines: Mapping[str, Engine], lenders_of: dict[str, tuple[Sequence[Lender], int]],
                        prompt: list[int], decode_tokens: int, rounds: int,
                        timeout_s: float) -> tuple[dict[str, list[Served]], list[int]]:
    """Each engine decodes the prompt once per round, in turn; also the big worker's greedy output. A row
    in `lenders_of` borrows from its lenders (each with the bytes it says it lends)."""
    served: dict[str, list[Served]] = {name: [] for name in engines}
    want: list[int] = []

    async def one(name: str, engine: Engine, request_id: str, max_tokens: int) -> Served:
        lenders, lend_bytes = lenders_of.get(name, ((), 0))
        if lenders:
            attach(engine, lenders, lend_bytes)
        result = await serve(engine, request_id, prompt, max_tokens, timeout_s)
        await settle(lenders)
        return result

    for name, engine in engines.items():  # warm-up: first-call allocations, connections
        warm = await one(name, engine, f"warm-{name}", 4)
        want = want or warm.tokens
    for r in range(rounds):
        for name, engine in engines.items():
            served[name].append(await one(name, engine, f"{name}-{r}", decode_tokens))
    return served, want


async def measure_vllm(args: argparse.Namespace, model_dir: Path, kv_bytes_per_token: int,
                       first_lender: Lender | None) -> dict[str, object]:
    """The same three claims for vLLM workers (engines/vllm/borrowing.py): a vLLM borrower on vLLM lenders,
    each of C_v tokens (whole 128-token blocks), lenders lending all of theirs. The decode rows compare
    a 1.5 C_v prompt on a big vLLM worker (the same DistAttention backend, all local) with the borrower
    holding C_v of it and one lender the rest. `first_lender`, when given, is the first of those lenders,
    already started (`measure`'s vLLM lender: a vLLM engine takes many seconds to start)."""
    capacity, block = args.vllm_capacity_tokens, VLLM_BLOCK_TOKENS
    counts = (1, 2) if args.quick else WORKER_COUNTS
    print(f"vLLM workers: C_v = {capacity} tokens ({capacity // block} blocks of {block}) per worker", flush=True)
    max_context: dict[str, int] = {}
    context_ratio: dict[str, float] = {}
    trials: dict[str, list[dict[str, object]]] = {}
    async with AsyncExitStack() as stack:
        reference = await stack.enter_async_context(started(engine_config(
            model_dir, "cpu", args.dtype, (max(counts) + 1) * capacity, "sdpa", kv_bytes_per_token)))
        borrower = await stack.enter_async_context(vllm_started(model_dir, args.dtype, capacity, kv_bytes_per_token,
                                                                borrow=True))
        lenders = [first_lender] if first_lender is not None else []
        lenders += [await stack.enter_async_context(vllm_lender(model_dir, args.dtype, capacity, kv_bytes_per_token))
                    for _ in range(max(counts) - 1 - len(lenders))]
        for n in counts:
            started_s = time.perf_counter()
            longest, tried = await longest_context(borrower, reference, lenders[: n - 1], capacity, kv_bytes_per_token,
                                                   args.output_tokens, args.timeout_s, block)
            max_context[str(n)] = longest
            context_ratio[str(n)] = longest / (n * capacity)
            trials[str(n)] = [{"context_tokens": t.context_tokens, "ok": t.ok, "why": t.why} for t in tried]
            print(f"vLLM N={n}: longest context served {longest} tokens = {context_ratio[str(n)]:.2f} x N x C_v "
                  f"({len(tried)} sizes tried in {time.perf_counter() - started_s:.1f} s)", flush=True)
        local = await stack.enter_async_context(vllm_started(model_dir, args.dtype, 4 * capacity, kv_bytes_per_token))
        prompt_tokens = 3 * capacity // 2
        served, want = await decode_rounds({"vllm_local": local, "vllm_borrowed": borrower},
                                           {"vllm_borrowed": ([lenders[0]], capacity * kv_bytes_per_token)},
                                           prompt_of(prompt_tokens), args.decode_tokens, args.rounds, args.timeout_s)
    step_ms = {name: 1000 * statistics.median(s.decode_s_per_token for s in runs) for name, runs in served.items()}
    ratio = step_ms["vllm_borrowed"] / step_ms["vllm_local"]
    equal = all(s.tokens[:len(want)] == want for runs in served.values() for s in runs)
    steps = args.decode_tokens - 1
    sent, received, written = (statistics.median((s.wire_last[i] - s.wire_first[i]) / steps for s in served["vllm_borrowed"])
                               for i in range(3))
    remote_kv_bytes = statistics.median(statistics.mean(s.borrowed_bytes[1:] or s.borrowed_bytes)
                                        for s in served["vllm_borrowed"])
    wire_ratio = (sent - written + received) / remote_kv_bytes if remote_kv_bytes else float("nan")
    borrowed_share = remote_kv_bytes / kv_bytes_per_token / (prompt_tokens + args.decode_tokens / 2)
    print(f"vLLM decode of a {prompt_tokens}-token prompt, {args.decode_tokens} tokens, median of {args.rounds} rounds: "
          f"all local {step_ms['vllm_local']:.2f} ms/token, {100 * borrowed_share:.0f}% borrowed "
          f"{step_ms['vllm_borrowed']:.2f} ms/token; greedy outputs {'equal' if equal else 'DIFFER'}; query bytes per "
          f"step {wire_ratio:.4f} x the remote KV", flush=True)
    context_met = all(context_ratio[str(n)] >= CONTEXT_TARGET for n in counts)
    for name, met, value in (
            (f"vLLM longest context >= {CONTEXT_TARGET} x N x C_v for N = {', '.join(map(str, counts))}", context_met,
             ", ".join(f"N={n}: {context_ratio[str(n)]:.2f}" for n in counts)),
            (f"vLLM borrowed decode step <= {STEP_TARGET} x all local (distattention)", ratio <= STEP_TARGET, f"{ratio:.2f}x"),
            (f"vLLM query bytes on the wire per step < {WIRE_TARGET} x the remote KV", wire_ratio < WIRE_TARGET,
             f"{wire_ratio:.4f}")):
        print(f"{'PASS' if met else 'MISS'} {name}: {value}")
    return {"capacity_tokens": capacity, "block_size_tokens": block, "max_context_tokens": max_context,
            "max_context_over_n_capacity": context_ratio, "context_target_met": context_met,
            "borrowed_over_local_step": ratio, "decode_ms_per_token": step_ms, "outputs_equal": equal,
            "borrowed_share": borrowed_share, "wire_bytes_query_over_kv": wire_ratio, "decode_prompt_tokens": prompt_tokens,
            "context_trials": trials}


async def measure(args: argparse.Namespace, model_dir: Path, device: str) -> dict[str, object]:
    """The builtin engine's figures, then, where vLLM is installed, the vLLM workers' (`vllm_workers`)."""
    kv_bytes_per_token = read_architecture(model_dir).kv_bytes_per_token(torch_dtype(args.dtype))
    # The decode rows' vLLM lender, when it is also the vLLM workers' first, lives on to their part.
    async with AsyncExitStack() as vllm_stack:
        summary, first_lender = await measure_builtin(args, model_dir, device, kv_bytes_per_token, vllm_stack)
        summary["vllm_workers"] = (await measure_vllm(args, model_dir, kv_bytes_per_token, first_lender)
                                   if args.vllm else None)
    return summary


async def measure_builtin(args: argparse.Namespace, model_dir: Path, device: str, kv_bytes_per_token: int,
                          vllm_stack: AsyncExitStack) -> tuple[dict[str, object], Lender | None]:
    """The three claims on builtin workers (the module's docstring), and the vLLM lender of the decode rows
    when it can serve `measure_vllm` as its first lender (then started on `vllm_stack`, to outlive this)."""
    capacity = args.capacity_tokens
    cfg = functools.partial(engine_config, model_dir, device, args.dtype, kv_bytes_per_token=kv_bytes_per_token)
    lend_all = capacity * kv_bytes_per_token
    prompt_tokens = 2 * capacity
    big_tokens = max(max(WORKER_COUNTS) * capacity, prompt_tokens + args.decode_tokens) + BLOCK_SIZE_TOKENS
    print(f"model: {args.shape} {describe(shape(args.shape, capacity))}, KV {kv_bytes_per_token} bytes a token "
          f"({args.dtype}, all layers), blocks of {BLOCK_SIZE_TOKENS} tokens; "
          f"C = {capacity} tokens ({capacity // BLOCK_SIZE_TOKENS} blocks, {lend_all // 1024} KiB) per worker", flush=True)
    shared_vllm_lender: Lender | None = None
    async with AsyncExitStack() as stack:
        big_sdpa = await stack.enter_async_context(started(cfg(big_tokens, "sdpa")))
        big_dist = await stack.enter_async_context(started(cfg(big_tokens, "distattention")))
        borrower = await stack.enter_async_context(started(cfg(capacity, "distattention", borrow=True)))
        lenders = [await stack.enter_async_context(lender(cfg(capacity, "distattention", lend_cap_bytes=lend_all)))
                   for _ in range(0 if args.skip_context else max(WORKER_COUNTS) - 1)]

        # 1. Longest context against N (a GPU run skips it: it is about the protocol, not the device).
        max_context: dict[str, int] = {}
        context_ratio: dict[str, float] = {}
        trials: dict[str, list[dict[str, object]]] = {}
        for n in () if args.skip_context else WORKER_COUNTS:
            started_s = time.perf_counter()
            longest, tried = await longest_context(borrower, big_sdpa, lenders[: n - 1], capacity, kv_bytes_per_token,
                                                   args.output_tokens, args.timeout_s)
            max_context[str(n)] = longest
            context_ratio[str(n)] = longest / (n * capacity)
            trials[str(n)] = [{"context_tokens": t.context_tokens, "ok": t.ok, "why": t.why} for t in tried]
            first_refused = min((t for t in tried if not t.ok), key=lambda t: t.context_tokens, default=None)
            print(f"N={n}: longest context served {longest} tokens = {context_ratio[str(n)]:.2f} x N x C "
                  f"({len(tried)} sizes tried in {time.perf_counter() - started_s:.1f} s)"
                  + (f"; {first_refused.context_tokens} tokens: {first_refused.why[:160]}" if first_refused else ""),
                  flush=True)

        # 2 and 3. Decode steps, all local against half borrowed from one lender (its own, room for 2C),
        # builtin and, where vLLM is installed, vLLM.
        half_lender = await stack.enter_async_context(lender(cfg(2 * capacity, "distattention", lend_cap_bytes=2 * lend_all)))
        engines = {"local_sdpa": big_sdpa, "local_distattention": big_dist, "borrowed": borrower}
        lenders_of: dict[str, tuple[Sequence[Lender], int]] = {"borrowed": ([half_lender], 2 * lend_all)}
        if args.vllm:
            # Room for 2C in whole vLLM blocks; one of the vLLM workers' lenders (C_v) when C_v has that room
            # (it does at the default and quick sizes): the half it lends is the same either way.
            half_tokens = -(-2 * capacity // VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS
            if half_tokens <= args.vllm_capacity_tokens:
                half_vllm = shared_vllm_lender = await vllm_stack.enter_async_context(vllm_lender(
                    model_dir, args.dtype, args.vllm_capacity_tokens, kv_bytes_per_token))
            else:
                half_vllm = await stack.enter_async_context(vllm_lender(model_dir, args.dtype, half_tokens,
                                                                        kv_bytes_per_token))
            engines["borrowed_vllm_lender"] = borrower
            lenders_of["borrowed_vllm_lender"] = ([half_vllm], 2 * lend_all)
        served, want = await decode_rounds(engines, lenders_of, prompt_of(prompt_tokens), args.decode_tokens,
                                           args.rounds, args.timeout_s)
    step_ms = {name: 1000 * statistics.median(s.decode_s_per_token for s in runs) for name, runs in served.items()}
    borrowed_over_local = step_ms["borrowed"] / step_ms["local_distattention"]
    vllm_lender_over_local = step_ms["borrowed_vllm_lender"] / step_ms["local_distattention"] if args.vllm else None
    borrowed_over_sdpa = step_ms["borrowed"] / step_ms["local_sdpa"]
    outputs_equal = all(s.tokens[:len(want)] == want for runs in served.values() for s in runs) and all(
        s.tokens == served["local_sdpa"][0].tokens for runs in served.values() for s in runs)
    steps = args.decode_tokens - 1
    sent_per_step, received_per_step, written_per_step = (
        statistics.median((s.wire_last[i] - s.wire_first[i]) / steps for s in served["borrowed"]) for i in range(3))
    query_per_step = sent_per_step - written_per_step + received_per_step
    remote_kv_bytes = statistics.median(statistics.mean(s.borrowed_bytes[1:] or s.borrowed_bytes) for s in served["borrowed"])
    remote_tokens = remote_kv_bytes / kv_bytes_per_token
    borrowed_share = remote_tokens / (prompt_tokens + args.decode_tokens / 2)
    wire_ratio = query_per_step / remote_kv_bytes if remote_kv_bytes else float("nan")
    wire_all_ratio = (sent_per_step + received_per_step) / remote_kv_bytes if remote_kv_bytes else float("nan")
    print(f"decode of a {prompt_tokens}-token prompt, {args.decode_tokens} tokens, median of {args.rounds} rounds: "
          f"all local sdpa {step_ms['local_sdpa']:.2f} ms/token, all local distattention "
          f"{step_ms['local_distattention']:.2f} ms/token, {100 * borrowed_share:.0f}% borrowed {step_ms['borrowed']:.2f} ms/token"
          + (f", the same from a vLLM lender {step_ms['borrowed_vllm_lender']:.2f} ms/token" if args.vllm else "")
          + f"; greedy outputs {'equal' if outputs_equal else 'DIFFER'}", flush=True)
    print(f"wire per decode step: {sent_per_step - written_per_step:.0f} bytes of queries out, {received_per_step:.0f} "
          f"back (partial outputs, lse), and {written_per_step:.0f} of the request's newest KV moving into the lease "
          f"(the whole traffic is {wire_all_ratio:.4f} x the remote KV); fetching the {remote_tokens:.0f} remote tokens' KV "
          f"each step instead: {remote_kv_bytes:.0f} bytes", flush=True)
    context_met = all(context_ratio[str(n)] >= CONTEXT_TARGET for n in WORKER_COUNTS) if not args.skip_context else None
    step_target = GPU_STEP_TARGET if args.gpu else STEP_TARGET
    step_met = borrowed_over_local <= step_target
    vllm_step_met = None if vllm_lender_over_local is None else vllm_lender_over_local <= step_target
    wire_met = wire_ratio < WIRE_TARGET
    for name, met, value in (
            (f"longest context >= {CONTEXT_TARGET} x N x C for N = 1, 2, 4", context_met,
             ", ".join(f"N={n}: {context_ratio[str(n)]:.2f}" for n in WORKER_COUNTS) if context_ratio else "not measured"),
            (f"borrowed decode step <= {step_target} x all local (distattention)", step_met, f"{borrowed_over_local:.2f}x"
             f" (vs sdpa {borrowed_over_sdpa:.2f}x)"),
            (f"borrowed from a vLLM lender, decode step <= {step_target} x all local (distattention)", vllm_step_met,
             "not measured (no vLLM)" if vllm_lender_over_local is None else f"{vllm_lender_over_local:.2f}x"),
            (f"query bytes on the wire per step < {WIRE_TARGET} x the remote KV", wire_met, f"{wire_ratio:.4f}")):
        print(f"{'SKIP' if met is None else 'PASS' if met else 'MISS'} {name}: {value}")
    return {
        "vllm_workers": None,  # `measure` fills it in
        "max_context_tokens": max_context, "max_context_over_n_capacity": context_ratio,
        "borrowed_over_local_step": borrowed_over_local, "borrowed_over_local_sdpa_step": borrowed_over_sdpa,
        "vllm_lender_over_local_step": vllm_lender_over_local,
        "wire_bytes_query_over_kv": wire_ratio, "device": device, "capacity_tokens": capacity,
        "block_size_tokens": BLOCK_SIZE_TOKENS, "kv_bytes_per_token": kv_bytes_per_token,
        "step_target": step_target,
        "targets_met": {"max_context": context_met, "borrowed_over_local_step": step_met,
                        "vllm_lender_over_local_step": vllm_step_met, "wire_bytes_query_over_kv": wire_met},
        "decode_ms_per_token": step_ms, "decode_prompt_tokens": prompt_tokens, "decode_tokens": args.decode_tokens,
        "rounds": args.rounds, "borrowed_share": borrowed_share, "outputs_equal": outputs_equal,
        "wire_bytes_all_over_kv": wire_all_ratio,
        "wire_bytes_per_step": {"sent": sent_per_step, "received": received_per_step, "kv_written": written_per_step,
                                "query": query_per_step, "remote_kv": remote_kv_bytes},
        "context_output_tokens": args.output_tokens, "context_trials": trials,
    }, shared_vllm_lender


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds (the test suite's run)")
    parser.add_argument("--capacity-tokens", type=int, help="C, KV tokens per worker, whole blocks (default 256; quick 64)")
    parser.add_argument("--output-tokens", type=int, default=4, help="output tokens of each longest-context request")
    parser.add_argument("--decode-tokens", type=int, help="tokens decoded per timed request (default 64; quick 8)")
    parser.add_argument("--rounds", type=int, help="timed rounds, median kept (default 5; quick 2)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="a request not done by then counts as not served")
    parser.add_argument("--shape", default="tiny", help="model shape (bench/_shapes.py; default tiny)")
    parser.add_argument("--dtype", default="float32", help="weights and KV dtype (default float32)")
    parser.add_argument("--model-dir", type=Path, help="where the model is (built with make_tiny if missing)")
    parser.add_argument("--skip-context", action="store_true", help="leave out the longest-context search")
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU run: llama-1b in bfloat16, C = 4096 tokens, the decode steps only (about a minute)")
    parser.add_argument("--skip-vllm", action="store_true", help="leave out vLLM workers (a vLLM lender, vLLM borrowers)")
    parser.add_argument("--vllm-capacity-tokens", type=int,
                        help="C_v, KV tokens per vLLM worker, whole 128-token blocks (default 512; quick 256)")
    args = parser.parse_args()
    # vLLM's CUDA build is not installed on the GPU machines (docs/gpu.md): the vLLM row is a CPU row.
    args.vllm = not args.skip_vllm and not args.gpu and find_spec("vllm") is not None
    if args.gpu:
        args.shape, args.dtype, args.skip_context = "llama-1b", "bfloat16", True
        args.capacity_tokens = args.capacity_tokens or 4096
        args.rounds = args.rounds or 3
    args.capacity_tokens = args.capacity_tokens or (64 if args.quick else 256)
    args.vllm_capacity_tokens = args.vllm_capacity_tokens or (256 if args.quick else 512)
    if args.vllm_capacity_tokens % VLLM_BLOCK_TOKENS or args.vllm_capacity_tokens < 2 * VLLM_BLOCK_TOKENS:
        parser.error(f"--vllm-capacity-tokens must be a multiple of {VLLM_BLOCK_TOKENS}, at least two blocks")
    args.decode_tokens = args.decode_tokens or (8 if args.quick else 64)
    args.rounds = args.rounds or (2 if args.quick else 5)
    if args.capacity_tokens % BLOCK_SIZE_TOKENS or args.capacity_tokens <= 0:
        parser.error(f"--capacity-tokens must be a positive multiple of {BLOCK_SIZE_TOKENS}")
    if args.decode_tokens < 2 or args.output_tokens < 1:
        parser.error("--decode-tokens needs at least 2 (a step between two tokens), --output-tokens at least 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"host: {platform.node()} ({cpu_model()}, {torch.get_num_threads()} torch threads), device: {device_name}, "
          f"torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        # Positions for the longest contexts tried: one block past N x C (builtin) and N x C_v (vLLM).
        positions = max(2 * args.capacity_tokens + args.decode_tokens + BLOCK_SIZE_TOKENS,
                        (max(WORKER_COUNTS) + 1) * args.vllm_capacity_tokens if args.vllm else 0)
        model_dir = make_tiny(args.model_dir or Path(tmp) / "model", seed=0, spec=shape(args.shape, positions))
        summary = asyncio.run(measure(args, model_dir, device))
    summary["device"] = device_name
    summary["quick"] = args.quick
    summary["shape"], summary["dtype"] = args.shape, args.dtype
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
