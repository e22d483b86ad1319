"""The vLLM engine's `KVLending` capability: Infinite-LLM's lender side (rManager, §4.3) over vLLM's blocks.

A request longer than its worker's memory keeps part of its KV in blocks other workers lend it, and
ships each step's queries there for the micro-attention over them (§4.2, §4.6). A vLLM worker lends
blocks of its own KV cache; the pieces live where vLLM keeps what they touch:

- **The blocks.** A lease's blocks come out of vLLM's block pool on EngineCore's loop thread (the
  connector's scheduler side, asks `lend`, `lend-trim` and `lend-free`: internals.lend_blocks), held as a
  request's would be, so vLLM's scheduler counts them used and never hands them to a request of its
  own. When the agent's pipe ends they all go back.
- **The KV.** The lent blocks sit in vLLM's KV cache tensors, which the connector's worker side holds.
  `LentBlocks` there stores a borrower's KV and answers its queries on the EngineCore's second pipe
  (corepipe.py), off vLLM's step loop, since a borrower's every layer waits for the answer; a lent
  block is never one a step reads or writes, so the two need no lock. It reads the cache through
  kvfleet's attention backend's layout (attention.py `kv_views`), so lending needs `distattention`.
- **The leases.** This process (`VLLMKVLending`, on the agent's event loop) keeps each lease's block
  ids, enforces the cap (first come, first served: §4.4), and names the blocks in every write and
  query, so the EngineCore side keeps no per-lease state but the blocks it took.

Lending needs a static KV cache: elastic memory also takes blocks out of vLLM's pool (options.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvfleet.worker.distkv.wire import attend_lease, lease_blocks, pack_partial, trimmed_blocks, unpack_partial
from kvfleet.worker.engines.capabilities import LendingError, MigrationError
from kvfleet.worker.engines.vllm.corepipe import CorePipe
from kvfleet.worker.engines.vllm.migration import ConnectorClient

log = logging.getLogger(__name__)


# -- in the EngineCore (the connector's worker side) ------------------------------------------------


class LentBlocks:
    """Writes into and attention over lent blocks of vLLM's KV cache, for the agent (module docstring).

    Asks on the core pipe:
      {"op": "lease-write", "blocks", "start"} + kv [layers, 2, tokens, kv_heads, head_dim]
          tokens [start, start + n) of a lease whose blocks are `blocks`, in token order;
      {"op": "lease-attend", "layer", "blocks", "tokens"} + q [rows, q_heads, head_dim]
          -> out [rows, q_heads, head_dim] then lse [rows, q_heads], one float32 tensor;
      {"op": "lease-read", "blocks", "start", "tokens"}
          -> kv [layers, 2, tokens, kv_heads, head_dim] (DGFM's recall takes them home).
    """

    def __init__(self, pipe: CorePipe, layers: list[torch.Tensor], block_size_tokens: int) -> None:
        from kvfleet.worker.engines.vllm.attention import kv_views

        self._views = [kv_views(layer) for layer in layers]
        self._block_size = block_size_tokens
        pipe.handle("lease-write", self._on_write)
        pipe.handle("lease-attend", self._on_attend)
        pipe.handle("lease-read", self._on_read)

    def _on_write(self, msg: dict[str, Any], kv: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor | None]:
        if kv is None:
            raise ValueError("lease-write without its KV")
        self.write(torch.tensor([int(b) for b in msg["blocks"]], dtype=torch.long), int(msg["start"]), kv)
        return {}, None

    def _on_attend(self, msg: dict[str, Any], q: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor | None]:
        if q is None:
            raise ValueError("lease-attend without its query")
        out, lse = self.attend(int(msg["layer"]), torch.tensor([int(b) for b in msg["blocks"]], dtype=torch.long),
                               int(msg["tokens"]), q)
        return {}, pack_partial(out, lse)

    def _on_read(self, msg: dict[str, Any], _: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor | None]:
        return {}, self.read(torch.tensor([int(b) for b in msg["blocks"]], dtype=torch.long), int(msg["start"]),
                             int(msg["tokens"]))

    def _slots(self, blocks: torch.Tensor, start_token: int, num_tokens: int) -> torch.Tensor:
        """Cache slots of a lease's tokens [start, start + n): block id x block size + offset."""
        positions = torch.arange(start_token, start_token + num_tokens)
        return blocks[positions // self._block_size] * self._block_size + positions % self._block_size

    def read(self, blocks: torch.Tensor, start_token: int, num_tokens: int) -> torch.Tensor:
        slots = self._slots(blocks, start_token, num_tokens)
        return torch.stack([torch.stack([k_cache.flatten(0, 1).index_select(0, slots),
                                         v_cache.flatten(0, 1).index_select(0, slots)])
                            for _, k_cache, v_cache in self._views]).cpu()

    def write(self, blocks: torch.Tensor, start_token: int, kv: torch.Tensor) -> None:
        if len(kv) != len(self._views):
            raise ValueError(f"KV of {len(kv)} layers for a cache of {len(self._views)}")
        slots = self._slots(blocks, start_token, int(kv.shape[2]))
        for (_, k_cache, v_cache), data in zip(self._views, kv, strict=True):
            # [blocks, block_size, heads, dim] -> [slots, heads, dim]: views, the layer is NHD-contiguous.
            k_cache.flatten(0, 1).index_copy_(0, slots, data[0].to(k_cache.dtype))
            v_cache.flatten(0, 1).index_copy_(0, slots, data[1].to(v_cache.dtype))

    def attend(self, layer: int, blocks: torch.Tensor, num_tokens: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer < len(self._views):
            raise ValueError(f"no layer {layer}")
        _, k_cache, v_cache = self._views[layer]
        return attend_lease(q, k_cache, v_cache, blocks, num_tokens)


# -- in the agent's process -------------------------------------------------------------------------


class VLLMKVLending:
    """The leases of this vLLM engine's blocks (capabilities.KVLending; module docstring)."""

    def __init__(self, cap_bytes: int) -> None:
        self._cap_bytes = cap_bytes
        self._cap_blocks = 0
        self._block_size = 0
        self._num_layers = 0
        self._leases: dict[str, list[int]] = {}   # lease id -> vLLM block ids, in token order
        self._asked = 0                            # blocks of lends in flight, held against the cap
        # Every lease a lend was asked for: one whose ask failed (a time-out) may still have been carried
        # out in the EngineCore, so freeing it is always asked there.
        self._ever: set[str] = set()
        self._control: ConnectorClient | None = None
        self._data: ConnectorClient | None = None

    def open(self, control: ConnectorClient, core: ConnectorClient, block_size_tokens: int, block_bytes: int,
             num_layers: int) -> None:
        """Lend from the started engine: blocks through the connector's pipe, KV through the core pipe."""
        self._control, self._data = control, core
        self._cap_blocks = self._cap_bytes // block_bytes
        self._block_size, self._num_layers = block_size_tokens, num_layers

    def close(self) -> None:
        """The engine stops: its EngineCore takes every lent block with it."""
        self._leases.clear()
        self._control = self._data = None

    @property
    def cap_blocks(self) -> int:
        return self._cap_blocks

    def lent_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._leases.values())

    async def lend(self, lease_id: str, num_blocks: int) -> None:
        control = self._control
        if control is None:
            raise LendingError("the engine is not running")
        if num_blocks < 1:
            raise LendingError(f"a lease grows by at least one block, not {num_blocks}")
        room = self._cap_blocks - self.lent_blocks() - self._asked
        if num_blocks > room:
            raise LendingError(f"lending {num_blocks} more blocks would pass this worker's cap of {self._cap_blocks}",
                               max(0, room))
        self._asked += num_blocks
        self._ever.add(lease_id)
        try:
            header, _ = await self._ask(control, "lend", lease=lease_id, blocks=num_blocks)
        finally:
            self._asked -= num_blocks
        block_ids = header.get("block_ids")
        if not block_ids:
            free = int(header.get("free_blocks", 0))
            raise LendingError(f"{num_blocks} blocks asked, {free} free", min(free, room))
        self._leases.setdefault(lease_id, []).extend(int(b) for b in block_ids)

    def _blocks(self, lease_id: str, num_tokens: int) -> list[int]:
        return lease_blocks(self._leases, lease_id, num_tokens, self._block_size)

    async def write(self, lease_id: str, start_token: int, kv: torch.Tensor) -> None:
        num_tokens = int(kv.shape[2])
        if start_token < 0 or num_tokens < 1:
            raise LendingError(f"nothing to write at token {start_token}")
        blocks = self._blocks(lease_id, start_token + num_tokens)
        await self._ask(self._require_data(), "lease-write", kv, blocks=blocks, start=start_token)

    async def attend(self, lease_id: str, layer: int, q: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer < self._num_layers:
            raise LendingError(f"no layer {layer}")
        if num_tokens < 1:
            raise LendingError("attention over no tokens")
        blocks = self._blocks(lease_id, num_tokens)
        _, data = await self._ask(self._require_data(), "lease-attend", q, layer=layer, blocks=blocks, tokens=num_tokens)
        rows, heads, dim = (int(d) for d in q.shape)
        return unpack_partial(data, rows, heads, dim)

    async def read(self, lease_id: str, start_token: int, num_tokens: int) -> torch.Tensor:
        if start_token < 0 or num_tokens < 1:
            raise LendingError(f"nothing to read at token {start_token}")
        blocks = self._blocks(lease_id, start_token + num_tokens)
        _, kv = await self._ask(self._require_data(), "lease-read", blocks=blocks, start=start_token, tokens=num_tokens)
        if kv is None:
            raise LendingError(f"the EngineCore answered no KV for lease {lease_id!r}")
        return kv

    async def trim(self, lease_id: str, num_tokens: int) -> int:
        gone = trimmed_blocks(self._leases, lease_id, num_tokens, self._block_size)
        blocks = self._leases[lease_id]
        if gone:
            control = self._control
            if control is None:
                raise LendingError("the engine is not running")
            await self._ask(control, "lend-trim", lease=lease_id, keep=len(blocks) - len(gone))
            del blocks[len(blocks) - len(gone):]
        return len(blocks)

    async def free(self, lease_id: str) -> int:
        blocks = self._leases.pop(lease_id, None) or []
        if lease_id not in self._ever:
            return 0
        self._ever.discard(lease_id)
        if self._control is not None:
            try:
                await self._ask(self._control, "lend-free", lease=lease_id)
            except LendingError as err:  # the EngineCore is gone, and its blocks with it
                log.info("lease %s: freeing in vLLM failed: %s", lease_id, err)
        return len(blocks)

    def _require_data(self) -> ConnectorClient:
        if self._data is None:
            raise LendingError("the engine is not running")
        return self._data

    @staticmethod
    async def _ask(client: ConnectorClient, op: str, tensor: torch.Tensor | None = None,
                   **fields: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
        try:
            return await client.ask(op, tensor, **fields)
        except MigrationError as err:
            raise LendingError(str(err)) from err
