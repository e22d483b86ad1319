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
from kvfleet.mell.cluster import PolicyConfig
from kvfleet.mell.mell_default import MellDefaultConfig
from kvfleet.mell.mell_paper import MellPaperConfig
from kvfleet.mell.policy import policy_config


def scheduler_config(spec: LLMPoolSpec) -> PolicyConfig:
    """The config of the pool's policy (spec.scheduling.policy), with the knobs the spec sets for it.

    `mell-paper`: the spec's two weights scale the defaults of MELL's GPU priority (§VI-C):
    workloadWeight the free-memory and request-count terms, distanceWeight the same-node and same-zone
    bonuses; 1.0 keeps the defaults and 0 turns that part off. `mell`: a TPOT objective (slo) becomes
    its load cap, and it plans within the pool's communication boundary. The baselines take C only.
    """
    policy = spec.scheduling.policy
    capacity_bytes = spec.kv_capacity_per_worker_bytes()
    if policy == "mell-paper":
        workload, distance = spec.scheduling.workload_weight, spec.scheduling.distance_weight
        paper = MellPaperConfig(capacity_bytes=capacity_bytes)
        return dataclasses.replace(
            paper,
            weight_free=paper.weight_free * workload,
            weight_requests=paper.weight_requests * workload,
            weight_same_node=paper.weight_same_node * distance,
            weight_same_zone=paper.weight_same_zone * distance,
        )
    if policy == "mell":
        cap = spec.tpot_load_cap()
        # The §V communication boundary of one epoch, as the operator's migration planner uses it
        # (kvfleet.operator.migrations): the default policy plans only moves within it.
        link_bytes = int(quantity_bytes(spec.migration.communication_boundary_bytes_per_second)
                         * spec.scheduling.epoch_seconds)
        return MellDefaultConfig(
            capacity_bytes=capacity_bytes,
            max_load_bytes=None if cap is None else cap[0],
            load_bytes_per_request=0 if cap is None else cap[1],
            intra_node_move_budget_bytes=link_bytes,
            inter_node_move_budget_bytes=link_bytes,
        )
    return policy_config(policy, capacity_bytes)
