"""A measured speed profile as the simulator's speed model, so a replay runs at a real engine's speed.

The simulator's own speed model is a datasheet's bandwidth and FLOPs (`kvfleet.sim.hardware`); a pool
of CPU workers, or a GPU that is slower than its datasheet, is better described by what its workers
measured (`kvfleet.api.speed.SpeedProfile`, written by `kvfleet replay` and served by the router's
`GET /kvfleet/speed-profile`). This module reads such a file and answers the two questions the replay
asks: how long a decode step of a batch takes, and how long a prefill of some prompt tokens takes.
Pure: no clock, no I/O beyond `load_profile` reading the one file it is given.

Rules (piecewise-linear over the measured points, docs/simulator.md "Measured speed"):

* Decode: a step of `batch` requests holding `kv_bytes` is looked up at context
  kv_bytes / kv_bytes_per_token tokens. Within one measured batch size the period is linear in the
  context between the two neighbouring points; beyond the first or last point the edge segment is
  extended, but never below the smallest period measured at that batch size (an engine paced to a
  step period has a floor, and extending a noisy slope downwards would break it; the floor is > 0,
  so a period is never negative). A batch size measured at one context has that period at every
  context. Between measured batch sizes the period is linear in the batch between the nearest
  measured sizes below and above (each looked up at the context as above); below the smallest or
  above the largest, the edge pair of sizes is extended, never below the smallest period measured
  at the nearer edge size. With one measured batch size, that size's periods stand for every batch.
* Prefill: linear in the prompt tokens over the prefill points in the same way (extended from the
  edge segments, never below the smallest measured prefill period; one point: its period for any
  size). 0 tokens -> 0 s is not assumed: the points alone decide.
* Points of one batch at the same context (or prefill points of the same size) count as one, their
  sample-weighted mean, as `kvfleet.api.speed.merge_profiles` would merge them.
* A TPOT cap needs the core's linear step (`kvfleet.mell.models.tpot_load_cap`): `linear_decode`
  fits step_s = a + b x batch + c x kv_bytes to the decode points by ordinary least squares (each
  point once, whatever its samples). When every point has the same batch size the batch term cannot
  be told from the constant and is taken as 0.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from kvfleet.api.speed import KIND, SpeedProfile


class ProfileError(ValueError):
    """A speed profile file that cannot be used; the message names the file and what is wrong."""


def _line(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    """The line through (x0, y0) and (x1, y1) at x, written as weights so that x = x0 or x = x1
    give y0 or y1 exactly (a + (b - a) x 1.0 need not be b in floating point)."""
    span = x1 - x0
    return (x1 - x) / span * y0 + (x - x0) / span * y1


@dataclass(frozen=True)
class Curve:
    """Seconds against one size (context or prompt tokens) through measured points, xs increasing."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    @property
    def floor_s(self) -> float:
        return min(self.ys)

    def at(self, x: float) -> float:
        if len(self.xs) == 1:
            return self.ys[0]
        # The segment containing x, or the edge segment when x is outside the points.
        i = min(max(bisect.bisect_right(self.xs, x) - 1, 0), len(self.xs) - 2)
        return max(_line(self.xs[i], self.ys[i], self.xs[i + 1], self.ys[i + 1], x), self.floor_s)

    @staticmethod
    def through(points: Iterable[tuple[float, float, int]]) -> Curve:
        """The curve through (x, seconds, samples) points, those at the same x merged by samples."""
        at_x: dict[float, list[tuple[float, int]]] = {}
        for x, y, n in points:
            at_x.setdefault(x, []).append((y, n))

        def mean(pairs: list[tuple[float, int]]) -> float:
            # A lone point keeps its value exactly (y x n / n need not be y in floating point).
            return pairs[0][0] if len(pairs) == 1 else sum(y * n for y, n in pairs) / sum(n for _, n in pairs)

        xs = tuple(sorted(at_x))
        return Curve(xs, tuple(mean(at_x[x]) for x in xs))


@dataclass(frozen=True)
class LinearDecode:
    """step_s = intercept_s + per_sequence_s x batch + per_kv_byte_s x kv_bytes, fitted."""

    intercept_s: float
    per_sequence_s: float
    per_kv_byte_s: float


