"""Migration's failure paths, its transport's authentication, and the KVMigration watcher.

Every abort path must leave both engines consistent (no KV held by anyone once the request ends, no
reservation left on the destination) and the client's stream whole: a migration that fails after
the request was stopped resumes it on the source, so the client sees a pause and nothing else.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from migration_testing import (
    CREDENTIALS,
    KV_CAPACITY_BYTES,
    FixedPort,
    Worker,
    body,
    fake_destination,
    read_sse,
    reference,
    start_worker,
    stream_with_migration,
    two_workers,
    wait_idle,
)
from worker_testing import EngineLoop

from kvfleet.serving.credentials import PoolCredentials, PoolSecrets
from kvfleet.worker.migration import target as target_module
from kvfleet.worker.migration.transport import AuthenticationError, TCPTransport, TransportError
from kvfleet.worker.migration.watcher import MigrationWatcher, WatcherConfig

# 2 layers x (K, V) x blocks x 16 tokens x 2 KV heads x 64 dims: the tiny model's KV block layout.
TINY_BLOCK_SHAPE = [2, 2, 1, 16, 2, 64]
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[tuple[Worker, Worker]]:
    yield from two_workers(tiny_model_dir, engine_loop)


def engine_blocks_free(worker: Worker) -> int:
    info = worker.agent.engine.info
    used = sum(r.kv_bytes for r in worker.agent.engine.kv_usage())
    return (info.kv_capacity_bytes - used) // (info.block_size_tokens * info.kv_bytes_per_token)


# --------------------------------------------------------------------------------------- aborts


def test_a_request_that_is_not_running_fails_and_changes_nothing(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    status, done = a.call("POST", "/v1/completions", body(max_tokens=4), **{"X-Request-Id": "finished-1"})
    assert status == 200, done
    result = a.migrate("finished-1", b, "kv")
    assert result["phase"] == "Failed"
    assert "not running on the source" in result["message"]
    result = a.migrate("never-was", b, "token")
    assert result["phase"] == "Failed"
    wait_idle(a, b)
    assert engine_blocks_free(a) == engine_blocks_free(b) == KV_CAPACITY_BYTES // (16 * 2048)


@pytest.mark.parametrize("mode", ["kv", "token"])
def test_a_destination_without_room_leaves_the_request_running_on_the_source(
        workers: tuple[Worker, Worker], tiny_model_dir: Path, engine_loop: EngineLoop, mode: str) -> None:
    a, _ = workers
    # One KV block: neither the long prompt's KV nor its re-prefill fits.
    small = start_worker("worker-small", tiny_model_dir, engine_loop, kv_capacity_bytes=16 * 2048)
    try:
        payload = body(prompt=LONG_PROMPT, max_tokens=120)
        ref_text, _ = reference(a, payload)
        streamed, result = stream_with_migration(a, small, f"no-room-{mode}", mode, payload=payload)
        assert result["phase"] == "Failed", result
        assert "keeps running on the source" in result["message"] or mode == "kv", result
        assert streamed.done
        assert streamed.text == ref_text
        wait_idle(a, small)
        assert engine_blocks_free(small) == 1
    finally:
        engine_loop.run(small.runner.cleanup())


def test_an_unreachable_destination_leaves_the_request_running(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    ref_text, _ = reference(a)
    dead_port = socket.socket()
    dead_port.bind(("127.0.0.1", 0))
    port = dead_port.getsockname()[1]
    dead_port.close()
    original = b.agent.migration_port
    try:
        b.agent._listener = FixedPort(port)  # type: ignore[assignment]
        streamed, result = stream_with_migration(a, b, "unreachable-1", "kv")
    finally:
        b.agent._listener = FixedPort(original)  # type: ignore[assignment]
    assert result["phase"] == "Failed"
    assert "unreachable" in result["message"]
    assert streamed.done and streamed.text == ref_text
    wait_idle(a, b)


@pytest.mark.parametrize("die_at", ["data", "commit"])
def test_a_destination_that_dies_mid_copy_leaves_the_request_running_on_the_source(
        workers: tuple[Worker, Worker], engine_loop: EngineLoop, die_at: str) -> None:
    a, b = workers
    ref_text, _ = reference(a)
    port, listener = fake_destination(engine_loop, die_at)
    try:
        b_real = b.agent._listener
        b.agent._listener = FixedPort(port)  # type: ignore[assignment]
        try:
            streamed, result = stream_with_migration(a, b, f"dies-at-{die_at}", "kv")
        finally:
            b.agent._listener = b_real
    finally:
        engine_loop.run(listener.close())
    assert result["phase"] == "Failed", result
    if die_at == "commit":  # stopped by then: resumed from its own KV on the source
        assert "keeps running on the source" in result["message"]
    assert streamed.done
    assert streamed.text == ref_text
    wait_idle(a, b)


def test_reservations_are_freed_when_the_source_goes_quiet_or_away(workers: tuple[Worker, Worker], engine_loop: EngineLoop,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _, b = workers
    free_before = engine_blocks_free(b)
    monkeypatch.setattr(target_module, "PREALLOCATION_TIMEOUT_S", 0.5)
    transport = TCPTransport(CREDENTIALS)
    port = b.agent.migration_port
    assert port is not None

    async def reserve(request_id: str) -> Any:
        channel = await transport.connect(f"127.0.0.1:{port}")
        await channel.send({"op": "begin", "request_id": request_id, "mode": "kv"})
        assert (await channel.recv(5)).header["ok"]
        shape = TINY_BLOCK_SHAPE[:2] + [3] + TINY_BLOCK_SHAPE[3:]
        await channel.send({"op": "stage", "first_block": 0, "num_tokens": 48, "block_size_tokens": 16, "shape": shape,
                            "dtype": "torch.float32"})
        assert (await channel.recv(5)).header["ok"]
        return channel

    quiet = engine_loop.run(reserve("quiet-1"))
    assert engine_blocks_free(b) == free_before - 3
    assert "quiet-1" not in {r.id for report in b.reports[-1:] for r in report.requests}
    deadline = time.monotonic() + 10
    while engine_blocks_free(b) != free_before:
        assert time.monotonic() < deadline, "the reservation outlived its timeout"
        time.sleep(0.05)
    quiet.close()
    gone = engine_loop.run(reserve("gone-1"))
    gone.close()
    deadline = time.monotonic() + 5
    while engine_blocks_free(b) != free_before:
        assert time.monotonic() < deadline, "a dropped connection left its reservation"
        time.sleep(0.05)


# -------------------------------------------------------------------------------- authentication


def test_the_migration_port_refuses_peers_without_the_pool_token(workers: tuple[Worker, Worker],
                                                                 engine_loop: EngineLoop) -> None:
    _, b = workers
    port = b.agent.migration_port
    free_before = engine_blocks_free(b)
    with pytest.raises(AuthenticationError):
        engine_loop.run(TCPTransport(PoolCredentials(PoolSecrets("not-the-token", b"not-the-key"))).connect(f"127.0.0.1:{port}"))
    # A peer that sends garbage instead of a proof is told no and cut off, before any frame is read.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        hello = raw.recv(40)
        assert hello.startswith(b"KVFLEET1")
        raw.sendall(os.urandom(64))
        assert raw.recv(1) == b"\x00"
        assert raw.recv(100) == b""
    # One that sends a frame right away (no handshake) gets nowhere either.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.recv(40)
        raw.sendall(b"\x00\x00\x00\x10" + b"\x00" * 8 + json.dumps({"op": "begin"}).encode().ljust(52))
        assert raw.recv(1) in (b"\x00", b"")
    assert engine_blocks_free(b) == free_before


def test_a_source_refuses_a_destination_that_cannot_prove_the_token(engine_loop: EngineLoop) -> None:
    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"KVFLEET1" + os.urandom(32))
        await reader.readexactly(64)
        writer.write(b"\x01" + os.urandom(32))  # "accepted", with a made-up proof
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    async def attempt() -> None:
        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await TCPTransport(CREDENTIALS).connect(f"127.0.0.1:{port}")
        finally:
            server.close()

    with pytest.raises(AuthenticationError):
        engine_loop.run(attempt())
    with pytest.raises(TransportError):
        engine_loop.run(TCPTransport(CREDENTIALS).connect("127.0.0.1:1", timeout_s=2))


# ------------------------------------------------------------------------------------ the watcher


class FakeKubernetes:
    """The watcher's four calls, with KVMigrations and pods held in memory."""

    def __init__(self, items: list[dict[str, Any]], pod_ips: dict[str, str]) -> None:
        self.items = items
        self.pod_ips = pod_ips
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def list(self) -> tuple[list[dict[str, Any]], str]:
        return list(self.items), "1"

    def watch(self, resource_version: str, timeout_s: int, stop: threading.Event) -> Any:
        stop.wait(timeout_s)
        return iter(())

    def patch_status(self, name: str, status: dict[str, Any]) -> None:
        with self.lock:
            self.patches.append((name, status))

    def pod_ip(self, pod_name: str) -> str | None:
        return self.pod_ips.get(pod_name)

    def statuses(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for n, s in self.patches if n == name]


