"""What the baselines MELL is measured against (§VIII-B) share: dispatch, and no migration.

BF, WF and LB (best_fit.py, worst_fit.py, load_balance.py) each pick a GPU for an incoming request
their own way; all activate a GPU when none fits and terminate idle ones (§VIII-B). Without
migration, a GPU whose requests outgrow it must preempt, as vLLM does: the most recently arrived
request on it is evicted and re-dispatched with re-prefill. Those are reported as preemptions, not
migrations. Every request is an item of its own (MELL's multi-items are Fig. 10's).
"""

from __future__ import annotations

import abc
from typing import ClassVar

from kvfleet.mell.cluster import ClusterPolicy
from kvfleet.mell.size_classes import SizeClass, size_class
from kvfleet.mell.state import Gpu, Item


class NoMigrationPolicy(ClusterPolicy):
    """Dispatch by `choose`, never migrate; preempt (recompute) what outgrows its GPU."""

    uses_free_index = True
    restores_multi_items: ClassVar[bool] = False  # every request is an item of its own

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
