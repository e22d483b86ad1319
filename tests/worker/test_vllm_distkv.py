"""DistKV's lender side on the vLLM engine (engines/vllm/lending.py, Infinite-LLM §4.3, §4.6).

A vLLM worker lends blocks of its own KV cache over the migration port, with the real transport and
handshake: the blocks come out of vLLM's block pool (a request that needs them waits until the lease
is freed), the borrower's KV lands in them, and shipped queries are answered with (out, lse) equal to
attention over that KV. A builtin worker then serves a request four times its own memory on a vLLM
lender (blocks of 128 tokens) and a builtin one (16), and its greedy output equals one big worker's;
and the same through two agents, the lease served on the vLLM worker's migration port, its KV-load
reports saying what it lends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from migration_testing import start_worker
from test_distkv_borrowing import BLOCK_BYTES, OPEN, TRANSPORT, config, greedy, lender, prompt_of, reference
from worker_testing import EngineLoop, skip_without_vllm

skip_without_vllm()

import torch  # noqa: E402

from kvfleet.kernels.micro_attention_decode_reference import attention_with_lse  # noqa: E402
from kvfleet.worker.distkv.borrower import RemoteLease  # noqa: E402
from kvfleet.worker.distkv.creditors import Creditor, StaticCreditors  # noqa: E402
from kvfleet.worker.distkv.lender import serve_lease  # noqa: E402
from kvfleet.worker.distkv.options import DistKVOptions  # noqa: E402
from kvfleet.worker.distkv.wire import LendingRefused  # noqa: E402
from kvfleet.worker.engines import EngineConfig, load_engine  # noqa: E402
from kvfleet.worker.engines.base import RequestTooLong  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine  # noqa: E402
from kvfleet.worker.engines.vllm.borrowing import VLLMKVBorrowing  # noqa: E402
from kvfleet.worker.engines.vllm.engine import VLLMEngine  # noqa: E402
from kvfleet.worker.engines.vllm.lending import VLLMKVLending  # noqa: E402
from kvfleet.worker.engines.vllm.options import VLLMOptions  # noqa: E402
from kvfleet.worker.migration.transport import Channel  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 2, 4, 64
VLLM_BLOCK = 128                       # vLLM's CPU block: 128 tokens of 2 KiB
VLLM_BLOCK_BYTES = VLLM_BLOCK * 2048
USABLE_BLOCKS = 8


@asynccontextmanager
async def vllm_lender(model_dir: Path, cap_blocks: int) -> AsyncIterator[tuple[VLLMEngine, VLLMKVLending, int]]:
    """A started vLLM engine of 8 blocks lending up to `cap_blocks`, served on a loopback port."""
    engine = VLLMEngine(EngineConfig(model_path=model_dir, kv_capacity_bytes=USABLE_BLOCKS * VLLM_BLOCK_BYTES,
                                     max_num_seqs=4, dtype="float32"),
                        VLLMOptions(attention="distattention",
                                    distkv=DistKVOptions(lend_cap_bytes=cap_blocks * VLLM_BLOCK_BYTES)))
    await engine.start()
    lending = engine.capabilities.lending
    assert isinstance(lending, VLLMKVLending) and lending.cap_blocks == cap_blocks

    async def handle(channel: Channel) -> None:
        await serve_lease(lending, channel, await channel.recv(5), engine.info.block_size_tokens)

    listener = await TRANSPORT.listen("127.0.0.1", 0, handle)
    try:
        yield engine, lending, listener.port
    finally:
        await listener.close()
        await engine.stop()


@asynccontextmanager
async def vllm_borrower(model_dir: Path, min_step_s: float = 0.0) -> AsyncIterator[VLLMEngine]:
    """A started vLLM engine of 4 blocks (512 tokens) that borrows for longer requests."""
    engine = VLLMEngine(EngineConfig(model_path=model_dir, kv_capacity_bytes=4 * VLLM_BLOCK_BYTES, max_num_seqs=4,
                                     dtype="float32", min_step_s=min_step_s),
                        VLLMOptions(attention="distattention", distkv=DistKVOptions(borrow=True)))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def test_a_vllm_lease_stores_kv_answers_queries_and_holds_its_blocks_out_of_vllms_pool(
        tiny_model_dir: Path, engine_loop: EngineLoop) -> None:
    async def scenario() -> None:
        async with vllm_lender(tiny_model_dir, cap_blocks=USABLE_BLOCKS + 2) as (engine, lending, port):
            assert engine.info.block_size_tokens == VLLM_BLOCK
            lease = RemoteLease(TRANSPORT, f"127.0.0.1:{port}", "req-1")
            await lease.lend(1)
            await lease.lend(1)  # grown: 2 blocks = 256 tokens
            assert lending.lent_blocks() == 2 and lease.block_size_tokens == VLLM_BLOCK
            gen = torch.Generator().manual_seed(0)
            kv = torch.randn(LAYERS, 2, 200, KV_HEADS, HEAD_DIM, generator=gen)
            await lease.write(0, kv[:, :, :90])
            await lease.write(90, kv[:, :, 90:])  # in two writes, across a block boundary
            q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=gen)
            for layer in range(LAYERS):
                for tokens in (1, 129, 200):
                    out, lse = await lease.attend(layer, q, tokens)
                    want_out, want_lse = attention_with_lse(q, kv[layer, 0, :tokens], kv[layer, 1, :tokens], HEAD_DIM**-0.5)
                    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)

            # vLLM's pool has 6 blocks left: a lend of 7 is refused with the room there is, not queued.
            other = RemoteLease(TRANSPORT, f"127.0.0.1:{port}", "req-2")
            with pytest.raises(LendingRefused, match="7 blocks asked, 6 free") as refused:
                await other.lend(7)
            assert refused.value.room_blocks == 6
            await other.lend(6)  # vLLM's whole pool is lent now
            # A request that needs a block waits for one: the lent blocks are out of vLLM's hands.
            stream = asyncio.create_task(greedy(engine, prompt_of(40), 4))  # type: ignore[arg-type]
            await asyncio.sleep(1.5)
            assert not stream.done()
            # A borrower that dies without freeing: its channel drops and vLLM gets the blocks back.
            assert other._channel is not None
            other._channel.close()
            assert len(await asyncio.wait_for(stream, 60)) == 4
            assert lending.lent_blocks() == 2
            # The lease's KV was untouched by the request that ran meanwhile.
            out, lse = await lease.attend(1, q, 200)
            torch.testing.assert_close(out, attention_with_lse(q, kv[1, 0], kv[1, 1], HEAD_DIM**-0.5)[0], rtol=1e-5, atol=1e-5)
            # DGFM's recall: the borrower reads tokens back, and the lease gives back the blocks past what it keeps.
            torch.testing.assert_close(await lease.read(90, 110), kv[:, :, 90:200])
            await lease.trim(128)
            assert lease.blocks == 1 and lending.lent_blocks() == 1
            out, lse = await lease.attend(0, q, 128)
            torch.testing.assert_close(out, attention_with_lse(q, kv[0, 0, :128], kv[0, 1, :128], HEAD_DIM**-0.5)[0],
                                       rtol=1e-5, atol=1e-5)
            with pytest.raises(LendingRefused, match="blocks"):
                await lease.attend(0, q, 129)  # past what the lease holds: refused, and the lease ends
            for _ in range(100):
                if lending.lent_blocks() == 0:
                    break
                await asyncio.sleep(0.02)
            assert lending.lent_blocks() == 0
            # Every block is back: the cap (10) is above the pool (8), so the pool answers.
            third = RemoteLease(TRANSPORT, f"127.0.0.1:{port}", "req-3")
            await third.lend(USABLE_BLOCKS)
            with pytest.raises(LendingRefused, match="would pass this worker's cap of 10") as capped:
                await third.lend(3)
            assert capped.value.room_blocks == 2
            await third.free()

    engine_loop.run(scenario(), timeout_s=600)


def test_a_builtin_worker_borrows_from_a_vllm_and_a_builtin_lender_and_equals_one_big_worker(
        tiny_model_dir: Path, engine_loop: EngineLoop) -> None:
    # 300 + 40 tokens of KV: 22 builtin blocks, the borrower holds 4. The vLLM lender lends one block of
    # 128 tokens (8 of the borrower's), the builtin lender the rest in blocks of 16.
    prompt, max_tokens = prompt_of(300), 40

    async def scenario() -> None:
        want = await reference(tiny_model_dir, prompt, max_tokens)
        async with AsyncExitStack() as stack:
            _, vllm_lending, vllm_port = await stack.enter_async_context(vllm_lender(tiny_model_dir, cap_blocks=1))
            builtin_engine, builtin_listener = await stack.enter_async_context(lender(tiny_model_dir, 16, 12))
            borrower = load_engine("builtin", *config(tiny_model_dir, 4, borrow=True))
            assert isinstance(borrower, BuiltinEngine)
            await borrower.start()
            stack.push_async_callback(borrower.stop)
            borrowing = borrower.capabilities.borrowing
            assert borrowing is not None
            borrowing.attach(OPEN, StaticCreditors([
                Creditor("vllm-lender", f"127.0.0.1:{vllm_port}", VLLM_BLOCK_BYTES),
                Creditor("builtin-lender", f"127.0.0.1:{builtin_listener.port}", 12 * BLOCK_BYTES)]))

            seen: list[tuple[int, int, dict[str, int]]] = []
            stream = asyncio.create_task(greedy(borrower, prompt, max_tokens))
            builtin_lending = builtin_engine.capabilities.lending
            assert builtin_lending is not None
            while not stream.done():
                seen.append((vllm_lending.lent_blocks(), builtin_lending.lent_blocks(), dict(borrowing.borrowed_bytes())))
                await asyncio.sleep(0.005)
            assert await stream == want
            # Both lenders held part of it at once; the vLLM lease is counted in its own block size.
            both = [s for s in seen if s[0] and s[1]]
            assert both and max(s[1] for s in both) >= 8
            assert any(s[2].get("vllm-lender") == VLLM_BLOCK_BYTES for s in both)
            for _ in range(100):  # the leases are freed as the request ends
                if vllm_lending.lent_blocks() == builtin_lending.lent_blocks() == 0:
                    break
                await asyncio.sleep(0.02)
            assert vllm_lending.lent_blocks() == builtin_lending.lent_blocks() == 0

    engine_loop.run(scenario(), timeout_s=600)


@pytest.mark.parametrize("distkv", [DistKVOptions(lend_cap_bytes=1 << 20), DistKVOptions(borrow=True)])
def test_lending_and_borrowing_are_refused_without_distattention_or_with_elastic_memory(distkv: DistKVOptions) -> None:
    from kvfleet.worker.elastic.options import MemoryOptions

    with pytest.raises(ValueError, match="distattention"):
        VLLMOptions(distkv=distkv)
    with pytest.raises(ValueError, match="static KV cache"):
        VLLMOptions(attention="distattention", distkv=distkv, memory=MemoryOptions(budget_bytes=1 << 30, elastic=True))


def test_agents_lend_through_the_vllm_workers_migration_port_and_report_it(tiny_model_dir: Path,
                                                                           engine_loop: EngineLoop) -> None:
    prompt, max_tokens = prompt_of(200), 30   # 230 tokens of KV: the borrower holds 64
    want = engine_loop.run(reference(tiny_model_dir, prompt, max_tokens), timeout_s=120)
    cap_bytes = 2 * VLLM_BLOCK_BYTES
    vllm_worker = start_worker("vllm-lender", tiny_model_dir, engine_loop, engine=VLLMEngine(
        EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=USABLE_BLOCKS * VLLM_BLOCK_BYTES, max_num_seqs=4,
                     dtype="float32"),
        VLLMOptions(attention="distattention", distkv=DistKVOptions(lend_cap_bytes=cap_bytes))))
    borrower = start_worker("borrower", tiny_model_dir, engine_loop, engine=load_engine("builtin", *config(
        tiny_model_dir, 4, borrow=True)), creditors=StaticCreditors([
            Creditor("vllm-lender", f"127.0.0.1:{vllm_worker.agent.migration_port}", cap_bytes)]))
    try:
        status, body = borrower.call("POST", "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == max_tokens
        assert body["choices"][0]["text"] == borrower.agent.tokenizer.decode(want)
        # The lender's reports said what it lends while the request ran, and nothing after.
        lending = [r for r in vllm_worker.reports if r.lent_bytes]
        assert lending and all(r.lend_cap_bytes == cap_bytes for r in lending)
        assert max(r.lent_bytes or 0 for r in lending) == VLLM_BLOCK_BYTES * 2
        assert any(r.borrowed == {"vllm-lender": 2 * VLLM_BLOCK_BYTES} for r in borrower.reports)
        for _ in range(100):
            if vllm_worker.reports[-1].lent_bytes == 0:
                break
            engine_loop.run(asyncio.sleep(0.05))
        assert vllm_worker.reports[-1].lent_bytes == 0
    finally:
        for worker in (borrower, vllm_worker):
            engine_loop.run(worker.runner.cleanup(), timeout_s=120)


def test_a_vllm_worker_borrows_for_a_request_longer_than_its_cache_and_equals_one_big_worker(
        tiny_model_dir: Path, engine_loop: EngineLoop) -> None:
    # 1,100 + 30 tokens of KV; the vLLM worker holds 4 blocks of 128 (512 tokens), two builtin lenders
    # hold the rest in blocks of 16.
    prompt, max_tokens = prompt_of(1100), 30

    async def scenario() -> None:
        want = await reference(tiny_model_dir, prompt, max_tokens, blocks=96)
        async with AsyncExitStack() as stack:
            lenders = [await stack.enter_async_context(lender(tiny_model_dir, 40, 36)) for _ in range(2)]
            engine = await stack.enter_async_context(vllm_borrower(tiny_model_dir, min_step_s=0.02))
            borrowing = engine.capabilities.borrowing
            assert isinstance(borrowing, VLLMKVBorrowing)
            borrowing.attach(OPEN, StaticCreditors([
                Creditor(f"lender-{i}", f"127.0.0.1:{listener.port}", 36 * BLOCK_BYTES)
                for i, (_, listener) in enumerate(lenders)]))
            seen: list[dict[str, int]] = []
            recalled = 0
            stream = asyncio.create_task(greedy(engine, prompt, max_tokens))  # type: ignore[arg-type]
            while not stream.done():
                seen.append(dict(borrowing.borrowed_bytes()))
                lent = lenders[0][0].capabilities.lending
                assert lent is not None
                if not recalled and seen[-1].get("lender-0", 0) >= 256 * 2048:
                    # DGFM's recall mid-request: 128 tokens (one vLLM block) of it come home from lender-0.
                    recalled = await borrowing.recall("lender-0", VLLM_BLOCK_BYTES)
                    assert recalled == VLLM_BLOCK_BYTES and borrowing.held_bytes() == VLLM_BLOCK_BYTES
                    # The lender trimmed the lease: what it lends is what the borrower counts (whole blocks of 16).
                    assert lent.lent_blocks() * BLOCK_BYTES == borrowing.borrowed_bytes()["lender-0"]
                await asyncio.sleep(0.01)
            assert await stream == want, "the recalled tokens are attended in the agent, the output unchanged"
            assert recalled, "the recall ran while the request borrowed"
            assert any(sum(s.values()) >= 512 * 2048 for s in seen)  # more than its whole cache was remote
            for _ in range(100):  # the leases are freed as the request ends
                if all(e.capabilities.lending.lent_blocks() == 0 for e, _ in lenders):  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.02)
            assert all(e.capabilities.lending.lent_blocks() == 0 for e, _ in lenders)  # type: ignore[union-attr]
            assert borrowing.borrowed_bytes() == {}

    engine_loop.run(scenario(), timeout_s=600)


def test_a_vllm_borrower_whose_lender_dies_computes_the_request_again_and_the_stream_goes_on(
        tiny_model_dir: Path, engine_loop: EngineLoop) -> None:
    prompt, max_tokens = prompt_of(700), 60

    async def scenario() -> None:
        want = await reference(tiny_model_dir, prompt, max_tokens)
        async with AsyncExitStack() as stack:
            doomed_engine, doomed = await stack.enter_async_context(lender(tiny_model_dir, 40, 36))
            spare_engine, spare = await stack.enter_async_context(lender(tiny_model_dir, 40, 36))
            engine = await stack.enter_async_context(vllm_borrower(tiny_model_dir, min_step_s=0.01))
            assert engine.capabilities.borrowing is not None
            engine.capabilities.borrowing.attach(OPEN, StaticCreditors([
                Creditor("doomed", f"127.0.0.1:{doomed.port}", 36 * BLOCK_BYTES),
                Creditor("spare", f"127.0.0.1:{spare.port}", 36 * BLOCK_BYTES)]))
            stream = asyncio.create_task(greedy(engine, prompt, max_tokens))  # type: ignore[arg-type]
            lending = doomed_engine.capabilities.lending
            assert lending is not None
            while lending.lent_blocks() == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)
            await doomed.close()  # the lender leaves: its listener and engine stop, its leases go
            await doomed_engine.stop()
            spare_lent: list[int] = []
            while not stream.done():
                spare_lent.append(spare_engine.capabilities.lending.lent_blocks())  # type: ignore[union-attr]
                await asyncio.sleep(0.01)
            assert await asyncio.wait_for(stream, 120) == want
            assert max(spare_lent) > 0  # computed again, it borrowed from the lender that was left

    engine_loop.run(scenario(), timeout_s=600)


def test_a_vllm_worker_refuses_what_it_and_its_pool_cannot_hold_saying_what_the_pool_lends(
        tiny_model_dir: Path, engine_loop: EngineLoop) -> None:
    async def scenario() -> None:
        async with lender(tiny_model_dir, 16, 8) as (_, listener):
            async with vllm_borrower(tiny_model_dir) as engine:
                assert engine.capabilities.borrowing is not None
                engine.capabilities.borrowing.attach(OPEN, StaticCreditors([
                    Creditor("lender", f"127.0.0.1:{listener.port}", 8 * BLOCK_BYTES)]))
                with pytest.raises(RequestTooLong, match="need 6 KV blocks; this engine has 4 and the pool can lend it 1 more"):
                    await greedy(engine, prompt_of(700), 10)  # type: ignore[arg-type]
                # What fits with the lender's room is served: a context past the cache is no longer refused.
                assert len(await greedy(engine, prompt_of(560), 4)) == 4  # type: ignore[arg-type]

    engine_loop.run(scenario(), timeout_s=600)


def test_the_pinned_vllm_has_every_private_name_lending_and_borrowing_use(tiny_model_dir: Path, engine_loop: EngineLoop,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    from kvfleet.worker.engines.base import EngineError
    from kvfleet.worker.engines.vllm import internals

    assert internals.lending_problems() == [] and internals.borrowing_problems() == []

    def renamed(self: Any, request_id: str, first: int, last: int) -> None: ...

    monkeypatch.setattr(SingleTypeKVCacheManager, "_remove_blocks_in_range", renamed)
    assert any("_remove_blocks_in_range" in problem for problem in internals.borrowing_problems())
    # A worker on such a vLLM refuses to borrow at start, saying what differs.
    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=4 * VLLM_BLOCK_BYTES, dtype="float32"),
                        VLLMOptions(attention="distattention", distkv=DistKVOptions(borrow=True)))
    with pytest.raises(EngineError, match="DistKV borrowing cannot run on this vLLM.*_remove_blocks_in_range"):
        engine_loop.run(engine.start(), timeout_s=60)
    engine_loop.run(engine.stop())


class _FakeRequest:
    """What SpanPlanner reads of vLLM's Request."""

    def __init__(self, request_id: str, prompt: int, max_tokens: int) -> None:
        self.request_id, self.num_prompt_tokens, self.max_tokens = request_id, prompt, max_tokens
        self.num_tokens, self.num_computed_tokens = prompt, 0