def kvmigration(name: str, request_id: str, source: str, target: str, mode: str = "kv",
                phase: str | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": name}, "spec": {"pool": "p", "requestId": request_id, "sourcePod": source,
                                                                "targetPod": target, "mode": mode, "reason": "Update"}}
    if phase:
        obj["status"] = {"phase": phase}
    return obj


def test_the_watcher_runs_the_kvmigrations_naming_its_pod_and_reports_them(workers: tuple[Worker, Worker],
                                                                           engine_loop: EngineLoop) -> None:
    a, b = workers
    ref_text, _ = reference(a)
    conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body(), "stream": True}).encode(),
                 {"Content-Type": "application/json", "X-Request-Id": "watched-1"})
    response = conn.getresponse()
    fake = FakeKubernetes([
        kvmigration("m-ours", "watched-1", "worker-a", "worker-b"),
        kvmigration("m-other-source", "watched-1", "worker-c", "worker-b"),
        kvmigration("m-done", "watched-1", "worker-a", "worker-b", phase="Succeeded"),
        kvmigration("m-gone", "no-such-request", "worker-a", "worker-b", mode="token"),
        kvmigration("m-no-pod", "watched-1", "worker-a", "worker-z"),
    ], {"worker-b": "127.0.0.1"})
    port = b.agent.migration_port
    assert port is not None
    watcher = MigrationWatcher(WatcherConfig("worker-a", "ns", "p", http_port=b.port, migration_port=port), fake,
                               a.agent.migrate)
    # Start watching once the request is decoding on the source.
    streamed_box: list[Any] = []
    reader = threading.Thread(target=lambda: streamed_box.append(read_sse(response)))
    reader.start()
    deadline = time.monotonic() + 30
    while "watched-1" not in {r.request_id for r in a.agent.engine.kv_usage()}:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    task = asyncio.run_coroutine_threadsafe(watcher.run(), engine_loop.loop)
    try:
        reader.join(60)
        deadline = time.monotonic() + 30
        while not any(s.get("phase") in ("Succeeded", "Failed") for s in fake.statuses("m-ours")):
            assert time.monotonic() < deadline, fake.patches
            time.sleep(0.05)
    finally:
        task.cancel()
    ours = fake.statuses("m-ours")
    assert [s["phase"] for s in ours] == ["Transferring", "Succeeded"], ours
    assert ours[0]["startTime"].endswith("Z")
    done = ours[1]
    assert done["bytesMoved"] > 0 and done["tokensMoved"] > 0 and done["downtimeSeconds"] > 0
    assert done["downtime"].endswith("ms") or done["downtime"].endswith("s")
    assert done["completionTime"].endswith("Z") and "worker-b" in done["message"]
    assert fake.statuses("m-other-source") == [] and fake.statuses("m-done") == []
    assert [s["phase"] for s in fake.statuses("m-gone")] == ["Transferring", "Failed"]
    no_pod = fake.statuses("m-no-pod")
    assert no_pod[-1]["phase"] == "Failed" and "worker-z" in no_pod[-1]["message"]
    streamed = streamed_box[0]
    assert streamed.done and streamed.text == ref_text
    wait_idle(a, b)


