"""rManager's lender side over the migration port (kvfleet.worker.distkv, Infinite-LLM §4.3, §4.6): a
builtin engine lends blocks of its own KV pool under a cap, stores a borrower's KV in them, answers
shipped queries with (out, lse) equal to attention over that KV, and takes the blocks back when the
lease is freed or its channel drops. Loopback TCP with the real transport and handshake."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from kvfleet.kernels.micro_attention_decode_reference import attention_with_lse
from kvfleet.serving.credentials import PoolCredentials, PoolSecrets
from kvfleet.worker.distkv.borrower import RemoteLease
from kvfleet.worker.distkv.lender import serve_lease
from kvfleet.worker.distkv.wire import LendingRefused
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.builtin.engine import BuiltinEngine
from kvfleet.worker.engines.builtin.lending import BuiltinKVLending
from kvfleet.worker.migration.transport import Channel, TCPTransport

TRANSPORT = TCPTransport(PoolCredentials(PoolSecrets("lending-token", b"lending-key")))
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 64, 16


@asynccontextmanager
async def lender(model_dir: Path, cap_blocks: int) -> AsyncIterator[tuple[BuiltinKVLending, BuiltinEngine, int]]:
    """A started builtin engine lending up to `cap_blocks` blocks, served on a loopback port."""
    engine = load_engine("builtin", EngineConfig(model_path=model_dir, kv_capacity_bytes=1024 * 2048, dtype="float32"))
    assert isinstance(engine, BuiltinEngine)
    await engine.start()
    lending = BuiltinKVLending(engine.scheduler, cap_blocks)
    assert engine._cache is not None and engine._executor is not None
    lending.open(engine._cache, engine._executor)

    async def handle(channel: Channel) -> None:
        await serve_lease(lending, channel, await channel.recv(5), BLOCK)

    listener = await TRANSPORT.listen("127.0.0.1", 0, handle)
    try:
        yield lending, engine, listener.port
    finally:
        await listener.close()
        lending.close()
        await engine.stop()


def test_a_lease_stores_kv_answers_queries_and_gives_the_blocks_back(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with lender(tiny_model_dir, cap_blocks=8) as (lending, engine, port):
            free_before = len(engine.scheduler.space.free)
            lease = RemoteLease(TRANSPORT, f"127.0.0.1:{port}", "req-1")
            await lease.lend(2)
            await lease.lend(2)  # grown: 4 blocks = 64 tokens
            assert lending.lent_blocks() == 4 and len(engine.scheduler.space.free) == free_before - 4
            gen = torch.Generator().manual_seed(0)
            kv = torch.randn(LAYERS, 2, 50, KV_HEADS, HEAD_DIM, generator=gen)
            await lease.write(0, kv[:, :, :30])
            await lease.write(30, kv[:, :, 30:])  # in two writes, across a block boundary
            q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=gen)
            for layer in range(LAYERS):
                for tokens in (1, 17, 50):
                    out, lse = await lease.attend(layer, q, tokens)
                    want_out, want_lse = attention_with_lse(q, kv[layer, 0, :tokens], kv[layer, 1, :tokens], HEAD_DIM**-0.5)
                    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
            # Query shipping: per step a query and its answer cross the wire, never the KV (§4.6).
            assert lease.bytes_received < kv[0].numel() * 4
            with pytest.raises(LendingRefused, match="blocks"):
                await lease.attend(0, q, 65)  # past what the lease holds
            await lease.free()
            assert lending.lent_blocks() == 0 and len(engine.scheduler.space.free) == free_before

    asyncio.run(scenario())


def test_the_cap_refuses_at_once_and_a_dropped_borrower_leaves_nothing_lent(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with lender(tiny_model_dir, cap_blocks=3) as (lending, engine, port):
            free_before = len(engine.scheduler.space.free)
            first = RemoteLease(TRANSPORT, f"127.0.0.1:{port}", "a")
            await first.lend(2)
            second = RemoteLease(TRANSPORT, f"127.0.0.1:{port}", "b")
            with pytest.raises(LendingRefused, match="cap of 3") as refused:
                await second.lend(2)  # first come, first served (§4.4)
            assert refused.value.room_blocks == 1  # the refusal says what it could lend instead
            await second.lend(1)  # what fits under the cap is still lent on the same channel
            assert lending.lent_blocks() == 3
            # A borrower that dies without freeing: its channel drops and the lender takes the blocks back.
            assert first._channel is not None
            first._channel.close()
            for _ in range(100):
                if lending.lent_blocks() == 1:
                    break
                await asyncio.sleep(0.02)
            assert lending.lent_blocks() == 1
            await second.free()
            assert len(engine.scheduler.space.free) == free_before

    asyncio.run(scenario())


def test_a_peer_without_the_pool_key_gets_no_lease(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with lender(tiny_model_dir, cap_blocks=3) as (lending, _, port):
            stranger = RemoteLease(TCPTransport(PoolCredentials(PoolSecrets("x", b"x"))), f"127.0.0.1:{port}", "c")
            with pytest.raises(LendingRefused, match="cannot reach"):
                await stranger.lend(1)
            assert lending.lent_blocks() == 0

    asyncio.run(scenario())
