"""What the scheduling state is made of: the records the policies work on and the values it is saved as.

`Gpu` and `Item` are the mutable, slotted records a policy updates on every event (mutable for speed:
1,000,000 live requests); `SortedIndex` keeps GPUs ordered by a key for O(log n) lookups. The frozen
`*Snapshot` dataclasses are the same state as a value (`ClusterPolicy.snapshot()` / `restore()`),
which the operator rebuilds from worker reports and the router hands to `allocate_one`. How one
epoch changes the state (batching, activation, the plan) is cluster.py's.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from kvfleet.mell.models import Location
from kvfleet.mell.size_classes import SizeClass


class Gpu:
    """A worker's scheduling state (internal and mutable; see GpuSnapshot for the frozen value)."""

    __slots__ = ("gpu_id", "index", "seq", "location", "load_bytes", "items", "class_counts", "num_requests",
                 "category", "span_owner", "idle", "t_bytes")

    def __init__(self, gpu_id: str, index: int, seq: int, location: Location) -> None:
        self.gpu_id = gpu_id
        self.index = index
        self.seq = seq
        self.location = location
        self.load_bytes = 0
        self.items: dict[int, Item] = {}
        self.class_counts = [0] * len(SizeClass)  # indexed by SizeClass
        self.num_requests = 0
        self.category: SizeClass | None = None
        self.span_owner: str | None = None  # request whose full KV chunk this GPU holds
        self.idle = False
        self.t_bytes = 0  # bytes of T-items here (MELL pairs S/M with an L ignoring them)


class Item:
    """What gets placed: one request, or a multi-item bundling tiny requests (MELL §VI-C)."""

    __slots__ = ("item_id", "cls", "size_bytes", "members", "gpu", "is_bundle", "arrival_seq")

    def __init__(self, item_id: int, cls: SizeClass, members: dict[str, int], is_bundle: bool, arrival_seq: int) -> None:
        self.item_id = item_id
        self.cls = cls
        self.members = members
        self.size_bytes = sum(members.values())
        self.gpu: Gpu | None = None
        self.is_bundle = is_bundle
        self.arrival_seq = arrival_seq


@dataclass(frozen=True)
class ItemSnapshot:
    members: tuple[tuple[str, int], ...]
    is_bundle: bool
    gpu_id: str


@dataclass(frozen=True)
class SpanSnapshot:
    request_id: str
    head_gpu_ids: tuple[str, ...]


@dataclass(frozen=True)
class GpuSnapshot:
    gpu_id: str
    index: int
    seq: int
    location: Location


@dataclass(frozen=True)
class ClusterSnapshot:
    """The whole scheduling state as a value: rebuildable from worker reports after an operator restart."""

    gpus: tuple[GpuSnapshot, ...]
    items: tuple[ItemSnapshot, ...]
    spans: tuple[SpanSnapshot, ...]
    next_gpu_index: int
    next_seq: int
    # (request id, epoch time it last moved) for requests moved recently: the default policy does not
    # move them again by choice for a while (MellDefaultConfig.min_move_interval_s).
    moved_at_s: tuple[tuple[str, float], ...] = ()
    # (request id, final size in bytes) for requests whose Arrive gave one: the default policy's
    # per-request growth estimate (MellDefaultConfig.growth_estimate).
    final_sizes_bytes: tuple[tuple[str, int], ...] = ()


class SortedIndex:
    """GPUs ordered by an integer key (free bytes, say), for "the best GPU that fits" in O(log n)."""

    __slots__ = ("entries", "keys")

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, str]] = []
        self.keys: dict[str, tuple[int, int, str]] = {}

    def set(self, gpu_id: str, key: tuple[int, int, str] | None) -> None:
        old = self.keys.get(gpu_id)
        if old == key:
            return
        if old is not None:
            pos = bisect_left(self.entries, old)
            del self.entries[pos]
            del self.keys[gpu_id]
        if key is not None:
            insort(self.entries, key)
            self.keys[gpu_id] = key
