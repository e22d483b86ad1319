"""Elastic memory in the vLLM engine: vLLM's KV cache grows and shrinks while it serves (eLLM, in vLLM 0.32).

A static vLLM worker splits its memory once: `kv_cache_memory_bytes` for KV, the rest kept for the
activations of its largest step (`max_num_batched_tokens`), idle whenever the batch decodes. eLLM
("eLLM: Elastic Memory Management Framework for Efficient LLM Serving", Xu et al.) puts both in one
pool; the builtin engine does it with its own scheduler (engines/builtin/elastic.py). vLLM schedules
and allocates blocks itself, so here the pool is imposed from outside through kvfleet's KV connector
(connector.py), without a fork, as kvcached does for older vLLMs (the idea, not its code):

- **Backing** (§4.2.1's eTensor): vLLM allocates its whole KV cache as one int8 buffer
  (`allocate_kv_cache`); the connector's `get_mem_pool_context` answers that one allocation with a view
  of an `ETensor` over kvfleet's memory backend (kvfleet.worker.elastic: memfd chunks on the host, CUDA's
  VMM on a GPU), reserved for the whole cache so views never move. A torch function mode, because a
  plain context would let `torch.zeros` fill unmapped slots, which are read-only.
- **Sets.** vLLM's CPU attention reads only layer-major caches ([layer][block]), so a chunk holds
  consecutive blocks of one layer, and a set (`SetGeometry`) is the same chunk in every layer: the
  balloon's unit, whole blocks of all layers. Set 0 holds vLLM's null block and is never unmapped.
- **The balloon** (§4.3.1's inflation and deflation): the scheduler side (`Balloon`) holds the blocks of
  unmapped sets out of vLLM's `BlockPool` free queue, so vLLM's own accounting (free blocks, admission,
  preemption) sees exactly the mapped capacity without a patch to `BlockPool`. Deflation takes a set
  whose blocks are all free out of the queue (hashes dropped), then the worker side unmaps it; inflation
  has the worker side map a set first and gives its blocks to vLLM only once the map is confirmed, so
  no block leaves the balloon unmapped (vLLM's CPU runner zeroes new blocks: a write to an unmapped
  slot would fault). Both run before the step's forward; the private vLLM names they need are in
  internals.py.
- **Activations are charged, not placed** (as in the builtin engine: torch's CPU allocator cannot be
  replaced from Python): `ActivationModel` charges each step from its real shapes, and Algorithm 1
  (§4.4.1) decides through two seams: a new request joins vLLM's batch only if its KV and the step's
  activations leave θ free (`Balloon.admit`, from `get_num_new_matched_tokens`, which holds a request
  back by answering None: vLLM then skips it this step), deflating free sets for its activations; and
  after each schedule (`Balloon.plan`, from `build_connector_meta`) the KV side inflates into what the
  step's activations leave when vLLM is short of free blocks, or deflates when they need the room.
- **Books** checked after every step (`Balloon.books_errors`): every balloon block out of the free
  queue with no reference; the worker's mapped slots = layers x the sets not in the balloon; mapped KV +
  the step's activations + θ within the budget (`violations` counts the steps that were not).

- **The CPU buffer** (§4.3.2, `CpuBuffer`): a request vLLM preempts has its KV copied to host memory
  (the connector's `handle_preemptions`, before the step reuses its blocks) and loaded back when vLLM
  schedules it again (the connector's load path), instead of being recomputed.

  With latency objectives, Algorithm 2 (§4.4.2) scales how much of it parks may take.

What is not here, and why (docs/elastic-memory.md says the same to users): offloaded prefills (a prefill whose KV goes straight to the
buffer: vLLM allocates a prefill's blocks itself) and mapping ahead of need (§5.1). vLLM's CUDA build
cannot be installed on the GPU machines this project was lent, so the CUDA backend
(`open_memory("cuda")`) is wired but was never run.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.overrides import TorchFunctionMode

from kvfleet.worker.elastic import (
    ChunkPool,
    ETensor,
    MapError,
    Owner,
    PhysicalMemory,
    PoolExhausted,
    granularity_bytes,
    open_memory,
)
from kvfleet.worker.elastic.policy import SloWindow, scale_logical_buffer
from kvfleet.worker.engines.vllm import internals

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# kv_connector_extra_config key carrying `ElasticSettings` (a dict).
EXTRA_ELASTIC = "kvfleet_elastic"
# Fault injection for tests: map calls (1-based, counted per worker) that fail, comma-separated.
ENV_FAIL_MAPS = "KVFLEET_VLLM_ELASTIC_FAIL_MAPS"
# Steps whose activation peaks make up the reported capacity (as the builtin engine's).
CAPACITY_WINDOW_STEPS = 32
# At most this many sets inflated per step: a grow maps layers x sets slots before the forward.
MAX_GROW_SETS_PER_STEP = 8
# Every this many steps the books are checked block by block over the whole balloon (the sets a step
# changed are checked at every step): the full pass costs O(balloon blocks) of Python per step.
AUDIT_EVERY_STEPS = 16


class ElasticRefused(Exception):
    """This vLLM, model or configuration cannot run elastic memory; the message says why."""


@dataclass(frozen=True)
class ActivationModel:
    """Transient bytes of one vLLM forward step (eLLM's requiredAct, §4.4.1), from its shapes.

    Per scheduled token, in the model's dtype, a Llama decoder layer's live tensors: the residual and
    its norm (2 x hidden), the fused QKV (heads + 2 x KV heads) x head_dim and the rotary copies of Q
    and K, the attention output and o_proj's (heads x head_dim + hidden), the fused gate-up (2 x
    intermediate) and its activation (intermediate). Per sequence: one row of logits in the dtype and
    in float32 (vLLM computes logits at sampled positions only). An upper bound in the spirit of the
    builtin engine's (engines/builtin/model.py activation_bytes), not measured against vLLM's allocator.
    """

    per_token_bytes: int
    per_sequence_bytes: int

    def charge(self, tokens: int, sequences: int) -> int:
        return tokens * self.per_token_bytes + sequences * self.per_sequence_bytes

    @staticmethod
    def of_config(hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  vocab_size: int, dtype_bytes: int) -> ActivationModel:
        h, d = hidden_size, head_dim
        qkv = (num_heads + 2 * num_kv_heads) * d
        per_token = dtype_bytes * (2 * h + qkv + (num_heads + num_kv_heads) * d + num_heads * d + h + 3 * intermediate_size)
        return ActivationModel(per_token, vocab_size * (dtype_bytes + 4))

    @staticmethod
    def of_hf_config(config: Any, dtype_bytes: int) -> ActivationModel:
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return ActivationModel.of_config(int(config.hidden_size), int(config.intermediate_size), heads,
                                         int(getattr(config, "num_key_value_heads", None) or heads), head_dim,
                                         int(config.vocab_size), dtype_bytes)


@dataclass(frozen=True)
class ElasticSettings:
    """What the engine tells the connector (through kv_connector_extra_config, as a dict)."""

    budget_bytes: int          # the pool: KV and activations together
    chunk_bytes: int           # one chunk of one layer: a whole number of vLLM blocks of that layer
    threshold_bytes: int       # θ: kept free at all times (Algorithm 1)
    per_token_activation_bytes: int
    per_sequence_activation_bytes: int
    cpu_buffer_bytes: int = 0  # host memory for preempted requests' KV (CpuBuffer); 0: vLLM recomputes them
    # Latency objectives Algorithm 2 scales the buffer's logical size by; 0: none.
    ttft_slo_us: int = 0
    tpot_slo_us: int = 0

    @property
    def activations(self) -> ActivationModel:
        return ActivationModel(self.per_token_activation_bytes, self.per_sequence_activation_bytes)

    def to_extra(self) -> dict[str, int]:
        return asdict(self)

    @staticmethod
    def from_extra(extra: dict[str, Any]) -> ElasticSettings:
        return ElasticSettings(**{name: int(value) for name, value in extra.items()})


def set_chunk_bytes(page_bytes: int, wanted_chunk_bytes: int, granularity: int) -> int:
    """A chunk of whole pages (one block of one layer) and whole backend units, near `wanted_chunk_bytes`."""
    unit = math.lcm(page_bytes, granularity)
    return max(1, round(wanted_chunk_bytes / unit)) * unit


@dataclass(frozen=True)
class SetGeometry:
    """vLLM's layer-major cache cut into sets: set s is chunk s of every layer's region."""

    num_layers: int
    num_blocks: int       # vLLM's blocks (its null block included)
    page_bytes: int       # one block of one layer
    blocks_per_set: int

    @property
    def num_sets(self) -> int:
        return self.num_blocks // self.blocks_per_set

    @property
    def chunk_bytes(self) -> int:
        return self.blocks_per_set * self.page_bytes

    @property
    def block_bytes(self) -> int:
        """One block of every layer: what vLLM's block pool counts as a block."""
        return self.num_layers * self.page_bytes

    @property
    def set_bytes(self) -> int:
        return self.blocks_per_set * self.block_bytes

    @property
    def num_slots(self) -> int:
        return self.num_layers * self.num_sets

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def slots(self, set_id: int) -> list[int]:
        return [layer * self.num_sets + set_id for layer in range(self.num_layers)]

    def blocks(self, set_id: int) -> range:
        return range(set_id * self.blocks_per_set, (set_id + 1) * self.blocks_per_set)

    @staticmethod
    def of(kv_cache_config: KVCacheConfig, chunk_bytes: int) -> SetGeometry:
        """From vLLM's cache config, or ElasticRefused naming what does not fit the balloon."""
        tensors = list(kv_cache_config.kv_cache_tensors)
        if len(tensors) != 1 or len(kv_cache_config.kv_cache_groups) != 1:
            raise ElasticRefused(f"{len(tensors)} KV cache tensors in {len(kv_cache_config.kv_cache_groups)} groups: "
                                 "elastic memory knows one group of same-shaped layers")
        tensor = tensors[0]
        num_blocks = int(kv_cache_config.num_blocks)
        page = int(tensor.block_stride)
        layers = len(tensor.layers)
        if tensor.offset != 0 or tensor.layer_stride != page * num_blocks or tensor.size != layers * page * num_blocks:
            raise ElasticRefused(f"vLLM's KV cache is not layer-major with packed blocks (layer stride "
                                 f"{tensor.layer_stride}, block stride {page}, {num_blocks} blocks, offset {tensor.offset})")
        if chunk_bytes % page:
            raise ElasticRefused(f"a chunk of {chunk_bytes} bytes is not whole blocks of {page} bytes per layer")
        per_set = chunk_bytes // page
        if num_blocks % per_set or num_blocks // per_set < 2:
            raise ElasticRefused(f"{num_blocks} blocks are not at least two whole sets of {per_set}")
        return SetGeometry(layers, num_blocks, page, per_set)


