#!/usr/bin/env python3
"""Load: a thousand concurrent streaming requests through one router to three CPU workers,
and what the router does under them: no errors, bounded memory, its latency and its overhead.

Why: the router is the one process every request of a pool passes through. Under a burst larger
than its pool can run it must not fail requests: the engines queue what they cannot run yet, the
router relays at most `max_in_flight` at once and answers the rest 429 `router_busy` with
Retry-After (docs/router.md), and a client that waits Retry-After and retries is served. Its memory
must stay bounded by what it relays, not grow with what it has seen.

Three builtin workers (`python -m kvfleet.worker`, the tiny model, float32, one torch thread each)
and the router (`python -m kvfleet.router --worker ...`'s own entrypoint, started through this file
only to add a read-only `GET /bench/router-state` with its in-flight, reservation and prefix-state
sizes) run as subprocesses on loopback, each its own process, so the router's RSS
(/proc/<pid>/status VmRSS, VmHWM) is its own. KVFLEET_POOL_TOKEN is set in all of them, so the
router reads the workers' KV facts and places by KV bytes. The client (aiohttp, this process) starts
every request within `--burst-s` (default 0: all at once; a short prompt of token ids, `stream: true`, a fixed number of
output tokens, `ignore_eos`), retries a 429 after its Retry-After (bounded), and counts as errors
anything else: another status, a stream without `[DONE]` or with an error event, a wrong token
count, a timeout.

The router runs with its default limit (1,024 in flight: the full run admits all 1,000 at once) unless
`--max-in-flight` says otherwise. Baselines in the same run (the house rule: ratios, not absolute
speeds): where the router's limit refuses some, the same workload through a second router that admits
every request at once (`router-all`: no 429s, the relay and placement alone); sent straight to the
same three workers, round-robin, no router (the router's overhead); and straight to one worker (what
one worker does alone). A limited router's tokens/s includes the clients' waits after a 429
(Retry-After is whole seconds), so its ratio is what a client sees, the admission policy included,
not the relay's cost alone. The router's CPU per relayed token is printed beside the workers' CPU per
generated token (the direct phase's): the two share the machine's cores here.

    python bench/load.py                      # 1,000 requests x 32 tokens, about a minute on 2 cores
    python bench/load.py --max-in-flight 256  # with 429s: a router-all phase too
    python bench/load.py --quick              # 100 requests x 8 tokens, max_in_flight 32 (make test runs it)

Prints the machine first, a table, and as its last line one JSON object: requests, errors,
refused_429, retries, ttft_p50_ms, ttft_p99_ms, tokens_per_s, router_rss_mib_before,
router_rss_mib_peak, router_rss_bytes_per_in_flight, router_cpu_us_per_token,
worker_cpu_us_per_token, device, and the baselines and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback import free_port, wait_ready  # noqa: E402
from _machine import cpu_model  # noqa: E402

# Module-level imports stay light (no torch, no kvfleet.worker): the router's subprocess runs this
# file too (`--router-child`), and its RSS is what is measured.

TOKEN = "bench-load-token"
STATE_PATH = "/bench/router-state"
# How often the router child records its state sizes' peaks, and the bench the router's RSS.
SAMPLE_S = 0.01
RSS_SAMPLE_S = 0.1
NUM_WORKERS = 3
# The documented Retry-After of router_busy is the router's retry_after_s (1 s); a value outside
# this range is not what docs/router.md promises and counts as an error.
RETRY_AFTER_BOUNDS_S = (1, 60)


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    burst_s: float
    max_retries: int
    seed: int = 0


@dataclass
class Outcome:
    ttft_s: float | None = None  # from the first attempt (429 waits included) to the first text
    admitted_ttft_s: float | None = None  # from the attempt that was admitted
    tokens: int = 0
    refused: int = 0
    retries: int = 0
    error: str | None = None


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome]
    elapsed_s: float
    samples: dict[str, float] = field(default_factory=dict)
    listen_overflows: int = 0
    # CPU seconds the workers used during the phase (all three, whichever served).
    workers_cpu_s: float = 0.0

    @property
    def refused(self) -> int:
        return sum(o.refused for o in self.outcomes)

    @property
    def retries(self) -> int:
        return sum(o.retries for o in self.outcomes)

    @property
    def errors(self) -> list[str]:
        return [o.error for o in self.outcomes if o.error is not None]

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.outcomes if o.error is None)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def ttfts_ms(self, admitted: bool = False) -> list[float]:
        values = [o.admitted_ttft_s if admitted else o.ttft_s for o in self.outcomes if o.error is None]
        return sorted(v * 1000 for v in values if v is not None)


def nearest_rank(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * pct // 100))
    return sorted_values[int(rank) - 1]


# ------------------------------------------------------------------------------- the router child

def router_child(argv: list[str]) -> int:
    """The router's own entrypoint (kvfleet.router.__main__.main, its flags and defaults) with one
    read-only route more: the sizes of the router's per-request state, which /metrics does not show."""
    from aiohttp import web

    from kvfleet.router import __main__ as entry
    from kvfleet.router.app import Router

    plain_app = Router.app

    def app_with_state(self: Router) -> web.Application:
        app = plain_app(self)
        peaks: dict[str, int] = {}

        def sizes() -> dict[str, int]:
            tree = self.prefix.tree
            return {"in_flight": self._in_flight, "reservations": len(self.loads.reservations()),
                    "prefix_queued": len(self.prefix._queued), "prefix_sessions": len(self.prefix._sessions),
                    "prefix_tree_blocks": tree.num_blocks if tree is not None else 0, "held": self.hold.num_held}

        async def sample_peaks() -> None:
            # In the router's own loop, so the peaks are not missed between two of the bench's reads.
            while True:
                for key, value in sizes().items():
                    peaks[key] = max(peaks.get(key, 0), value)
                await asyncio.sleep(SAMPLE_S)

        async def state(request: web.Request) -> web.Response:
            answer = {"now": sizes(), "peak": dict(peaks)}
            if request.query.get("reset"):
                peaks.clear()
            return web.json_response(answer)

        async def start_sampling(app: web.Application) -> None:
            app["bench_sampler"] = asyncio.create_task(sample_peaks())

        app.router.add_get(STATE_PATH, state)
        app.on_startup.append(start_sampling)
        return app

    Router.app = app_with_state  # type: ignore[method-assign]
    return entry.main(argv)


