"""Bookkeeping shared by every policy: GPUs, items, loads, activation order, and epoch batching.

The policies differ only in where they put things (mell_default.py, mell_paper.py, best_fit.py,
worst_fit.py, load_balance.py); the mechanics of one epoch are the same for all of them and live
here, with the config every policy shares (`PolicyConfig`): events are applied in the order of MELL's
request operation batching (§VI-C: departs, then updates, then allocates), every move is written to a
buffer keyed by request so that redundant moves cancel (A->B->A vanishes, A->B->C becomes A->C, a
request placed and moved in the same epoch is just placed), and GPUs left idle are terminated at
the end of the epoch (Algorithm 1).

The scheduler object is mutable for speed (1,000,000 live requests), but it is a deterministic
function of its initial state and the batches it is given: no clock, no randomness, no I/O, and every
iteration is over insertion-ordered dicts. `snapshot()` takes the state out as a value and `restore()`
loads one into a fresh policy (the records and their snapshot values are state.py's); on them rest
the pure forms: `plan_epoch` (policy.py), (state, batch) -> (plan, state), and `allocate_one`
(allocate.py), (state, one request) -> where Allocate puts it. The operator rebuilds its state from
worker reports after a restart the same way.
"""

from __future__ import annotations

import abc
import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from kvfleet.mell.models import (
    Arrive,
    EventBatch,
    Finish,
    Grow,
    Location,
    Migration,
    Placement,
    Plan,
    Span,
)
from kvfleet.mell.size_classes import SizeClass, size_class
from kvfleet.mell.state import ClusterSnapshot, Gpu, GpuSnapshot, Item, ItemSnapshot, SpanSnapshot

# A GPU's category is the largest class it holds (§VI-C), so categories are looked up largest first.
# TINY is never one: tiny requests travel in T multi-items. An empty GPU has no category (None).
CATEGORY_ORDER = (SizeClass.X, SizeClass.L, SizeClass.M, SizeClass.S, SizeClass.T)


@dataclass(frozen=True)
class PolicyConfig:
    """What every policy needs: C and the shape of the cluster its new GPUs land in.

    Each policy with knobs of its own extends this (mell_default.MellDefaultConfig,
    mell_paper.MellPaperConfig, load_balance.LoadBalanceConfig); best-fit and worst-fit have none.
    """

    capacity_bytes: int
    gpus_per_node: int = 8
    nodes_per_zone: int = 4

    def within_link_budgets(self, intra_node_bytes: int, inter_node_bytes: int) -> PolicyConfig:
        """This config planning within these per-epoch link budgets (§V), where the policy plans moves
        against budgets and was given none: the simulator costs every move against its links, so a
        policy that can respect them is told them. Policies that do not plan by links ignore them."""
        return self