def test_the_planner_moves_what_the_next_chunk_needs_even_when_a_preempted_request_is_computed_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet.worker.engines.vllm import borrowing, internals

    skipped: list[tuple[str, int]] = []
    monkeypatch.setattr(internals, "skip_blocks", lambda manager, rid, n: skipped.append((rid, n)))
    planner = borrowing.SpanPlanner(block_size_tokens=128, usable_blocks=4, batched_tokens=256)
    req = _FakeRequest("v1", prompt=600, max_tokens=100)
    planner.admitted(req, "a1")  # type: ignore[arg-type]
    assert "v1" in planner.spans
    # Computed again after a preemption: 650 tokens (prompt and 50 of output), 256 done, 256 this step.
    req.num_tokens, req.num_computed_tokens = 650, 256
    plan = planner.plan({"v1": 256}, lambda rid: [1, 2, 3, 4], free_blocks=0)
    # The next chunk (the last 138 tokens, output included) needs two more blocks: the two computed before
    # this step move (counting the prompt alone, it would wait for blocks and be preempted again).
    assert [(o.block_ids, o.first_token) for o in plan.spills] == [([1, 2], 0)]
    assert plan.spans == []  # nothing is remote during this step: it moves after the forward
    planner.confirmed({"v1": 2}, {}, {}, manager=None, scheduler=None)
    assert skipped == [("v1", 2)]
    req.num_computed_tokens = 512
    plan = planner.plan({"v1": 138}, lambda rid: [0, 0, 3, 4, 5, 6], free_blocks=0)
    assert plan.spans == [("a1", 2, [3, 4, 5, 6])]
    # A move that failed (not a loss) is forgotten once vLLM computes the request again from its start.
    planner.confirmed({}, {"v1": "timed out"}, {}, manager=None, scheduler=None)
    req.num_computed_tokens = 0
    plan = planner.plan({"v1": 256}, lambda rid: [6, 7], free_blocks=2)
    assert plan.releases == ["a1"] and planner.spans["v1"].failed is None
