"""The `mell-paper` policy: MELL's Allocate / Depart / Update of Fig. 10 under Algorithm 1, as written.

Kept beside kvfleet's default (`mell`, mell_default.py) so that the default's gain is always
measured against the paper's own rule.

Each method below is one branch of Fig. 10 and says which. Where the paper leaves a case open, the
choice made here is marked "(kvfleet)" and documented in docs/mell.md:

* Multi-items (§VI-C): a tiny request (<= C/8) joins an under-filled multi-item, probing the oldest
  GPUs first so that multi-items shrunk by departures are refilled where they are and the newest GPU
  drains; otherwise it opens a new multi-item placed by Allocate T-request. A multi-item that grows
  past C/4 sheds the grown request into a new multi-item on the same GPU (no data moves).
* Growth without a class change that overloads a GPU (Fig. 10 only covers L->L): the grown request is
  departed and re-allocated, as in Update case 1.
* Allocate S/M "to the most recently activated S/M-GPU": the GPU of the request's own class, so that
  M-GPUs hold M-requests and S-GPUs S-requests (Theorem 1, properties 1 and 2).
* A T-request departing from a GPU that it leaves empty triggers no refill (the GPU is terminated),
  nor from a T-GPU still at least 3/4 full (Theorem 1 property 3 already holds there).

Refinements, each a MellPaperConfig switch, all off by default so that `mell-paper` is Fig. 10 as
written (docs/mell.md gives their measured effect): `refill_underfilled_t` (T-requests go to the
oldest T-GPU under 3/4 full first), `refill_source_max_fill` (Depart T refills only from a newest GPU
that the refill can drain), `growth_headroom_fraction` (room kept for growth), `t_on_sm_gpus`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvfleet.mell.cluster import ClusterPolicy, PolicyConfig
from kvfleet.mell.size_classes import SizeClass, size_class
from kvfleet.mell.state import Gpu, Item, SortedIndex

# Short names for the classes of Fig. 10, as the paper writes them.
TINY, T, S, M, L = SizeClass.TINY, SizeClass.T, SizeClass.S, SizeClass.M, SizeClass.L


@dataclass(frozen=True)
class MellPaperConfig(PolicyConfig):
    """Knobs of `mell-paper`. Weights are the provider-set priority factors of MELL §VI-C; the
    (kvfleet) refinements default to off, which is Fig. 10 exactly as the paper states it."""

    # Priority of a GPU from its workload: more free memory and fewer requests rank higher.
    weight_free: float = 1.0
    weight_requests: float = 0.001
    # Priority from GPU j to GPU j' adds a distance bonus (same node before same zone before elsewhere).
    weight_same_node: float = 0.2
    weight_same_zone: float = 0.1
    # How many under-filled multi-items a tiny request probes (oldest GPU first) before opening a new one.
    tiny_probe_limit: int = 4
    # (kvfleet) T-requests go to the oldest T-GPU under 3/4 full before the newest T-GPU.
    refill_underfilled_t: bool = False
    # (kvfleet) Depart T refills only from a newest GPU at most this full, one it can drain; 1.0 is
    # Fig. 10 as written.
    refill_source_max_fill: float = 1.0
    # (kvfleet) one T-request may use the spare room of the newest S/M-GPU.
    t_on_sm_gpus: bool = False
    # (kvfleet) share of C kept free for growth when placing or pairing requests.
    growth_headroom_fraction: float = 0.0


class MellPaperPolicy(ClusterPolicy):
    name = "mell-paper"
    config_type: ClassVar[type[PolicyConfig]] = MellPaperConfig

    def __init__(self, config: MellPaperConfig) -> None:
        super().__init__(config)
        self.cfg: MellPaperConfig = config
        # Under-filled multi-items, oldest GPU first: (gpu seq, item id).
        self._underfilled: list[tuple[int, int]] = []
        self._bundles: dict[int, Item] = {}
        # (kvfleet) space kept free for growth when placing (0 in the paper, whose sizes do not grow
        # within a class): a pair packed to exactly C overloads on the next decoded tokens.
        self._headroom = int(config.growth_headroom_fraction * config.capacity_bytes)
        # Indexes for the priority searches of Fig. 10 (largest key first, see _best): L-GPUs by free
        # bytes (Allocate T) and by room beside their L-request (Allocate S/M), S/M-GPUs by free bytes
        # (pulling an S/M-request into an L-GPU). Searching stops once no later GPU can rank higher.
        self._l_by_free = SortedIndex()
        self._l_by_pair_room = SortedIndex()
        self._sm_by_free = SortedIndex()
        cfg = config
        self._bounded = cfg.weight_free >= 0 and cfg.weight_requests >= 0
        self._max_bonus = max(0.0, cfg.weight_same_node, cfg.weight_same_zone)
        # T-GPUs that fell under 3/4 full, oldest first (see _underfilled_t_gpu).
        self._t_low: list[tuple[int, str]] = []

    # ================================================================ events (Algorithm 1)

    def on_arrive(self, request_id: str, size_bytes: int) -> None:
        cls = size_class(size_bytes, self.capacity_bytes)
        if cls == TINY:
            self._allocate_tiny(request_id, size_bytes, None, "allocate")
            return
        item = self._new_item(cls, {request_id: size_bytes}, False)
        self.allocate(item, "allocate", None)

    def on_finish(self, request_id: str) -> None:
        item = self.item_of.pop(request_id, None)
        if item is None:
            raise ValueError(f"unknown request {request_id!r} finished")
        if item.is_bundle:
            self.item_of[request_id] = item
            self._leave_bundle(item, request_id)
            return
        self.depart(item, "depart")

    def on_grow(self, request_id: str, size_bytes: int) -> None:
        item = self.item_of.get(request_id)
        if item is None:
            raise ValueError(f"unknown request {request_id!r} grew")
        if item.is_bundle:
            self._grow_tiny(item, request_id, size_bytes)
            return
        old = item.size_bytes
        if size_bytes <= old:
            return  # KV only grows (§VI-A); a stale report changes nothing
        item.members[request_id] = size_bytes
        self.update(item, size_bytes)

    # ================================================================ Allocate (Fig. 10)

    def allocate(self, item: Item, cause: str, src: Gpu | None) -> None:
        cls = item.cls
        if cls == T:
            self._allocate_t(item, cause, src, None)
        elif cls in (S, M):
            self._allocate_sm(item, cause, src)
        else:
            self._allocate_l(item, cause, src)

    def _allocate_t(self, item: Item, cause: str, src: Gpu | None, exclude: Gpu | None) -> None:
        # Fig. 10 Allocate case 1: the L-GPU with the highest priority that fits ...
        need = item.size_bytes + self._headroom
        best = self._best(self._l_by_free, lambda g: g is not exclude and self._free(g) >= need, need, None)
        if best is None and self.cfg.refill_underfilled_t:
            best = self._underfilled_t_gpu(item.size_bytes, exclude)
        if best is None and self.cfg.t_on_sm_gpus:
            # (kvfleet) the newest S/M-GPU's spare room takes one T-request (Theorem 1 property 1
            # allows "two M-requests, possibly one T-request") before a T-GPU is grown or started.
            for cat in (M, S):
                cand = self._mra_gpu((cat,), exclude)
                if cand is not None and cand.t_bytes == 0 and self._room(cand) >= item.size_bytes:
                    best = cand
                    break
        if best is None:
            # ... otherwise the most recently activated T-GPU (a new GPU when that one is full).
            best = self._mra_gpu((T,), exclude)
            if best is None or self._room(best) < item.size_bytes:
                best = self._activate()
        self._put(item, best, cause, src)

    def _room(self, gpu: Gpu) -> int:
        return self._free(gpu) - self._headroom

    def _underfilled_t_gpu(self, size: int, exclude: Gpu | None) -> Gpu | None:
        """(kvfleet, `refill_underfilled_t`) the oldest T-GPU under 3/4 full that fits the T-request.

        Fig. 10 refills a T-GPU only when a T-request departs from it, and never when it was the newest
        GPU at that moment (case 1); such GPUs stay under 3/4 full once newer GPUs exist, against
        Theorem 1 property 3, and on long runs they accumulate. Sending T-requests there first
        restores the property instead of growing the newest T-GPU.
        """
        heap = self._t_low
        c = self.capacity_bytes
        probes = 0
        while heap and probes < self.cfg.tiny_probe_limit:
            seq, gid = heap[0]
            gpu = self.gpus.get(gid)
            if gpu is None or gpu.idle or gpu.seq != seq or gpu.category != T or 4 * gpu.load_bytes >= 3 * c:
                heapq.heappop(heap)
                continue
            if gpu is not exclude and self._room(gpu) >= size:
                latest = self._latest_gpu()
                if latest is not None and gpu is not latest:
                    return gpu
            probes += 1
            heapq.heappop(heap)
        return None

    def _set_load(self, gpu: Gpu, new_load: int) -> None:
        dropped = new_load < gpu.load_bytes
        super()._set_load(gpu, new_load)
        if gpu.span_owner is not None:
            self._reindex(gpu)
        if (dropped and self.cfg.refill_underfilled_t and gpu.category == T
                and 4 * new_load < 3 * self.capacity_bytes):
            heapq.heappush(self._t_low, (gpu.seq, gpu.gpu_id))

    def _non_t_load(self, gpu: Gpu) -> int:
        return gpu.load_bytes - gpu.t_bytes

    def _priority(self, gpu: Gpu) -> float:
        """Priority of a GPU from its workload alone (MELL §VI-C, used for incoming requests)."""
        cfg = self.cfg
        return cfg.weight_free * self._free(gpu) / self.capacity_bytes - cfg.weight_requests * gpu.num_requests

    def _priority_from(self, origin: Gpu, gpu: Gpu) -> float:
        """Priority of `gpu` for `origin`: workload plus distance (same node > same zone > elsewhere)."""
        bonus = 0.0
        if gpu.location.node_id == origin.location.node_id:
            bonus = self.cfg.weight_same_node
        elif gpu.location.zone_id == origin.location.zone_id:
            bonus = self.cfg.weight_same_zone
        return self._priority(gpu) + bonus

    def _best(
        self,
        index: SortedIndex,
        accept: Callable[[Gpu], bool] | None,
        min_key: int,
        origin: Gpu | None,
    ) -> Gpu | None:
        """The accepted GPU of highest priority (from `origin` if given) among those whose index key
        is at least `min_key`; ties go to the older GPU. Keys bound the free bytes from above, so
        with non-negative weights the scan stops as soon as no later GPU can rank higher."""
        cfg = self.cfg
        c = self.capacity_bytes
        best: Gpu | None = None
        best_key = (0.0, 0)
        bonus = self._max_bonus if origin is not None else 0.0
        for key, _, gid in reversed(index.entries):
            if key < min_key:
                break
            if best is not None and self._bounded:
                bound = cfg.weight_free * key / c - cfg.weight_requests + bonus
                if bound < best_key[0]:
                    break
            gpu = self.gpus[gid]
            if accept is not None and not accept(gpu):
                continue
            prio = self._priority_from(origin, gpu) if origin is not None else self._priority(gpu)
            cand = (prio, -gpu.seq)
            if best is None or cand > best_key:
                best, best_key = gpu, cand
        return best

    def _allocate_sm(self, item: Item, cause: str, src: Gpu | None) -> None:
        # Fig. 10 Allocate case 2: an L-GPU j with S_iL + S_i < C, highest priority ...
        # S_iL + S_i < C, T-requests aside (they are evicted): the pair room must exceed the size.
        need = item.size_bytes + self._headroom + 1
        best = self._best(self._l_by_pair_room, None, need, None)
        if best is not None:
            self._put(item, best, cause, src)
            # ... and depart and re-allocate any T-request in j.
            for other in [it for it in best.items.values() if it.cls == T]:
                self._remove(other)
                self._allocate_t(other, "evict-t", best, best)
            return
        # ... otherwise the most recently activated GPU of the request's class, or a new one.
        target = self._mra_gpu((item.cls,))
        if target is None or self._room(target) < item.size_bytes:
            target = self._activate()
        self._put(item, target, cause, src)

    def _allocate_l(self, item: Item, cause: str, src: Gpu | None) -> None:
        # Fig. 10 Allocate case 3: activate a new GPU j for the L-request ...
        gpu = self._activate()
        self._put(item, gpu, cause, src)
        # ... move an S/M-request from an S/M-GPU j' to j if possible ...
        pulled = self._pull_sm_into(gpu, "pull-sm")
        if pulled is None:
            return
        moved_from, moved_cls = pulled
        # ... then fulfil j' with an S/M-request from the most recently activated S/M-GPU.
        self._refill_sm(moved_from, moved_cls, exclude=gpu)

    def _pull_sm_into(self, gpu: Gpu, cause: str) -> tuple[Gpu, SizeClass] | None:
        """Move the S/M-request that fits L-GPU `gpu` from the S/M-GPU of highest priority for it."""
        room = self.capacity_bytes - self._non_t_load(gpu) - self._headroom

        def largest_fit(cand: Gpu) -> Item | None:
            fit: Item | None = None
            for it in cand.items.values():
                if it.cls in (S, M) and it.size_bytes < room and (fit is None or it.size_bytes > fit.size_bytes):
                    fit = it
            return fit

        source_gpu = self._best(self._sm_by_free, lambda g: g is not gpu and largest_fit(g) is not None,
                                -self.capacity_bytes, gpu)
        if source_gpu is None:
            return None
        choice = largest_fit(source_gpu)
        assert choice is not None
        source = choice.gpu
        assert source is not None
        cls = choice.cls
        self._move(choice, gpu, cause)
        # T-requests cannot share an L-GPU with an S/M-request (Allocate case 2).
        for other in [it for it in gpu.items.values() if it.cls == T]:
            self._remove(other)
            self._allocate_t(other, "evict-t", gpu, gpu)
        return source, cls

    def _refill_sm(self, target: Gpu, cls: SizeClass, exclude: Gpu | None) -> None:
        """Move a request of class `cls` from the most recently activated GPU of that class into `target`."""
        if not target.items:
            return
        source = self._mra_gpu((cls,), target)
        if source is None or source is exclude or source.seq < target.seq:
            return
        free = self._room(target)
        fit: Item | None = None
        for it in source.items.values():
            if it.cls == cls and it.size_bytes <= free and (fit is None or it.size_bytes > fit.size_bytes):
                fit = it
        if fit is not None:
            self._move(fit, target, "refill-sm")

    # ================================================================ Depart (Fig. 10)

    def depart(self, item: Item, cause: str) -> Gpu:
        """Remove `item` from its GPU j and repair j as Fig. 10 Depart says. Returns j."""
        gpu = item.gpu
        assert gpu is not None
        category_before = gpu.category
        latest = self._latest_gpu()
        self._remove(item)
        # Case 1: j is the most recently activated GPU: just remove.
        if latest is None or gpu.seq >= latest.seq:
            return gpu
        cls = item.cls
        if cls == T:
            self._depart_t(gpu, category_before)
        elif cls in (S, M):
            self._depart_sm(gpu, cls, category_before)
        elif cls == L:
            # Case 4: depart and re-allocate all other requests in j.
            self._evict_all(gpu, "depart-l")
        return gpu

    def _depart_t(self, gpu: Gpu, category_before: SizeClass | None) -> None:
        if not gpu.items:
            return  # (kvfleet) j is now empty and will be terminated: nothing to refill
        if category_before == T and 4 * gpu.load_bytes >= 3 * self.capacity_bytes:
            # (kvfleet) j is still at least 3/4 full: Theorem 1 property 3 holds without a move, and
            # the refill exists to restore it; skipping it saves a migration and changes no property.
            return
        # Case 2: a T-GPU refills from the most recently activated T/M-GPU, any other from the latest T-GPU.
        sources = (T, M) if category_before == T else (T,)
        source = self._mra_gpu(sources, gpu)
        if source is None or source.seq < gpu.seq:
            return  # refilling from an older GPU would not drain the newest one
        if source.load_bytes > self.cfg.refill_source_max_fill * self.capacity_bytes:
            # (kvfleet) the refill is there to drain the newest GPU; one more than half full (by
            # default) is not about to empty, so the move would cost a migration now for no GPU soon.
            return
        free = self._room(gpu)
        fit: Item | None = None
        for it in source.items.values():
            if it.cls != T or it.size_bytes > free:
                continue
            # Fewest requests first (a multi-item moves all of its requests), then the largest.
            if fit is None or (len(it.members), -it.size_bytes) < (len(fit.members), -fit.size_bytes):
                fit = it
        if fit is not None:
            self._move(fit, gpu, "refill-t")

    def _depart_sm(self, gpu: Gpu, cls: SizeClass, category_before: SizeClass | None) -> None:
        if category_before == L:
            # Case 3, L-GPU: pull an S/M-request from the S/M-GPU j' of highest priority for j ...
            pulled = self._pull_sm_into(gpu, "refill-l")
            if pulled is not None:
                # ... then fulfil j' from the most recently activated S/M-GPU.
                self._refill_sm(pulled[0], pulled[1], exclude=gpu)
            return
        if not gpu.items:
            return
        # Case 3, S/M-GPU: move an S/M-request from the most recently activated S/M-GPU to j ...
        self._refill_sm(gpu, cls, exclude=None)
        # ... and re-allocate any T-request in j.
        for other in [it for it in gpu.items.values() if it.cls == T]:
            self._remove(other)
            self._allocate_t(other, "depart-sm-t", gpu, gpu)

    def _evict_all(self, gpu: Gpu, cause: str, keep: Item | None = None) -> None:
        for other in [it for it in gpu.items.values() if it is not keep]:
            self._remove(other)
            if other.is_bundle:
                self._reallocate_bundle(other, cause, gpu)
            else:
                self.allocate(other, cause, gpu)

    def _reallocate_bundle(self, bundle: Item, cause: str, src: Gpu) -> None:
        self._allocate_t(bundle, cause, src, None)

    # ================================================================ Update (Fig. 10)

    def update(self, item: Item, new_size: int) -> None:
        gpu = item.gpu
        assert gpu is not None
        old_cls = item.cls
        new_cls = size_class(new_size, self.capacity_bytes)
        c = self.capacity_bytes
        if new_cls == old_cls:
            self._resize(item, new_size)
            if gpu.load_bytes > c:
                if new_cls == L:
                    # Case 3, L -> L: overload after growth: depart and re-allocate all others in j.
                    self._evict_all(gpu, "overload-l", keep=item)
                else:
                    # (kvfleet) overload within T/S/M: depart and re-allocate the grown request.
                    self.depart(item, "overload")
                    self.allocate(item, "overload", gpu)
            return
        if new_cls == L:
            other_l = any(it.cls == L for it in gpu.items.values() if it is not item)
            if other_l:
                # Case 2, j is an L-GPU: depart i and re-allocate i.
                self.depart(item, "update")
                item.size_bytes = new_size
                item.cls = new_cls
                self.allocate(item, "update", gpu)
                return
            # Case 2, j is an M-GPU: i stays; on overload, depart and re-allocate all others in j.
            self._resize(item, new_size, new_cls)
            if gpu.load_bytes > c:
                self._evict_all(gpu, "update-l", keep=item)
            return
        # Case 1, T/S -> S/M: depart i and re-allocate i.
        self.depart(item, "update")
        item.size_bytes = new_size
        item.cls = new_cls
        self.allocate(item, "update", gpu)

    # ================================================================ multi-items (§VI-C)

    def _push_underfilled(self, bundle: Item) -> None:
        gpu = bundle.gpu
        if gpu is not None and 4 * bundle.size_bytes < self.capacity_bytes:
            heapq.heappush(self._underfilled, (gpu.seq, bundle.item_id))

    def _allocate_tiny(self, request_id: str, size: int, src: Gpu | None, cause: str) -> None:
        c = self.capacity_bytes
        heap = self._underfilled
        probes = 0
        while heap and probes < self.cfg.tiny_probe_limit:
            seq, item_id = heap[0]
            bundle = self._bundles.get(item_id)
            gpu = bundle.gpu if bundle is not None else None
            if bundle is None or gpu is None or gpu.seq != seq or 4 * bundle.size_bytes >= c:
                heapq.heappop(heap)
                continue
            if 4 * (bundle.size_bytes + size) <= c and self._room(gpu) >= size and gpu is not src:
                bundle.members[request_id] = size
                self.item_of[request_id] = bundle
                gpu.num_requests += 1
                self._resize(bundle, bundle.size_bytes + size)
                if src is not None:
                    self._op_moves += 1
                self._record(request_id, size, src, gpu, cause)
                return
            heapq.heappop(heap)  # re-pushed when it shrinks again
            probes += 1
        bundle = self._new_item(T, {request_id: size}, True)
        self._bundles[bundle.item_id] = bundle
        self._allocate_t(bundle, cause, src, src)
        self._push_underfilled(bundle)

    # ---------------------------------------------------------------- indexes

    def _reindex(self, gpu: Gpu) -> None:
        cat = None if gpu.idle else gpu.category
        gid = gpu.gpu_id
        if cat is not L and cat is not S and cat is not M:
            if gid in self._l_by_free.keys or gid in self._sm_by_free.keys:
                self._l_by_free.set(gid, None)
                self._l_by_pair_room.set(gid, None)
                self._sm_by_free.set(gid, None)
            return
        c = self.capacity_bytes
        if cat == L:
            self._l_by_free.set(gid, (c - gpu.load_bytes, gpu.seq, gid))
            self._l_by_pair_room.set(gid, (c - gpu.load_bytes + gpu.t_bytes, gpu.seq, gid))
        else:
            self._l_by_free.set(gid, None)
            self._l_by_pair_room.set(gid, None)
        self._sm_by_free.set(gid, (c - gpu.load_bytes, gpu.seq, gid) if cat in (S, M) else None)

    def _remove(self, item: Item) -> Gpu:
        gpu = item.gpu
        assert gpu is not None
        if item.cls == T:
            gpu.t_bytes -= item.size_bytes
        super()._remove(item)
        self._reindex(gpu)
        return gpu

    def _resize(self, item: Item, new_size: int, new_cls: SizeClass | None = None) -> None:
        gpu = item.gpu
        assert gpu is not None
        if item.cls == T:
            gpu.t_bytes -= item.size_bytes
        super()._resize(item, new_size, new_cls)
        if item.cls == T:
            gpu.t_bytes += item.size_bytes
        self._reindex(gpu)

    def _place(self, item: Item, gpu: Gpu) -> None:
        if item.cls == T:
            gpu.t_bytes += item.size_bytes
        super()._place(item, gpu)
        self._reindex(gpu)
        if item.is_bundle:
            self._bundles[item.item_id] = item  # also registers multi-items restored from a snapshot
            self._push_underfilled(item)

    def _grow_tiny(self, bundle: Item, request_id: str, size_bytes: int) -> None:
        old = bundle.members[request_id]
        if size_bytes <= old:
            return  # KV only grows (§VI-A)
        gpu = bundle.gpu
        assert gpu is not None
        c = self.capacity_bytes
        delta = size_bytes - old
        if size_class(size_bytes, c) is TINY:
            if gpu.load_bytes + delta > c:
                # (kvfleet) overload: the grown request leaves for a multi-item elsewhere.
                self._leave_bundle(bundle, request_id)
                self._allocate_tiny(request_id, size_bytes, gpu, "overload")
            elif 4 * (bundle.size_bytes + delta) <= c:
                bundle.members[request_id] = size_bytes
                if gpu.category == T:
                    # Fast path of _resize for the commonest event (a chat turn's KV grows on a
                    # T-GPU): T-GPUs are in no index and a growing load drops no GPU under 3/4.
                    bundle.size_bytes += delta
                    gpu.t_bytes += delta
                    gpu.load_bytes += delta
                else:
                    self._resize(bundle, bundle.size_bytes + delta)
            else:
                # (kvfleet) the multi-item would pass C/4: the request opens a new one on the same GPU.
                # It cannot be alone in its multi-item here, since a tiny request is at most C/8.
                self._leave_bundle(bundle, request_id)
                fresh = self._new_item(T, {request_id: size_bytes}, True)
                self._bundles[fresh.item_id] = fresh
                self._place(fresh, gpu)
            return
        # TINY -> T or larger: the request becomes an item of its own, first as a T-request where it
        # is, then Update treats it exactly as any T-request that grew.
        if len(bundle.members) == 1:
            single = bundle
            single.is_bundle = False
            del self._bundles[single.item_id]
        else:
            del bundle.members[request_id]
            gpu.num_requests -= 1
            self._resize(bundle, bundle.size_bytes - old)
            self._push_underfilled(bundle)
            single = self._new_item(T, {request_id: old}, False)
            self._place(single, gpu)
        single.members[request_id] = size_bytes
        self.update(single, size_bytes)

    def _leave_bundle(self, bundle: Item, request_id: str) -> None:
        """Take a request out of its multi-item; an emptied multi-item departs (Fig. 10 Depart T)."""
        size = bundle.members[request_id]
        del self.item_of[request_id]
        if len(bundle.members) == 1:
            self.depart(bundle, "depart")
            del bundle.members[request_id]
            del self._bundles[bundle.item_id]
            return
        del bundle.members[request_id]
        gpu = bundle.gpu
        assert gpu is not None
        gpu.num_requests -= 1
        self._resize(bundle, bundle.size_bytes - size)
        self._push_underfilled(bundle)

    # ================================================================ checks used by tests

    def category_of(self, gpu_id: str) -> SizeClass | None:
        return self.gpus[gpu_id].category if gpu_id in self.gpus else None
