"""MELL's adaptive request migration (§V): choose KV transfer or token re-prefill per migration.

Every link has a communication boundary (bytes it may carry per epoch without stalling the requests
whose memory cannot be freed until the copy ends) and every instance a computation boundary (tokens
it may re-prefill per epoch without disturbing its decode batch). The split of the plan's migrations
into the KV class and the token class is a global two-bin packing over all migrations of the epoch
(§V, "Global Consensus"): each migration goes to the bin of its link or of its target instance where
it fits, greedily (first fit or best fit), and a migration that fits neither is deferred to the next
epoch. Pure: boundaries come in as arguments.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvfleet.mell.models import Location, Migration


class Mode(enum.Enum):
    KV = "kv"
    TOKEN = "token"


@dataclass(frozen=True)
class Boundaries:
    """Profiled boundaries (§V, "Boundary Profiling"), per epoch."""

    intra_node_link_bytes: int
    inter_node_link_bytes: int
    instance_prefill_tokens: int


@dataclass(frozen=True)
class ClassifiedMigration:
    migration: Migration
    mode: Mode
    link_id: str
    num_tokens: int


@dataclass(frozen=True)
class MigrationSchedule:
    kv: tuple[ClassifiedMigration, ...]
    token: tuple[ClassifiedMigration, ...]
    deferred: tuple[Migration, ...]

    @property
    def kv_bytes(self) -> int:
        return sum(c.migration.size_bytes for c in self.kv)

    @property
    def token_count(self) -> int:
        return sum(c.num_tokens for c in self.token)


def link_of(source: Location, target: Location) -> str:
    """GPUs of one node share its PCIe/NVLink fabric; across nodes each ordered node pair is a link."""
    if source.node_id == target.node_id:
        return f"intra:{source.node_id}"
    return f"inter:{source.node_id}->{target.node_id}"


def plan_migrations(
    migrations: Sequence[Migration],
    locate: Callable[[str], Location],
    kv_bytes_per_token: int,
    boundaries: Boundaries,
    strategy: str = "first-fit",
) -> MigrationSchedule:
    """Split migrations into KV and token classes under the boundaries (§V, "Hybrid Migration").

    Largest first, as greedy bin packing does best that way; ties broken by request id so the result
    does not depend on input order beyond sizes.
    """
    if strategy not in ("first-fit", "best-fit"):
        raise ValueError(f"unknown strategy {strategy!r}")
    link_left: dict[str, int] = {}
    prefill_left: dict[str, int] = {}
    kv: list[ClassifiedMigration] = []
    token: list[ClassifiedMigration] = []
    deferred: list[Migration] = []
    for mig in sorted(migrations, key=lambda m: (-m.size_bytes, m.request_id)):
        link = link_of(locate(mig.source_gpu_id), locate(mig.target_gpu_id))
        if link not in link_left:
            link_left[link] = (boundaries.intra_node_link_bytes if link.startswith("intra:")
                               else boundaries.inter_node_link_bytes)
        if mig.target_gpu_id not in prefill_left:
            prefill_left[mig.target_gpu_id] = boundaries.instance_prefill_tokens
        tokens = -(-mig.size_bytes // kv_bytes_per_token)
        kv_room = link_left[link] - mig.size_bytes
        token_room = prefill_left[mig.target_gpu_id] - tokens
        fits_kv = kv_room >= 0
        fits_token = token_room >= 0
        if fits_kv and fits_token and strategy == "best-fit":
            # Best fit: the bin left fullest, comparing shares of each bin's boundary.
            kv_share = kv_room / max(1, boundaries.inter_node_link_bytes if link.startswith("inter:")
                                     else boundaries.intra_node_link_bytes)
            token_share = token_room / max(1, boundaries.instance_prefill_tokens)
            fits_kv = kv_share <= token_share
            fits_token = not fits_kv
        if fits_kv:
            link_left[link] = kv_room
            kv.append(ClassifiedMigration(mig, Mode.KV, link, tokens))
        elif fits_token:
            prefill_left[mig.target_gpu_id] = token_room
            token.append(ClassifiedMigration(mig, Mode.TOKEN, link, tokens))
        else:
            deferred.append(mig)
    return MigrationSchedule(tuple(kv), tuple(token), tuple(deferred))
