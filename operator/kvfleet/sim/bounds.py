"""The least KV any policy can hold for a workload: the bound every run's GPUs are compared with.

Each run also reports its own fluid bound (the KV that run held, RunResult.lower_bound); that one
depends on how fast the run's GPUs decoded, so it cannot compare policies. `shared_bound` is
computed from the workload alone, in closed form, and is the same beside every policy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet.sim.prefix_cache import PrefixCacheSpec
from kvfleet.sim.speed_model import Setup
from kvfleet.sim.traces import TraceRequest


@dataclass(frozen=True)
class SharedBound:
    """The least KV any policy can hold for a workload: the same for every policy of a scenario.

    Every request is taken to be placed at the first epoch end after it arrives (the scheduler's
    first chance, for every policy), to hold its prompt from then, and to decode at an unloaded GPU's
    speed (`step_s(1, 0)` per token) from then or from its arrival plus its own prefill, whichever is
    later, holding its prompt and the tokens written so far (whole tokens). No policy places a request
    earlier or decodes it faster, so no policy holds less KV-time.
    `gpu_hours` (KV-seconds / C) bounds every policy's active and billed GPU-hours; `peak` (the
    largest ceil(KV / C) at an epoch end along that trajectory) is a reference, not a strict bound
    (a policy's requests run later, so its peak may fall at other times).
    """

    kv_byte_seconds: float = 0.0
    duration_s: float = 0.0
    capacity_bytes: int = 0
    peak: int = 0

    @property
    def gpu_hours(self) -> float:
        return self.kv_byte_seconds / self.capacity_bytes / 3600.0 if self.capacity_bytes else 0.0

    @property
    def mean(self) -> float:
        """GPUs on average over the workload's own span (until its last request would finish)."""
        return self.kv_byte_seconds / (self.capacity_bytes * self.duration_s) if self.duration_s else 0.0


def shared_bound(requests: Iterable[TraceRequest], setup: Setup, epoch_s: float,
                 prefix_cache: PrefixCacheSpec | None = None) -> SharedBound:
    """The workload-only bound (see `SharedBound`), in closed form per request.

    With a prefix cache, a request may find every block its `hash_ids` cover cached, so the bound
    prefills only the rest (at least 1 token, as a replay does): still no run decodes it sooner.

    A request with prompt P and output N is placed at ta, the first epoch end after its arrival, and
    holds P tokens until it starts decoding at t0 = max(ta, arrival + prefill(P)); it then writes one
    token every s = step_s(1, 0): during its j-th step (j = 0 .. N-1) it holds P + j tokens, so it
    holds bytes_per_token x (P x (t0 - ta) + s x (N x P + N x (N - 1) / 2)) byte-seconds, and
    releases its KV at t0 + N x s.
    """
    step = setup.step_s(1, 0)
    bpt = setup.kv_bytes_per_token
    kv_byte_seconds = 0.0
    end_s = 0.0
    at_epoch: dict[int, int] = {}  # KV bytes held at the end of epoch k (time k x epoch_s)
    for req in requests:
        n, p = req.output_tokens, req.prompt_tokens
        k = math.floor(req.arrival_s / epoch_s) + 1  # admitted at the end of the epoch it arrives in
        placed_s = k * epoch_s
        prefill_tokens = p if prefix_cache is None else max(1, p - req.hashed_tokens(prefix_cache.hash_block_tokens))
        t0 = max(placed_s, req.arrival_s + setup.prefill_s(prefill_tokens))
        t1 = t0 + n * step
        end_s = max(end_s, t1, placed_s)
        kv_byte_seconds += bpt * (p * (t0 - placed_s) + step * (n * p + n * (n - 1) / 2))
        while k * epoch_s < t1 or k * epoch_s == placed_s:
            written = max(0, min(n - 1, math.floor((k * epoch_s - t0) / step)))
            at_epoch[k] = at_epoch.get(k, 0) + (p + written) * bpt
            k += 1
    c = setup.capacity_bytes
    peak = max((math.ceil(kv / c) for kv in at_epoch.values()), default=0)
    duration_s = math.ceil(end_s / epoch_s) * epoch_s if end_s > 0 else 0.0
    return SharedBound(kv_byte_seconds, duration_s, c, peak)
