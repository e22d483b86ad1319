"""rManager's borrower side in the builtin engine (docs/distkv.md, Infinite-LLM §4.3, §4.6): a request
larger than its worker's whole KV cache is served with blocks other workers lend, over loopback TCP
with the real transport and handshake, and its greedy output equals one big worker's. A lender that
dies mid-request costs a re-prefill, not the stream; a pool without room refuses clearly."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest

from kvfleet.serving.credentials import PoolCredentials, PoolSecrets
from kvfleet.worker.distkv.borrower import RemoteLease
from kvfleet.worker.distkv.creditors import Creditor, StaticCreditors
from kvfleet.worker.distkv.lender import serve_lease
from kvfleet.worker.distkv.options import DistKVOptions
from kvfleet.worker.distkv.parts import RemoteParts
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import RequestTooLong, SamplingParams
from kvfleet.worker.engines.builtin.engine import BuiltinEngine
from kvfleet.worker.engines.builtin.options import BuiltinOptions
from kvfleet.worker.migration.transport import Channel, Listener, TCPTransport

TRANSPORT = TCPTransport(PoolCredentials(PoolSecrets("borrow-token", b"borrow-key")))
OPEN = functools.partial(RemoteLease, TRANSPORT)
BLOCK = 16
BLOCK_BYTES = BLOCK * 2048  # the tiny model: 2 layers x K,V x 2 kv heads x 64 x float32 = 2 KiB a token


def config(model_dir: Path, blocks: int, lend_cap_bytes: int = 0, borrow: bool = False,
           min_step_s: float = 0.0) -> tuple[EngineConfig, BuiltinOptions]:
    return (EngineConfig(model_path=model_dir, kv_capacity_bytes=blocks * BLOCK_BYTES, dtype="float32", min_step_s=min_step_s),
            BuiltinOptions(attention="distattention", distkv=DistKVOptions(lend_cap_bytes=lend_cap_bytes, borrow=borrow)))


@asynccontextmanager
async def lender(model_dir: Path, blocks: int, cap_blocks: int) -> AsyncIterator[tuple[BuiltinEngine, Listener]]:
    """A started builtin engine lending up to `cap_blocks` of its `blocks`, on a loopback port."""
    engine = load_engine("builtin", *config(model_dir, blocks, lend_cap_bytes=cap_blocks * BLOCK_BYTES))
    assert isinstance(engine, BuiltinEngine)
    await engine.start()

    async def handle(channel: Channel) -> None:
        await serve_lease(engine.capabilities.lending, channel, await channel.recv(5), BLOCK)

    listener = await TRANSPORT.listen("127.0.0.1", 0, handle)
    try:
        yield engine, listener
    finally:
        await listener.close()
        await engine.stop()


async def greedy(engine: BuiltinEngine, prompt: list[int], max_tokens: int, request_id: str = "r") -> list[int]:
    out: list[int] = []
    async for step in engine.generate(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
        out.extend(step.new_token_ids)
    return out


def prompt_of(n: int) -> list[int]:
    return [(7 * i + 3) % 250 + 1 for i in range(n)]


async def reference(model_dir: Path, prompt: list[int], max_tokens: int, blocks: int = 64) -> list[int]:
    """One big builtin worker's greedy output (`blocks` of 16 tokens hold the whole request)."""
    big = load_engine("builtin", EngineConfig(model_path=model_dir, kv_capacity_bytes=blocks * BLOCK_BYTES, dtype="float32"))
    assert isinstance(big, BuiltinEngine)
    await big.start()
    try:
        return await greedy(big, prompt, max_tokens)
    finally:
        await big.stop()