def test_a_request_holding_no_kv_moves_as_tokens_when_kv_mode_is_asked(tiny_model_dir: Path, engine_loop: EngineLoop,
                                                                        workers: tuple[Worker, Worker]) -> None:
    """A preempted request (or one queued for blocks) holds no KV to copy: a KV migration moves it by
    its tokens instead, says so, and the client's stream is whole."""
    _, b = workers
    # 24 blocks: two requests that each grow past 12 blocks cannot both keep their KV.
    small = start_worker("worker-tight", tiny_model_dir, engine_loop, kv_capacity_bytes=24 * 16 * 2048)
    try:
        long_x = body(max_tokens=350)
        ref_text, _ = reference(small, body(max_tokens=300))
        answers: dict[str, Any] = {}

        def run(request_id: str, payload: dict[str, Any]) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", small.port, timeout=120)
            conn.request("POST", "/v1/completions", json.dumps({**payload, "stream": True}).encode(),
                         {"Content-Type": "application/json", "X-Request-Id": request_id})
            answers[request_id] = read_sse(conn.getresponse())

        threads = [threading.Thread(target=run, args=("x", long_x))]
        threads[0].start()
        deadline = time.monotonic() + 30
        while "x" not in {r.request_id for r in small.agent.engine.kv_usage()}:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        threads.append(threading.Thread(target=run, args=("y", body(max_tokens=300))))
        threads[1].start()

        def preempted() -> bool:
            return small.agent.live_request("y") is not None and "y" not in {
                r.request_id for r in small.agent.engine.kv_usage()} and small.agent.engine.num_waiting() == 1

        deadline = time.monotonic() + 60
        while not (preempted() and getattr(small.agent.engine, "num_preemptions", 0) > 0):
            assert time.monotonic() < deadline, "y was never preempted"
            time.sleep(0.002)
        result = small.migrate("y", b, "kv")
        for t in threads:
            t.join(120)
        assert result["phase"] == "Succeeded" and "holds no KV on the source" in result["message"], result
        assert answers["y"].done and answers["y"].text == ref_text
        wait_idle(small, b)
    finally:
        engine_loop.run(small.runner.cleanup())


