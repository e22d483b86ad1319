"""The builtin engine's `KVLending` capability: rManager's lender side (Infinite-LLM §4.3).

A request longer than its worker's memory keeps its newest KV in blocks other workers lend it. The
lent blocks are taken from this engine's own block pool, so its scheduler sees them as used and never
hands them to a request of its own; they sit in the same paged cache tensors, and a borrower's query
is answered with a micro-attention over them (§4.6: the query is shipped, never the KV) on a thread
of the lender's own, not the engine's tensor thread: a borrower's every layer waits for the answer,
and queued behind this engine's step it would wait a whole step per layer; two workers that lend to
each other (a debt cycle, §4.5) would each hold its tensor thread in a forward that waits for the
other's, a deadlock. Reads (attention, DGFM's recall) are safe beside a step: no step writes a lent
block once its lease has been written. Writes are not: a block freed in the middle of a step (its
request aborted) may be lent at once while that step still writes it, so a lease's KV is stored on
the tensor thread, after the step. A write comes from a borrower's move between its own steps, never
from inside a forward, so waiting for a step there cannot deadlock. A lease is one borrower request's blocks
here, in token order. What may be lent is capped (`cap_blocks`, §4.3's hyper-parameter); a request
beyond the cap or the free blocks is refused at once, first come first served (§4.4, "competing
candidates"), and the borrower asks another creditor.

`BuiltinKVLending` is its own object, given the scheduler at construction and the cache and the
executor when the engine starts (`open`), as BuiltinKVMigration is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import torch

from kvfleet.worker.distkv.wire import attend_lease, lease_blocks, trimmed_blocks
from kvfleet.worker.engines.base import blocks_for
from kvfleet.worker.engines.builtin.model import PagedKVCache
from kvfleet.worker.engines.builtin.scheduler import Scheduler
from kvfleet.worker.engines.capabilities import LendingError


class BuiltinKVLending:
    """Leases of this engine's KV blocks to requests running elsewhere."""

    def __init__(self, sched: Scheduler, cap_blocks: int) -> None:
        if cap_blocks < 0:
            raise ValueError("the lending cap must be at least 0 blocks")
        self._sched = sched
        self._cap_blocks = cap_blocks
        self._cache: PagedKVCache | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None  # reads: attention, recalls
        self._store_executor: concurrent.futures.Executor | None = None  # writes: the engine's tensor thread
        self._leases: dict[str, list[int]] = {}  # lease id -> block ids, in token order

    def open(self, cache: PagedKVCache, executor: concurrent.futures.Executor, cap_blocks: int | None = None) -> None:
        """Lend from the started engine's cache, storing on its tensor thread `executor`; `cap_blocks`
        replaces the cap (known once blocks are sized)."""
        self._cache = cache
        self._store_executor = executor
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-lend")
        if cap_blocks is not None:
            if cap_blocks < 0:
                raise ValueError("the lending cap must be at least 0 blocks")
            self._cap_blocks = cap_blocks

    def close(self) -> None:
        """The engine stops: every lease is gone with its memory."""
        for lease_id in list(self._leases):
            self._free(lease_id)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._cache = self._executor = self._store_executor = None

    @property
    def cap_blocks(self) -> int:
        return self._cap_blocks

    def lent_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._leases.values())

    def room_blocks(self) -> int:
        """Blocks a lend could take now: the room under the cap, or the free blocks if fewer."""
        return max(0, min(self._cap_blocks - self.lent_blocks(), len(self._sched.space.free))) if self._cache else 0

    async def lend(self, lease_id: str, num_blocks: int) -> None:
        if self._cache is None:
            raise LendingError("the engine is not running")
        if num_blocks < 1:
            raise LendingError(f"a lease grows by at least one block, not {num_blocks}")
        if self.lent_blocks() + num_blocks > self._cap_blocks:
            raise LendingError(f"lending {num_blocks} more blocks would pass this worker's cap of {self._cap_blocks}",
                               self.room_blocks())
        if len(self._sched.space.free) < num_blocks:
            raise LendingError(f"{num_blocks} blocks asked, {len(self._sched.space.free)} free", self.room_blocks())
        self._leases.setdefault(lease_id, []).extend(self._sched.space.allocate(num_blocks))

    def _blocks(self, lease_id: str, num_tokens: int) -> list[int]:
        assert self._cache is not None
        return lease_blocks(self._leases, lease_id, num_tokens, self._cache.block_size_tokens)

    async def write(self, lease_id: str, start_token: int, kv: torch.Tensor) -> None:
        cache, _ = self._require()
        executor = self._store_executor
        if executor is None:
            raise LendingError("the engine is not running")
        num_tokens = int(kv.shape[2])
        if start_token < 0 or num_tokens < 1:
            raise LendingError(f"nothing to write at token {start_token}")
        blocks = self._blocks(lease_id, start_token + num_tokens)
        bs = cache.block_size_tokens
        positions = torch.arange(start_token, start_token + num_tokens)
        block_index = torch.tensor(blocks, dtype=torch.long)[positions // bs]
        offset_index = positions % bs

        def store() -> None:
            device = cache.layers[0].device
            b, o = block_index.to(device), offset_index.to(device)
            for layer, data in zip(cache.layers, kv.to(device=device, dtype=cache.layers[0].dtype)):
                layer[0][b, o] = data[0]
                layer[1][b, o] = data[1]

        await asyncio.get_running_loop().run_in_executor(executor, store)

    async def attend(self, lease_id: str, layer: int, q: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache, executor = self._require()
        if not 0 <= layer < len(cache.layers):
            raise LendingError(f"no layer {layer}")
        if num_tokens < 1:
            raise LendingError("attention over no tokens")
        blocks = self._blocks(lease_id, num_tokens)

        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            kv = cache.layers[layer]
            return attend_lease(q, kv[0], kv[1], torch.tensor(blocks), num_tokens)

        return await asyncio.get_running_loop().run_in_executor(executor, compute)

    async def read(self, lease_id: str, start_token: int, num_tokens: int) -> torch.Tensor:
        cache, executor = self._require()
        if start_token < 0 or num_tokens < 1:
            raise LendingError(f"nothing to read at token {start_token}")
        blocks = self._blocks(lease_id, start_token + num_tokens)
        bs = cache.block_size_tokens
        first, end = start_token // bs, blocks_for(start_token + num_tokens, bs)

        def load() -> torch.Tensor:
            # [layers, 2, blocks, block, kv_heads, dim] -> the tokens asked for
            data = cache.read_blocks(blocks[first:end]).flatten(2, 3)
            return data[:, :, start_token - first * bs:start_token - first * bs + num_tokens].cpu().contiguous()

        return await asyncio.get_running_loop().run_in_executor(executor, load)

    async def trim(self, lease_id: str, num_tokens: int) -> int:
        cache, _ = self._require()
        gone = trimmed_blocks(self._leases, lease_id, num_tokens, cache.block_size_tokens)
        blocks = self._leases[lease_id]
        if gone:
            self._sched.space.release(gone)
            del blocks[len(blocks) - len(gone):]
            self._sched.wake()
        return len(blocks)

    async def free(self, lease_id: str) -> int:
        return self._free(lease_id)

    def _free(self, lease_id: str) -> int:
        blocks = self._leases.pop(lease_id, None)
        if not blocks:
            return 0
        self._sched.space.release(blocks)
        self._sched.wake()
        return len(blocks)

    def _require(self) -> tuple[PagedKVCache, concurrent.futures.Executor]:
        if self._cache is None or self._executor is None:
            raise LendingError("the engine is not running")
        return self._cache, self._executor

