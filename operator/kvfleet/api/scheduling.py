"""From an LLMPool's spec to the scheduling core's knobs: the one mapping, for the operator and the router.

The operator runs MELL every epoch and the router runs MELL's Allocate for each request it places
between epochs (kvfleet.mell.allocate); both must rank GPUs with the pool's weights, or the router
places requests where the next epoch moves them from. The router may import kvfleet.api and
kvfleet.mell but not kvfleet.operator, so the mapping lives here, beside the spec it reads.
"""

from __future__ import annotations

import dataclasses

from kvfleet.api.models import LLMPoolSpec
from kvfleet.mell.cluster import SchedulerConfig


def scheduler_config(spec: LLMPoolSpec) -> SchedulerConfig:
    """The pool's MELL knobs. The spec's two weights scale the defaults of MELL's GPU priority (§VI-C):
    workloadWeight the free-memory and request-count terms, distanceWeight the same-node and same-zone
    bonuses; 1.0 keeps the defaults and 0 turns that part off."""
    base = SchedulerConfig(capacity_bytes=spec.kv_capacity_per_worker_bytes())
    workload, distance = spec.scheduling.workload_weight, spec.scheduling.distance_weight
    return dataclasses.replace(
        base,
        weight_free=base.weight_free * workload,
        weight_requests=base.weight_requests * workload,
        weight_same_node=base.weight_same_node * distance,
        weight_same_zone=base.weight_same_zone * distance,
    )
