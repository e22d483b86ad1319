"""MELL's adaptive request migration (§V): KV transfer, token re-prefill, or both, per migration.

Every link has a communication boundary (bytes it may carry per epoch without stalling the requests
whose memory cannot be freed until the copy ends) and every instance a computation boundary (tokens
it may re-prefill per epoch without disturbing its decode batch). The split of the plan's migrations
into the KV class and the token class is a global two-bin packing over all migrations of the epoch
(§V, "Global Consensus"): each migration goes to the bin of its link or of its target instance where
it fits, greedily (first fit or best fit). A migration that fits neither bin whole may still be split
across both (§V, "Hybrid Migration": the two classes are the two bins, and a request's KV is made of
blocks, so its full blocks can travel as KV while the tail is re-prefilled): as many full blocks as
the link still carries, the rest re-prefilled at the target if its prefill budget holds it. Only what
fits neither whole nor split is deferred to the next epoch. Pure: boundaries, and the measured link
and prefill rates that refine them (§V, "Boundary Profiling"), come in as arguments.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvfleet.mell.models import Location, Migration


class MoveMode(enum.StrEnum):
    """How one request travels (§V): its KV copied, its tokens re-prefilled, or full blocks copied and
    the tail re-prefilled (hybrid). The one definition: the planner, the KVMigration schema and the
    worker's executor all use it; the value is what `KVMigration.spec.mode` carries."""

    KV = "kv"
    TOKEN = "token"
    HYBRID = "hybrid"


@dataclass(frozen=True)
class Boundaries:
    """Profiled boundaries (§V, "Boundary Profiling"), per epoch."""

    intra_node_link_bytes: int
    inter_node_link_bytes: int
    instance_prefill_tokens: int


@dataclass(frozen=True)
class ClassifiedMigration:
    """One scheduled migration and what it costs each bin.

    `kv_bytes` is charged to the link and `prefill_tokens` to the target: all of one for KV and
    token moves, a block-aligned split for hybrid ones (`kv_tokens` full-block tokens copied as KV).
    """

    migration: Migration
    mode: MoveMode
    link_id: str
    num_tokens: int
    kv_bytes: int = 0
    kv_tokens: int = 0
    prefill_tokens: int = 0


@dataclass(frozen=True)
class MigrationSchedule:
    kv: tuple[ClassifiedMigration, ...]
    token: tuple[ClassifiedMigration, ...]
    deferred: tuple[Migration, ...]
    hybrid: tuple[ClassifiedMigration, ...] = ()

    @property
    def scheduled(self) -> tuple[ClassifiedMigration, ...]:
        return (*self.kv, *self.token, *self.hybrid)

    @property
    def kv_bytes(self) -> int:
        """Bytes all links carry, hybrid moves' full blocks included."""
        return sum(c.kv_bytes for c in self.scheduled)

    @property
    def token_count(self) -> int:
        """Tokens all targets re-prefill, hybrid moves' tails included."""
        return sum(c.prefill_tokens for c in self.scheduled)


def link_of(source: Location, target: Location) -> str:
    """GPUs of one node share its PCIe/NVLink fabric; across nodes each ordered node pair is a link."""
    if source.node_id == target.node_id:
        return f"intra:{source.node_id}"
    return f"inter:{source.node_id}->{target.node_id}"


def _capped(boundary: int, measured: int | None) -> int:
    # The pool's boundary is the most a link or an instance may give to migrations; a measured rate
    # below it says the hardware gives less, so plan with that (§V, "Boundary Profiling").
    return boundary if measured is None else max(0, min(boundary, measured))


def plan_migrations(
    migrations: Sequence[Migration],
    locate: Callable[[str], Location],
    kv_bytes_per_token: int,
    boundaries: Boundaries,
    strategy: str = "first-fit",
    *,
    block_size_tokens: int | None = None,
    measured_link_bytes: Mapping[str, int] | None = None,
    measured_prefill_tokens: Mapping[str, int] | None = None,
) -> MigrationSchedule:
    """Split migrations into KV, token and hybrid classes under the boundaries (§V, "Hybrid Migration").

    Largest first, as greedy bin packing does best that way; ties broken by request id so the result
    does not depend on input order beyond sizes. A move goes whole to a bin where it fits (`strategy`
    picks between two that both fit); only when neither fits is it split (hybrid): the link takes
    the most full blocks of `block_size_tokens` it still can, the target re-prefills the rest. Without
    a block size there is no split and such a move is deferred, as before.

    `measured_link_bytes` (by link id, see `link_of`) and `measured_prefill_tokens` (by target GPU
    id) are per-epoch figures from measurement; each budget is the smaller of it and the boundary.
    """
    if strategy not in ("first-fit", "best-fit"):
        raise ValueError(f"unknown strategy {strategy!r}")
    if block_size_tokens is not None and block_size_tokens <= 0:
        raise ValueError("block_size_tokens must be positive")
    bins = _Bins(boundaries, measured_link_bytes or {}, measured_prefill_tokens or {})
    by_mode: dict[MoveMode, list[ClassifiedMigration]] = {mode: [] for mode in MoveMode}
    deferred: list[Migration] = []
    for mig in sorted(migrations, key=lambda m: (-m.size_bytes, m.request_id)):
        link = link_of(locate(mig.source_gpu_id), locate(mig.target_gpu_id))
        bins.open(link, mig.target_gpu_id)
        classified = _classify(mig, link, bins, kv_bytes_per_token, strategy, block_size_tokens)
        if classified is None:
            deferred.append(mig)
        else:
            by_mode[classified.mode].append(classified)
    return MigrationSchedule(
        tuple(by_mode[MoveMode.KV]), tuple(by_mode[MoveMode.TOKEN]), tuple(deferred), tuple(by_mode[MoveMode.HYBRID])
    )