class ClusterPolicy(abc.ABC):
    """Base of all policies: applies batches, keeps loads and categories, records the plan."""

    name = "base"
    # The config dataclass this policy reads its knobs from (make_policy builds one by name).
    config_type: ClassVar[type[PolicyConfig]] = PolicyConfig
    uses_free_index = False
    # Whether a state rebuilt from worker reports (the operator after a restart) groups tiny requests
    # into MELL's multi-items (§VI-C, allocate.items_of). A policy that places every request as an
    # item of its own must not get them: a departing member would take its whole bundle off the GPU.
    restores_multi_items: ClassVar[bool] = True

    def __init__(self, config: PolicyConfig) -> None:
        if config.capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self.cfg = config
        self.capacity_bytes = config.capacity_bytes
        self.gpus: dict[str, Gpu] = {}
        self.item_of: dict[str, Item] = {}
        self._next_gpu_index = 0
        # GPUs per node, and nodes that may have a free GPU slot (lowest first), for `_new_location`.
        self._node_gpus: dict[str, int] = {}
        self._open_nodes: list[int] = []
        self._open_node_set: set[int] = set()  # what _open_nodes holds, so each node is in it once
        self._next_node = 0
        self._next_seq = 0
        self._next_item_id = 0
        self._next_arrival = 0
        # Per category (indexed by SizeClass): GPUs most recently activated first, and in entry order.
        self._mra: list[list[tuple[int, str]]] = [[] for _ in SizeClass]
        self._by_cat: list[dict[str, Gpu]] = [{} for _ in SizeClass]
        self._latest: list[tuple[int, str]] = []
        self._idle: list[Gpu] = []
        self._free_index: list[tuple[int, int, str]] = []
        # GPUs whose load changed while index updates were deferred, with the key the index still holds.
        self._stale_free: dict[str, tuple[int, int, str]] = {}
        self._defer_free_index = False
        self._heads: dict[str, list[Gpu]] = {}
        self._respanned: dict[str, str] = {}
        # per-batch recording
        self._new_placements: dict[str, str] = {}
        self._moves: dict[str, list[object]] = {}
        self._preemptions: list[Migration] = []
        self._activated: dict[str, None] = {}
        self._op_moves = 0
        self._moves_per_op: list[int] = []
        self._num_hops = 0

    # ------------------------------------------------------------------ public API

    def schedule(self, batch: EventBatch, *, end_of_epoch: bool = True) -> Plan:
        """Algorithm 1 for one epoch, with request operation batching (§VI-C).

        `end_of_epoch=False` schedules a batch that is not the epoch's last (the simulator's
        unbatched mode gives each operation a batch of its own): the per-epoch work of `after_batch`
        (the load-balance baseline's rebalancing) waits for the call that ends the epoch.
        """
        finishes: list[Finish] = []
        grows: list[Grow] = []
        arrives: list[Arrive] = []
        for event in batch.events:
            if isinstance(event, Finish):
                finishes.append(event)
            elif isinstance(event, Grow):
                grows.append(event)
            else:
                arrives.append(event)
        self._begin_batch()
        # (1) departs, (2) updates, (3) allocates; moves land in the buffer and cancel there.
        for fin in finishes:
            self._op_moves = 0
            self._finish(fin.request_id)
            # A request moved by an earlier depart of this batch and finished now needs no move.
            if self._moves.pop(fin.request_id, None) is not None:
                self._num_hops += 1
            self._moves_per_op.append(self._op_moves)
        # Growth reports are most of an epoch's events: the free-bytes index is brought up to date
        # once per GPU after them (or when a policy reads it), not re-sorted on every report.
        self._defer_free_index = self.uses_free_index
        try:
            for grow in grows:
                self._op_moves = 0
                if grow.request_id not in self.item_of:
                    raise ValueError(f"unknown request {grow.request_id!r} grew")
                self._grow(grow.request_id, grow.size_bytes)
                self._moves_per_op.append(self._op_moves)
        finally:
            self._defer_free_index = False
        self._sync_free_index()
        for arr in arrives:
            if arr.request_id in self.item_of:
                raise ValueError(f"request {arr.request_id!r} arrived twice")
            if arr.size_bytes < 0:
                raise ValueError(f"request {arr.request_id!r} has a negative size")
            self._op_moves = 0
            self._arrive(arr.request_id, arr.size_bytes)
            self._moves_per_op.append(self._op_moves)
        self._op_moves = 0
        if end_of_epoch:
            self.after_batch()
        if self._op_moves:
            self._moves_per_op.append(self._op_moves)
        return self._end_batch(batch.now_s)

    def num_gpus(self) -> int:
        return sum(1 for g in self.gpus.values() if not g.idle)

    def gpu_of(self, request_id: str) -> str:
        item = self.item_of[request_id]
        assert item.gpu is not None
        return item.gpu.gpu_id

    def loads(self) -> dict[str, int]:
        return {g.gpu_id: g.load_bytes for g in self.gpus.values()}

    def snapshot(self) -> ClusterSnapshot:
        items: list[ItemSnapshot] = []
        seen: set[int] = set()
        for item in self.item_of.values():
            if item.item_id in seen or item.gpu is None:
                continue
            seen.add(item.item_id)
            items.append(ItemSnapshot(tuple(item.members.items()), item.is_bundle, item.gpu.gpu_id))
        gpus = tuple(GpuSnapshot(g.gpu_id, g.index, g.seq, g.location) for g in self.gpus.values())
        spans = tuple(SpanSnapshot(rid, tuple(g.gpu_id for g in heads)) for rid, heads in self._heads.items())
        return ClusterSnapshot(gpus, tuple(items), spans, self._next_gpu_index, self._next_seq)

    def restore(self, snap: ClusterSnapshot) -> None:
        """Load a snapshot into an empty policy (placement is taken as reported, not re-decided)."""
        if self.gpus:
            raise ValueError("restore() needs an empty policy")
        self._next_gpu_index = snap.next_gpu_index
        self._next_seq = snap.next_seq
        for gs in snap.gpus:
            gpu = Gpu(gs.gpu_id, gs.index, gs.seq, gs.location)
            self.gpus[gpu.gpu_id] = gpu
            self._count_node(gpu.location, +1)
            heapq.heappush(self._latest, (-gpu.seq, gpu.gpu_id))
            if self.uses_free_index:
                insort(self._free_index, (self.capacity_bytes, gpu.seq, gpu.gpu_id))
        for its in snap.items:
            members = dict(its.members)
            size = sum(members.values())
            cls = SizeClass.T if its.is_bundle else size_class(size, self.capacity_bytes)
            item = self._new_item(cls, members, its.is_bundle)
            self._place(item, self.gpus[its.gpu_id])
        for sp in snap.spans:
            heads = [self.gpus[gid] for gid in sp.head_gpu_ids]
            for head in heads:
                self._make_head(head, sp.request_id)
            self._heads[sp.request_id] = heads
        for gpu in self.gpus.values():
            self._maybe_idle(gpu)  # out of the free index too: the epoch's end deletes it

    # ------------------------------------------------------------------ hooks for policies

    @abc.abstractmethod
    def on_arrive(self, request_id: str, size_bytes: int) -> None:
        """Place a new request (Allocate)."""

    @abc.abstractmethod
    def on_finish(self, request_id: str) -> None:
        """Remove a finished request (Depart)."""

    @abc.abstractmethod
    def on_grow(self, request_id: str, size_bytes: int) -> None:
        """Account a request's growth (Update)."""

    def after_batch(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Called after all allocates (the load-balance baseline migrates here)."""

    def note_moved(self, request_ids: Iterable[str], now_s: float) -> None:  # noqa: B027 - optional, as above
        """Requests that moved although this policy did not move them: a live pool's router placed them
        elsewhere than Allocate did, so reaching Allocate's GPU is a migration (the default policy then
        leaves them alone for a while, as after its own moves)."""

    # ------------------------------------------------------------------ primitives

    def _new_item(self, cls: SizeClass, members: dict[str, int], is_bundle: bool) -> Item:
        item = Item(self._next_item_id, cls, members, is_bundle, self._next_arrival)
        self._next_item_id += 1
        self._next_arrival += 1
        for rid in members:
            self.item_of[rid] = item
        return item

    def _free(self, gpu: Gpu) -> int:
        return self.capacity_bytes - gpu.load_bytes

    def _count_node(self, location: Location, delta: int) -> None:
        node = location.node_id
        count = self._node_gpus.get(node, 0) + delta
        self._node_gpus[node] = count
        if node.startswith("node-") and node[5:].isdigit():
            number = int(node[5:])
            self._next_node = max(self._next_node, number + 1)
            if count < self.cfg.gpus_per_node and number not in self._open_node_set:
                self._open_node_set.add(number)
                heapq.heappush(self._open_nodes, number)

    def _new_location(self, near: Gpu | None) -> Location:
        """Where a new GPU is: on `near`'s node if it has a free GPU slot, else on the lowest-numbered
        node with one, else on a new node (the Kubernetes scheduler binds a pod to a node with a free
        GPU, and the cluster autoscaler adds a node only when none has one)."""
        per_node = self.cfg.gpus_per_node
        if near is not None and self._node_gpus.get(near.location.node_id, 0) < per_node:
            return near.location
        while self._open_nodes:
            number = self._open_nodes[0]
            if self._node_gpus.get(f"node-{number}", 0) < per_node:
                break
            self._open_node_set.discard(heapq.heappop(self._open_nodes))
        else:
            number = self._next_node
        return Location(f"node-{number}", f"zone-{number // self.cfg.nodes_per_zone}")

    def _idle_to_reuse(self, near: Gpu | None) -> int:
        """The index in `_idle` of the GPU `_activate(near)` reuses, or -1 for a new one."""
        pick = len(self._idle) - 1
        if near is not None and self._idle:
            node = near.location.node_id
            same = next((i for i in range(pick, -1, -1) if self._idle[i].location.node_id == node), None)
            # Rather a new GPU beside `near` than an emptied one on another node.
            if same is not None:
                return same
            if self._node_gpus.get(node, 0) < self.cfg.gpus_per_node:
                return -1
        return pick

    def _activation_location(self, near: Gpu | None) -> Location:
        """Where the GPU `_activate(near)` would give is, without activating it."""
        pick = self._idle_to_reuse(near)
        return self._idle[pick].location if pick >= 0 else self._new_location(near)

    def _activate(self, near: Gpu | None = None) -> Gpu:
        """Start a GPU. One emptied earlier in this epoch is reused (its pod still exists); a new one
        goes on `near`'s node when it has room (see `_new_location`)."""
        seq = self._next_seq
        self._next_seq += 1
        pick = self._idle_to_reuse(near)
        if pick >= 0:
            gpu = self._idle.pop(pick)
            if self.uses_free_index:
                self._free_index_remove(gpu)
            gpu.idle = False
            gpu.seq = seq
        else:
            index = self._next_gpu_index
            self._next_gpu_index += 1
            gpu = Gpu(f"gpu-{index}", index, seq, self._new_location(near))
            self.gpus[gpu.gpu_id] = gpu
            self._count_node(gpu.location, +1)
            self._activated[gpu.gpu_id] = None
        if self.uses_free_index:
            insort(self._free_index, (self._free(gpu), gpu.seq, gpu.gpu_id))
        heapq.heappush(self._latest, (-seq, gpu.gpu_id))
        if len(self._latest) > 4 * len(self.gpus) + 64:
            self._latest = [(-g.seq, g.gpu_id) for g in self.gpus.values() if not g.idle]
            heapq.heapify(self._latest)
        return gpu

    def _set_load(self, gpu: Gpu, new_load: int) -> None:
        if self.uses_free_index and not gpu.idle:
            if self._defer_free_index:
                self._stale_free.setdefault(gpu.gpu_id, (self._free(gpu), gpu.seq, gpu.gpu_id))
                gpu.load_bytes = new_load
                return
            self._free_index_remove(gpu)
            gpu.load_bytes = new_load
            insort(self._free_index, (self._free(gpu), gpu.seq, gpu.gpu_id))
        else:
            gpu.load_bytes = new_load

    def _free_index_remove(self, gpu: Gpu) -> None:
        key = self._stale_free.pop(gpu.gpu_id, None) or (self._free(gpu), gpu.seq, gpu.gpu_id)
        pos = bisect_left(self._free_index, key)
        if pos < len(self._free_index) and self._free_index[pos] == key:
            del self._free_index[pos]

    def _sync_free_index(self) -> list[tuple[int, int, str]]:
        """The GPUs in use by free bytes (least first), with every deferred load change applied: what a
        policy reads its best or worst fit from."""
        for gpu_id in list(self._stale_free):
            gpu = self.gpus[gpu_id]
            self._free_index_remove(gpu)
            insort(self._free_index, (self._free(gpu), gpu.seq, gpu.gpu_id))
        return self._free_index

    def _load_on_primary(self, item: Item) -> int:
        return item.size_bytes

    def _recategorize(self, gpu: Gpu) -> None:
        counts = gpu.class_counts
        cat: SizeClass | None = None
        for c in CATEGORY_ORDER:
            if counts[c]:
                cat = c
                break
        if cat is not gpu.category:
            if gpu.category is not None:
                del self._by_cat[gpu.category][gpu.gpu_id]
            gpu.category = cat
            if cat is not None:
                self._by_cat[cat][gpu.gpu_id] = gpu
                heap = self._mra[cat]
                heapq.heappush(heap, (-gpu.seq, gpu.gpu_id))
                if len(heap) > 4 * len(self.gpus) + 64:
                    self._mra[cat] = [(-g.seq, g.gpu_id) for g in self.gpus.values() if g.category == cat]
                    heapq.heapify(self._mra[cat])

    def _place(self, item: Item, gpu: Gpu) -> None:
        item.gpu = gpu
        gpu.items[item.item_id] = item
        gpu.class_counts[item.cls] += 1
        gpu.num_requests += len(item.members)
        self._set_load(gpu, gpu.load_bytes + self._load_on_primary(item))
        self._recategorize(gpu)

    def _remove(self, item: Item) -> Gpu:
        gpu = item.gpu
        assert gpu is not None
        item.gpu = None
        del gpu.items[item.item_id]
        gpu.class_counts[item.cls] -= 1
        gpu.num_requests -= len(item.members)
        self._set_load(gpu, gpu.load_bytes - self._load_on_primary(item))
        self._recategorize(gpu)
        self._maybe_idle(gpu)
        return gpu

    def _maybe_idle(self, gpu: Gpu) -> None:
        if not gpu.items and gpu.span_owner is None and not gpu.idle:
            if self.uses_free_index:
                self._free_index_remove(gpu)
            gpu.idle = True
            self._idle.append(gpu)

    def _resize(self, item: Item, new_size: int, new_cls: SizeClass | None = None) -> None:
        """Change an item's size (and class) in place, on its GPU."""
        gpu = item.gpu
        assert gpu is not None
        old_load = self._load_on_primary(item)
        item.size_bytes = new_size
        if new_cls is not None and new_cls != item.cls:
            gpu.class_counts[item.cls] -= 1
            item.cls = new_cls
            gpu.class_counts[new_cls] += 1
            self._recategorize(gpu)
        self._set_load(gpu, gpu.load_bytes - old_load + self._load_on_primary(item))

    def _record(self, request_id: str, size: int, src: Gpu | None, dst: Gpu, cause: str) -> None:
        if src is None or request_id in self._new_placements:
            self._new_placements[request_id] = dst.gpu_id
            return
        move = self._moves.get(request_id)
        if move is None:
            self._moves[request_id] = [src.gpu_id, dst.gpu_id, size, cause]
        else:
            self._num_hops += 1
            move[1] = dst.gpu_id
            move[2] = size

    def _put(self, item: Item, gpu: Gpu, cause: str, src: Gpu | None) -> None:
        """Place an item that is not on any GPU; `src` is where it was (None for a new request)."""
        self._place(item, gpu)
        if src is not None and src is not gpu:
            self._op_moves += 1
        for rid, size in item.members.items():
            self._record(rid, size, src, gpu, cause)

    def _move(self, item: Item, dst: Gpu, cause: str) -> None:
        src = self._remove(item)
        self._put(item, dst, cause, src)

    def _latest_gpu(self) -> Gpu | None:
        """The most recently activated GPU that is in use."""
        heap = self._latest
        while heap:
            neg_seq, gid = heap[0]
            gpu = self.gpus.get(gid)
            if gpu is not None and not gpu.idle and gpu.seq == -neg_seq:
                return gpu
            heapq.heappop(heap)
        return None

    def _mra_gpu(self, categories: tuple[SizeClass, ...], exclude: Gpu | None = None) -> Gpu | None:
        """The most recently activated GPU whose category is one of `categories` (MELL §VI-C)."""
        best: Gpu | None = None
        for cat in categories:
            heap = self._mra[cat]
            held: list[tuple[int, str]] = []
            found: Gpu | None = None
            while heap:
                neg_seq, gid = heap[0]
                gpu = self.gpus.get(gid)
                if gpu is None or gpu.category != cat or gpu.seq != -neg_seq or gpu.idle:
                    heapq.heappop(heap)
                    continue
                if gpu is exclude:
                    held.append(heapq.heappop(heap))
                    continue
                found = gpu
                break
            for entry in held:
                heapq.heappush(heap, entry)
            if found is not None and (best is None or found.seq > best.seq):
                best = found
        return best

    def _gpus_in(self, categories: tuple[SizeClass, ...]) -> list[Gpu]:
        """GPUs of these categories, in the order they entered them (deterministic)."""
        if len(categories) == 1:
            return list(self._by_cat[categories[0]].values())
        return [g for cat in categories for g in self._by_cat[cat].values()]

    # ------------------------------------------------------------------ DistAttention spans

    def _make_head(self, gpu: Gpu, request_id: str) -> None:
        gpu.span_owner = request_id
        gpu.class_counts[SizeClass.X] += 1
        self._recategorize(gpu)
        self._set_load(gpu, self.capacity_bytes)

    def _split(self, size_bytes: int) -> tuple[int, int]:
        """(full chunks, tail bytes) of a request: k chunks of exactly C, a tail in (0, C]."""
        chunks = max(0, -(-size_bytes // self.capacity_bytes) - 1)
        return chunks, size_bytes - chunks * self.capacity_bytes

    def _arrive(self, request_id: str, size_bytes: int) -> None:
        """A request larger than C is not a failure but the DistAttention case (Infinite-LLM): whole chunks
        of C fill GPUs of their own and the tail is scheduled like any request; DistAttention spans them."""
        chunks, tail = self._split(size_bytes)
        if chunks:
            self._heads[request_id] = [self._new_head(request_id) for _ in range(chunks)]
        self.on_arrive(request_id, tail)

    def _new_head(self, request_id: str) -> Gpu:
        gpu = self._activate()
        self._make_head(gpu, request_id)
        return gpu

    def _grow(self, request_id: str, size_bytes: int) -> None:
        heads = self._heads.get(request_id)
        chunks, tail = self._split(size_bytes)
        if chunks == (len(heads) if heads else 0):
            self.on_grow(request_id, tail)
            return
        if chunks < (len(heads) if heads else 0):
            return  # KV only grows (§VI-A): a stale report changes nothing
        # The tail passed C: it becomes whole chunks on GPUs of their own and a new, small tail is
        # scheduled afresh (its blocks are newly written, nothing is copied).
        src = self.item_of[request_id].gpu
        self.on_finish(request_id)
        self._moves.pop(request_id, None)
        new_heads = self._heads.setdefault(request_id, [])
        while len(new_heads) < chunks:
            new_heads.append(self._new_head(request_id))
        self.on_arrive(request_id, tail)
        if src is not None and request_id in self._new_placements:
            self._respanned[request_id] = src.gpu_id

    def _finish(self, request_id: str) -> None:
        self.on_finish(request_id)
        for head in self._heads.pop(request_id, []):
            head.span_owner = None
            head.class_counts[SizeClass.X] -= 1
            self._recategorize(head)
            self._set_load(head, 0)
            self._maybe_idle(head)

    # ------------------------------------------------------------------ batch begin / end

    def _begin_batch(self) -> None:
        self._new_placements = {}
        self._moves = {}
        self._preemptions = []
        self._activated = {}
        self._moves_per_op = []
        self._num_hops = 0
        self._respanned = {}

    def _end_batch(self, now_s: float) -> Plan:
        terminate: list[str] = []
        for gpu in self._idle:
            del self.gpus[gpu.gpu_id]
            self._count_node(gpu.location, -1)
            if gpu.gpu_id in self._activated:
                del self._activated[gpu.gpu_id]
            else:
                terminate.append(gpu.gpu_id)
        self._idle = []
        migrations: list[Migration] = []
        cancelled = self._num_hops
        for rid, (src, dst, size, cause) in self._moves.items():
            if src == dst:
                cancelled += 1
                continue
            assert isinstance(src, str) and isinstance(dst, str) and isinstance(size, int) and isinstance(cause, str)
            if cause == "preempt":
                # Recompute preemption (baselines): re-prefill, not a migration (see no_migration.py).
                self._preemptions.append(Migration(rid, src, dst, size, cause))
            else:
                migrations.append(Migration(rid, src, dst, size, cause))
        placements = tuple(Placement(rid, gid) for rid, gid in self._new_placements.items())
        spans = tuple(
            Span(rid, (*(g.gpu_id for g in heads), self.gpu_of(rid))) for rid, heads in self._heads.items()
        )
        return Plan(
            now_s=now_s,
            placements=placements,
            migrations=tuple(migrations),
            preemptions=tuple(self._preemptions),
            spans=spans,
            activate_gpu_ids=tuple(self._activated),
            terminate_gpu_ids=tuple(sorted(terminate)),
            moves_per_operation=tuple(self._moves_per_op),
            num_moves_cancelled=cancelled,
        )