# ------------------------------------------------------------------------------------- processes

def listen_overflows() -> int:
    """The host's TcpExt ListenOverflows: connections dropped because a listener's accept queue was full
    (the client's SYN is retransmitted a second or more later: a delay, not an error)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split(), values.split(), strict=True)).get("ListenOverflows", 0))
    return 0


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (/proc/<pid>/stat utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class Processes:
    """The workers and the router as subprocesses, their logs in a directory, ended on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {self.tail(name)}")

    def tail(self, name: str, num_chars: int = 3000) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ----------------------------------------------------------------------------------------- client

def body_of(prompt: list[int], output_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def one_request(session: aiohttp.ClientSession, address: str, body: dict[str, Any], start_s: float,
                      max_retries: int) -> Outcome:
    """One streamed completion, retried after each 429's Retry-After up to `max_retries` times."""
    await asyncio.sleep(start_s)
    out = Outcome()
    started = time.perf_counter()
    try:
        while True:
            attempt = time.perf_counter()
            async with session.post(f"http://{address}/v1/completions", json=body) as resp:
                if resp.status == 429:
                    out.refused += 1
                    payload = await resp.json(content_type=None)
                    code = (payload.get("error") or {}).get("code")
                    retry_after = resp.headers.get("Retry-After", "")
                    if code != "router_busy":
                        out.error = f"429 with code {code!r}, not router_busy"
                        return out
                    if not retry_after.isdigit() or not RETRY_AFTER_BOUNDS_S[0] <= int(retry_after) <= RETRY_AFTER_BOUNDS_S[1]:
                        out.error = f"429 with Retry-After {retry_after!r}, outside {RETRY_AFTER_BOUNDS_S} s"
                        return out
                    if out.retries >= max_retries:
                        out.error = f"still 429 after {max_retries} retries"
                        return out
                    out.retries += 1
                    await asyncio.sleep(int(retry_after))
                    continue
                if resp.status != 200:
                    out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return out
                done = False
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        out.error = f"error event: {str(chunk['error'])[:200]}"
                        return out
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("text") and out.ttft_s is None:
                        now = time.perf_counter()
                        out.ttft_s, out.admitted_ttft_s = now - started, now - attempt
                    if chunk.get("usage"):
                        out.tokens = int(chunk["usage"]["completion_tokens"])
                if not done:
                    out.error = "stream ended without [DONE]"
                elif out.tokens != body["max_tokens"]:
                    out.error = f"{out.tokens} tokens, not {body['max_tokens']}"
                return out
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"[:200]
        return out


async def sample_rss(pid: int, into: dict[str, float]) -> None:
    """The router's largest RSS while the load runs (VmHWM gives the peak too; this says when)."""
    while True:
        try:
            into["rss_bytes_max"] = max(into.get("rss_bytes_max", 0), proc_status_kib(pid, "VmRSS") * 1024)
        except (OSError, KeyError):
            pass
        await asyncio.sleep(RSS_SAMPLE_S)


async def run_phase(name: str, addresses: list[str], work: Workload, prompts: list[list[int]],
                    router_pid: int | None = None, worker_pids: tuple[int, ...] = ()) -> Phase:
    """Every request of the workload, started within work.burst_s, spread round-robin over `addresses`."""
    rng = random.Random(work.seed + 1)
    starts = sorted(rng.uniform(0, work.burst_s) for _ in prompts)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=300)
    samples: dict[str, float] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sampler = asyncio.create_task(sample_rss(router_pid, samples)) if router_pid is not None else None
        overflows_before = listen_overflows()
        workers_cpu_before_s = sum(proc_cpu_s(pid) for pid in worker_pids)
        began = time.perf_counter()
        outcomes = await asyncio.gather(*(
            one_request(session, addresses[i % len(addresses)], body_of(p, work.output_tokens), starts[i], work.max_retries)
            for i, p in enumerate(prompts)))
        elapsed_s = time.perf_counter() - began
        workers_cpu_s = sum(proc_cpu_s(pid) for pid in worker_pids) - workers_cpu_before_s
        overflows = listen_overflows() - overflows_before
        if sampler is not None:
            sampler.cancel()
    return Phase(name, list(outcomes), elapsed_s, samples, overflows, workers_cpu_s)


