"""How many prefill workers a disaggregated pool wants (MemServe §5; docs/operator.md "Disaggregated pools").

The decode workers are MELL's, sized by the KV they hold. The prefill workers hold KV only while they
prefill and hand it over, so they are sized by the work waiting for them instead: the prompt tokens
queued on them must be prefilled within the pool's TTFT objective,

    desired = clamp(ceil(queued prefill tokens / (prefill tokens per second x TTFT objective)), min, max).

Pure functions over the workers' reports and the spec; kvfleet.operator.pods.plan_prefill_pods turns
the number into pods (scale-down after autoscaling.scaleDownDelaySeconds, like MELL's workers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet.api.models import LLMPoolSpec
from kvfleet.api.reports import KVLoadReport

# The TTFT objective when the spec sets none (elasticMemory.ttftMilliseconds is the spec's one TTFT
# objective): a second to the first token is what an interactive request tolerates.
DEFAULT_TTFT_S = 1.0
# A prefill speed to plan with before any worker has measured one: deliberately low (a GPU prefills a
# 7B model at tens of thousands of tokens per second; the builtin engine's tiny CPU model at thousands),
# so that an unmeasured pool has too many prefill workers rather than too few, until the first report.
CONSERVATIVE_PREFILL_TOKENS_PER_S = 2000.0


@dataclass(frozen=True)
class PrefillDemand:
    """What the prefill tier's size rests on, read off the reports of one pass."""

    queued_tokens: int  # prompt tokens waiting to be prefilled
    tokens_per_s: float  # one prefill worker's prefill speed
    ttft_s: float  # the objective those tokens must be prefilled within


def ttft_objective_s(spec: LLMPoolSpec) -> float:
    """The pool's TTFT objective in seconds: elasticMemory.ttftMilliseconds, else DEFAULT_TTFT_S."""
    ttft_ms = spec.elastic_memory.ttft_milliseconds
    return DEFAULT_TTFT_S if ttft_ms is None else ttft_ms / 1000.0


def prefill_speed_tokens_per_s(prefill_reports: Iterable[KVLoadReport], decode_reports: Iterable[KVLoadReport]) -> float:
    """One worker's prefill speed: the mean `prefillTokensPerSecond` the prefill workers report, else
    the decode workers' (the same engine and GPUs, measured by their re-prefills as migration
    targets), else CONSERVATIVE_PREFILL_TOKENS_PER_S."""
    for reports in (prefill_reports, decode_reports):
        speeds = [r.prefill_tokens_per_second for r in reports if r.prefill_tokens_per_second]
        if speeds:
            return sum(speeds) / len(speeds)
    return CONSERVATIVE_PREFILL_TOKENS_PER_S


def queued_prefill_tokens(prefill_reports: Iterable[KVLoadReport], decode_reports: Iterable[KVLoadReport],
                          num_live_prefill: int) -> int:
    """The prompt tokens waiting for the prefill tier: the sum the prefill workers report. With no live
    prefill worker (prefillWorkers.min: 0, idle) the decode workers prefill everything, and the prompts
    queued on them are the demand, so the tier wakes from zero instead of staying there."""
    reports = prefill_reports if num_live_prefill > 0 else decode_reports
    return sum(r.queued_prefill_tokens or 0 for r in reports)


def desired_prefill_workers(demand: PrefillDemand, min_workers: int, max_workers: int) -> int:
    """clamp(ceil(queued tokens / (speed x TTFT)), min, max): the fewest workers that prefill what waits
    within the objective, within the spec's bounds."""
    per_worker_tokens = demand.tokens_per_s * demand.ttft_s
    needed = math.ceil(demand.queued_tokens / per_worker_tokens) if per_worker_tokens > 0 else max_workers
    return max(min_workers, min(max_workers, needed))


def demand_of(spec: LLMPoolSpec, prefill_reports: list[KVLoadReport], decode_reports: list[KVLoadReport],
              num_live_prefill: int) -> PrefillDemand:
    """The pool's prefill demand from one pass's reports."""
    return PrefillDemand(queued_prefill_tokens(prefill_reports, decode_reports, num_live_prefill),
                         prefill_speed_tokens_per_s(prefill_reports, decode_reports), ttft_objective_s(spec))


def desired_for_pool(spec: LLMPoolSpec, demand: PrefillDemand) -> int:
    """The pool's desired prefill workers: none in a colocated pool (a pool that stopped being
    disaggregated lets its prefill workers go once idle), else desired_prefill_workers in the spec's bounds."""
    if not spec.disaggregation.enabled:
        return 0
    bounds = spec.disaggregation.prefill_workers
    return desired_prefill_workers(demand, bounds.min, bounds.max)


def kv_transfers(prefill_reports: Iterable[KVLoadReport]) -> int:
    """KV hand-overs from prefill to decode workers: the sum of the prefill workers' counts."""
    return sum(r.kv_transfers or 0 for r in prefill_reports)
