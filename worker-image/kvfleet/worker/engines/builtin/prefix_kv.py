"""The builtin engine's `PrefixKV` capability: KV moved by prefix in and out of its prefix cache.

capabilities.PrefixKV says what it is for (MemServe §5's caching on both sides of disaggregated
serving). What it means here: the cache is the scheduler's `PrefixCache` (a prompt tree of block
ids), blocks are copied through the engine's one-thread executor behind any step in flight, and only
the device tier is moved (a host-tier node, under elastic memory, ends a prefix). The scheduler is
mutated on the event loop only, as everywhere in the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvfleet.serving.prompt_tree import Match
from kvfleet.worker.engines.builtin.blocks import StagedKV
from kvfleet.worker.engines.builtin.model import PagedKVCache
from kvfleet.worker.engines.builtin.prefix import PrefixCache
from kvfleet.worker.engines.builtin.scheduler import Scheduler
from kvfleet.worker.engines.capabilities import KVBlocks

T = TypeVar("T")


class BuiltinPrefixKV:
    """The PrefixKV calls over a builtin engine's scheduler (with its prefix cache), cache and executor."""

    def __init__(self, sched: Scheduler) -> None:
        assert sched.prefix is not None, "PrefixKV needs the engine's prefix cache"
        self._sched = sched
        self._prefix: PrefixCache = sched.prefix
        self._cache: PagedKVCache | None = None
        self._executor: concurrent.futures.Executor | None = None

    def open(self, cache: PagedKVCache, executor: concurrent.futures.Executor) -> None:
        self._cache = cache
        self._executor = executor

    def close(self) -> None:
        self._cache = None
        self._executor = None

    async def _in_executor(self, fn: Callable[[], T]) -> T:
        if self._executor is None:
            raise RuntimeError("the builtin engine is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _full_tokens(self, tokens: Sequence[int]) -> list[int]:
        bs = self._sched.block_size_tokens
        return list(tokens[: len(tokens) // bs * bs])

    def _device_match(self, tokens: Sequence[int]) -> Match[int] | None:
        """The cached device prefix of `tokens`' full blocks, locked; None when there is none."""
        match = self._prefix.match(self._full_tokens(tokens))
        if match is None:
            return None
        num_device = next((i for i, node in enumerate(match.nodes) if node.on_host), len(match.nodes))
        if num_device < len(match.nodes):  # a host node's value is a host slot, not a device block
            self._prefix.unlock(Match(match.values[num_device:], match.nodes[num_device:], match.block_size_tokens))
            if num_device == 0:
                return None
            match = Match(match.values[:num_device], match.nodes[:num_device], match.block_size_tokens)
        return match

    def cached_blocks(self, tokens: Sequence[int]) -> int:
        match = self._device_match(tokens)
        if match is None:
            return 0
        self._prefix.unlock(match)
        return len(match.nodes)

    def stage_prefix(self, request_id: str, tokens: Sequence[int]) -> int:
        sched = self._sched
        if sched.get(request_id) is not None or sched.staged_kv(request_id) is not None or self._cache is None:
            return 0
        match = self._device_match(tokens)
        if match is None:
            return 0
        num = len(match.nodes)
        sched.staged[request_id] = StagedKV(list(match.values), num * sched.block_size_tokens, match)
        # Tokens whose KV this worker did not receive: its cache served them (a decode worker's hits).
        sched.num_cache_hit_tokens += num * sched.block_size_tokens
        return num

    async def export_prefix(self, tokens: Sequence[int], first_block: int) -> KVBlocks | None:
        cache = self._cache
        if cache is None:
            raise RuntimeError("the builtin engine is not started")
        match = self._device_match(tokens)
        if match is None:
            return None
        try:
            block_ids = list(match.values[first_block:])
            if not block_ids:
                return None
            # Locked while the copy, queued behind any step in flight, reads them.
            data = await self._in_executor(lambda: cache.read_blocks(block_ids).cpu())
        finally:
            self._prefix.unlock(match)
        bs = self._sched.block_size_tokens
        return KVBlocks("", first_block, len(block_ids) * bs, bs, data)

    async def import_prefix(self, tokens: Sequence[int], kv: KVBlocks) -> int:
        sched, cache = self._sched, self._cache
        if cache is None:
            raise RuntimeError("the builtin engine is not started")
        bs = sched.block_size_tokens
        if kv.block_size_tokens != bs:
            return 0
        end = min(kv.end_block, len(tokens) // bs)
        full = list(tokens[: end * bs])
        held = self._device_match(full)
        num_held = len(held.nodes) if held is not None else 0
        try:
            if num_held >= end or kv.first_block > num_held:
                return 0  # it has them all, or they would leave a gap after its prefix
            num_new = end - num_held
            if not sched.ensure_free(num_new):
                return 0  # a cache takes what it has room for; the sender loses nothing
            blocks = sched.space.allocate(num_new)
            data = kv.data[:, :, num_held - kv.first_block:end - kv.first_block]
            try:
                await self._in_executor(lambda: cache.write_blocks(blocks, data))
            except BaseException:
                sched.space.release(blocks)
                raise
            own = list(held.values) if held is not None else []
            duplicates = self._prefix.insert(full, own + blocks, num_held)
            sched.space.release(duplicates)
            sched.wake()
            return num_new - len(duplicates)
        finally:
            if held is not None:
                self._prefix.unlock(held)