async def router_state(address: str, reset: bool = False) -> dict[str, dict[str, int]]:
    """The router's state sizes now and their peaks since the last reset."""
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://{address}{STATE_PATH}", params={"reset": "1"} if reset else {}) as resp:
        return dict(await resp.json())


async def warm_up(addresses: list[str], work: Workload) -> None:
    """A few requests to each address first: model information, tokenizer and first-step costs are
    paid before anything is measured."""
    rng = random.Random(work.seed + 2)
    async with aiohttp.ClientSession() as session:
        outcomes = await asyncio.gather(*(
            one_request(session, a, body_of([rng.randrange(3, 2048) for _ in range(work.prompt_tokens)],
                                            work.output_tokens), 0.0, 10)
            for a in addresses for _ in range(2)))
    failed = [o.error for o in outcomes if o.error]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[:3]}")


@dataclass
class RouterRun:
    """One router process under the load: its phase, and its memory, CPU and state around it."""

    phase: Phase
    rss_before: int
    rss_peak: int
    rss_after: int
    cpu_s: float
    state_before: dict[str, int]
    state_peak: dict[str, int]
    state_after: dict[str, int]

    @property
    def peak_in_flight(self) -> int:
        return self.state_peak.get("in_flight", 0)

    @property
    def bytes_per_in_flight(self) -> float | None:
        """The RSS the load added at its peak, per request relayed at once at the peak."""
        return (self.rss_peak - self.rss_before) / self.peak_in_flight if self.peak_in_flight else None


def measure_router(name: str, address: str, pid: int, work: Workload, prompts: list[list[int]],
                   worker_pids: tuple[int, ...]) -> RouterRun:
    # VmHWM is the process's peak since it started: the phases run one router each, so it is this one's.
    rss_before = proc_status_kib(pid, "VmRSS") * 1024
    state_before = asyncio.run(router_state(address, reset=True))["now"]
    cpu_before_s = proc_cpu_s(pid)
    phase = asyncio.run(run_phase(name, [address], work, prompts, pid, worker_pids))
    cpu_s = proc_cpu_s(pid) - cpu_before_s
    rss_peak = max(proc_status_kib(pid, "VmHWM") * 1024, int(phase.samples.get("rss_bytes_max", 0)))
    state_after = asyncio.run(router_state(address))
    return RouterRun(phase, rss_before, rss_peak, proc_status_kib(pid, "VmRSS") * 1024, cpu_s, state_before,
                     state_after["peak"], state_after["now"])


