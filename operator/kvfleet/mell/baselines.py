"""The baselines MELL is measured against (§VIII-B), behind the same interface as MellPolicy.

* BF: each incoming request to the GPU with the least free memory that still fits; no migration.
* WF: each incoming request to the GPU with the most free memory; no migration.
* LB: WF dispatch plus Llumnix-style load balancing: GPUs are paired most-loaded with least-loaded
  and a request moves across a pair while that narrows the pair's gap.

All three activate a GPU when none fits and terminate idle ones (§VIII-B). Without migration, a GPU
whose requests outgrow it must preempt, as vLLM does: the most recently arrived request on it is
evicted and re-dispatched with re-prefill. Those are reported as preemptions, not migrations.
"""

from __future__ import annotations

import abc
from bisect import bisect_left

from kvfleet.mell.cluster import ClusterPolicy
from kvfleet.mell.models import SizeClass, size_class
from kvfleet.mell.state import Gpu, Item


class _NoMigrationPolicy(ClusterPolicy):
    uses_free_index = True

    @abc.abstractmethod
    def choose(self, size_bytes: int, exclude: Gpu | None) -> Gpu | None:
        """The GPU that takes an item of this size (None: activate a new one)."""

    def on_arrive(self, request_id: str, size_bytes: int) -> None:
        cls = size_class(size_bytes, self.capacity_bytes)
        item = self._new_item(cls, {request_id: size_bytes}, False)
        self._dispatch(item, "allocate", None)

    def _dispatch(self, item: Item, cause: str, src: Gpu | None) -> None:
        target = self.choose(item.size_bytes, src)
        if target is None:
            target = self._activate()
        self._put(item, target, cause, src)

    def on_finish(self, request_id: str) -> None:
        item = self.item_of.pop(request_id, None)
        if item is None:
            raise ValueError(f"unknown request {request_id!r} finished")
        self._remove(item)

    def on_grow(self, request_id: str, size_bytes: int) -> None:
        item = self.item_of.get(request_id)
        if item is None:
            raise ValueError(f"unknown request {request_id!r} grew")
        if size_bytes <= item.size_bytes:
            return
        item.members[request_id] = size_bytes
        gpu = item.gpu
        assert gpu is not None
        new_cls = size_class(size_bytes, self.capacity_bytes)
        self._resize(item, size_bytes, new_cls)
        self._preempt_until_fits(gpu, keep=None)

    def _preempt_until_fits(self, gpu: Gpu, keep: Item | None) -> None:
        """vLLM's recompute preemption: evict the latest arrivals until the GPU fits again."""
        while gpu.load_bytes > self.capacity_bytes:
            victims = [it for it in gpu.items.values() if it is not keep]
            if not victims:
                return
            victim = max(victims, key=lambda it: it.arrival_seq)
            self._remove(victim)
            rid = next(iter(victim.members))
            target = self.choose(victim.size_bytes, gpu)
            if target is None:
                target = self._activate()
            self._place(victim, target)
            self._record(rid, victim.size_bytes, gpu, target, "preempt")

    def _usable(self, gpu: Gpu, exclude: Gpu | None) -> bool:
        return gpu is not exclude and gpu.category is not SizeClass.X and not gpu.idle


class BestFitPolicy(_NoMigrationPolicy):
    name = "bf"

    def choose(self, size_bytes: int, exclude: Gpu | None) -> Gpu | None:
        index = self._sync_free_index()
        pos = bisect_left(index, (size_bytes, -1, ""))
        while pos < len(index):
            gpu = self.gpus[index[pos][2]]
            if self._usable(gpu, exclude):
                return gpu
            pos += 1
        return None


class WorstFitPolicy(_NoMigrationPolicy):
    name = "wf"

    def choose(self, size_bytes: int, exclude: Gpu | None) -> Gpu | None:
        index = self._sync_free_index()
        pos = len(index) - 1
        while pos >= 0 and index[pos][0] >= size_bytes:
            gpu = self.gpus[index[pos][2]]
            if self._usable(gpu, exclude):
                return gpu
            pos -= 1
        return None


class LoadBalancePolicy(WorstFitPolicy):
    """Llumnix-style: WF dispatch, then migrations from the most to the least loaded GPUs."""

    name = "lb"

    def after_batch(self) -> None:
        gap_min = self.cfg.lb_gap_fraction * self.capacity_bytes
        gpus = sorted((g for g in self.gpus.values() if not g.idle and g.category is not SizeClass.X),
                      key=lambda g: (-g.load_bytes, g.seq))
        for k in range(len(gpus) // 2):
            heavy = gpus[k]
            light = gpus[len(gpus) - 1 - k]
            # Llumnix pairs instances by load and migrates one request at a time while the pair's gap
            # narrows; the smallest request that narrows it moves first (least to copy).
            while heavy.load_bytes - light.load_bytes > gap_min:
                gap = heavy.load_bytes - light.load_bytes
                best: Item | None = None
                for it in heavy.items.values():
                    if 2 * it.size_bytes <= gap and light.load_bytes + it.size_bytes <= self.capacity_bytes:
                        if best is None or it.size_bytes < best.size_bytes:
                            best = it
                if best is None:
                    break
                self._move(best, light, "balance")
