"""kvfleet's KV connector for vLLM: a running request's KV blocks out of and into vLLM, with no patch to vLLM.

vLLM keeps its block tables and KV cache in its EngineCore process; the worker's agent lives in the
process that runs AsyncLLM (engines/vllm/engine.py). vLLM's own extension point for moving KV is the KV
connector (vllm/distributed/kv_transfer/kv_connector/v1/base.py), which vLLM loads by module path
(`KVTransferConfig(kv_connector="KvfleetConnector", kv_connector_module_path=<this module>)`) in
two roles: the SCHEDULER side inside the scheduler, the WORKER side next to the model (in the same
EngineCore process on one device, as here). This module is both, plus the socket through which the
agent's process drives them (pipe.py: a Unix socket in a private folder, authenticated with a key
that only the two processes know). What the agent asks (engines/vllm/migration.py speaks for it):

- `suspend` (the source stops a request, keeping its KV): the scheduler side caps the running
  request's `max_tokens` at one more token, so that vLLM finishes it as length-capped after its next
  step; `request_finished` then keeps its blocks (returns True: "freed later") and answers with the
  tokens their KV holds (prompt + output but the last token). A request that finished by itself
  (stop token, its own max_tokens, an abort) is answered "finished" and freed as usual.
- `export` (a stage of the copy, while the request decodes or once it is suspended): the scheduler
  side looks the request's blocks up (`KVCacheManager.get_block_ids`; only full blocks while it
  runs: those can no longer change), the worker side copies them into one CPU tensor in kvfleet's
  layout after the step's forward (`wait_for_save`) and hands it back through the worker metadata.
- `stage` (the target receives a stage): kept in this process, by tokens, until the request resumes.
- a resumed request (`kv_transfer_params {"kvfleet": {"id", "load": true}}`): `get_num_new_matched_tokens`
  offers the staged tokens (at most all but the last: vLLM computes at least one), vLLM allocates
  the blocks, and the worker side writes the staged KV into them before the step's forward (a
  synchronous load). A request resumed where it was suspended (a rolled-back migration) loads from
  its own kept blocks.
- `release`: the kept blocks go back to vLLM (reported in `get_finished`, which frees them), or the
  staged KV is dropped.

A load that fails (layout, shape) is reported to vLLM as failed blocks: with `kv_load_failure_policy
="recompute"` vLLM recomputes them, and the agent is told (`load_failed` event) so the migration says so.

kvfleet's KV layout (engines/capabilities.py KVBlocks): [layers, 2 (K, V), blocks, block_size, kv_heads,
head_dim]. vLLM's attention backends keep each layer in their own layout; `KVLayout` reads the two
this connector knows, the CPU backend's, by asking its cache-writing kernel where each element goes
(`KVLayout.calibrate`). Another backend (GPU backends are not verified here: no GPU on the machines
this was built on), a quantized KV cache, or tensor parallelism makes the connector refuse every move
(the agent then moves requests by their tokens and says why).

Threads: the scheduler side's calls run on EngineCore's loop thread; the pipe has a reader and a
writer thread of its own. What the reader takes for the loop thread goes through a queue, read in
`build_connector_meta`; vLLM keeps stepping while the queue is not empty (`has_pending_push_work`), and
the agent wakes an idle EngineCore with a cheap utility call after the reader has queued its ask.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvfleet.worker.engines.vllm import borrowing, internals
from kvfleet.worker.engines.vllm.attention import kv_views
from kvfleet.worker.engines.vllm.borrowing import CoreBorrowing, SpanPlanner, SpillOrder
from kvfleet.worker.engines.vllm.corepipe import CallFailed, CorePipe, core_socket_path
from kvfleet.worker.engines.vllm.elastic import (
    EXTRA_ELASTIC,
    Balloon,
    CpuBuffer,
    ElasticRefused,
    ElasticSettings,
    MapReport,
    Park,
    Parked,
    SetGeometry,
    WorkerPool,
)
from kvfleet.worker.engines.vllm.lending import LentBlocks
from kvfleet.worker.engines.vllm.pipe import LOOP_OPS, Pipe, accept_agent, listen
from kvfleet.worker.engines.vllm.plugin import BACKEND_PATH

if TYPE_CHECKING:
    from contextlib import AbstractContextManager
    from multiprocessing.connection import Connection

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

CONNECTOR_NAME = "KvfleetConnector"
# kv_connector_extra_config keys: where the pipe listens, and its key (hex).
EXTRA_SOCKET = "kvfleet_socket"
EXTRA_AUTHKEY = "kvfleet_authkey"
# A floor on a step's wall time in seconds (EngineConfig.min_step_s: tests and the demo emulate a slower
# accelerator with it); vLLM has no such setting, and the connector is called once a step.
EXTRA_MIN_STEP_S = "kvfleet_min_step_s"
# The attention the engine asked for (VLLMOptions.attention): the worker side checks vLLM built it.
EXTRA_ATTENTION = "kvfleet_attention"
# DistKV (vllm/lending.py, vllm/borrowing.py): the worker side serves lent blocks and moves a spanning
# request's KV over a second pipe beside the first (vllm/corepipe.py).
EXTRA_LEND = "kvfleet_lend"
EXTRA_BORROW = "kvfleet_borrow"

# The request's kv_transfer_params key: {"kvfleet": {"id": the agent's request id, "load": bool}}.
# vLLM adds a suffix of its own to the id it gives a request inside the EngineCore, so the agent's id
# travels here.
PARAMS_KEY = "kvfleet"


# Beside the pipe's socket, in the engine's private folder: why the connector stopped vLLM's start. vLLM
# tells the process that started it only that its EngineCore failed; the engine reads this for the reason.
REFUSAL_FILE = "refusal"


def refusal_path(socket_path: str) -> Path:
    return Path(socket_path).parent / REFUSAL_FILE


def kv_params(request_id: str, load: bool = False) -> dict[str, Any]:
    """The kv_transfer_params that name a request to this connector (and ask to load its staged KV)."""
    return {PARAMS_KEY: {"id": request_id, "load": load}}


# -- vLLM's KV layout <-> kvfleet's ----------------------------------------------------------------


class KVLayout:
    """Where each of a block's K and V elements sits in a vLLM layer's cache, and the copies that use it.

    vLLM's CPU backend keeps a layer as [blocks, kv_heads, block_size, 2 x head_dim], but inside a
    block the order depends on the kernel its CPU picked (its "ISA": K is stored dim-major, [head_dim,
    block_size], by the `vec` kernel, and packed otherwise by others). Rather than copy each kernel's
    packing here, `calibrate` asks the backend's own cache-writing kernel where it puts every element
    of one block (writing element numbers, a few digits at a time so bfloat16 holds them exactly), and
    `index` is that answer: for kvfleet's order [2, block_size, kv_heads, head_dim] flattened, the
    position in the block's flattened storage. A block is then read with one gather and written with
    one scatter, whatever the kernel.
    """

    def __init__(self, index: torch.Tensor, block_size_tokens: int, kv_heads: int, head_dim: int) -> None:
        self.index = index
        # Storage position -> kvfleet's element: a write is a gather too (contiguous stores, about half
        # the time of a scatter at 2,000 tokens here).
        self.inverse = torch.empty_like(index)
        self.inverse[index] = torch.arange(len(index))
        self.block_size_tokens = block_size_tokens
        self.kv_heads = kv_heads
        self.head_dim = head_dim

    def read(self, layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """Blocks of one layer -> [2, blocks, block_size, kv_heads, head_dim] (a new tensor)."""
        blocks = layer.view(layer.shape[0], -1).index_select(0, torch.tensor(block_ids, dtype=torch.long))
        ours = blocks.index_select(1, self.index).view(len(block_ids), 2, self.block_size_tokens, self.kv_heads,
                                                       self.head_dim)
        return ours.transpose(0, 1)

    def write(self, layer: torch.Tensor, block_ids: list[int], kv: torch.Tensor) -> None:
        """kv [2, blocks, block_size, kv_heads, head_dim] into the layer's blocks."""
        expected = (2, len(block_ids), self.block_size_tokens, self.kv_heads, self.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV of shape {tuple(kv.shape)} for blocks of shape {expected}")
        ours = kv.to(dtype=layer.dtype).transpose(0, 1).reshape(len(block_ids), -1)
        layer.view(layer.shape[0], -1).index_copy_(0, torch.tensor(block_ids, dtype=torch.long),
                                                   ours.index_select(1, self.inverse))

    @staticmethod
    def calibrate(layer: torch.Tensor, block_size_tokens: int, kv_heads: int, head_dim: int,
                  kv_cache_dtype: str) -> KVLayout:
        """Asks vLLM's CPU kernel where it writes each element of a block (class docstring); raises
        RuntimeError for a cache that is not the CPU backend's or not a plain copy (quantized KV)."""
        if layer.device.type != "cpu" or tuple(layer.shape[1:]) != (kv_heads, block_size_tokens, 2 * head_dim):
            raise RuntimeError(f"a KV cache of shape {tuple(layer.shape)} on {layer.device.type} is not the CPU "
                               "backend's: moving KV through this backend is not verified")
        if kv_cache_dtype != "auto":
            raise RuntimeError(f"a quantized KV cache ({kv_cache_dtype}) is not a plain copy of K and V")
        from vllm import _custom_ops as ops

        isa = internals.cpu_attention_isa(layer.dtype, block_size_tokens, head_dim, kv_cache_dtype)
        per_kind = block_size_tokens * kv_heads * head_dim
        numbers = torch.arange(per_kind, dtype=torch.long)
        slots = torch.arange(block_size_tokens, dtype=torch.long)
        position = torch.zeros(2 * per_kind, dtype=torch.long)   # kvfleet's element -> storage position
        base = 64   # bfloat16 holds 0..256 exactly
        digits = 1
        while base ** digits < per_kind:
            digits += 1
        for kind in (0, 1):
            found = torch.zeros(kv_heads * block_size_tokens * 2 * head_dim, dtype=torch.long)
            for digit in range(digits):
                values = ((numbers // base ** digit) % base).to(layer.dtype).view(block_size_tokens, kv_heads, head_dim)
                marker = torch.full_like(values, -1)
                cache = torch.zeros((1, kv_heads, block_size_tokens, 2 * head_dim), dtype=layer.dtype)
                key_cache, value_cache = cache.view(1, kv_heads, 2 * block_size_tokens, head_dim).chunk(2, dim=2)
                key, value = (values, marker) if kind == 0 else (marker, values)
                ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache, slots, isa)
                stored = cache.view(-1)
                if digit == 0:
                    mine = (stored >= 0).nonzero().flatten()
                    if len(mine) != per_kind:
                        raise RuntimeError(f"vLLM's CPU kernel ({isa}) wrote {len(mine)} elements for {per_kind}")
                found[mine] += stored[mine].to(torch.long) * base ** digit
            at = torch.full((per_kind,), -1, dtype=torch.long)
            at[found[mine]] = mine
            if (at < 0).any():
                raise RuntimeError(f"vLLM's CPU kernel ({isa}) does not copy each element of a block once")
            position[kind * per_kind:(kind + 1) * per_kind] = at
        return KVLayout(position, block_size_tokens, kv_heads, head_dim)


class PlainKVLayout:
    """The layout kvfleet's attention backend keeps (attention.py): vLLM's NHD, a layer [blocks, block_size,
    kv_heads, 2 x head_dim] with a token's K then V in one row. Reading and writing blocks are strided
    copies; nothing to calibrate."""

    def __init__(self, block_size_tokens: int, kv_heads: int, head_dim: int) -> None:
        self.shape = (block_size_tokens, kv_heads, 2, head_dim)

    def read(self, layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """Blocks of one layer -> [2, blocks, block_size, kv_heads, head_dim] (a new tensor)."""
        rows = kv_views(layer)[0].index_select(0, torch.tensor(block_ids, dtype=torch.long))
        return rows.view(len(block_ids), *self.shape).permute(3, 0, 1, 2, 4).contiguous()

    def write(self, layer: torch.Tensor, block_ids: list[int], kv: torch.Tensor) -> None:
        """kv [2, blocks, block_size, kv_heads, head_dim] into the layer's blocks."""
        block_size, kv_heads, _, head_dim = self.shape
        expected = (2, len(block_ids), block_size, kv_heads, head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV of shape {tuple(kv.shape)} for blocks of shape {expected}")
        rows = kv.to(dtype=layer.dtype).permute(1, 2, 3, 0, 4).reshape(len(block_ids), block_size, kv_heads, 2 * head_dim)
        kv_views(layer)[0].index_copy_(0, torch.tensor(block_ids, dtype=torch.long), rows)


# -- what the scheduler side tells the worker side each step, and back -----------------------------


@dataclass
class _Save:
    task: int
    block_ids: list[int]


@dataclass
class _Load:
    agent_id: str                     # the agent's id of the resumed request (what a failure is reported under)
    request: str                      # vLLM's id of it
    block_ids: list[int]              # its blocks to write, from its first loaded block on
    data: torch.Tensor | None         # [layers, 2, blocks, block_size, heads, head_dim], or None:
    source_block_ids: list[int] | None = None   # copy from these blocks (its own kept KV) instead


@dataclass
class _Unpark:
    request: str                      # vLLM's id of a request resumed from the CPU buffer
    block_ids: list[int]              # its blocks to write, from its first loaded block on
    data: torch.Tensor                # [layers, blocks, *vLLM's block layout]: the parked copy, raw


@dataclass
class KvfleetMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)
    # vLLM's ids of finished requests whose kept blocks vLLM may free now (get_finished).
    frees: list[str] = field(default_factory=list)
    # Elastic memory (vllm/elastic.py): sets of the KV cache to map and to unmap before the forward.
    balloon_maps: list[int] = field(default_factory=list)
    balloon_unmaps: list[int] = field(default_factory=list)
    # The CPU buffer (vllm/elastic.py CpuBuffer): preempted requests to copy out, parked ones to copy in.
    parks: list[Park] = field(default_factory=list)
    unparks: list[_Unpark] = field(default_factory=list)
    # DistKV borrowing (vllm/borrowing.py): blocks to move to leases during the step, where spanning
    # requests' local blocks start (the agent's id, blocks moved, local block ids), leases to give back.
    spills: list[SpillOrder] = field(default_factory=list)
    spans: list[tuple[str, int, list[int]]] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)


@dataclass
class KvfleetWorkerMetadata(KVConnectorWorkerMetadata):
    saved: dict[int, torch.Tensor] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    failed_loads: dict[str, str] = field(default_factory=dict)
    # Elastic memory: what the worker side did with the step's balloon orders, and its mapped slots.
    balloon: MapReport | None = None
    mapped_slots: int | None = None
    parked: dict[str, Parked] = field(default_factory=dict)
    # DistKV borrowing: blocks moved to leases (vLLM's request id -> count), or why not.
    moved: dict[str, int] = field(default_factory=dict)
    move_failed: dict[str, str] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)   # the agent's id -> why its remote KV is lost

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # One worker per engine (tensor parallelism refuses moves and elastic memory): nothing to merge.
        assert isinstance(other, KvfleetWorkerMetadata)
        return KvfleetWorkerMetadata({**self.saved, **other.saved}, {**self.errors, **other.errors},
                                     {**self.failed_loads, **other.failed_loads}, other.balloon or self.balloon,
                                     other.mapped_slots if other.mapped_slots is not None else self.mapped_slots,
                                     {**self.parked, **other.parked}, {**self.moved, **other.moved},
                                     {**self.move_failed, **other.move_failed}, {**self.lost, **other.lost})


# -- the scheduler side ----------------------------------------------------------------------------


@dataclass
class _Kept:
    """A suspended request's blocks, kept until released or resumed here."""

    request: str            # vLLM's id (still in its scheduler, finished, blocks not freed)
    block_ids: list[int]
    num_tokens: int         # tokens whose KV the blocks hold


@dataclass
class _Staged:
    """KV received for a request about to be resumed here, by tokens: the stages as they came, each
    [layers, 2, tokens, heads, head_dim], joined once, when the request resumes (not at every stage)."""

    chunks: list[torch.Tensor]
    num_tokens: int

    def cut(self, num_tokens: int) -> list[torch.Tensor]:
        """The chunks holding the first num_tokens tokens (a stage may re-send the last, partial block)."""
        kept: list[torch.Tensor] = []
        have = 0
        for chunk in self.chunks:
            if have >= num_tokens:
                break
            kept.append(chunk[:, :, :num_tokens - have])
            have += int(kept[-1].shape[2])
        return kept

    def blocks(self, block_size: int) -> torch.Tensor:
        """[layers, 2, blocks, block_size, heads, head_dim], the last block zero-padded: one copy."""
        layers, two, _, heads, head_dim = self.chunks[0].shape
        blocks = -(-self.num_tokens // block_size)
        pad = self.chunks[0].new_zeros(layers, two, blocks * block_size - self.num_tokens, heads, head_dim)
        return torch.cat([*self.chunks, pad], dim=2).view(layers, two, blocks, block_size, heads, head_dim)


class _SchedulerSide:
    def __init__(self, block_size_tokens: int, socket_path: str, authkey: bytes, refusal: str | None,
                 layout: dict[str, Any], min_step_s: float = 0.0) -> None:
        self.block_size = block_size_tokens
        self.min_step_s = min_step_s
        self.last_step_s = 0.0
        self.refusal = refusal
        self.layout = layout
        self.inbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.lock = threading.Lock()          # staged: the pipe's reader and the loop thread
        self.running: dict[str, Request] = {}      # the agent's id -> vLLM's request, from admission to finish
        self.capped: dict[str, tuple[int, int]] = {}   # id -> (max_tokens it had, seq of the suspend ask)
        self.kept: dict[str, _Kept] = {}
        self.staged: dict[str, _Staged] = {}
        self.loads: list[_Load] = []
        self.frees: list[str] = []
        self.saves: dict[int, tuple[int, dict[str, Any]]] = {}   # task -> (seq, reply so far)
        self.tasks = itertools.count(1)
        self.pipe: Pipe | None = None
        # Elastic memory's scheduler side (vllm/elastic.py), once vLLM binds its block pool.
        self.balloon: Balloon | None = None
        self.buffer: CpuBuffer | None = None
        self.unparks: list[_Unpark] = []
        self._memory_sent: dict[str, Any] = {}
        # DistKV lending (vllm/lending.py): vLLM's block pool once bound, and the blocks of each lease.
        self.block_pool: BlockPool | None = None
        self.lent: dict[str, list[KVCacheBlock]] = {}
        # DistKV borrowing's scheduler side (vllm/borrowing.py), once vLLM binds its block pool.
        self.planner: SpanPlanner | None = None
        self.kv_cache_manager: Any = None
        self.scheduler: Any = None   # vLLM's, which preempts a request that lost its remote KV
        self.releases: list[str] = []
        self._listener = listen(socket_path, authkey)
        threading.Thread(target=accept_agent, args=(self._listener, lambda: self.pipe, self._connected, "kvfleet connector"),
                         name="kvfleet-connector-accept", daemon=True).start()

    # The pipe (reader thread) ------------------------------------------------------------------

    def _connected(self, conn: Connection) -> None:
        self.pipe = Pipe(conn, self._on_message, self._on_pipe_closed, "kvfleet-connector")
        self.pipe.send({"op": "hello", "refusal": self.refusal, **self.layout})

    def reply(self, seq: int, **fields: Any) -> None:
        self.reply_with(seq, None, **fields)

    def reply_with(self, seq: int, tensor: torch.Tensor | None, **fields: Any) -> None:
        pipe = self.pipe
        if pipe is not None:
            pipe.send({"seq": seq, **fields}, tensor)

    def event(self, **fields: Any) -> None:
        pipe = self.pipe
        if pipe is not None:
            pipe.send({"event": True, **fields})

    def _on_pipe_closed(self) -> None:
        # The agent is gone (it stops with vLLM): nothing it suspended or staged will be asked for again.
        self.inbox.put({"op": "release_all", "seq": 0, "id": ""})

    def _on_message(self, msg: dict[str, Any], tensor: torch.Tensor | None) -> None:
        op, seq, rid = msg.get("op"), int(msg.get("seq", 0)), str(msg.get("id", ""))
        if self.refusal is not None:
            self.reply(seq, ok=False, error=self.refusal)
        elif op in LOOP_OPS:
            self.inbox.put(msg)
            self.reply(seq, queued=True)   # the agent wakes the loop now (module docstring)
        elif op == "stage" and tensor is not None:
            self.reply(seq, **self._stage(rid, int(msg["first_token"]), int(msg["num_tokens"]), tensor))
        elif op == "drop":
            with self.lock:
                self.staged.pop(rid, None)
            self.reply(seq, ok=True)
        else:
            self.reply(seq, ok=False, error=f"unknown ask {op!r}")

    def _stage(self, rid: str, first_token: int, num_tokens: int, kv: torch.Tensor) -> dict[str, Any]:
        """kv [layers, 2, tokens, heads, head_dim] as the request's tokens from first_token on."""
        with self.lock:
            staged = self.staged.get(rid)
            have = 0 if staged is None else staged.num_tokens
            if first_token > have:
                return {"ok": False, "error": f"a stage from token {first_token} after {have} staged tokens: "
                                              "stages must be contiguous"}
            chunks = staged.cut(first_token) if staged is not None else []
            self.staged[rid] = _Staged([*chunks, kv[:, :, :num_tokens]], first_token + num_tokens)
        return {"ok": True}

    # The loop thread -----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return (not self.inbox.empty() or bool(self.loads or self.frees or self.saves or self.unparks)
                or bool(self.releases) or (self.balloon is not None and self.balloon.waiting_for_worker))

    def admitted(self, request: Request) -> None:
        rid = _agent_id(request)
        if rid is not None:
            self.running[rid] = request
        if self.planner is not None:
            self.planner.admitted(request, rid)

    def _loadable(self, request: Request) -> int:
        """Tokens a resumed request can load: staged here for it, else its own kept blocks; vLLM computes
        at least the last token itself."""
        rid = _load_id(request)
        if rid is None:
            return 0
        with self.lock:
            staged = self.staged.get(rid)
        held = staged if staged is not None else self.kept.get(rid)
        return 0 if held is None else min(held.num_tokens, request.num_tokens - 1)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if self.buffer is not None and _load_id(request) is None:
            return max(0, self.buffer.loadable(request) - num_computed_tokens)
        return max(0, self._loadable(request) - num_computed_tokens)

    def unpark(self, request: Request, block_ids: list[int], num_external_tokens: int) -> bool:
        """A request resumed from the CPU buffer: its parked KV into its new blocks (False: not one)."""
        if self.buffer is None or _load_id(request) is not None:
            return False
        first_token = self.buffer.loadable(request) - num_external_tokens
        parked = self.buffer.take(request)
        if parked is None or num_external_tokens <= 0:
            return parked is not None
        bs = self.block_size
        first, end = first_token // bs, -(-(first_token + num_external_tokens) // bs)
        self.unparks.append(_Unpark(request.request_id, block_ids[first:end], parked.data[:, first:end]))
        return True

    def allocated(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if self.unpark(request, block_ids, num_external_tokens):
            return
        rid = _load_id(request)
        if rid is None or num_external_tokens <= 0:
            return
        # What vLLM found in its own prefix cache comes first (whole blocks), the loaded tokens after
        # it, up to what matched_tokens offered.
        first_token = self._loadable(request) - num_external_tokens
        with self.lock:
            staged = self.staged.pop(rid, None)
        kept = self.kept.get(rid) if staged is None else None
        bs = self.block_size
        first = first_token // bs
        end = -(-(first_token + num_external_tokens) // bs)
        if staged is not None:
            blocks = staged.blocks(bs)[:, :, first:end]
            self.loads.append(_Load(rid, request.request_id, block_ids[first:end], blocks))
            return
        if kept is None:  # matched_tokens offered nothing for it: vLLM would not have asked
            return
        del self.kept[rid]
        self.loads.append(_Load(rid, request.request_id, block_ids[first:end], None, kept.block_ids[first:end]))
        self.frees.append(kept.request)   # after the copy, in the same step (get_finished runs after the load)

    def build(self, scheduler_output: SchedulerOutput, block_ids_of: Callable[[str], list[int]]) -> KvfleetMetadata:
        if self.min_step_s > 0 and scheduler_output.total_num_scheduled_tokens > 0:
            now_s = time.monotonic()
            time.sleep(max(0.0, self.min_step_s - (now_s - self.last_step_s)))
            self.last_step_s = time.monotonic()
        meta = KvfleetMetadata(loads=self.loads, frees=self.frees)
        self.loads, self.frees = [], []
        if self.planner is not None and self.block_pool is not None:
            plan = self.planner.plan(scheduler_output.num_scheduled_tokens, block_ids_of,
                                     internals.free_block_count(self.block_pool))
            meta.spills, meta.spans = plan.spills, plan.spans
            meta.releases, self.releases = [*self.releases, *plan.releases], []
        if self.balloon is not None:
            orders = self.balloon.plan(scheduler_output)
            meta.balloon_maps, meta.balloon_unmaps = orders.maps, orders.unmaps
            if self.buffer is not None:
                self.buffer.observe(time.time(), scheduler_output, self.balloon.requests)
                meta.parks = self.buffer.snapshot(scheduler_output, self.balloon.requests, block_ids_of)
                meta.unparks, self.unparks = self.unparks, []
            self._send_memory()
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._carry_out(msg, meta, block_ids_of)
        return meta

    def _carry_out(self, msg: dict[str, Any], meta: KvfleetMetadata, block_ids_of: Callable[[str], list[int]]) -> None:
        op, seq, rid = msg["op"], int(msg["seq"]), str(msg.get("id", ""))
        if op == "suspend":
            request = self.running.get(rid)
            if request is None:
                self.reply(seq, ok=False, error=f"request {rid!r} is not running in vLLM (finished, or never here)")
                return
            # One more token, then vLLM finishes it as length-capped and request_finished keeps its blocks.
            self.capped[rid] = (request.max_tokens, seq)
            request.max_tokens = min(request.max_tokens, request.num_output_tokens + 1)
        elif op == "release":
            kept = self.kept.pop(rid, None)
            if kept is not None:
                meta.frees.append(kept.request)
            with self.lock:
                self.staged.pop(rid, None)
            self.reply(seq, ok=True)
        elif op == "release_all":
            meta.frees += [kept.request for kept in self.kept.values()]
            self.kept.clear()
            with self.lock:
                self.staged.clear()
            for lease in list(self.lent):
                self._unlend(lease)
        elif op == "lend":
            self._lend(seq, str(msg["lease"]), int(msg["blocks"]))
        elif op == "lend-trim":
            self.reply(seq, ok=True, freed=self._unlend(str(msg["lease"]), int(msg["keep"])))
        elif op == "lend-free":
            self.reply(seq, ok=True, freed=self._unlend(str(msg["lease"])))
        elif op == "export":
            self._export(seq, rid, int(msg["first_block"]), msg.get("end_block"), meta, block_ids_of)

    def _lend(self, seq: int, lease: str, num_blocks: int) -> None:
        """Blocks out of vLLM's pool for a lease (vllm/lending.py); answered with their ids, or with the
        number free when fewer are (the agent has checked the cap)."""
        pool = self.block_pool
        if pool is None:
            self.reply(seq, ok=False, error="vLLM has not bound its block pool")
            return
        blocks = internals.lend_blocks(pool, num_blocks) if num_blocks > 0 else None
        if blocks is None:
            self.reply(seq, ok=True, block_ids=[], free_blocks=internals.free_block_count(pool))
            return
        self.lent.setdefault(lease, []).extend(blocks)
        self.reply(seq, ok=True, block_ids=[b.block_id for b in blocks])

    def _unlend(self, lease: str, keep: int = 0) -> int:
        """A lease's blocks past its first `keep` back to vLLM's pool (all of them: the lease ends)."""
        held = self.lent.pop(lease, [])
        blocks = held[keep:]
        if held[:keep]:
            self.lent[lease] = held[:keep]
        if blocks and self.block_pool is not None:
            internals.unlend_blocks(self.block_pool, blocks)
        return len(blocks)

    def _export(self, seq: int, rid: str, first_block: int, end_block: int | None, meta: KvfleetMetadata,
                block_ids_of: Callable[[str], list[int]]) -> None:
        bs = self.block_size
        kept = self.kept.get(rid)
        if kept is not None:
            block_ids, num_tokens, default_end = kept.block_ids, kept.num_tokens, -(-kept.num_tokens // bs)
        elif (request := self.running.get(rid)) is not None and request.num_computed_tokens > 0:
            # Running: its full blocks can no longer change.
            block_ids, num_tokens = block_ids_of(request.request_id), request.num_computed_tokens
            default_end = num_tokens // bs
        else:
            self.reply(seq, ok=False, error=f"request {rid!r} holds no KV in vLLM (queued, preempted or gone)")
            return
        end = default_end if end_block is None else min(int(end_block), -(-num_tokens // bs))
        if first_block >= end:
            self.reply(seq, ok=True, first_block=first_block, num_tokens=0, empty=True)
            return
        task = next(self.tasks)
        meta.saves.append(_Save(task, block_ids[first_block:end]))
        self.saves[task] = (seq, {"ok": True, "first_block": first_block,
                                  "num_tokens": min(num_tokens, end * bs) - first_block * bs})

    def _send_memory(self) -> None:
        """The pool's figures to the agent's process when they change (engine.py memory_state)."""
        assert self.balloon is not None
        memory = {**self.balloon.memory(), **(self.buffer.figures() if self.buffer is not None else {})}
        if memory != self._memory_sent:
            self._memory_sent = memory
            self.event(op="memory", **memory)

    def worker_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if self.buffer is not None:
            # Parks the worker reported are held; any other ordered for the step was not carried out.
            self.buffer.reported(meta.parked if isinstance(meta, KvfleetWorkerMetadata) else {})
            self.buffer.unreported()
        if not isinstance(meta, KvfleetWorkerMetadata):
            return
        if self.planner is not None and (meta.moved or meta.move_failed or meta.lost):
            self.planner.confirmed(meta.moved, meta.move_failed, meta.lost, self.kv_cache_manager, self.scheduler)
        if self.balloon is not None and (meta.balloon is not None or meta.mapped_slots is not None):
            report = meta.balloon or MapReport()
            self.balloon.confirmed(report.mapped, report.failed, meta.mapped_slots, report.map_s, report.unmap_s)
            self._send_memory()
        for task, data in meta.saved.items():
            seq, reply = self.saves.pop(task)
            self.reply_with(seq, data, **reply)
        for task, error in meta.errors.items():
            seq, _ = self.saves.pop(task)
            self.reply(seq, ok=False, error=error)
        for request, error in meta.failed_loads.items():
            self.event(op="load_failed", request=request, error=error)

    def finished(self, request: Request, block_ids: list[int]) -> bool:
        """request_finished: True keeps the blocks (a suspended request)."""
        if self.planner is not None and (leased := self.planner.finished(request)) is not None:
            self.releases.append(leased)
        rid = _agent_id(request)
        if rid is None:
            return False
        self.running.pop(rid, None)
        capped = self.capped.pop(rid, None)
        if capped is None:
            return False
        max_tokens, seq = capped
        status = str(request.status.name)
        if status != "FINISHED_LENGTH_CAPPED" or request.num_output_tokens >= max_tokens or not block_ids:
            self.reply(seq, ok=True, suspended=False, status=status)
            return False
        # Every token but the last has its KV (the last was sampled, never fed back).
        num_tokens = request.num_tokens - 1
        self.kept[rid] = _Kept(request.request_id, list(block_ids), num_tokens)
        self.reply(seq, ok=True, suspended=True, num_cached_tokens=num_tokens, num_output_tokens=request.num_output_tokens)
        return True

    def close(self) -> None:
        self._listener.close()
        if self.pipe is not None:
            self.pipe.close()


def _agent_id(request: Request) -> str | None:
    """The agent's id of a request it named to this connector (kv_params), or None."""
    ours = (request.kv_transfer_params or {}).get(PARAMS_KEY)
    return str(ours["id"]) if isinstance(ours, dict) and "id" in ours else None


def _load_id(request: Request) -> str | None:
    """The agent's id of a resumed request that asked to load what the connector holds for it, or None."""
    ours = (request.kv_transfer_params or {}).get(PARAMS_KEY)
    return _agent_id(request) if isinstance(ours, dict) and ours.get("load") else None


# -- the worker side -------------------------------------------------------------------------------


class _WorkerSide:
    def __init__(self, block_size_tokens: int, kv_heads: int, head_dim: int) -> None:
        self.block_size = block_size_tokens
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.layers: list[torch.Tensor] = []
        self.layout: KVLayout | PlainKVLayout | None = None
        self.out = KvfleetWorkerMetadata()
        self.freed: set[str] = set()
        self.failed_blocks: set[int] = set()
        self.refusal = "no KV cache registered"
        # Elastic memory's worker side (vllm/elastic.py): the KV cache over kvfleet's memory.
        self.pool: WorkerPool | None = None
        # DistKV (vllm/corepipe.py): the second pipe, lent blocks and the borrowing side, as configured.
        self.core_pipe: CorePipe | None = None
        self.lent_blocks: LentBlocks | None = None
        self.borrowing: CoreBorrowing | None = None

    def register(self, kv_caches: dict[str, torch.Tensor], kv_cache_dtype: str, plain: bool) -> None:
        """`plain`: every layer is kvfleet's attention backend's (PlainKVLayout), else vLLM's own."""
        self.layers = list(kv_caches.values())
        if self.pool is not None:
            self.pool.check_backing(self.layers)
        if plain:
            self.layout = PlainKVLayout(self.block_size, self.kv_heads, self.head_dim)
            return
        try:
            self.layout = KVLayout.calibrate(self.layers[0], self.block_size, self.kv_heads, self.head_dim, kv_cache_dtype)
        except Exception as err:   # any failure means: no KV moves (the agent moves tokens and says why)
            self.refusal = str(err)
            log.warning("kvfleet connector: no KV moves: %s", err)

    def apply_balloon(self, meta: KvfleetMetadata) -> None:
        """The step's deflations and inflations, before its forward reads or writes any block."""
        if self.pool is None or not (meta.balloon_maps or meta.balloon_unmaps):
            return
        self.out.balloon = self.pool.apply(meta.balloon_maps, meta.balloon_unmaps)
        self.out.mapped_slots = self.pool.mapped_slots

    def park(self, meta: KvfleetMetadata) -> None:
        """Preempted requests' blocks to host memory, before the step reuses any of them."""
        for park in meta.parks:
            index = torch.tensor(park.block_ids, dtype=torch.long)
            data = torch.stack([layer.index_select(0, index) for layer in self.layers]).to("cpu")
            self.out.parked[park.request] = Parked(data, park.num_tokens)

    def unpark(self, meta: KvfleetMetadata) -> None:
        for unpark in meta.unparks:
            try:
                if unpark.data.shape[1] != len(unpark.block_ids):
                    raise RuntimeError(f"{unpark.data.shape[1]} parked blocks for {len(unpark.block_ids)} allocated")
                index = torch.tensor(unpark.block_ids, dtype=torch.long)
                for layer, data in zip(self.layers, unpark.data, strict=True):
                    layer.index_copy_(0, index, data.to(layer.device))
            except Exception as err:  # reported: vLLM recomputes the blocks (kv_load_failure_policy)
                log.warning("kvfleet connector: loading parked KV for %s failed: %s", unpark.request, err)
                self.failed_blocks.update(unpark.block_ids)

    def load(self, meta: KvfleetMetadata) -> None:
        for load in meta.loads:
            try:
                self._load(load)
            except Exception as err:  # reported: vLLM recomputes the blocks (kv_load_failure_policy)
                log.warning("kvfleet connector: loading KV for %s failed: %s", load.request, err)
                self.out.failed_loads[load.agent_id] = str(err)
                self.failed_blocks.update(load.block_ids)

    def _load(self, load: _Load) -> None:
        layout = self.layout
        if layout is None:
            raise RuntimeError(self.refusal)
        for i, layer in enumerate(self.layers):
            if load.data is not None:
                if load.data.shape[2] != len(load.block_ids):
                    raise RuntimeError(f"{load.data.shape[2]} staged blocks for {len(load.block_ids)} allocated")
                layout.write(layer, load.block_ids, load.data[i])
            else:
                assert load.source_block_ids is not None
                layout.write(layer, load.block_ids, layout.read(layer, load.source_block_ids))

    def save(self, meta: KvfleetMetadata) -> None:
        layout = self.layout
        for save in meta.saves:
            if layout is None:
                self.out.errors[save.task] = self.refusal
                continue
            self.out.saved[save.task] = torch.stack([layout.read(layer, save.block_ids).to("cpu")
                                                     for layer in self.layers])
        self.freed.update(meta.frees)

    def distkv_before(self, meta: KvfleetMetadata) -> None:
        """Borrowing's share of a step before its forward: leases to give back, and where each spanning
        request's local blocks start (the blocks moved in earlier steps are remote now)."""
        core = self.borrowing
        if core is None:
            return
        core.lost.clear()
        for agent_id in meta.releases:
            core.release(agent_id)
        core.spans = list(meta.spans)

    def distkv_after(self, meta: KvfleetMetadata) -> None:
        """Borrowing's share after the forward: the blocks to move (computed in earlier steps, so their KV
        is written). Moved after the forward, which attended them here: they are remote from the next
        step on, never on both sides of one step."""
        core = self.borrowing
        if core is None:
            return
        for order in meta.spills:
            if order.agent_id in core.lost:
                continue  # computed again from its start: nothing to move
            try:
                core.spill(order.agent_id, order.block_ids, order.first_token)
                self.out.moved[order.request] = len(order.block_ids)
            except CallFailed as err:
                if err.lost and order.first_token:  # its remote KV is gone: computed again (borrowing.py)
                    core.lose(order.agent_id, str(err))
                else:  # reported: the blocks stay local (borrowing.py SpanPlanner.confirmed)
                    self.out.move_failed[order.request] = str(err)
            except Exception as err:
                self.out.move_failed[order.request] = str(err)

    def take_freed(self) -> set[str]:
        freed, self.freed = self.freed, set()
        return freed

    def take_output(self) -> KvfleetWorkerMetadata | None:
        if self.borrowing is not None and self.borrowing.lost:
            self.out.lost = dict(self.borrowing.lost)
        out, self.out = self.out, KvfleetWorkerMetadata()
        return out if (out.saved or out.errors or out.failed_loads or out.balloon or out.mapped_slots is not None
                       or out.parked or out.moved or out.move_failed or out.lost) else None

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        if self.borrowing is not None:
            # A spanning request that lost remote KV: its first local block is reported failed, so vLLM
            # drops its output of the step (borrowing.py); the scheduler side then preempts it.
            failed |= self.borrowing.lost_blocks()
        return failed


# -- the connector vLLM loads ------------------------------------------------------------------------


class KvfleetConnector(KVConnectorBase_V1):
    """The class vLLM instantiates in both roles (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        block_size = int(vllm_config.cache_config.block_size)
        kv_heads, head_dim = model.get_num_kv_heads(parallel), model.get_head_size()
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        extra = self._kv_transfer_config.kv_connector_extra_config
        # Elastic memory (vllm/elastic.py): the engine asked for it only after checking this vLLM
        # (internals.problems); what does not fit here stops vLLM's start with the reason (ElasticRefused).
        self._elastic = ElasticSettings.from_extra(extra[EXTRA_ELASTIC]) if extra.get(EXTRA_ELASTIC) else None
        self._geometry: SetGeometry | None = None
        if self._elastic is not None:
            if parallel.world_size > 1:
                raise ElasticRefused("elastic memory needs one device per engine (no tensor or pipeline parallelism)")
            assert kv_cache_config is not None, "vLLM 0.32 gives both roles the KV cache config"
            self._geometry = SetGeometry.of(kv_cache_config, self._elastic.chunk_bytes)
        if role == KVConnectorRole.SCHEDULER:
            # The worker side finds the layout (KVLayout.calibrate) and refuses what it cannot read; the
            # cases known here are refused up front, so the agent falls back to tokens with the reason.
            refusal = None
            if parallel.world_size > 1:
                refusal = "KV moves with vLLM need one device per engine (no tensor or pipeline parallelism)"
            elif vllm_config.device_config.device_type != "cpu":
                refusal = (f"KV moves through vLLM's {vllm_config.device_config.device_type} attention backends are "
                           "not verified yet (only its CPU backend is)")
            elif vllm_config.cache_config.cache_dtype != "auto":
                refusal = f"a quantized KV cache ({vllm_config.cache_config.cache_dtype}) is not a plain copy of K and V"
            layout = {"block_size_tokens": block_size, "layers": model.get_num_layers(parallel), "kv_heads": kv_heads,
                      "head_dim": head_dim}
            self._scheduler = _SchedulerSide(block_size, str(extra[EXTRA_SOCKET]), bytes.fromhex(str(extra[EXTRA_AUTHKEY])),
                                             refusal, layout, float(extra.get(EXTRA_MIN_STEP_S, 0.0)))
        else:
            self._worker = _WorkerSide(block_size, kv_heads, head_dim)
            if self._geometry is not None:
                self._worker.pool = WorkerPool(self._geometry, torch.device(vllm_config.device_config.device_type))

    # Worker side -----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        backends = internals.attention_backends(self._vllm_config, kv_caches)
        plain = backends == {BACKEND_PATH}
        asked = self._kv_transfer_config.kv_connector_extra_config.get(EXTRA_ATTENTION)
        if asked == "distattention" and not plain:
            # The plugin did not register in this process (plugin.py): refuse to run what was not asked.
            reason = (f"DistAttention was asked, but vLLM built its layers with {sorted(backends)}: is the kvfleet "
                      "package installed with its vllm.general_plugins entry point, and VLLM_PLUGINS unset or naming "
                      "kvfleet_attention?")
            refusal_path(self._kv_transfer_config.kv_connector_extra_config[EXTRA_SOCKET]).write_text(reason)
            raise RuntimeError(reason)
        self._worker.register(kv_caches, str(self._vllm_config.cache_config.cache_dtype), plain)
        extra = self._kv_transfer_config.kv_connector_extra_config
        if extra.get(EXTRA_LEND) or extra.get(EXTRA_BORROW):
            # The engine asks for DistKV only with kvfleet's backend (options.py), whose layout it reads.
            worker, layout = self._worker, self._worker.layout
            if not plain or not isinstance(layout, PlainKVLayout):
                raise RuntimeError(f"DistKV reads kvfleet's attention layout; vLLM built {sorted(backends)}")
            worker.core_pipe = CorePipe(core_socket_path(str(extra[EXTRA_SOCKET])), bytes.fromhex(str(extra[EXTRA_AUTHKEY])))
            if extra.get(EXTRA_LEND):
                worker.lent_blocks = LentBlocks(worker.core_pipe, worker.layers, worker.block_size)
            if extra.get(EXTRA_BORROW):
                worker.borrowing = borrowing.CORE = CoreBorrowing(worker.core_pipe, layout, worker.layers)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Called before the step writes any block (vLLM's model runner): parks copy preempted requests'
        # KV while their freed blocks still hold it.
        assert self._worker is not None and isinstance(kv_connector_metadata, KvfleetMetadata)
        self._worker.park(kv_connector_metadata)
        # DistKV borrowing's share too: vLLM starts a step's KV loads after its forward when none is a
        # synchronous load, and the forward must already know where each spanning request's blocks start.
        self._worker.distkv_before(kv_connector_metadata)

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        # Elastic memory: vLLM's KV allocation becomes a view of the eTensor (vllm/elastic.py).
        assert self._worker is not None
        return self._worker.pool.backing if self._worker.pool is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfleetMetadata)
        self._worker.apply_balloon(meta)
        self._worker.unpark(meta)
        self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves read whole blocks after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfleetMetadata)
        self._worker.save(meta)
        self._worker.distkv_after(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        freed = self._worker.take_freed()
        return (freed or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.take_output()

    # Scheduler side --------------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None and self._scheduler.planner is not None:
            self._scheduler.scheduler = internals.binding_scheduler()
            if self._scheduler.scheduler is None:
                raise RuntimeError("DistKV borrowing could not find vLLM's scheduler (engines/vllm/internals.py)")

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        assert self._scheduler is not None
        self._scheduler.block_pool = gpu_block_pool
        if self._kv_transfer_config.kv_connector_extra_config.get(EXTRA_BORROW):
            self._scheduler.planner = SpanPlanner(int(self._vllm_config.cache_config.block_size),
                                                  int(gpu_block_pool.num_gpu_blocks) - 1,
                                                  int(self._vllm_config.scheduler_config.max_num_batched_tokens))
        if self._elastic is not None and self._geometry is not None:
            block_size = int(self._vllm_config.cache_config.block_size)
            scheduler_config = self._vllm_config.scheduler_config
            self._scheduler.balloon = Balloon(gpu_block_pool, self._geometry, self._elastic, block_size,
                                              int(scheduler_config.max_num_batched_tokens),
                                              bool(getattr(scheduler_config, "scheduler_reserve_full_isl", False)))
            settings = self._elastic
            if settings.cpu_buffer_bytes > 0:
                self._scheduler.buffer = CpuBuffer(settings.cpu_buffer_bytes, self._geometry.block_bytes, block_size,
                                                   ttft_slo_s=settings.ttft_slo_us / 1e6 if settings.ttft_slo_us else None,
                                                   tpot_slo_s=settings.tpot_slo_us / 1e6 if settings.tpot_slo_us else None)

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.admitted(request)
        if self._scheduler.balloon is not None:
            self._scheduler.balloon.requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        matched = self._scheduler.matched_tokens(request, num_computed_tokens)
        balloon = self._scheduler.balloon
        if balloon is not None and not balloon.admit(request, num_computed_tokens, matched):
            return None, False  # Algorithm 1 holds it this step (vllm/elastic.py)
        return matched, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        if num_external_tokens <= 0:
            self._scheduler.unpark(request, [], 0)  # parked KV vLLM did not need (its own cache had it)
            return
        self._scheduler.allocated(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        manager = self._kv_cache_manager
        assert manager is not None, "vLLM binds its cache manager before scheduling"
        self._scheduler.kv_cache_manager = manager
        return self._scheduler.build(scheduler_output, lambda request_id: list(manager.get_block_ids(request_id)[0]))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.worker_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        if self._scheduler.balloon is not None:
            self._scheduler.balloon.requests.pop(request.request_id, None)
        if self._scheduler.buffer is not None:
            self._scheduler.buffer.forget(request.request_id)
        return self._scheduler.finished(request, block_ids), None

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_work()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None and self._worker.core_pipe is not None:
            self._worker.core_pipe.close()