# ------------------------------------------------------------------------------------------- main

def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--router-child":
        return router_child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="100 requests x 8 tokens, max_in_flight 32")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--burst-s", type=float, default=0.0, help="every request starts within this many seconds")
    p.add_argument("--max-in-flight", type=int, default=None, help="the router's (default: its own, 1024; quick: 32)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="each worker's")
    p.add_argument("--locality", default="prompt-tree", choices=("none", "session", "prompt-tree"),
                   help="the router's prefix locality (prompt-tree: workers cache prefixes)")
    p.add_argument("--max-retries", type=int, default=600, help="429 retries one request may make")
    p.add_argument("--model-dir", type=Path, default=None, help="where to build the model (default: a temp dir)")
    p.add_argument("--no-one-worker", action="store_true", help="skip the one-worker baseline")
    args = p.parse_args()
    num_requests = args.requests or (100 if args.quick else 1000)
    output_tokens = args.output_tokens or (8 if args.quick else 32)
    from kvfleet.router.app import RouterConfig

    # The full run's router is the default one; the quick run's limit is small, so that make test
    # sees 429s and their retries.
    max_in_flight = args.max_in_flight or (32 if args.quick else RouterConfig("").max_in_flight)
    work = Workload(num_requests, args.prompt_tokens, output_tokens, args.burst_s, args.max_retries)

    import torch  # here, not at the top: the router child must not load it

    from kvfleet.worker.model.tiny import TINY, make_tiny

    scratch = args.model_dir or Path(tempfile.mkdtemp())
    model_dir = make_tiny(scratch / "load-bench-model")
    log_dir = Path(tempfile.mkdtemp(prefix="load-bench-logs-"))
    kv_bytes_per_token = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4
    # Room for max_num_seqs whole requests per worker: the router's reservations fill a worker at
    # that point and queue the rest where MELL says (placement.py), as a full pool would.
    capacity_bytes = args.max_num_seqs * (work.prompt_tokens + work.output_tokens) * kv_bytes_per_token
    print(f"host: {platform.node()} ({cpu_model()}, {os.cpu_count()} cores), device: cpu, python {platform.python_version()}, "
          f"torch {torch.__version__}, aiohttp {aiohttp.__version__}")
    print(f"workload: {work.num_requests} streaming requests started within {work.burst_s:g} s, prompts of "
          f"{work.prompt_tokens} token ids, {work.output_tokens} output tokens each; {NUM_WORKERS} builtin workers "
          f"(tiny model, float32, 1 torch thread, max_num_seqs {args.max_num_seqs}, KV {capacity_bytes / 2**20:.1f} MiB); "
          f"router max_in_flight {max_in_flight}, locality {args.locality}", flush=True)

    env = {**os.environ, "KVFLEET_POOL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = Processes(log_dir)
    worker_addresses = [f"127.0.0.1:{free_port()}" for _ in range(NUM_WORKERS)]
    rng = random.Random(work.seed)
    # Distinct prompts: no request is served from another's cached prefix.
    prompts = [[rng.randrange(3, TINY.vocab_size) for _ in range(work.prompt_tokens)] for _ in range(work.num_requests)]
    # Each phase gets fresh prompts of the same shape (the workers' caches hold the earlier phases').
    fresh = iter(range(1, 100))

    def prompts_again() -> list[list[int]]:
        flip = next(fresh)
        return [[t ^ flip for t in q] for q in prompts]

    routers: list[RouterRun] = []
    worker_pids: list[int] = []
    try:
        for i, address in enumerate(worker_addresses):
            worker_pids.append(procs.start(f"worker-{i}", [
                sys.executable, "-m", "kvfleet.worker", "--engine", "builtin", "--model-path", str(model_dir),
                "--model-name", "tiny", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
                "--migration-port", "0", "--kv-capacity-bytes", str(capacity_bytes),
                "--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32", "--log-level", "WARNING",
                *(["--prefix-caching"] if args.locality != "none" else [])], env).pid)
        # The router as configured, and one admitting every request at once (no 429): the relay's
        # own cost apart from the admission policy's (the same router where the limit admits them
        # all). One at a time serves; the other idles.
        router_limits = {"router": max_in_flight}
        if max_in_flight < work.num_requests:
            router_limits["router-all"] = work.num_requests
        router_procs: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        for name, limit in router_limits.items():
            address = f"127.0.0.1:{free_port()}"
            router_procs[name] = address, procs.start(name, [
                sys.executable, str(Path(__file__).resolve()), "--router-child",
                *[a for w in worker_addresses for a in ("--worker", w)], "--host", "127.0.0.1",
                "--port", address.rsplit(":", 1)[1], "--max-in-flight", str(limit), "--locality", args.locality,
                "--log-level", "WARNING"], env)

        async def ready_all() -> None:
            async with aiohttp.ClientSession() as session:
                for a in [*worker_addresses, *(a for a, _ in router_procs.values())]:
                    await wait_ready(session, a, poll_s=0.2, check=procs.check_alive)
        asyncio.run(ready_all())
        asyncio.run(warm_up([*(a for a, _ in router_procs.values()), *worker_addresses], work))
        phases = []
        for name, (address, proc) in router_procs.items():
            run = measure_router(name, address, proc.pid, work, prompts if name == "router" else prompts_again(),
                                 tuple(worker_pids))
            routers.append(run)
            phases.append(run.phase)
            procs.check_alive()
        phases.append(asyncio.run(run_phase("direct-3", worker_addresses, work, prompts_again(),
                                            worker_pids=tuple(worker_pids))))
        if not args.no_one_worker:
            phases.append(asyncio.run(run_phase("direct-1", worker_addresses[:1], work, prompts_again())))
        procs.check_alive()
    except BaseException:
        for name, _ in procs.procs:
            print(f"--- {name} log tail ---\n{procs.tail(name)}", file=sys.stderr)
        raise
    finally:
        procs.stop()
    shutil.rmtree(log_dir, ignore_errors=True)

    by_name = {ph.name: ph for ph in phases}
    print(f"{'phase':>10} {'requests':>8} {'errors':>6} {'429s':>6} {'retries':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'admitted p50':>12} {'admitted p99':>12} {'tokens':>7} {'tokens/s':>9} {'elapsed':>8} {'SYN drops':>9}")
    for ph in phases:
        ttfts, admitted = ph.ttfts_ms(), ph.ttfts_ms(admitted=True)
        print(f"{ph.name:>10} {len(ph.outcomes):>8} {len(ph.errors):>6} {ph.refused:>6} "
              f"{ph.retries:>7} {nearest_rank(ttfts, 50):>7.0f}ms {nearest_rank(ttfts, 99):>7.0f}ms "
              f"{nearest_rank(admitted, 50):>10.0f}ms {nearest_rank(admitted, 99):>10.0f}ms {ph.tokens:>7} "
              f"{ph.tokens_per_s:>9.1f} {ph.elapsed_s:>7.1f}s {ph.listen_overflows:>9}")
        for reason, count in Counter(ph.errors).most_common(5):
            print(f"           error x{count}: {reason}")
    print("(TTFT from a request's first attempt, 429 waits included; admitted: from the attempt the router took; "
          "SYN drops: the host's TcpExt ListenOverflows during the phase, a full accept queue)")
    mib = 2**20
    for run in routers:
        print(f"{run.phase.name}: RSS {run.rss_before / mib:.1f} MiB before, {run.rss_peak / mib:.1f} MiB peak (VmHWM), "
              f"{run.rss_after / mib:.1f} MiB after; peak in flight {run.peak_in_flight} -> "
              + (f"{run.bytes_per_in_flight / 1024:.1f} KiB per in-flight request" if run.bytes_per_in_flight else "n/a")
              + f"; CPU {run.cpu_s:.1f} s ({run.cpu_s / run.phase.elapsed_s:.0%} of a core, "
              f"{run.cpu_s * 1000 / len(run.phase.outcomes):.1f} ms per request)")
        print(f"{run.phase.name}: state before {json.dumps(run.state_before)}; peak {json.dumps(run.state_peak)}; "
              f"after {json.dumps(run.state_after)}")
    routed, relay_only = routers[0], routers[-1]
    direct3 = by_name["direct-3"].tokens_per_s
    direct1 = by_name["direct-1"].tokens_per_s if "direct-1" in by_name else None

    def ratio(a: float, b: float | None) -> float | None:
        return round(a / b, 4) if b else None
    over3, over1 = ratio(routed.phase.tokens_per_s, direct3), ratio(routed.phase.tokens_per_s, direct1)
    relay_over3 = ratio(relay_only.phase.tokens_per_s, direct3)
    print(f"tokens/s against direct to the same 3 workers: router {over3}x"
          + (f" (its 429 waits included), router admitting all {relay_over3}x (the relay alone)" if len(routers) > 1
             else " (it admitted every request at once)")
          + (f"; router (3 workers) against direct to 1 worker: {over1}x" if over1 is not None else ""))
    # Where the CPU goes: the router's per token it relays, beside the workers' per token they generate
    # (in the direct phase: no router in the way).
    router_us_per_token = relay_only.cpu_s * 1e6 / max(1, relay_only.phase.tokens)
    worker_us_per_token = by_name["direct-3"].workers_cpu_s * 1e6 / max(1, by_name["direct-3"].tokens)
    print(f"CPU per token: router {router_us_per_token:.0f} us relayed ({relay_only.phase.name}), workers "
          f"{worker_us_per_token:.0f} us generated (direct-3): the router costs "
          f"{router_us_per_token / worker_us_per_token:.2f}x a worker's per token")
    ttfts = routed.phase.ttfts_ms()
    print(json.dumps({
        "requests": len(routed.phase.outcomes), "errors": len(routed.phase.errors),
        "refused_429": routed.phase.refused, "retries": routed.phase.retries,
        "ttft_p50_ms": round(nearest_rank(ttfts, 50), 1), "ttft_p99_ms": round(nearest_rank(ttfts, 99), 1),
        "admitted_ttft_p50_ms": round(nearest_rank(routed.phase.ttfts_ms(True), 50), 1),
        "admitted_ttft_p99_ms": round(nearest_rank(routed.phase.ttfts_ms(True), 99), 1),
        "tokens_per_s": round(routed.phase.tokens_per_s, 1),
        "router_rss_mib_before": round(routed.rss_before / mib, 2), "router_rss_mib_peak": round(routed.rss_peak / mib, 2),
        "router_rss_mib_after": round(routed.rss_after / mib, 2),
        "router_rss_bytes_per_in_flight": round(routed.bytes_per_in_flight) if routed.bytes_per_in_flight else None,
        "router_peak_in_flight": routed.peak_in_flight, "router_peak_state": routed.state_peak,
        "router_state_after": routed.state_after, "router_cpu_s": round(routed.cpu_s, 2),
        "listen_overflows": routed.phase.listen_overflows,
        "all_admitted_errors": len(relay_only.phase.errors), "all_admitted_tokens_per_s": round(relay_only.phase.tokens_per_s, 1),
        "all_admitted_ttft_p99_ms": round(nearest_rank(relay_only.phase.ttfts_ms(), 99), 1),
        "all_admitted_rss_mib_peak": round(relay_only.rss_peak / mib, 2),
        "all_admitted_rss_bytes_per_in_flight": round(relay_only.bytes_per_in_flight) if relay_only.bytes_per_in_flight else None,
        "all_admitted_peak_in_flight": relay_only.peak_in_flight,
        "direct_3_workers_tokens_per_s": round(direct3, 1),
        "direct_1_worker_tokens_per_s": round(direct1, 1) if direct1 is not None else None,
        "router_over_direct_3": over3, "router_over_direct_1": over1, "all_admitted_over_direct_3": relay_over3,
        "direct_errors": sum(len(by_name[n].errors) for n in ("direct-3", "direct-1") if n in by_name),
        "router_cpu_us_per_token": round(router_us_per_token, 1), "worker_cpu_us_per_token": round(worker_us_per_token, 1),
        "output_tokens": work.output_tokens, "max_in_flight": max_in_flight, "device": "cpu",
    }))
    return 0

if __name__ == "__main__":
    sys.exit(main())