@dataclass(frozen=True)
class ProfileSpeed:
    """A measured profile as `step_s` / `prefill_s` (the rules are the module docstring's)."""

    engine: str
    model: str
    kv_bytes_per_token: int
    batches: tuple[int, ...]  # measured batch sizes, increasing
    decode: tuple[Curve, ...]  # one per batch size in `batches`, seconds against context tokens
    prefill: Curve  # seconds against prompt tokens
    # (batch, context tokens, seconds) of every decode point, for the least-squares fit
    decode_points: tuple[tuple[int, float, float], ...]
    num_samples: int

    @staticmethod
    def from_profile(profile: SpeedProfile) -> ProfileSpeed:
        if not profile.decode or not profile.prefill:
            raise ProfileError("a speed profile needs decode and prefill points")
        batches = tuple(sorted({p.batch for p in profile.decode}))
        decode = tuple(Curve.through((p.context_tokens, p.step_seconds, p.samples)
                                     for p in profile.decode if p.batch == b) for b in batches)
        return ProfileSpeed(
            engine=profile.engine, model=profile.model, kv_bytes_per_token=profile.kv_bytes_per_token,
            batches=batches, decode=decode,
            prefill=Curve.through((p.tokens, p.step_seconds, p.samples) for p in profile.prefill),
            decode_points=tuple((p.batch, p.context_tokens, p.step_seconds) for p in profile.decode),
            num_samples=profile.num_samples,
        )

    def step_s(self, batch: int, kv_bytes: int) -> float:
        context_tokens = kv_bytes / self.kv_bytes_per_token
        batches = self.batches
        i = bisect.bisect_left(batches, batch)
        if i < len(batches) and batches[i] == batch:
            return self.decode[i].at(context_tokens)
        if len(batches) == 1:
            return self.decode[0].at(context_tokens)
        # The nearest measured sizes below and above, or the edge pair outside them.
        lo = min(max(i - 1, 0), len(batches) - 2)
        y = _line(batches[lo], self.decode[lo].at(context_tokens),
                  batches[lo + 1], self.decode[lo + 1].at(context_tokens), batch)
        if i == 0:
            return max(y, self.decode[0].floor_s)
        if i == len(batches):
            return max(y, self.decode[-1].floor_s)
        return y

    def prefill_s(self, tokens: int) -> float:
        return self.prefill.at(tokens)

    def prefill_tokens_per_s(self) -> float:
        """The fastest prefill measured, in tokens a second: a paced step's floor makes one token cost a
        whole step, so 1 / prefill_s(1) would understate what a re-prefill of many tokens runs at."""
        return max(x / y for x, y in zip(self.prefill.xs, self.prefill.ys))

    def linear_decode(self) -> LinearDecode:
        """The least-squares line through the decode points (see the module docstring).

        Raises ProfileError when the points do not determine how the step grows with KV (fewer than
        two contexts, or batch and context moving together so the two cannot be told apart).
        """
        n = len(self.decode_points)
        bs = [float(b) for b, _, _ in self.decode_points]
        ks = [ctx * self.kv_bytes_per_token for _, ctx, _ in self.decode_points]
        ys = [y for _, _, y in self.decode_points]
        b_mean, k_mean, y_mean = sum(bs) / n, sum(ks) / n, sum(ys) / n
        # Centred sums: the normal equations of the two slopes, the intercept from the means.
        sbb = sum((b - b_mean) ** 2 for b in bs)
        skk = sum((k - k_mean) ** 2 for k in ks)
        sbk = sum((b - b_mean) * (k - k_mean) for b, k in zip(bs, ks))
        sby = sum((b - b_mean) * (y - y_mean) for b, y in zip(bs, ys))
        sky = sum((k - k_mean) * (y - y_mean) for k, y in zip(ks, ys))
        if skk == 0:
            raise ProfileError("the decode points have one context: how a step grows with KV is unknown")
        if sbb == 0:
            per_seq, per_byte = 0.0, sky / skk
        else:
            det = sbb * skk - sbk * sbk
            # Relative to the product: batch and context along one line leave the slopes undetermined.
            if det <= 1e-12 * sbb * skk:
                raise ProfileError("the decode points' batch and context grow together: their effects cannot be "
                                   "told apart")
            per_seq = (sby * skk - sky * sbk) / det
            per_byte = (sky * sbb - sby * sbk) / det
        return LinearDecode(y_mean - per_seq * b_mean - per_byte * k_mean, per_seq, per_byte)


def parse_profile(text: str, source: str) -> SpeedProfile:
    """A SpeedProfile from a file's text; `source` names the file in errors."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProfileError(f"{source}: not JSON: {err.msg} (line {err.lineno} column {err.colno})") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{source}: expected a JSON object (a SpeedProfile), found {type(raw).__name__}")
    kind = raw.get("kind", KIND)
    if kind != KIND:
        raise ProfileError(f"{source}: kind {kind!r} is not a {KIND}")
    try:
        profile = SpeedProfile.model_validate(raw)
    except ValidationError as err:
        errors = err.errors()
        first = errors[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ProfileError(f"{source}: {where}: {first['msg']}{more}") from None
    if not profile.decode:
        raise ProfileError(f"{source}: no decode points (the workers measured no decode-only step)")
    if not profile.prefill:
        raise ProfileError(f"{source}: no prefill points (the workers measured no prefill step)")
    return profile


def load_profile(path: Path) -> SpeedProfile:
    """The SpeedProfile in `path` (what `SpeedProfile.model_dump_json(by_alias=True)` writes)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ProfileError(f"{path}: cannot read the speed profile: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not JSON: not UTF-8 text") from None
    return parse_profile(text, str(path))
