"""A worker's measured speed: how long its engine's steps take against batch size and context.

The simulator's speed model is a GPU's bandwidth and FLOPs (kvfleet.sim.hardware); a pool of CPU
workers, or a GPU whose real speed differs from the datasheet, needs measured numbers instead. The
builtin engine times every step it runs and folds it into a profile of this shape (served at the
worker's and the router's `GET /kvfleet/speed-profile`); `kvfleet replay` writes the pool's merged
profile into its record and `kvfleet simulate --speed-profile FILE` replays a trace at that speed.
One schema for the three, here at the edge (docs/simulator.md, docs/worker.md).

A step is either pure decode (every running request writes one token) or carries prefill (some of
its tokens are new prompt tokens): decode points are keyed by (batch, context tokens in the batch),
prefill points by the prompt tokens the step prefilled. Each point is a bucket's mean over its
samples, so two profiles merge exactly by sample-weighted means.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

KIND: Literal["SpeedProfile"] = "SpeedProfile"
# The HTTP route that serves a profile: each worker's own, and the router's merge of its workers'
# (which `kvfleet replay` asks for). One constant, so the two servers and the client agree.
SPEED_PROFILE_PATH = "/kvfleet/speed-profile"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


def context_bucket(tokens: int) -> int:
    """The bucket of a context (or prefill) size: 0 for none, then two buckets per power of two, so
    a point stands for contexts within ~41% of each other at any scale (16 tokens or 100K)."""
    return 0 if tokens <= 0 else 1 + int(2 * math.log2(tokens))


class DecodePoint(_Model):
    """Decode-only steps of one batch size and context bucket: their mean context and period."""

    batch: int = Field(ge=1)
    context_tokens: float = Field(ge=0)  # the mean over the bucket's samples: KV tokens read by the step
    step_seconds: float = Field(gt=0)  # the mean step period (compute plus any pacing)
    samples: int = Field(ge=1)


class PrefillPoint(_Model):
    """Steps that prefilled prompt tokens, by how many: their mean size and period."""

    tokens: float = Field(gt=0)
    step_seconds: float = Field(gt=0)
    samples: int = Field(ge=1)


class SpeedProfile(_Model):
    """A worker's (or a pool's merged) measured step speed."""

    kind: Literal["SpeedProfile"] = KIND
    engine: str
    model: str
    kv_bytes_per_token: int = Field(gt=0)
    capacity_bytes: int = Field(gt=0)  # the worker's KV capacity C
    # Measured by the migration executor (the KV-load report's fields); None until a move measured it.
    link_bytes_per_second: float | None = Field(default=None, gt=0)
    decode: list[DecodePoint] = Field(default_factory=list)
    prefill: list[PrefillPoint] = Field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(p.samples for p in self.decode) + sum(p.samples for p in self.prefill)


def _mean(pairs: Iterable[tuple[float, int]]) -> tuple[float, int]:
    total = n = 0.0
    for value, count in pairs:
        total += value * count
        n += count
    return total / n, int(n)


def merge_profiles(profiles: Iterable[SpeedProfile]) -> SpeedProfile:
    """One profile from several workers' of the same engine, model and C: per bucket, the
    sample-weighted mean (what one worker would have measured had it run all their steps)."""
    items = list(profiles)
    if not items:
        raise ValueError("no speed profiles to merge")
    first = items[0]
    for p in items[1:]:
        if (p.engine, p.model, p.kv_bytes_per_token, p.capacity_bytes) != (
                first.engine, first.model, first.kv_bytes_per_token, first.capacity_bytes):
            raise ValueError(f"cannot merge the speed of {p.engine}/{p.model} (C {p.capacity_bytes} B) with "
                             f"{first.engine}/{first.model} (C {first.capacity_bytes} B)")
    decode: dict[tuple[int, int], list[DecodePoint]] = {}
    prefill: dict[int, list[PrefillPoint]] = {}
    for p in items:
        for d in p.decode:
            decode.setdefault((d.batch, context_bucket(round(d.context_tokens))), []).append(d)
        for f in p.prefill:
            prefill.setdefault(context_bucket(round(f.tokens)), []).append(f)
    merged_decode = []
    for key in sorted(decode):
        points = decode[key]
        ctx, n = _mean((d.context_tokens, d.samples) for d in points)
        step, _ = _mean((d.step_seconds, d.samples) for d in points)
        merged_decode.append(DecodePoint(batch=key[0], context_tokens=ctx, step_seconds=step, samples=n))
    merged_prefill = []
    for bucket in sorted(prefill):
        fpoints = prefill[bucket]
        tokens, n = _mean((f.tokens, f.samples) for f in fpoints)
        step, _ = _mean((f.step_seconds, f.samples) for f in fpoints)
        merged_prefill.append(PrefillPoint(tokens=tokens, step_seconds=step, samples=n))
    links = [p.link_bytes_per_second for p in items if p.link_bytes_per_second is not None]
    return SpeedProfile(engine=first.engine, model=first.model, kv_bytes_per_token=first.kv_bytes_per_token,
                        capacity_bytes=first.capacity_bytes, link_bytes_per_second=min(links) if links else None,
                        decode=merged_decode, prefill=merged_prefill)