@dataclass
class _Bins:
    """The two bins of §V's "Global Consensus" for one epoch: what each link may still carry (KV
    class) and each target instance may still re-prefill (token class).

    A budget opens on the first migration that uses its link or target, so only those appear; the
    full budgets are kept beside what is left because best fit compares shares of them.
    """

    boundaries: Boundaries
    measured_link_bytes: Mapping[str, int]
    measured_prefill_tokens: Mapping[str, int]
    link_budget_bytes: dict[str, int] = field(default_factory=dict)
    link_left_bytes: dict[str, int] = field(default_factory=dict)
    prefill_budget_tokens: dict[str, int] = field(default_factory=dict)
    prefill_left_tokens: dict[str, int] = field(default_factory=dict)

    def open(self, link_id: str, target_gpu_id: str) -> None:
        if link_id not in self.link_left_bytes:
            boundary = (self.boundaries.intra_node_link_bytes if link_id.startswith("intra:")
                        else self.boundaries.inter_node_link_bytes)
            budget = _capped(boundary, self.measured_link_bytes.get(link_id))
            self.link_budget_bytes[link_id] = self.link_left_bytes[link_id] = budget
        if target_gpu_id not in self.prefill_left_tokens:
            budget = _capped(self.boundaries.instance_prefill_tokens, self.measured_prefill_tokens.get(target_gpu_id))
            self.prefill_budget_tokens[target_gpu_id] = self.prefill_left_tokens[target_gpu_id] = budget


def _classify(
    mig: Migration,
    link_id: str,
    bins: _Bins,
    kv_bytes_per_token: int,
    strategy: str,
    block_size_tokens: int | None,
) -> ClassifiedMigration | None:
    """Charge one move to the KV bin, the token bin, or both split (hybrid); None if it must wait.

    Whole first: the split (§V, "Hybrid Migration") is the fallback for a move neither bin holds
    whole, as the module docstring says.
    """
    target = mig.target_gpu_id
    tokens = -(-mig.size_bytes // kv_bytes_per_token)
    kv_room = bins.link_left_bytes[link_id] - mig.size_bytes
    token_room = bins.prefill_left_tokens[target] - tokens
    fits_kv = kv_room >= 0
    fits_token = token_room >= 0
    if fits_kv and fits_token and strategy == "best-fit":
        # Best fit: the bin left fullest, comparing shares of each bin's budget.
        kv_share = kv_room / max(1, bins.link_budget_bytes[link_id])
        token_share = token_room / max(1, bins.prefill_budget_tokens[target])
        fits_kv = kv_share <= token_share
        fits_token = not fits_kv
    if fits_kv:
        bins.link_left_bytes[link_id] = kv_room
        return ClassifiedMigration(mig, MoveMode.KV, link_id, tokens, kv_bytes=mig.size_bytes, kv_tokens=tokens)
    if fits_token:
        bins.prefill_left_tokens[target] = token_room
        return ClassifiedMigration(mig, MoveMode.TOKEN, link_id, tokens, prefill_tokens=tokens)
    split = _split(tokens, bins.link_left_bytes[link_id], bins.prefill_left_tokens[target], block_size_tokens,
                   kv_bytes_per_token)
    if split is None:
        return None
    kv_tokens, tail_tokens = split
    bins.link_left_bytes[link_id] -= kv_tokens * kv_bytes_per_token
    bins.prefill_left_tokens[target] -= tail_tokens
    return ClassifiedMigration(mig, MoveMode.HYBRID, link_id, tokens, kv_bytes=kv_tokens * kv_bytes_per_token,
                               kv_tokens=kv_tokens, prefill_tokens=tail_tokens)


def _split(num_tokens: int, link_left_bytes: int, prefill_left_tokens: int, block_size_tokens: int | None,
           kv_bytes_per_token: int) -> tuple[int, int] | None:
    """(tokens sent as KV, tokens re-prefilled) for a move neither bin holds whole, or None.

    Only full blocks travel as KV (the executor copies blocks; the partial last block is always
    re-prefilled), and as many as the link still carries, since a copy costs the target no compute.
    Called only when the whole move exceeds the link, so the KV part is short of the whole and the
    tail is never empty.
    """
    if block_size_tokens is None:
        return None
    block_bytes = block_size_tokens * kv_bytes_per_token
    num_blocks = min(num_tokens // block_size_tokens, max(0, link_left_bytes) // block_bytes)
    if num_blocks == 0:
        return None
    kv_tokens = num_blocks * block_size_tokens
    tail_tokens = num_tokens - kv_tokens
    if tail_tokens > prefill_left_tokens:
        return None
    return kv_tokens, tail_tokens
