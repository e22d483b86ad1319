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
from dataclasses import dataclass

from kvfleet.mell.models import Location, Migration


class Mode(enum.Enum):
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
    mode: Mode
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
    measured_link = measured_link_bytes or {}
    measured_prefill = measured_prefill_tokens or {}
    link_budget: dict[str, int] = {}
    prefill_budget: dict[str, int] = {}
    link_left: dict[str, int] = {}
    prefill_left: dict[str, int] = {}
    kv: list[ClassifiedMigration] = []
    token: list[ClassifiedMigration] = []
    hybrid: list[ClassifiedMigration] = []
    deferred: list[Migration] = []
    for mig in sorted(migrations, key=lambda m: (-m.size_bytes, m.request_id)):
        link = link_of(locate(mig.source_gpu_id), locate(mig.target_gpu_id))
        target = mig.target_gpu_id
        if link not in link_left:
            boundary = (boundaries.intra_node_link_bytes if link.startswith("intra:")
                        else boundaries.inter_node_link_bytes)
            link_budget[link] = link_left[link] = _capped(boundary, measured_link.get(link))
        if target not in prefill_left:
            prefill_budget[target] = prefill_left[target] = _capped(
                boundaries.instance_prefill_tokens, measured_prefill.get(target))
        tokens = -(-mig.size_bytes // kv_bytes_per_token)
        kv_room = link_left[link] - mig.size_bytes
        token_room = prefill_left[target] - tokens
        fits_kv = kv_room >= 0
        fits_token = token_room >= 0
        if fits_kv and fits_token and strategy == "best-fit":
            # Best fit: the bin left fullest, comparing shares of each bin's budget.
            kv_share = kv_room / max(1, link_budget[link])
            token_share = token_room / max(1, prefill_budget[target])
            fits_kv = kv_share <= token_share
            fits_token = not fits_kv
        if fits_kv:
            link_left[link] = kv_room
            kv.append(ClassifiedMigration(mig, Mode.KV, link, tokens, kv_bytes=mig.size_bytes, kv_tokens=tokens))
            continue
        if fits_token:
            prefill_left[target] = token_room
            token.append(ClassifiedMigration(mig, Mode.TOKEN, link, tokens, prefill_tokens=tokens))
            continue
        split = _split(tokens, link_left[link], prefill_left[target], block_size_tokens, kv_bytes_per_token)
        if split is None:
            deferred.append(mig)
            continue
        kv_tokens, tail_tokens = split
        link_left[link] -= kv_tokens * kv_bytes_per_token
        prefill_left[target] -= tail_tokens
        hybrid.append(ClassifiedMigration(mig, Mode.HYBRID, link, tokens, kv_bytes=kv_tokens * kv_bytes_per_token,
                                          kv_tokens=kv_tokens, prefill_tokens=tail_tokens))
    return MigrationSchedule(tuple(kv), tuple(token), tuple(deferred), tuple(hybrid))


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
