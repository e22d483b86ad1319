"""A borrowing request's KV held by lenders, and finding room for more of it (Infinite-LLM §4.3, §4.4, §4.6).

Whichever engine borrows (the builtin engine on its event loop, vLLM's EngineCore on a loop thread of
its own) keeps a spanning request's remote KV as `RemoteParts`: one `Part` per lease, each holding
some of the request's oldest tokens. Attention over a set of keys does not depend on where they live
or in which order (positions are already in the keys), so the parts are attended independently and
merged with ScaleReduce (§4.2), and any part may grow. `LeaseFinder` finds room for a number of the
engine's blocks: the request's own leases first (the newest first), then a new lease at the best
creditor that has room (§4.4: the creditor answers; one short of what is asked says how many it has).

DGFM's recall (§4.5) runs the other way: `RemoteParts.recall` reads the newest tokens of the leases at
one creditor back, holds them here (`HeldPart`, attended in this process with the same
micro-attention a lender runs) and trims the leases, so the creditor gets its blocks back. Where the
held tokens go then is the engine's business (the builtin engine moves them into its own blocks when
it has room, builtin/borrowing.py). A swap needs no free memory (§4.5: each instance on a debt cycle
sends back what it holds for its debtor as it takes its own home), but the two halves happen on
different workers at different moments; holding the recalled tokens in host memory between them is
what lets every worker of a cycle recall at once without waiting on the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvfleet.kernels.dispatch import scale_reduce_pair
from kvfleet.worker.distkv.creditors import Creditors
from kvfleet.worker.distkv.wire import attend_lease
from kvfleet.worker.engines.base import EngineError
from kvfleet.worker.engines.capabilities import LeaseOpener, LendingError, RemoteKVLease

# A remote micro-attention waits behind the lender's own step: past this the lender counts as lost
# (distkv/wire.py's reply timeout, and a margin).
ATTEND_TIMEOUT_S = 35.0

log = logging.getLogger(__name__)


class RemotePartLost(EngineError):
    """A spanning request's remote KV cannot be reached (its lender died or left)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id}: its KV lent by another worker is lost: {reason}")
        self.request_id = request_id


class NoRoomToBorrow(EngineError):
    """No creditor lends what a spanning request needs next."""


@dataclass
class Part:
    """One lease of a request: it holds `num_tokens` of the request's tokens."""

    lease: RemoteKVLease
    pod: str
    num_tokens: int = 0