def test_a_request_three_times_the_workers_memory_equals_one_big_workers_greedy(tiny_model_dir: Path) -> None:
    prompt, max_tokens = prompt_of(150), 40  # 189 tokens of KV: 12 blocks, the borrower has 4

    async def scenario() -> None:
        want = await reference(tiny_model_dir, prompt, max_tokens)
        async with AsyncExitStack() as stack:
            lenders = [await stack.enter_async_context(lender(tiny_model_dir, 8, 6)) for _ in range(2)]
            borrower = load_engine("builtin", *config(tiny_model_dir, 4, borrow=True))
            assert isinstance(borrower, BuiltinEngine)
            await borrower.start()
            stack.push_async_callback(borrower.stop)
            borrowing = borrower.capabilities.borrowing
            assert borrowing is not None
            creditors = [Creditor(f"lender-{i}", f"127.0.0.1:{listener.port}", 6 * BLOCK_BYTES)
                         for i, (_, listener) in enumerate(lenders)]
            borrowing.attach(OPEN, StaticCreditors(creditors))

            seen_lent: list[int] = []
            stream = asyncio.create_task(greedy(borrower, prompt, max_tokens))
            while not stream.done():
                usage = borrower.kv_usage()
                if usage and usage[0].borrowed_bytes:
                    assert usage[0].kv_bytes <= 4 * BLOCK_BYTES  # only the local part is this worker's load
                    assert sum(borrowing.borrowed_bytes().values()) >= usage[0].borrowed_bytes
                    seen_lent.append(sum(engine.capabilities.lending.lent_blocks()  # type: ignore[union-attr]
                                         for engine, _ in lenders))
                await asyncio.sleep(0.005)
            assert await stream == want
            assert seen_lent and max(seen_lent) >= 8  # the first lender's 6 blocks, then the second's
            for _ in range(100):  # the leases are freed as the request ends
                if all(engine.capabilities.lending.lent_blocks() == 0 for engine, _ in lenders):  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.02)
            assert all(engine.capabilities.lending.lent_blocks() == 0 for engine, _ in lenders)  # type: ignore[union-attr]
            assert borrowing.borrowed_bytes() == {}
            assert len(borrower.scheduler.space.free) == 4

    asyncio.run(scenario())


def test_lenders_with_uneven_room_are_used_to_the_last_block(tiny_model_dir: Path) -> None:
    # 4 local + 6 + 6 lent = 16 blocks: a 256-token request (16 blocks) fits only if the first lender's
    # last 2 blocks are taken after a spill of 4 is refused there (the refusal says how many it has).
    prompt, max_tokens = prompt_of(252), 5

    async def scenario() -> None:
        want = await reference(tiny_model_dir, prompt, max_tokens)
        async with AsyncExitStack() as stack:
            lenders = [await stack.enter_async_context(lender(tiny_model_dir, 8, 6)) for _ in range(2)]
            borrower = load_engine("builtin", *config(tiny_model_dir, 4, borrow=True))
            assert isinstance(borrower, BuiltinEngine)
            await borrower.start()
            stack.push_async_callback(borrower.stop)
            assert borrower.capabilities.borrowing is not None
            borrower.capabilities.borrowing.attach(OPEN, StaticCreditors([
                Creditor(f"lender-{i}", f"127.0.0.1:{listener.port}", 6 * BLOCK_BYTES)
                for i, (_, listener) in enumerate(lenders)]))
            assert await greedy(borrower, prompt, max_tokens) == want

    asyncio.run(scenario())


def test_a_lender_that_dies_costs_a_re_prefill_elsewhere_not_the_stream(tiny_model_dir: Path) -> None:
    prompt, max_tokens = prompt_of(100), 60

    async def scenario() -> None:
        want = await reference(tiny_model_dir, prompt, max_tokens)
        async with AsyncExitStack() as stack:
            doomed_engine, doomed = await stack.enter_async_context(lender(tiny_model_dir, 16, 12))
            _, spare = await stack.enter_async_context(lender(tiny_model_dir, 16, 12))
            borrower = load_engine("builtin", *config(tiny_model_dir, 4, borrow=True, min_step_s=0.01))
            assert isinstance(borrower, BuiltinEngine)
            await borrower.start()
            stack.push_async_callback(borrower.stop)
            assert borrower.capabilities.borrowing is not None
            borrower.capabilities.borrowing.attach(OPEN, StaticCreditors([
                Creditor("doomed", f"127.0.0.1:{doomed.port}", 12 * BLOCK_BYTES),
                Creditor("spare", f"127.0.0.1:{spare.port}", 12 * BLOCK_BYTES)]))
            stream = asyncio.create_task(greedy(borrower, prompt, max_tokens))
            lending = doomed_engine.capabilities.lending
            assert lending is not None
            while lending.lent_blocks() == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.1)
            await doomed.close()  # the lender leaves: its listener and engine stop, its leases go
            await doomed_engine.stop()
            assert await asyncio.wait_for(stream, 60) == want
            assert borrower.num_preemptions >= 1

    asyncio.run(scenario())


