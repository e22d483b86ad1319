"""The builtin engine's `KVBorrowing` capability: rManager's borrower side (Infinite-LLM §4.3, §4.6).

A request larger than this engine's whole KV cache (the scheduler's `spans`) is served with blocks
other workers lend: before each step, when such a request lacks blocks for its next chunk or token,
its oldest full local blocks are copied into a lease at a creditor and freed here (`prepare`). So
its local blocks always hold its newest tokens, the forward writes only local blocks, and its remote
tokens are the first `RemoteParts.num_tokens` positions, attended where they live: each layer ships
the step's query rows to every lease at once and merges the partial outputs with ScaleReduce (§4.2,
§4.6: the query travels, the KV stays). Creditors come from `Creditors` (the operator's published
plan, §4.4's contract protocol): the first that accepts lends; one that refuses is skipped.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvfleet.kernels.dispatch import scale_reduce_pair
from kvfleet.worker.distkv.creditors import Creditors
from kvfleet.worker.engines.base import EngineError
from kvfleet.worker.engines.builtin.model import PagedKVCache
from kvfleet.worker.engines.builtin.scheduler import Request, RequestState, Scheduler
from kvfleet.worker.engines.capabilities import LeaseOpener, LendingError, RemoteKVLease

# A remote micro-attention waits behind the lender's own step: past this the lender counts as lost
# (distkv/wire.py's reply timeout, and a margin).
ATTEND_TIMEOUT_S = 35.0
# A request whose remote KV is lost this many times is failed instead of prefilled once more: lenders
# that keep dying (or a bug) must not turn one request into an endless re-prefill.
MAX_LOSSES = 3

log = logging.getLogger(__name__)


class RemotePartLost(EngineError):
    """A spanning request's remote KV cannot be reached (its lender died or left)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id}: its KV lent by another worker is lost: {reason}")
        self.request_id = request_id


class NoRoomToBorrow(EngineError):
    """No creditor lends what a spanning request needs next."""


@dataclass
class _Part:
    """One lease of a request, in token order: its tokens are the request's next `num_tokens`."""

    lease: RemoteKVLease
    pod: str
    num_tokens: int = 0