def test_migrations_show_in_the_metrics_the_planner_is_configured_from(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    stream_with_migration(a, b, "metrics-kv", "kv")
    stream_with_migration(a, b, "metrics-token", "token", payload=body(prompt=LONG_PROMPT, max_tokens=200))
    wait_idle(a, b)
    _, source_metrics = a.call("GET", "/metrics", token=None)
    _, target_metrics = b.call("GET", "/metrics", token=None)
    source_text, target_text = source_metrics.decode(), target_metrics.decode()

    def value(text: str, name: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(name)]
        assert lines, f"{name} missing"
        return float(lines[0].rsplit(" ", 1)[1])

    assert value(source_text, 'kvfleet_worker_migrations_total{mode="kv",result="Succeeded"}') >= 1
    assert value(source_text, 'kvfleet_worker_migrations_total{mode="token",result="Succeeded"}') >= 1
    assert value(source_text, "kvfleet_worker_migration_link_bytes_per_second") > 0
    assert value(source_text, "kvfleet_worker_migration_bytes_total") > 0
    assert value(source_text, "kvfleet_worker_migration_downtime_seconds_count") >= 2
    # The token move re-prefilled the long prompt on b: its prefill speed is measured there.
    assert value(target_text, "kvfleet_worker_migration_prefill_tokens_per_second") > 0


def test_a_hybrid_move_copies_only_the_kv_the_planner_gave_its_link(workers: tuple[Worker, Worker]) -> None:
    """expectedBytes of a hybrid KVMigration (here kvBytes): two blocks go over the link, the rest of
    the request is re-prefilled at the target, and the client's stream is the unmigrated one."""
    a, b = workers
    payload = body(prompt=LONG_PROMPT, max_tokens=120)
    ref_text, _ = reference(a, payload)
    info = a.agent.engine.info
    block_bytes = info.block_size_tokens * info.kv_bytes_per_token
    streamed, result = stream_with_migration(a, b, "hybrid-limited", "hybrid", payload=payload, kv_bytes=2 * block_bytes)
    assert result["phase"] == "Succeeded" and result["mode"] == "hybrid", result
    assert result["bytesMoved"] == 2 * block_bytes, result
    assert streamed.done and streamed.text == ref_text
    wait_idle(a, b)
