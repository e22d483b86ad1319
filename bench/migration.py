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

Last line: JSON with `kv_downtime_ms` and `token_downtime_ms` (each keyed by sequence length in
tokens) and `throughput_ratio_vs_socket`.
"""

from __future__ import annotations

import argparse
import asyncio
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
# Tokens each request decodes in all; it is migrated after MIGRATE_AFTER_TOKENS of them.
OUTPUT_TOKENS = 48
MIGRATE_AFTER_TOKENS = 4


# ------------------------------------------------------------------------------------ downtime


class Pod:
    def __init__(self, name: str, agent: Agent, runner: web.AppRunner, port: int) -> None:
        self.name = name
        self.agent = agent
        self.runner = runner
        self.port = port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def start_pod(name: str, model: Path) -> Pod:
    engine = load_engine("builtin", EngineConfig(model_path=model, kv_capacity_bytes=KV_CAPACITY_BYTES, max_model_len=2048))
    agent = Agent(AgentConfig(model_name="tiny", credentials=PoolCredentials.of(TOKEN), migration_host="127.0.0.1", migration_port=0),
                  engine, Tokenizer(model), None)
    runner = web.AppRunner(agent.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    while not agent.ready or agent.migration_port is None:
        await asyncio.sleep(0.05)
    return Pod(name, agent, runner, port)


async def migrate_once(session: aiohttp.ClientSession, source: Pod, target: Pod, length: int, mode: MoveMode,
                       tag: str) -> MigrationResult:
    """Streams a request of `length` prompt tokens from source, moves it mid-decode, reads it to the end."""
    rng = random.Random(length)
    prompt = [1] + [rng.randrange(3, 2000) for _ in range(length - 1)]
    request_id = f"bench-{tag}"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True,
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
        raise RuntimeError(f"migration of {request_id} failed: {result.message}")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with session.get(f"http://{target.address}/internal/requests/{request_id}/stream", headers=auth,
                           params={"after": str(index)}) as response:
        rest = await response.read()
    if not rest.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"the continuation of {request_id} did not end: {rest[-200:]!r}")
    return result


async def downtimes(model: Path, lengths: list[int], repeat: int) -> tuple[dict[str, dict[int, float]], float | None]:
    source, target = await start_pod("bench-source", model), await start_pod("bench-target", model)
    kv_link: list[float] = []
    samples: dict[str, dict[int, list[float]]] = {"kv": {n: [] for n in lengths}, "token": {n: [] for n in lengths}}
    try:
        async with aiohttp.ClientSession() as session:
            await migrate_once(session, source, target, 32, MoveMode.KV, "warm")  # first-call costs on both sides
            for r in range(repeat):
                for length in lengths:
                    for mode in (MoveMode.KV, MoveMode.TOKEN):
                        # Alternate the direction so both pods see the same mix of work.
                        a, b = (source, target) if r % 2 == 0 else (target, source)
                        result = await migrate_once(session, a, b, length, mode, f"{mode}-{length}-{r}")
                        assert result.downtime_s is not None
                        samples[mode][length].append(result.downtime_s * 1000)
                        if mode == MoveMode.KV and result.link_bytes_per_s:
                            kv_link.append(result.link_bytes_per_s)
    finally:
        for pod in (source, target):
            await pod.runner.cleanup()
    medians = {mode: {n: statistics.median(v) for n, v in by_length.items()} for mode, by_length in samples.items()}
    return medians, statistics.median(kv_link) if kv_link else None


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
                        help="prompt lengths in tokens (at most 2000: the tiny model has 2048 positions)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--copy-mib", type=int, default=64, help="bytes of the throughput copy")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (the test runs this)")
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeat, args.copy_mib = [64, 256], 1, 8
    torch.set_num_threads(1)  # two engines and two transports share the machine, as two pods on a node would not
    print(f"host: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), python {platform.python_version()}, "
          f"torch {torch.__version__}, device cpu; downtime: two workers in this process; throughput: to a receiver process, loopback TCP", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny(args.model_dir or Path(tmp) / "tiny")
        medians, link = asyncio.run(downtimes(model, args.lengths, args.repeat))
        transport_bps, socket_bps = asyncio.run(throughput(args.copy_mib * 1024 * 1024, max(3, args.repeat * 2)))
    print(f"{'tokens':>8} {'KV downtime ms':>15} {'token downtime ms':>18}")
    for n in args.lengths:
        print(f"{n:>8} {medians['kv'][n]:>15.1f} {medians['token'][n]:>18.1f}")
    kv = [medians["kv"][n] for n in args.lengths]
    print(f"KV downtime, longest over shortest: {kv[-1] / kv[0]:.2f}x for {args.lengths[-1] / args.lengths[0]:.0f}x the tokens")
    ratio = transport_bps / socket_bps
    print(f"copy of {args.copy_mib} MiB: transport {transport_bps / 1e9:.2f} GB/s, raw socket {socket_bps / 1e9:.2f} GB/s, "
          f"ratio {ratio:.2f}")
    if link is not None:
        print(f"KV migrations' own copy rate (small stages, engine export/import included): {link / 1e9:.3f} GB/s")
    print(json.dumps({
        "kv_downtime_ms": {str(n): round(medians["kv"][n], 2) for n in args.lengths},
        "token_downtime_ms": {str(n): round(medians["token"][n], 2) for n in args.lengths},
        "throughput_ratio_vs_socket": round(ratio, 3),
        "transport_bytes_per_s": round(transport_bps), "socket_bytes_per_s": round(socket_bps),
        "migration_link_bytes_per_s": round(link) if link else None,
        "host": platform.node(), "cpus": os.cpu_count(), "device": "cpu",
    }))


if __name__ == "__main__":
    main()
