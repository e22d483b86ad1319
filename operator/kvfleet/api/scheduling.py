"""From an LLMPool's spec to the scheduling core's knobs: the one mapping, for the operator and the router.

The operator runs MELL every epoch and the router runs MELL's Allocate for each request it places
between epochs (kvfleet.mell.allocate); both must rank GPUs with the pool's weights, or the router
places requests where the next epoch moves them from. The router may import kvfleet.api and
kvfleet.mell but not kvfleet.operator, so the mapping lives here, beside the spec it reads.
"""

from __future__ import annotations

import dataclasses

from kvfleet.api.models import LLMPoolSpec
from kvfleet.api.quantity import quantity_bytes
from kvfleet.mell.cluster import SchedulerConfig


def scheduler_config(spec: LLMPoolSpec) -> SchedulerConfig:
    """The pool's MELL knobs. The spec's two weights scale the defaults of MELL's GPU priority (§VI-C):
    workloadWeight the free-memory and request-count terms, distanceWeight the same-node and same-zone
    bonuses; 1.0 keeps the defaults and 0 turns that part off. A TPOT objective (slo) becomes the
    default policy's load cap."""
    base = SchedulerConfig(capacity_bytes=spec.kv_capacity_per_worker_bytes())
    workload, distance = spec.scheduling.workload_weight, spec.scheduling.distance_weight
    cap = spec.tpot_load_cap()
    # The §V communication boundary of one epoch, as the operator's migration planner uses it
    # (kvfleet.operator.migrations): the default policy plans only moves within it.
    link_bytes = int(quantity_bytes(spec.migration.communication_boundary_bytes_per_second)
                     * spec.scheduling.epoch_seconds)
    return dataclasses.replace(
        base,
        weight_free=base.weight_free * workload,
        weight_requests=base.weight_requests * workload,
        weight_same_node=base.weight_same_node * distance,
        weight_same_zone=base.weight_same_zone * distance,
        max_load_bytes=None if cap is None else cap[0],
        load_bytes_per_request=0 if cap is None else cap[1],
        intra_node_move_budget_bytes=link_bytes,
        inter_node_move_budget_bytes=link_bytes,
    )