@dataclass
class HeldPart:
    """Tokens of a request recalled from a lender (DGFM, §4.5), held in this process's memory:
    kv [layers, 2, tokens, kv_heads, head_dim], attended here as a lender would attend them."""

    kv: torch.Tensor
    block_size_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2])

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def attend(self, layer_index: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Whole blocks of the engine (recalls move whole blocks), seen as a paged cache of them.
        k, v = (t.reshape(-1, self.block_size_tokens, *t.shape[1:]) for t in self.kv[layer_index])
        return attend_lease(q, k, v, torch.arange(k.shape[0]), self.num_tokens)


class RemoteParts:
    """One spanning request's KV held by lenders, and any of it recalled and held here (`held`)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.parts: list[Part] = []
        self.held: list[HeldPart] = []
        self._loop = loop
        # Moves into leases (spills) and out of them (recalls) of one request, one at a time.
        self.moving = asyncio.Lock()
        # Attentions of leases in flight (`_take`), counted under a lock: a forward reads the parts from its
        # own thread.
        self._snapshot = threading.Lock()
        self._attending = 0
        self._attended = asyncio.Event()
        self._attended.set()
        # Wire bytes of leases a recall emptied and freed.
        self._retired_sent = self._retired_received = 0

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts) + sum(h.num_tokens for h in self.held)

    @property
    def lent_tokens(self) -> int:
        """Tokens that live at lenders (not the recalled ones held here)."""
        return sum(p.num_tokens for p in self.parts)

    def _take(self) -> tuple[list[tuple[RemoteKVLease, int]], list[HeldPart]]:
        """The parts to attend, read at once (a recall moves tokens from a lease to `held` on the loop while
        a forward may be reading them from its own thread), the leases' attention counted in flight until
        `_attend_lent` ends it: a recall trims a lease only once those that counted its old tokens are done."""
        with self._snapshot:
            lent = [(p.lease, p.num_tokens) for p in self.parts if p.num_tokens]
            if lent:
                self._attending += 1
                self._attended.clear()
            return lent, list(self.held)

    async def _attend_lent(self, layer_index: int, q: torch.Tensor,
                           lent: list[tuple[RemoteKVLease, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        try:
            return list(await asyncio.gather(*(lease.attend(layer_index, q, n) for lease, n in lent)))
        finally:
            with self._snapshot:
                self._attending -= 1
                idle = not self._attending
            if idle:
                self._attended.set()

    def submit(self, layer_index: int, q: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """From a thread other than the loop's: the query goes to every lease at once (the loop sends it
        while the caller computes the local part and the held parts, here), and `collect()` merges the
        answers (§4.2's ScaleReduce). A request whose KV all came home makes no trip to the loop."""
        device = q.device
        lent, held = self._take()
        future = (asyncio.run_coroutine_threadsafe(self._attend_lent(layer_index, q.detach().cpu(), lent), self._loop)
                  if lent else None)
        # Held parts here, on the forward's thread, while the lenders answer (on a thread of their own they
        # measured slower on two cores: bench/dgfm.py's one swap).
        results = _attend_held(held, layer_index, q)

        def collect() -> tuple[torch.Tensor, torch.Tensor]:
            answers = list(results)
            if future is not None:
                try:
                    answers += future.result(ATTEND_TIMEOUT_S)
                except Exception as err:  # any failure of a lease: its KV is out of reach
                    future.cancel()
                    raise RemotePartLost(self.request_id, str(err) or type(err).__name__) from err
            out, lse = _merge(answers)
            return out.to(device), lse.to(device)

        return collect

    async def attend(self, layer_index: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """On the loop: q over every lease at once and over the held parts, merged (§4.2's ScaleReduce)."""
        lent, held = self._take()
        at_home = (asyncio.get_running_loop().run_in_executor(_held_executor(), _attend_held, held, layer_index, q)
                   if held else None)
        results = await self._attend_lent(layer_index, q, lent) if lent else []
        return _merge((await at_home if at_home is not None else []) + results)

    async def recall(self, pod: str, max_tokens: int, block_size_tokens: int) -> int:
        """DGFM's recall (module docstring): up to `max_tokens` (whole blocks of `block_size_tokens`) of the
        newest tokens of the leases at `pod` read back into `held`, and those leases trimmed; the tokens
        recalled. A lease emptied is freed. Raises RemotePartLost when a lease at `pod` fails."""
        recalled = 0
        async with self.moving:
            for part in [p for p in reversed(self.parts) if p.pod == pod]:
                take = min(part.num_tokens, max_tokens - recalled) // block_size_tokens * block_size_tokens
                if take <= 0:
                    continue
                keep = part.num_tokens - take
                try:
                    kv = await part.lease.read(keep, take)
                except Exception as err:
                    raise RemotePartLost(self.request_id, str(err) or type(err).__name__) from err
                # At once for any reader: the tokens leave the lease's count and join the held ones together.
                with self._snapshot:
                    part.num_tokens = keep
                    self.held.append(HeldPart(kv, block_size_tokens))
                recalled += take
                # An attention that counted the lease's old tokens may still be on its way to the lender.
                try:
                    await asyncio.wait_for(self._attended.wait(), ATTEND_TIMEOUT_S)
                except TimeoutError as err:
                    raise RemotePartLost(self.request_id, "its leases' attention did not end") from err
                try:
                    if keep:
                        await part.lease.trim(keep)
                    else:
                        with self._snapshot:  # a forward's thread may be reading the list
                            self.parts.remove(part)
                        self._retired_sent += part.lease.bytes_sent
                        self._retired_received += part.lease.bytes_received
                        await part.lease.free()
                except Exception as err:
                    # A lender that fails a trim ends the lease: the tokens it kept are lost, and the next
                    # attention finds it so and has the request computed again, as for any lost lender.
                    log.warning("request %s: %s failed to give back its blocks: %s", self.request_id, pod, err)
        return recalled

    def wire_bytes(self) -> tuple[int, int]:
        """(sent, received) bytes over this request's leases so far."""
        return (self._retired_sent + sum(p.lease.bytes_sent for p in self.parts),
                self._retired_received + sum(p.lease.bytes_received for p in self.parts))

    def lent_bytes(self, token_bytes: int, into: dict[str, int]) -> None:
        """Add the bytes each creditor pod lends this request to `into`: its blocks, in its own block size
        (a lender's blocks need not be the borrower's: LeaseFinder.grow)."""
        for part in self.parts:
            if part.lease.blocks:
                into[part.pod] = into.get(part.pod, 0) + part.lease.blocks * part.lease.block_size_tokens * token_bytes

    async def close(self) -> None:
        await asyncio.gather(*(p.lease.free() for p in self.parts), return_exceptions=True)


_HELD_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None


def _held_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The thread held parts are attended on when the caller is the event loop (a vLLM worker's agent,
    which also serves HTTP and lenders: a layer's held attention must not stall it)."""
    global _HELD_EXECUTOR
    if _HELD_EXECUTOR is None:
        _HELD_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-held")
    return _HELD_EXECUTOR


def _attend_held(held: list[HeldPart], layer_index: int, q: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [h.attend(layer_index, q) for h in held]


async def recall_requests(requests: Iterable[RemoteParts], pod: str, num_bytes: int, block_size_tokens: int,
                          token_bytes: int, lost: Callable[[RemoteParts, RemotePartLost], None]) -> int:
    """DGFM's recall for an engine (`KVBorrowing.recall`): up to `num_bytes` of its requests' KV at `pod`,
    request after request, in whole blocks of `block_size_tokens`; the bytes brought home. A request whose
    lease at `pod` fails is handed to `lost` (the engine decides when it is computed again)."""
    left_tokens = num_bytes // token_bytes if token_bytes else 0
    recalled = 0
    for remote in list(requests):
        if left_tokens < block_size_tokens:
            break
        try:
            n = await remote.recall(pod, left_tokens, block_size_tokens)
        except RemotePartLost as err:
            lost(remote, err)
            continue
        left_tokens -= n
        recalled += n * token_bytes
    if recalled:
        log.info("recalled %d bytes of KV from %s (DGFM)", recalled, pod)
    return recalled


def _merge(results: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = results[0]
    for o, s in results[1:]:
        out, lse = scale_reduce_pair(out, lse, o.to(out.device), s.to(out.device))
    return out, lse


class LeaseFinder:
    """Room in leases for a spanning request's blocks (module docstring). Lease ids are unique per
    lender across all its borrowers: the engine's random id first, then the request's, then a count."""

    def __init__(self, engine_id: str, block_size_tokens: int) -> None:
        self._engine_id = engine_id
        self._block_size_tokens = block_size_tokens
        self._lease_seq = 0

    async def room(self, remote: RemoteParts, num_blocks: int, open_lease: LeaseOpener,
                   creditors: Creditors) -> tuple[Part, int]:
        """A lease with room for up to `num_blocks` more of the engine's blocks, and for how many.
        Raises RemotePartLost when one of the request's lenders fails, NoRoomToBorrow when no creditor lends."""
        for part in reversed(remote.parts):
            try:
                granted = await self.grow(part, num_blocks)
            except LendingError:
                continue  # refused for something else than room: its other leases may still do
            except Exception as err:
                raise RemotePartLost(remote.request_id, str(err) or type(err).__name__) from err
            if granted:
                return part, granted
        for creditor in creditors.candidates():
            if any(p.lease.address == creditor.address for p in remote.parts):
                continue  # asked above
            self._lease_seq += 1
            part = Part(open_lease(creditor.address, f"{self._engine_id}/{remote.request_id}/{self._lease_seq}"),
                        creditor.pod)
            try:
                granted = await self.grow(part, num_blocks)
            except Exception as err:  # refused, or unreachable: the next candidate
                log.info("creditor %s refused %d blocks: %s", creditor.pod, num_blocks, err)
                granted = 0
            if not granted:
                creditors.refused(creditor.address)
                await part.lease.free()
                continue
            remote.parts.append(part)
            log.info("request %s borrows from %s (%d blocks)", remote.request_id, creditor.pod, granted)
            return part, granted
        raise NoRoomToBorrow(f"request {remote.request_id} needs {num_blocks} more KV blocks and no worker of the pool "
                             "lends them now")

    async def grow(self, part: Part, num_blocks: int) -> int:
        """Room in `part` for up to `num_blocks` of the engine's blocks: what its lease has left, grown
        by what is missing or by the room its lender says it has; the blocks it takes now (0: none).

        Counted in tokens, so a lender's blocks need not be the engine's size (a vLLM lender's are 128
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
