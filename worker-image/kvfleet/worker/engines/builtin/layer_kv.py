"""The builtin engine's `LayerKV` capability: a prompt's KV handed out layer by layer as it is prefilled.

capabilities.LayerKV says what it is for (MemServe §5.2's by-layer transfer). What it means here: a
watch is registered on the event loop; before each step the engine asks `hook(step)` (on the loop,
so the watches it reads do not change under it) for the callback the model's forward calls on the
executor thread once a layer's K and V are written (`LlamaForward.forward(on_layer=...)`). The callback
copies that layer's blocks of each watched prompt off the cache and puts them on the watch's queue
through the loop (`call_soon_threadsafe`), while the forward goes on to the next layer. Only prompts
whose KV goes into the paged cache are streamed (not elastic memory's offloaded prefill, not a
request spanning workers): for those the queue gets nothing, and the hand-over sends the KV whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfleet.worker.engines.base import DuplicateRequest, blocks_for
from kvfleet.worker.engines.builtin.model import PagedKVCache
from kvfleet.worker.engines.builtin.scheduler import Scheduler, Step
from kvfleet.worker.engines.capabilities import LayerPart, MigrationError


@dataclass
class _Watch:
    queue: asyncio.Queue[LayerPart | None]
    loop: asyncio.AbstractEventLoop
    first_block: int
    # The first step sends the prefix this worker held before it (computed by no step) once.
    started: bool = False
    ended: bool = False


class BuiltinLayerKV:
    """The LayerKV calls over a builtin engine's scheduler and cache (the module docstring)."""

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._cache: PagedKVCache | None = None
        self._executor: concurrent.futures.Executor | None = None
        self._watches: dict[str, _Watch] = {}

    def open(self, cache: PagedKVCache, executor: concurrent.futures.Executor) -> None:
        self._cache = cache
        self._executor = executor

    def close(self) -> None:
        self._cache = None
        self._executor = None
        for request_id in list(self._watches):
            self.unwatch(request_id)

    def watch_layers(self, request_id: str, first_block: int) -> asyncio.Queue[LayerPart | None]:
        queue: asyncio.Queue[LayerPart | None] = asyncio.Queue()
        self._watches[request_id] = _Watch(queue, asyncio.get_running_loop(), max(0, first_block))
        return queue

    def unwatch(self, request_id: str) -> None:
        self._watches.pop(request_id, None)

    # -- the source: the step's callback -------------------------------------------------------------

    def hook(self, step: Step) -> Callable[[int], None] | None:
        """The forward's `on_layer` for this step, or None when it prefills no watched prompt."""
        cache = self._cache
        if not self._watches or cache is None:
            return None
        bs = self._sched.block_size_tokens
        streamed: list[tuple[_Watch, list[int], int, int]] = []  # (watch, blocks, first block, end token)
        ending: list[_Watch] = []
        for req, entry in zip(step.requests, step.entries):
            watch = self._watches.get(req.request_id)
            if watch is None or watch.ended or entry.start_position >= len(req.prompt):
                continue  # not watched, done, or past its prompt: the hand-over sends what follows whole
            end = entry.start_position + len(entry.token_ids)
            if entry.offload_to is not None or req.spans or entry.remote_tokens:
                watch.ended = True  # its KV is not in this cache's blocks as the prompt goes: none sent
                ending.append(watch)
                continue
            first = max(watch.first_block, entry.start_position // bs)
            if not watch.started:
                watch.started = True
                held = list(entry.block_table[watch.first_block:first])
                if held:  # its cached prefix here: computed by no step, so sent as it is, all layers
                    self._put(watch, LayerPart(None, watch.first_block, len(held) * bs, bs,
                                               cache.read_blocks(held).cpu()))
            blocks = list(entry.block_table[first:blocks_for(end, bs)])
            if blocks:
                streamed.append((watch, blocks, first, end))
            if end >= len(req.prompt):
                watch.ended = True
                ending.append(watch)
        if not streamed:
            for watch in ending:
                self._put(watch, None)
            return None
        last_layer = len(cache.layers) - 1

        def on_layer(layer_index: int) -> None:
            layer = cache.layers[layer_index]
            for watch, blocks, first, end in streamed:
                index = torch.tensor(blocks, dtype=torch.long, device=layer.device)
                self._put(watch, LayerPart(layer_index, first, end - first * bs, bs, layer[:, index].cpu()))
            if layer_index == last_layer:
                for watch in ending:
                    self._put(watch, None)

        return on_layer

    @staticmethod
    def _put(watch: _Watch, part: LayerPart | None) -> None:
        watch.loop.call_soon_threadsafe(watch.queue.put_nowait, part)

    # -- the destination -----------------------------------------------------------------------------

    async def import_layer(self, request_id: str, part: LayerPart) -> None:
        sched, cache, executor = self._sched, self._cache, self._executor
        if cache is None or executor is None:
            raise RuntimeError("the builtin engine is not started")
        if sched.get(request_id) is not None:
            raise DuplicateRequest(f"request {request_id!r} is already on this engine")
        bs = sched.block_size_tokens
        if part.block_size_tokens != bs:
            raise MigrationError(f"layer parts of {part.block_size_tokens}-token blocks; this engine's are {bs}")
        num_blocks = int(part.data.shape[2] if part.layer is None else part.data.shape[1])
        end_block = part.first_block + num_blocks
        staged = sched.stage(request_id, end_block)
        if staged is None:
            raise MigrationError(f"no room for {end_block} KV blocks of {request_id!r}: {sched.num_free_blocks} free")
        staged.num_tokens = max(staged.num_tokens, part.first_block * bs + part.num_tokens)
        # Blocks staged from this worker's prefix cache hold the same KV and are the cache's: never written.
        skip = max(0, min(staged.num_shared, end_block) - part.first_block)
        block_ids = staged.blocks[part.first_block + skip:end_block]
        if not block_ids:
            return
        if part.layer is None:
            data = part.data[:, :, skip:]
            await asyncio.get_running_loop().run_in_executor(executor, lambda: cache.write_blocks(block_ids, data))
            return
        layer, data = cache.layers[part.layer], part.data[:, skip:]

        def write() -> None:
            index = torch.tensor(block_ids, dtype=torch.long, device=layer.device)
            layer[:, index] = data.to(device=layer.device, dtype=layer.dtype)

        await asyncio.get_running_loop().run_in_executor(executor, write)