class RemoteParts:
    """One spanning request's KV held by lenders: `KVParts` for the forward (scheduler.RemoteKV)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.parts: list[_Part] = []
        self._loop = loop

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts)

    def submit(self, layer_index: int, q: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """On the engine's tensor thread: the query goes to every lease at once (the event loop sends it
        while the forward computes the local parts), and the answers are merged (§4.2's ScaleReduce)."""
        device = q.device
        future = asyncio.run_coroutine_threadsafe(self._attend(layer_index, q.detach().cpu()), self._loop)

        def collect() -> tuple[torch.Tensor, torch.Tensor]:
            try:
                out, lse = future.result(ATTEND_TIMEOUT_S)
            except Exception as err:  # any failure of a lease: its KV is out of reach
                future.cancel()
                raise RemotePartLost(self.request_id, str(err) or type(err).__name__) from err
            return out.to(device), lse.to(device)

        return collect

    async def _attend(self, layer_index: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        results = await asyncio.gather(*(p.lease.attend(layer_index, q, p.num_tokens) for p in self.parts if p.num_tokens))
        out, lse = results[0]
        for o, s in results[1:]:
            out, lse = scale_reduce_pair(out, lse, o, s)
        return out, lse

    async def close(self) -> None:
        await asyncio.gather(*(p.lease.free() for p in self.parts), return_exceptions=True)


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
        for part in remote.parts:
            self.bytes_sent += part.lease.bytes_sent
            self.bytes_received += part.lease.bytes_received
        task = asyncio.get_running_loop().create_task(remote.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


class BuiltinKVBorrowing:
    """Leases at other workers for this engine's spanning requests (module docstring)."""

    def __init__(self, sched: Scheduler, lenders: Lenders, block_size_tokens: int) -> None:
        self._sched = sched
        self._lenders = lenders
        self._block_size_tokens = block_size_tokens
        # Lease ids are unique per lender across all its borrowers: this engine's random id first.
        self._engine_id = uuid.uuid4().hex[:12]
        self._cache: PagedKVCache | None = None
        self._executor: concurrent.futures.Executor | None = None
        self._losses: dict[str, int] = {}  # request id -> times its remote KV was lost
        self._lease_seq = 0

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
        # Per token: a lender's blocks need not be this engine's size (_grow).
        token_bytes = self._sched.space.block_bytes // self._block_size_tokens
        borrowed: dict[str, int] = {}
        for req in self._sched.requests.values():
            if isinstance(req.remote, RemoteParts):
                for part in req.remote.parts:
                    if part.lease.blocks:
                        lent_bytes = part.lease.blocks * part.lease.block_size_tokens * token_bytes
                        borrowed[part.pod] = borrowed.get(part.pod, 0) + lent_bytes
        return borrowed

    def wire_bytes(self) -> tuple[int, int]:
        """(sent, received) bytes over every lease so far, closed ones included."""
        sent, received = self._lenders.bytes_sent, self._lenders.bytes_received
        for req in self._sched.requests.values():
            if isinstance(req.remote, RemoteParts):
                sent += sum(p.lease.bytes_sent for p in req.remote.parts)
                received += sum(p.lease.bytes_received for p in req.remote.parts)
        return sent, received

    # -- before each step ------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Give each running spanning request the free blocks its next chunk needs, moving its oldest
        full blocks to lenders; a request no creditor can help fails, one whose lender is gone is
        preempted (module docstring)."""
        sched = self._sched
        self._losses = {rid: n for rid, n in self._losses.items() if rid in sched.requests}
        for req in [r for r in sched.running if r.spans]:
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
        moved = 0
        while moved < num_blocks:
            part, granted = await self._lend(req, remote, num_blocks - moved)
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

    async def _lend(self, req: Request, remote: RemoteParts, num_blocks: int) -> tuple[_Part, int]:
        """A lease with room for up to `num_blocks` more of this engine's blocks, and for how many: one
        of the request's leases if its lender has room (the newest first), else a new one at the best
        candidate that has. A lender short of what is asked says how many blocks it has, and that is
        taken (§4.4: the creditor answers)."""
        open_lease, creditors = self._lenders.open_lease, self._lenders.creditors
        assert open_lease is not None and creditors is not None
        for part in reversed(remote.parts):
            try:
                granted = await self._grow(part, num_blocks)
            except LendingError:
                continue  # refused for something else than room: its other leases may still do
            except Exception as err:
                raise RemotePartLost(req.request_id, str(err) or type(err).__name__) from err
            if granted:
                return part, granted
        for creditor in creditors.candidates():
            if any(p.lease.address == creditor.address for p in remote.parts):
                continue  # asked above
            self._lease_seq += 1
            part = _Part(open_lease(creditor.address, f"{self._engine_id}/{req.request_id}/{self._lease_seq}"),
                         creditor.pod)
            try:
                granted = await self._grow(part, num_blocks)
            except Exception as err:  # refused, or unreachable: the next candidate
                log.info("creditor %s refused %d blocks: %s", creditor.pod, num_blocks, err)
                granted = 0
            if not granted:
                creditors.refused(creditor.address)
                await part.lease.free()
                continue
            remote.parts.append(part)
            log.info("request %s borrows from %s (%d blocks)", req.request_id, creditor.pod, granted)
            return part, granted
        raise NoRoomToBorrow(f"request {req.request_id} needs {num_blocks} more KV blocks and no worker of the pool "
                             "lends them now")

    async def _grow(self, part: _Part, num_blocks: int) -> int:
        """Room in `part` for up to `num_blocks` of this engine's blocks: what its lease has left, grown
        by what is missing or by the room its lender says it has; the blocks it takes now (0: none).

        Counted in tokens, so a lender's blocks need not be this engine's size (a vLLM lender's are 128
        tokens on the CPU, the builtin engine's 16): a new lease first takes one block, which says the
        lender's size, and a lease's unused room is filled by the next spill. Errors other than a
        refusal for room propagate."""
        lease, bs = part.lease, self._block_size_tokens

        def fits() -> int:
            return min(num_blocks, (lease.blocks * lease.block_size_tokens - part.num_tokens) // bs)

        for _ in range(2):  # a new lease: once to learn the lender's block size, once for the rest
            if fits() >= num_blocks:
                break
            missing_tokens = num_blocks * bs + part.num_tokens - lease.blocks * lease.block_size_tokens
            ask = 1 if not lease.blocks else -(-missing_tokens // lease.block_size_tokens)
            try:
                await lease.lend(ask)
            except LendingError as err:
                if not 0 < err.room_blocks < ask:
                    break
                try:
                    await lease.lend(err.room_blocks)
                except LendingError:
                    pass  # taken by another borrower meanwhile
                break
        return fits()