def test_without_room_in_the_pool_the_request_is_refused_clearly(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        borrower = load_engine("builtin", *config(tiny_model_dir, 4, borrow=True))
        assert isinstance(borrower, BuiltinEngine)
        await borrower.start()
        try:
            assert borrower.capabilities.borrowing is not None
            borrower.capabilities.borrowing.attach(OPEN, StaticCreditors([
                Creditor("small", "127.0.0.1:9", 2 * BLOCK_BYTES)]))
            with pytest.raises(RequestTooLong, match="this engine has 4 and the pool can lend it 2 more"):
                borrower.generate("r", prompt_of(150), SamplingParams(max_tokens=10))
        finally:
            await borrower.stop()

    asyncio.run(scenario())


def test_borrowing_needs_distattention() -> None:
    with pytest.raises(Exception, match="distattention"):
        load_engine("builtin", EngineConfig(model_path=Path("/nonexistent")), BuiltinOptions(distkv=DistKVOptions(borrow=True)))


class _Remote:
    """A stand-in for a request's leases: only how many of its tokens they hold."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = self.lent_tokens = num_tokens

    def submit(self, layer_index: int, q: object) -> object:
        raise AssertionError("not run")


def test_the_scheduler_chunks_a_spanning_request_keeps_its_newest_blocks_and_never_preempts_it() -> None:
    from kvfleet.worker.engines.builtin.blocks import BlockPool
    from kvfleet.worker.engines.builtin.scheduler import ModelLimits, Request, Scheduler

    class Lenders:  # the scheduler's RemoteKVHooks: what the creditors offer, nothing to give back
        lendable_blocks = 0

        def borrowable_blocks(self, block_bytes: int) -> int:
            return self.lendable_blocks

        def release_remote(self, req: Request) -> None:
            pass

    async def scenario() -> None:
        lenders = Lenders()
        sched = Scheduler(max_num_seqs=4, block_size_tokens=BLOCK, seed=0, remote=lenders)
        sched.open(BlockPool(4, BLOCK_BYTES), ModelLimits(2048, 256, 2048), frozenset())
        with pytest.raises(RequestTooLong, match="this engine has 4$"):
            sched.new_request("r", prompt_of(100), [], SamplingParams(max_tokens=4))
        lenders.lendable_blocks = 6
        req = sched.new_request("r", prompt_of(100), [], SamplingParams(max_tokens=4))
        assert req.spans
        sched.enqueue(req)
        step = sched.schedule()
        assert step is not None and [len(e.token_ids) for e in step.entries] == [64]  # its 4 blocks' worth
        sched.process(step, [9])
        assert (req.num_cached, req.output) == (64, [])  # a chunk samples nothing
        assert sched.spanning_shortfall(req) == 3 and sched.schedule() is None  # 36 more tokens need 3 blocks
        # What builtin.borrowing's spill does: the 3 oldest blocks move to a lender.
        sched.space.release(req.blocks[:3])
        del req.blocks[:3]
        req.remote = _Remote(48)  # type: ignore[assignment]
        step = sched.schedule()
        assert step is not None
        entry = step.entries[0]
        assert (entry.start_position, len(entry.token_ids), entry.remote_tokens, len(entry.block_table)) == (64, 36, 48, 4)
        assert entry.extra_parts == (req.remote,)
        # An ordinary request arrives; blocks are short, and the spanning request is not the victim.
        other = sched.new_request("o", prompt_of(10), [], SamplingParams(max_tokens=4))
        sched.enqueue(other)
        sched.process(step, [7])
        assert req.output == [7] and req.state.value == "running"
        usage = {u.request_id: u for u in sched.kv_usage()}
        assert (usage["r"].kv_bytes, usage["r"].borrowed_bytes) == (4 * BLOCK_BYTES, 3 * BLOCK_BYTES)
        sched.abort(req)
        assert len(sched.space.free) == 4 and req.remote is None

    asyncio.run(scenario())


class _BrokenLease:
    """A lease whose lender takes the KV and then is never reachable for attention."""

    def __init__(self, address: str, lease_id: str) -> None:
        self.address, self.lease_id = address, lease_id
        self.blocks, self.block_size_tokens, self.bytes_sent, self.bytes_received = 0, BLOCK, 0, 0

    async def lend(self, num_blocks: int) -> None:
        self.blocks += num_blocks

    async def write(self, start_token: int, kv: object) -> None:
        pass

    async def attend(self, layer: int, q: object, num_tokens: int) -> tuple[object, object]:
        raise ConnectionResetError("the lender is gone")

    async def free(self) -> None:
        self.blocks = 0


def test_a_request_that_keeps_losing_its_lenders_fails_instead_of_looping(tiny_model_dir: Path) -> None:
    from kvfleet.worker.engines.base import EngineError
    from kvfleet.worker.engines.builtin.borrowing import MAX_LOSSES

    async def scenario() -> None:
        borrower = load_engine("builtin", *config(tiny_model_dir, 4, borrow=True))
        assert isinstance(borrower, BuiltinEngine)
        await borrower.start()
        try:
            assert borrower.capabilities.borrowing is not None
            borrower.capabilities.borrowing.attach(_BrokenLease, StaticCreditors([  # type: ignore[arg-type]
                Creditor("flaky", "127.0.0.1:9", 64 * BLOCK_BYTES)]))
            with pytest.raises(EngineError, match=f"lost the KV other workers lent it {MAX_LOSSES + 1} times"):
                await asyncio.wait_for(greedy(borrower, prompt_of(100), 5), 30)
            assert borrower.num_preemptions == MAX_LOSSES
            assert len(borrower.scheduler.space.free) == 4
        finally:
            await borrower.stop()

    asyncio.run(scenario())


def test_a_worker_refuses_a_request_longer_than_it_and_its_pool_hold_with_a_clear_400(tiny_model_dir: Path) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from kvfleet.worker.agent import Agent, AgentConfig
    from kvfleet.worker.text import Tokenizer

    async def scenario() -> None:
        engine = load_engine("builtin", *config(tiny_model_dir, 4, borrow=True))
        agent = Agent(AgentConfig(model_name="tiny", migration_port=None), engine, Tokenizer(tiny_model_dir), None)
        async with TestClient(TestServer(agent.app())) as client:
            for _ in range(600):
                if (await client.get("/readyz")).status == 200:
                    break
                await asyncio.sleep(0.1)
            for stream in (False, True):
                response = await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt_of(150), "max_tokens": 10, "stream": stream})
                body = await response.json()
                assert response.status == 400, body
                assert body["error"]["code"] == "context_length_exceeded"
                assert "need 10 KV blocks; this engine has 4" in body["error"]["message"]

    asyncio.run(scenario())


def test_a_dgfm_recall_brings_kv_home_gives_the_lender_its_blocks_and_settles_when_room_appears(
        tiny_model_dir: Path) -> None:
    """DGFM's swap as one debtor lives it (§4.5): it recalls its KV from its creditor (held in host memory
    at once, the creditor's blocks given back), and its own debtor's recall frees the blocks it had lent,
    into which the recalled KV moves. The stream never notices."""
    prompt, max_tokens = prompt_of(150), 60  # 210 tokens of KV: 14 blocks, the borrower keeps 6

    async def scenario() -> None:
        want = await reference(tiny_model_dir, prompt, max_tokens)
        async with AsyncExitStack() as stack:
            creditor_engine, creditor = await stack.enter_async_context(lender(tiny_model_dir, 16, 12))
            borrower = load_engine("builtin", *config(tiny_model_dir, 8, lend_cap_bytes=2 * BLOCK_BYTES, borrow=True,
                                                      min_step_s=0.01))
            assert isinstance(borrower, BuiltinEngine)
            await borrower.start()
            stack.push_async_callback(borrower.stop)
            borrowing, own_lending = borrower.capabilities.borrowing, borrower.capabilities.lending
            creditor_lending = creditor_engine.capabilities.lending
            assert borrowing is not None and own_lending is not None and creditor_lending is not None
            await own_lending.lend("its-debtor", 2)  # two of its 8 blocks hold another worker's KV
            borrowing.attach(OPEN, StaticCreditors([Creditor("creditor", f"127.0.0.1:{creditor.port}", 12 * BLOCK_BYTES)]))
            stream = asyncio.create_task(greedy(borrower, prompt, max_tokens))
            while creditor_lending.lent_blocks() < 5:
                await asyncio.sleep(0.005)
            remote = borrower.scheduler.requests["r"].remote
            assert isinstance(remote, RemoteParts)

            assert await borrowing.recall("elsewhere", 10 * BLOCK_BYTES) == 0  # nothing of it lives there
            lent_before, tokens_before = remote.lent_tokens, remote.num_tokens
            assert await borrowing.recall("creditor", 3 * BLOCK_BYTES + 100) == 3 * BLOCK_BYTES  # whole blocks only
            assert sum(h.num_tokens for h in remote.held) == 3 * BLOCK
            assert remote.lent_tokens <= lent_before - 3 * BLOCK + BLOCK  # (one block may spill meanwhile)
            assert remote.num_tokens >= tokens_before
            assert creditor_lending.lent_blocks() * BLOCK <= remote.lent_tokens + BLOCK  # trimmed at the creditor
            assert sum(borrowing.borrowed_bytes().values()) == creditor_lending.lent_blocks() * BLOCK_BYTES

            await own_lending.free("its-debtor")  # its debtor recalled: room for what came home
            for _ in range(500):
                if sum(h.num_tokens for h in remote.held) < 3 * BLOCK:
                    break
                await asyncio.sleep(0.01)
            assert sum(h.num_tokens for h in remote.held) < 3 * BLOCK, "recalled KV moves into freed blocks"
            assert await asyncio.wait_for(stream, 60) == want
            assert borrower.num_preemptions == 0
            for _ in range(100):
                if creditor_lending.lent_blocks() == 0:
                    break
                await asyncio.sleep(0.02)
            assert creditor_lending.lent_blocks() == 0 and len(borrower.scheduler.space.free) == 8

    asyncio.run(scenario())
