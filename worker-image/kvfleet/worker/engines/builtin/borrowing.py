"""The builtin engine's `KVBorrowing` capability: rManager's borrower side (Infinite-LLM §4.3, §4.6).

A request larger than this engine's whole KV cache (the scheduler's `spans`) is served with blocks
other workers lend: before each step, when such a request lacks blocks for its next chunk or token,
its oldest full local blocks are copied into a lease at a creditor and freed here (`prepare`). So
its local blocks always hold its newest tokens, the forward writes only local blocks, and its remote
tokens are the first `RemoteParts.num_tokens` positions, attended where they live: each layer ships
the step's query rows to every lease at once and merges the partial outputs with ScaleReduce (§4.2,
§4.6: the query travels, the KV stays). Creditors come from `Creditors` (the operator's published
plan, §4.4's contract protocol): the first that accepts lends; one that refuses is skipped.

DGFM's recall (§4.5, `recall`): the operator finds debt cycles and tells each debtor on one how much
of its KV to bring home from its creditor. The tokens are read back into host memory at once
(parts.py `RemoteParts.recall`, attended there meanwhile) and move into this engine's own blocks before
a step that finds room for them (`prepare`), as the oldest local blocks: the room comes from the
debtor of this worker giving back what it borrowed here.

Faults (§4.3, docs/distkv.md): a lease call that fails mid-step (the lender died or left; a leaving
lender's engine frees its leases as it stops) raises `RemotePartLost`; the engine then preempts that
request, which frees what it held anywhere, and it is prefilled again from its prompt and the tokens
it produced, borrowing afresh, while its stream waits: the client sees a delay, not a gap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from collections.abc import Mapping

from kvfleet.worker.distkv.creditors import Creditors
from kvfleet.worker.distkv.parts import LeaseFinder, NoRoomToBorrow, RemotePartLost, RemoteParts, recall_requests
from kvfleet.worker.engines.base import EngineError
from kvfleet.worker.engines.builtin.model import PagedKVCache
from kvfleet.worker.engines.builtin.scheduler import Request, RequestState, Scheduler
from kvfleet.worker.engines.capabilities import LeaseOpener

__all__ = ["BuiltinKVBorrowing", "Lenders", "NoRoomToBorrow", "RemotePartLost", "RemoteParts"]

# A request whose remote KV is lost this many times is failed instead of prefilled once more: lenders
# that keep dying (or a bug) must not turn one request into an endless re-prefill.
MAX_LOSSES = 3

log = logging.getLogger(__name__)


class Lenders:
    """Whom a borrowing engine asks and how it reaches them, and the leases it gives back: the
    scheduler's `RemoteKVHooks`, built before the scheduler and handed to it (so it holds nothing of
    the borrower's side but these two calls)."""

    def __init__(self) -> None:
        self.open_lease: LeaseOpener | None = None
        self.creditors: Creditors | None = None
        self._closing: set[asyncio.Task[None]] = set()
        # Bytes written to and read from lenders by closed leases, for the bench (wire bytes per step).
        self.bytes_sent = self.bytes_received = 0

    def attach(self, open_lease: LeaseOpener, creditors: Creditors) -> None:
        """How to reach lenders (leases over the pool's authenticated migration port) and whom to ask."""
        self.open_lease, self.creditors = open_lease, creditors

    def borrowable_blocks(self, block_bytes: int) -> int:
        """Blocks the creditors said they could lend (a hint: the contract decides)."""
        if self.creditors is None or self.open_lease is None:
            return 0
        return sum(c.lendable_bytes for c in self.creditors.candidates()) // block_bytes if block_bytes else 0

    def release_remote(self, req: Request) -> None:
        """Free a request's leases (in the background: the scheduler does not wait for lenders)."""
        remote = req.remote
        if not isinstance(remote, RemoteParts):
            return
        sent, received = remote.wire_bytes()
        self.bytes_sent, self.bytes_received = self.bytes_sent + sent, self.bytes_received + received
        task = asyncio.get_running_loop().create_task(remote.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


class BuiltinKVBorrowing:
    """Leases at other workers for this engine's spanning requests (module docstring)."""

    def __init__(self, sched: Scheduler, lenders: Lenders, block_size_tokens: int) -> None:
        self._sched = sched
        self._lenders = lenders
        self._block_size_tokens = block_size_tokens
        self._finder = LeaseFinder(uuid.uuid4().hex[:12], block_size_tokens)
        self._cache: PagedKVCache | None = None
        self._executor: concurrent.futures.Executor | None = None
        self._losses: dict[str, int] = {}  # request id -> times its remote KV was lost
        self._recall_lost: set[str] = set()  # requests a recall found lost, preempted by the next prepare

    # -- wiring --------------------------------------------------------------------------------------

    def attach(self, open_lease: LeaseOpener, creditors: Creditors) -> None:
        """How to reach lenders (leases over the pool's authenticated migration port) and whom to ask."""
        self._lenders.attach(open_lease, creditors)

    def open(self, cache: PagedKVCache, executor: concurrent.futures.Executor) -> None:
        self._cache, self._executor = cache, executor

    def close(self) -> None:
        self._cache = self._executor = None

    # -- what the reports and the admission check read -------------------------------------------------

    def borrowable_blocks(self) -> int:
        """Blocks the creditors said they could lend (a hint: the contract decides)."""
        return self._lenders.borrowable_blocks(self._sched.space.block_bytes)

    def borrowed_bytes(self) -> Mapping[str, int]:
        """Creditor pod -> bytes of blocks it lends this engine's requests now."""
        token_bytes = self._sched.space.block_bytes // self._block_size_tokens
        borrowed: dict[str, int] = {}
        for req in self._sched.requests.values():
            if isinstance(req.remote, RemoteParts):
                req.remote.lent_bytes(token_bytes, borrowed)
        return borrowed

    def wire_bytes(self) -> tuple[int, int]:
        """(sent, received) bytes over every lease so far, closed ones included."""
        sent, received = self._lenders.bytes_sent, self._lenders.bytes_received
        for req in self._sched.requests.values():
            if isinstance(req.remote, RemoteParts):
                s, r = req.remote.wire_bytes()
                sent, received = sent + s, received + r
        return sent, received

    # -- before each step ------------------------------------------------------------------------------

    async def recall(self, creditor_pod: str, num_bytes: int) -> int:
        """DGFM's recall (module docstring): up to `num_bytes` of this engine's KV at `creditor_pod`, newest
        leases first, read back and held until `prepare` finds blocks for it."""
        bs = self._block_size_tokens

        def lost(remote: RemoteParts, err: RemotePartLost) -> None:
            # Preempted before its next step, not in the middle of one (prepare).
            log.warning("%s; it is prefilled again", err)
            self._recall_lost.add(remote.request_id)

        return await recall_requests((r.remote for r in self._sched.running if isinstance(r.remote, RemoteParts)),
                                     creditor_pod, num_bytes, bs, self._sched.space.block_bytes // bs, lost)

    async def _settle(self, req: Request) -> None:
        """Recalled tokens of a request into its own blocks, as many whole blocks of them as there are free
        blocks beyond what its next chunk takes: they become its oldest local blocks (local slots count
        from remote_tokens, and the recalled tokens leave the remote count as they arrive)."""
        remote, cache, executor = req.remote, self._cache, self._executor
        if not isinstance(remote, RemoteParts) or not remote.held or cache is None or executor is None:
            return
        sched, bs = self._sched, self._block_size_tokens
        async with remote.moving:
            for held in list(remote.held):
                # Held KV is attended where it is meanwhile: it takes only blocks nobody needs next step
                # (its own next chunk, and a block for each other running request that may cross into one).
                margin = max(0, sched.next_chunk_blocks(req)) + len(sched.running) - 1
                num_blocks = min(held.num_tokens // bs, len(sched.space.free) - margin)
                if num_blocks <= 0:
                    return
                blocks = sched.space.allocate(num_blocks)
                kv = held.kv[:, :, :num_blocks * bs]  # [layers, 2, tokens, kv_heads, dim] -> blocks of them
                data = kv.reshape(*kv.shape[:2], num_blocks, bs, *kv.shape[3:])
                try:
                    await asyncio.get_running_loop().run_in_executor(executor, cache.write_blocks, blocks, data)
                except BaseException:
                    sched.space.release(blocks)
                    raise
                if req.state is not RequestState.RUNNING or req.remote is not remote:
                    sched.space.release(blocks)  # aborted or preempted meanwhile
                    return
                # Between steps (prepare), so no forward reads the parts while they change.
                req.blocks[:0] = blocks
                if num_blocks * bs == held.num_tokens:
                    remote.held.remove(held)
                else:
                    held.kv = held.kv[:, :, num_blocks * bs:].clone()

    async def prepare(self) -> None:
        """Give each running spanning request the free blocks its next chunk needs, moving its oldest
        full blocks to lenders, or move its recalled tokens into its own blocks where there is room; a
        request no creditor can help fails, one whose lender is gone is preempted (module docstring)."""
        sched = self._sched
        self._losses = {rid: n for rid, n in self._losses.items() if rid in sched.requests}
        self._recall_lost &= set(sched.requests)
        for req in [r for r in sched.running if r.spans]:
            if req.request_id in self._recall_lost:
                self._recall_lost.discard(req.request_id)
                self.lose(req)
                continue
            try:
                await self._settle(req)
            except Exception as err:  # a torch error: this request fails, the engine goes on
                log.exception("moving recalled KV of %s into its blocks failed", req.request_id)
                sched.fail_request(req, EngineError(f"moving recalled KV home failed: {err}"))
                continue
            short = sched.spanning_shortfall(req)
            if short <= 0 or req.state is not RequestState.RUNNING:
                continue
            full_local = (req.num_cached - req.remote_tokens) // self._block_size_tokens
            if full_local == 0:
                continue  # nothing of its own to move: it waits for blocks other requests free
            try:
                await self._spill(req, min(short, full_local))
            except RemotePartLost as err:
                log.warning("%s; it is prefilled again", err)
                self.lose(req)
            except NoRoomToBorrow as err:
                if not self._sched.step_tokens(req):
                    sched.fail_request(req, err)
            except Exception as err:  # a bug or a torch error: this request fails, the engine goes on
                log.exception("moving KV of %s to a lender failed", req.request_id)
                sched.fail_request(req, EngineError(f"borrowing KV failed: {err}"))

    def lose(self, req: Request) -> None:
        """A request's remote KV is gone: free all it holds and prefill it again (its stream waits), at
        most MAX_LOSSES times; then it fails rather than loop."""
        if req.state is not RequestState.RUNNING:
            return
        losses = self._losses[req.request_id] = self._losses.get(req.request_id, 0) + 1
        if losses > MAX_LOSSES:
            self._sched.fail_request(req, EngineError(
                f"request {req.request_id} lost the KV other workers lent it {losses} times; giving up"))
        else:
            self._sched.preempt(req)

    async def _spill(self, req: Request, num_blocks: int) -> None:
        cache, executor = self._cache, self._executor
        if cache is None or executor is None or self._lenders.open_lease is None or self._lenders.creditors is None:
            raise NoRoomToBorrow("this worker is not set up to borrow KV (KVFLEET_DISTKV)")
        remote = req.remote
        if not isinstance(remote, RemoteParts):
            remote = req.remote = RemoteParts(req.request_id, asyncio.get_running_loop())
        async with remote.moving:
            await self._spill_locked(req, remote, num_blocks, cache, executor)

    async def _spill_locked(self, req: Request, remote: RemoteParts, num_blocks: int, cache: PagedKVCache,
                            executor: concurrent.futures.Executor) -> None:
        assert self._lenders.open_lease is not None and self._lenders.creditors is not None
        moved = 0
        while moved < num_blocks:
            part, granted = await self._finder.room(remote, num_blocks - moved, self._lenders.open_lease,
                                                    self._lenders.creditors)
            blocks = req.blocks[:granted]
            data = await asyncio.get_running_loop().run_in_executor(executor, cache.read_blocks, blocks)
            # [layers, 2, blocks, block, kv_heads, dim] -> [layers, 2, tokens, kv_heads, dim]
            kv = data.flatten(2, 3)
            try:
                await part.lease.write(part.num_tokens, kv)
            except Exception as err:  # refused or failed, the lease cannot take its KV: start again
                raise RemotePartLost(req.request_id, str(err) or type(err).__name__) from err
            if req.state is not RequestState.RUNNING:
                return  # aborted meanwhile: its leases were released with it
            part.num_tokens += granted * self._block_size_tokens
            self._sched.space.release(blocks)
            del req.blocks[:granted]
            moved += granted
