"""What an engine measures of its own speed: step periods against batch size and context, bucketed.

The simulator replays a trace at a pool's measured speed (kvfleet.api.speed says why); this is the
measuring end. An engine that measures owns one `SpeedRecorder` and hands it every step it runs as
four numbers: the batch, the KV tokens the batch holds, the prompt tokens it prefilled, and the
step's period. The recorder keeps, per bucket, only a count and two sums, so its memory is bounded
by (batch sizes x context buckets) whatever the uptime, and a step costs one dict lookup and three
additions: the step loop is hot and runs for the pod's whole life.

Keys are the schema's: a decode step by (batch, context_bucket(context tokens)), a step that
prefilled by context_bucket(prompt tokens). The profile's point of a bucket is its mean context (or
prompt size) and mean period, so `kvfleet.api.speed.merge_profiles` merges recorders' profiles exactly.
"""

from __future__ import annotations

from kvfleet.api.speed import DecodePoint, PrefillPoint, SpeedProfile, context_bucket


class _Sums:
    """One bucket's running sums (mutable: updated in place every step, never copied)."""

    __slots__ = ("samples", "size_total", "seconds_total")

    def __init__(self) -> None:
        self.samples = 0
        self.size_total = 0  # context tokens (decode) or prompt tokens (prefill), summed: exact ints
        self.seconds_total = 0.0


class SpeedRecorder:
    """Step periods folded into buckets; `profile` is their means as a SpeedProfile.

    Runs on the engine's event loop only (record and read alike), so it needs no lock.
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._decode: dict[tuple[int, int], _Sums] = {}
        self._prefill: dict[int, _Sums] = {}

    def record_step(self, batch: int, context_tokens: int, prefill_tokens: int, step_seconds: float) -> None:
        """One step of `batch` requests holding `context_tokens` KV tokens in all (after the step's
        writes), of which `prefill_tokens` were prompt tokens it prefilled (0 for a decode-only
        step), that took `step_seconds` from its start to the start of the next possible step.

        A step that prefilled anything is a prefill point, whatever else it decoded: its period is
        what the prefill cost the requests that waited for it.
        """
        if batch < 1 or step_seconds <= 0:
            return  # nothing ran, or a clock that did not move: no point the schema can hold
        if prefill_tokens > 0:
            sums = self._prefill.get(bucket := context_bucket(prefill_tokens))
            if sums is None:
                sums = self._prefill[bucket] = _Sums()
            sums.size_total += prefill_tokens
        else:
            key = (batch, context_bucket(context_tokens))
            sums = self._decode.get(key)
            if sums is None:
                sums = self._decode[key] = _Sums()
            sums.size_total += context_tokens
        sums.samples += 1
        sums.seconds_total += step_seconds

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self._decode.values()) + sum(s.samples for s in self._prefill.values())

    def profile(self, model: str, kv_bytes_per_token: int, capacity_bytes: int) -> SpeedProfile | None:
        """The means so far, points sorted by key; None before the first recorded step."""
        if not self._decode and not self._prefill:
            return None
        decode = [DecodePoint(batch=batch, context_tokens=s.size_total / s.samples,
                              step_seconds=s.seconds_total / s.samples, samples=s.samples)
                  for (batch, _), s in sorted(self._decode.items())]
        prefill = [PrefillPoint(tokens=s.size_total / s.samples, step_seconds=s.seconds_total / s.samples,
                                samples=s.samples)
                   for _, s in sorted(self._prefill.items())]
        return SpeedProfile(engine=self.engine, model=model, kv_bytes_per_token=kv_bytes_per_token,
                            capacity_bytes=capacity_bytes, decode=decode, prefill=prefill)