# -- the scheduler side ------------------------------------------------------------------------------


class SetState(Enum):
    MAPPED = "mapped"     # its blocks are vLLM's (free, used or cached)
    HELD = "held"         # in the balloon: unmapped, its blocks out of vLLM's free queue
    MAPPING = "mapping"   # in the balloon, a map ordered: its blocks go to vLLM once the worker confirms


@dataclass
class BalloonCounters:
    grows: int = 0               # sets inflated (mapped and given to vLLM)
    shrinks: int = 0             # sets deflated
    map_failures: int = 0        # set maps the worker could not do (the set stays in the balloon)
    held_prefills: int = 0       # admissions held back a step (Algorithm 1: no room)
    violations: int = 0          # steps whose KV + activations + θ exceeded the budget
    books_errors: int = 0        # book checks that failed (tests assert 0)
    map_s: float = 0.0           # worker time mapping and unmapping (reported back)
    unmap_s: float = 0.0


@dataclass
class Orders:
    """One step's orders to the worker side: sets to map, then sets to unmap, before the forward."""

    maps: list[int] = field(default_factory=list)
    unmaps: list[int] = field(default_factory=list)


class Balloon:
    """The scheduler side's pool (module docstring): which sets are mapped, and Algorithm 1's seams."""

    def __init__(self, pool: BlockPool, geometry: SetGeometry, settings: ElasticSettings, block_size_tokens: int,
                 max_batched_tokens: int, reserve_full_sequence: bool = True) -> None:
        if pool.num_gpu_blocks != geometry.num_blocks:
            raise ElasticRefused(f"vLLM's block pool has {pool.num_gpu_blocks} blocks, its cache {geometry.num_blocks}")
        self.pool = pool
        self.geometry = geometry
        self.settings = settings
        self.activations = settings.activations
        self.block_size = block_size_tokens
        self.max_batched_tokens = max_batched_tokens
        # vLLM 0.32 admits a request only when blocks for its whole input are free
        # (SchedulerConfig.scheduler_reserve_full_isl, on by default), not only its first chunk's.
        self.reserve_full_sequence = reserve_full_sequence
        self.state = [SetState.MAPPED] + [SetState.HELD] * (geometry.num_sets - 1)
        self._num_in = {SetState.MAPPED: 1, SetState.HELD: geometry.num_sets - 1, SetState.MAPPING: 0}
        self._touched: set[int] = set()   # sets whose state changed since the last check
        self._steps = 0
        self.counters = BalloonCounters()
        self.requests: dict[str, Request] = {}
        # Algorithm 1's running batch, estimated at the last plan for the next step (tokens, sequences),
        # and what joined it since (this schedule). A step's activations are charged on its tokens,
        # which vLLM caps at max_num_batched_tokens whatever joins.
        self._floor = (0, 0)
        self._admitted = (0, 0)
        self._holding = False             # a request was held this schedule: later ones wait too (FCFS)
        self._waiting_blocks = 0          # blocks an admitted request needs free (vLLM keeps it waiting till then)
        self._recent_act: deque[int] = deque(maxlen=CAPACITY_WINDOW_STEPS)
        self.last_act_bytes = 0
        self.worker_slots: int | None = None   # the worker's mapped slots, as it last reported
        self._pending = Orders()               # deflations admit() ordered, sent with the step's orders
        # Steps whose orders were sent, and worker reports back: the slot count is comparable when equal.
        self._orders_sent = self._reports = 0
        internals.take_free_blocks(pool, [pool.blocks[b] for s in range(1, geometry.num_sets)
                                          for b in geometry.blocks(s)])
        internals.replace_usage(pool, self.usage)

    # -- figures ----------------------------------------------------------------------------------

    def _sets(self, *states: SetState) -> list[int]:
        return [s for s, state in enumerate(self.state) if state in states]

    def _move(self, set_id: int, state: SetState) -> None:
        self._num_in[self.state[set_id]] -= 1
        self._num_in[state] += 1
        self.state[set_id] = state
        self._touched.add(set_id)

    @property
    def mapped_sets(self) -> int:
        """Sets mapped, or being mapped this step (they count against the budget from now)."""
        return self._num_in[SetState.MAPPED] + self._num_in[SetState.MAPPING]

    @property
    def balloon_blocks(self) -> int:
        return (self._num_in[SetState.HELD] + self._num_in[SetState.MAPPING]) * self.geometry.blocks_per_set

    @property
    def free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    @property
    def used_blocks(self) -> int:
        """Blocks requests (or the prefix cache's referenced entries) hold: not free, not the balloon's, not null."""
        return self.geometry.num_blocks - 1 - self.free_blocks - self.balloon_blocks

    def usage(self) -> float:
        """Used over the current capacity (`vllm:kv_cache_usage_perc`, internals.replace_usage)."""
        capacity = self.geometry.num_blocks - 1 - self.balloon_blocks
        return self.used_blocks / capacity if capacity > 0 else 0.0

    def capacity_bytes(self) -> int:
        """What KV can count on: the budget less θ and the largest activation of the recent steps,
        in whole blocks (what the worker reports and MELL plans with)."""
        recent = max(self._recent_act, default=self._step_act(self._floor))
        room = self.settings.budget_bytes - self.settings.threshold_bytes - recent
        block = self.geometry.block_bytes
        return max(block, min(room, (self.geometry.num_blocks - 1) * block) // block * block)

    def memory(self) -> dict[str, Any]:
        """The figures the agent's process reports (engine.py memory_state), and the books for tests."""
        return {"capacity_bytes": self.capacity_bytes(), "activation_bytes": self.last_act_bytes,
                "budget_bytes": self.settings.budget_bytes, "mapped_sets": self.mapped_sets,
                "mapped_bytes": self.mapped_sets * self.geometry.set_bytes,
                "free_blocks": self.free_blocks, "used_blocks": self.used_blocks, "balloon_blocks": self.balloon_blocks,
                "num_blocks": self.geometry.num_blocks, "worker_slots": self.worker_slots,
                "slots_per_set": self.geometry.num_layers, **asdict(self.counters)}

    def _step_act(self, *parts: tuple[int, int]) -> int:
        """The activations of a step made of these (tokens, sequences), its tokens capped as vLLM caps them."""
        tokens = min(sum(p[0] for p in parts), self.max_batched_tokens)
        return self.activations.charge(tokens, sum(p[1] for p in parts))

    # -- Algorithm 1's admission (get_num_new_matched_tokens) -----------------------------------

    def admit(self, request: Request, num_computed_tokens: int, external_tokens: int = 0) -> bool:
        """Whether a waiting request may join this step: its KV and the step's activations leave θ free
        (Algorithm 1, lines 2-13); deflates free sets for the activations. False holds it (and, in
        arrival order, every later one) until the next step. `num_computed_tokens`: its hit in vLLM's
        prefix cache; `external_tokens`: KV the connector loads for it (a resumed request)."""
        if self._holding:
            return False
        bs, geometry = self.block_size, self.geometry
        known = num_computed_tokens + external_tokens
        chunk = max(1, min(request.num_tokens - known, self.max_batched_tokens))
        admitted_tokens = request.num_tokens if self.reserve_full_sequence else known + chunk
        new_blocks = -(-admitted_tokens // bs) - num_computed_tokens // bs
        act = self._step_act(self._floor, self._admitted, (chunk, 1))
        limit = self.settings.budget_bytes - self.settings.threshold_bytes
        fits = (self.used_blocks + new_blocks) * geometry.block_bytes + act <= limit
        if fits:
            excess = self.mapped_sets * geometry.set_bytes + act - limit
            if excess > 0:
                self._deflate(-(-excess // geometry.set_bytes), keep_free_blocks=new_blocks, orders=self._pending)
                fits = self.mapped_sets * geometry.set_bytes + act <= limit
        if not fits and self.used_blocks == 0 and self._admitted == (0, 0):
            # Nothing runs and nothing joined: holding it would hold it for ever (the engine checked at
            # start that the budget takes one prefill step), so it runs, and the step counts a violation.
            fits = True
        if not fits:
            self._holding = True
            self.counters.held_prefills += 1
            return False
        self._admitted = (self._admitted[0] + chunk, self._admitted[1] + 1)
        if self.free_blocks < new_blocks:
            # vLLM will keep it waiting (and every later one: it stops at the first it cannot allocate).
            self._waiting_blocks = max(self._waiting_blocks, new_blocks)
        return True

    # -- after each schedule (build_connector_meta) ----------------------------------------------

    def plan(self, scheduler_output: SchedulerOutput) -> Orders:
        """This step's orders: deflate so its KV and activations fit, inflate where vLLM is short."""
        orders, self._pending = self._pending, Orders()
        geometry, limit = self.geometry, self.settings.budget_bytes - self.settings.threshold_bytes
        scheduled = scheduler_output.num_scheduled_tokens
        act = self.activations.charge(int(scheduler_output.total_num_scheduled_tokens), len(scheduled))
        self.last_act_bytes = act
        self._recent_act.append(act)
        # The batch's next step if nothing joins it: decodes give one token, prefills their next chunk.
        next_tokens = 0
        for rid, num in scheduled.items():
            request = self.requests.get(rid)
            left = 1 if request is None else request.num_tokens - (request.num_computed_tokens + num)
            next_tokens += max(1, left)
        self._floor = (next_tokens, len(scheduled))
        target = max(1, (limit - max(act, self._step_act(self._floor))) // geometry.set_bytes)
        zeroed = set(scheduler_output.new_block_ids_to_zero or ())
        if self.mapped_sets > target:
            self._deflate(self.mapped_sets - target, keep_free_blocks=0, orders=orders, avoid=zeroed)
        elif self.mapped_sets < target:
            # Inflation when vLLM is short of free blocks: the running batch's next blocks, what the
            # admitted request vLLM could not allocate needs, and a set of margin, within what the
            # activations leave.
            want_blocks = len(scheduled) + self._waiting_blocks + geometry.blocks_per_set
            short = want_blocks - self.free_blocks
            if short > 0:
                grow = min(-(-short // geometry.blocks_per_set), target - self.mapped_sets, MAX_GROW_SETS_PER_STEP)
                for set_id in self._sets(SetState.HELD)[:grow]:
                    self._move(set_id, SetState.MAPPING)
                    orders.maps.append(set_id)
        if self.mapped_sets * geometry.set_bytes + act > limit:
            self.counters.violations += 1
        self._admitted = (0, 0)
        self._holding = False
        self._waiting_blocks = 0
        if orders.maps or orders.unmaps:
            self._orders_sent += 1
        self._check_books(full=self._steps % AUDIT_EVERY_STEPS == 0)
        self._steps += 1
        return orders

    def _deflate(self, num_sets: int, *, keep_free_blocks: int, orders: Orders, avoid: set[int] | None = None) -> int:
        """Take up to `num_sets` mapped sets whose blocks are all free out of vLLM (highest first), leaving
        at least `keep_free_blocks` free; returns how many."""
        taken = 0
        blocks = self.pool.blocks
        for set_id in reversed(self._sets(SetState.MAPPED)):
            if taken == num_sets or set_id == 0:
                break
            if self.free_blocks - self.geometry.blocks_per_set < keep_free_blocks:
                break
            members = [blocks[b] for b in self.geometry.blocks(set_id)]
            if not all(internals.is_free(block) for block in members) or (avoid and any(b.block_id in avoid for b in members)):
                continue
            internals.take_free_blocks(self.pool, members)
            self._move(set_id, SetState.HELD)
            orders.unmaps.append(set_id)
            self.counters.shrinks += 1
            taken += 1
        return taken

    # -- the worker's answers (update_connector_output) ------------------------------------------

    def confirmed(self, mapped: Sequence[int], failed: dict[int, str], worker_slots: int | None,
                  map_s: float, unmap_s: float) -> None:
        """Sets the worker mapped go to vLLM; sets it failed to map stay in the balloon."""
        blocks = self.pool.blocks
        for set_id in mapped:
            if self.state[set_id] is SetState.MAPPING:
                self._move(set_id, SetState.MAPPED)
                internals.return_blocks(self.pool, [blocks[b] for b in self.geometry.blocks(set_id)])
                self.counters.grows += 1
        for set_id in failed:
            if self.state[set_id] is SetState.MAPPING:
                self._move(set_id, SetState.HELD)
                self.counters.map_failures += 1
        self._reports += 1
        if worker_slots is not None:
            self.worker_slots = worker_slots
        self.counters.map_s += map_s
        self.counters.unmap_s += unmap_s
        self._check_books()

    @property
    def waiting_for_worker(self) -> bool:
        """A map ordered and not confirmed yet: vLLM must step again for the answer."""
        return self._num_in[SetState.MAPPING] > 0

    def _check_books(self, *, full: bool = False) -> None:
        blocks = self.pool.blocks
        ok = True
        sets = range(len(self.state)) if full else sorted(self._touched)
        self._touched.clear()
        for set_id in sets:
            if self.state[set_id] is SetState.MAPPED:
                continue
            ok = ok and all(blocks[b].ref_cnt == 0 and blocks[b].prev_free_block is None for b in self.geometry.blocks(set_id))
        ok = ok and self.used_blocks >= 0
        in_step = self._orders_sent == self._reports and not (self._pending.maps or self._pending.unmaps)
        if self.worker_slots is not None and in_step:
            # Every order sent has been carried out: the worker maps exactly the sets not in the balloon.
            ok = ok and self.worker_slots == self.mapped_sets * self.geometry.num_layers
        if not ok:
            self.counters.books_errors += 1


# -- the CPU buffer (eLLM §4.3.2): a preempted request's KV parked in host memory ------------------


@dataclass
class Park:
    """An order to the worker side: copy a preempted request's blocks to host memory before the step
    reuses them (handle_preemptions runs before anything writes a block)."""

    request: str            # vLLM's id
    block_ids: list[int]
    num_tokens: int         # tokens whose KV the blocks hold


@dataclass
class Parked:
    data: torch.Tensor      # [layers, blocks, *vLLM's block layout], a copy in host memory
    num_tokens: int


class CpuBuffer:
    """The scheduler side of eLLM's CPU buffer for vLLM (§4.3.2): where static vLLM recomputes a request
    it preempts (recompute mode), the KV its blocks held is copied to host memory first and loaded back
    when vLLM schedules it again, through the connector's load path (vLLM then computes only the token
    after it). With the balloon that is how a larger batch decodes than the static split holds: a
    request prefilled while there was room for its activations, parked while others prefill, comes
    back needing no prefill activations at all.

    Tables are read after each schedule (`snapshot`): a request preempted in the next schedule has
    lost its blocks to vLLM's free queue by the time the connector hears of it. A request that finishes
    or aborts while parked drops its KV. Bytes are reserved when a park is ordered and counted held
    once the worker reports the copy.

    Algorithm 2 (§4.4.2) with latency objectives: the buffer takes parks up to its logical size, which
    starts at one block's worth, doubles on a TTFT violation event and halves on a TPOT one (`observe`,
    elastic/policy.py; as the builtin engine). A park it has no logical room for is recomputed, as on
    static vLLM. Without objectives the logical size is the whole buffer."""

    def __init__(self, capacity_bytes: int, block_bytes: int, block_size_tokens: int,
                 ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.block_size = block_size_tokens
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.with_slo = ttft_slo_s is not None or tpot_slo_s is not None
        self.logical_bytes = min(block_bytes, capacity_bytes) if self.with_slo else capacity_bytes
        self._window = SloWindow()
        self._last_token_s: dict[str, float] = {}
        self.tables: dict[str, tuple[list[int], int]] = {}
        self.ordered: dict[str, int] = {}     # request -> bytes reserved for a park not reported yet
        self.parked: dict[str, Parked] = {}
        self.num_parked = 0
        self.num_loaded = 0
        self.num_refused = 0                  # preempted requests the buffer had no room for

    @property
    def held_bytes(self) -> int:
        return sum(self.ordered.values()) + sum(-(-p.num_tokens // self.block_size) * self.block_bytes
                                                for p in self.parked.values())

    def snapshot(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                 block_ids_of: Callable[[str], list[int]]) -> list[Park]:
        """Parks for the requests this schedule preempted, then the tables of those it scheduled."""
        parks: list[Park] = []
        for rid in scheduler_output.preempted_req_ids or ():
            table = self.tables.pop(rid, None)
            if table is None or rid in self.parked or rid in self.ordered:
                continue
            block_ids, num_tokens = table
            blocks = -(-num_tokens // self.block_size)
            if num_tokens < 1 or blocks > len(block_ids):
                continue
            if self.held_bytes + blocks * self.block_bytes > min(self.logical_bytes, self.capacity_bytes):
                self.num_refused += 1
                continue
            self.ordered[rid] = blocks * self.block_bytes
            parks.append(Park(rid, block_ids[:blocks], num_tokens))
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is not None:
                self.tables[rid] = (block_ids_of(rid), request.num_computed_tokens + num)
        return parks

    def observe(self, now_s: float, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Algorithm 2 on the step just scheduled: its first tokens late against the TTFT objective and
        its decodes late against the TPOT objective (since their last token), §4.4.2's events."""
        if not self.with_slo:
            return
        ttft_misses = tpot_misses = 0
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or request.num_computed_tokens + num < request.num_tokens:
                continue  # a prefill chunk: no token this step
            last = self._last_token_s.get(rid)
            if last is None:
                ttft_misses += self.ttft_slo_s is not None and now_s - request.arrival_time > self.ttft_slo_s
            else:
                tpot_misses += self.tpot_slo_s is not None and now_s - last > self.tpot_slo_s
            self._last_token_s[rid] = now_s
        ttft_event, tpot_event = self._window.observe(ttft_misses, tpot_misses)
        self.logical_bytes = scale_logical_buffer(self.logical_bytes, ttft_event=ttft_event, tpot_event=tpot_event,
                                                  max_bytes=self.capacity_bytes,
                                                  min_bytes=min(self.block_bytes, self.capacity_bytes))

    def reported(self, parked: dict[str, Parked]) -> None:
        for rid, item in parked.items():
            if self.ordered.pop(rid, None) is not None:
                self.parked[rid] = item
                self.num_parked += 1

    def unreported(self) -> None:
        """A step whose worker reported no parks: orders it could not carry out are given up."""
        self.ordered.clear()

    def loadable(self, request: Request) -> int:
        item = self.parked.get(request.request_id)
        return 0 if item is None else min(item.num_tokens, request.num_tokens - 1)

    def take(self, request: Request) -> Parked | None:
        item = self.parked.pop(request.request_id, None)
        if item is not None:
            self.num_loaded += 1
        return item

    def forget(self, request_id: str) -> None:
        self._last_token_s.pop(request_id, None)
        self.tables.pop(request_id, None)
        self.ordered.pop(request_id, None)
        self.parked.pop(request_id, None)

    def figures(self) -> dict[str, int]:
        return {"cpu_buffer_bytes": self.held_bytes, "cpu_buffer_capacity_bytes": self.capacity_bytes,
                "cpu_buffer_logical_bytes": self.logical_bytes,
                "parked": self.num_parked, "loaded_from_buffer": self.num_loaded, "park_refused": self.num_refused}


# -- the worker side ---------------------------------------------------------------------------------


class _BackingMode(TorchFunctionMode):
    """Answers vLLM's one KV allocation (`internals.kv_allocation_call`) with the eTensor's view."""

    def __init__(self, size_bytes: int, view: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.size_bytes = size_bytes
        self.view = view
        self.answered = False

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.answered and internals.kv_allocation_call(func, tuple(args), kwargs, self.size_bytes):
            self.answered = True
            return self.view()
        return func(*args, **kwargs)


@dataclass
class MapReport:
    mapped: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    map_s: float = 0.0
    unmap_s: float = 0.0


class WorkerPool:
    """The worker side: vLLM's KV cache as an eTensor over kvfleet's memory, mapped a set at a time."""

    def __init__(self, geometry: SetGeometry, device: torch.device) -> None:
        self.geometry = geometry
        kind: Literal["host", "cuda"] = "cuda" if device.type == "cuda" else "host"
        unit = granularity_bytes(kind, device)
        if geometry.chunk_bytes % unit:
            raise ElasticRefused(f"a chunk of {geometry.chunk_bytes} bytes is not whole {kind} units of {unit}")
        self.memory: PhysicalMemory = open_memory(kind, geometry.num_slots, geometry.chunk_bytes, device)
        self.chunks = ChunkPool(geometry.num_slots, geometry.chunk_bytes)
        self.tensor = ETensor(self.chunks, self.memory, Owner.KV, geometry.num_slots)
        self.tensor.map_slots(geometry.slots(0))
        self.mapped_sets = {0}
        self._maps = 0
        self._fail_maps = {int(n) for n in os.environ.get(ENV_FAIL_MAPS, "").split(",") if n.strip()}
        self.backing = _BackingMode(geometry.cache_bytes, lambda: self.tensor.view(torch.int8, (geometry.cache_bytes,)))

    @property
    def mapped_slots(self) -> int:
        return len(self.tensor.mapped_slots)

    def check_backing(self, layers: Sequence[torch.Tensor]) -> None:
        """vLLM's layers must view the eTensor: a vLLM that allocated its cache another way would serve
        from memory the balloon does not govern while it reports elastic figures."""
        start = self.tensor.view(torch.int8, (self.geometry.cache_bytes,)).data_ptr()
        end = start + self.geometry.cache_bytes
        if not self.backing.answered or any(not start <= layer.data_ptr() < end for layer in layers):
            raise ElasticRefused("vLLM did not allocate its KV cache through the connector's memory context "
                                 "(internals.kv_allocation_call): elastic memory cannot govern it")

    def apply(self, maps: Sequence[int], unmaps: Sequence[int]) -> MapReport:
        """Unmap, then map (each set all or nothing), before the step's forward."""
        report = MapReport()
        start = time.perf_counter()
        for set_id in unmaps:
            if set_id in self.mapped_sets:
                self.tensor.unmap_slots(self.geometry.slots(set_id))
                self.mapped_sets.discard(set_id)
        report.unmap_s = time.perf_counter() - start
        start = time.perf_counter()
        for set_id in maps:
            self._maps += 1
            try:
                if self._maps in self._fail_maps:
                    raise MapError(f"map {self._maps} failed ({ENV_FAIL_MAPS})")
                self.tensor.map_slots(self.geometry.slots(set_id))
            except (MapError, PoolExhausted) as err:
                report.failed[set_id] = str(err)
                continue
            self.mapped_sets.add(set_id)
            report.mapped.append(set_id)
        report.map_s = time.perf_counter() - start
        return report


__all__ = ["EXTRA_ELASTIC", "ActivationModel", "Balloon", "CpuBuffer", "ElasticRefused", "ElasticSettings", "Orders",
           "Park", "Parked", "SetGeometry", "WorkerPool", "set_chunk_bytes"]
