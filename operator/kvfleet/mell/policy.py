"""One entry point for every policy, and the pure form (snapshot, batch) -> (plan, snapshot).

The operator names a policy in the LLMPool spec (`mell`, `mell-paper`, `best-fit`, `worst-fit`,
`load-balance`); the simulator runs all five. `mell` is kvfleet's default (fleet.py), `mell-paper`
MELL's Fig. 10 exactly as the paper states it (mell.py with every kvfleet refinement off), kept so
that the default's gain is always measured against it. `plan_epoch` is the core as a pure function of
(snapshot, events) -> plan: no state survives the call, so the operator can rebuild the snapshot from
worker reports after a restart.
"""

from __future__ import annotations

import dataclasses

from kvfleet.mell.baselines import BestFitPolicy, LoadBalancePolicy, WorstFitPolicy
from kvfleet.mell.cluster import ClusterPolicy, SchedulerConfig
from kvfleet.mell.fleet import FleetPolicy
from kvfleet.mell.mell import MellPolicy
from kvfleet.mell.models import EventBatch, Plan
from kvfleet.mell.state import ClusterSnapshot

POLICIES: dict[str, type[ClusterPolicy]] = {
    "mell": FleetPolicy,
    "mell-paper": MellPolicy,
    "bf": BestFitPolicy,
    "wf": WorstFitPolicy,
    "lb": LoadBalancePolicy,
}
ALIASES = {"best-fit": "bf", "worst-fit": "wf", "load-balance": "lb"}


def paper_strict(config: SchedulerConfig) -> SchedulerConfig:
    """`config` with MellPolicy's kvfleet refinements (mell.py) all off: Fig. 10 as written."""
    return dataclasses.replace(config, refill_underfilled_t=False, refill_source_max_fill=1.0, t_on_sm_gpus=False,
                               growth_headroom_fraction=0.0)


def make_policy(name: str, config: SchedulerConfig) -> ClusterPolicy:
    key = ALIASES.get(name, name)
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join([*POLICIES, *ALIASES])}")
    if key == "mell-paper":
        config = paper_strict(config)
    return POLICIES[key](config)


def plan_epoch(
    policy_name: str, config: SchedulerConfig, snapshot: ClusterSnapshot, batch: EventBatch
) -> tuple[Plan, ClusterSnapshot]:
    """Pure: the same (policy, config, snapshot, batch) always gives the same plan and next snapshot."""
    policy = make_policy(policy_name, config)
    policy.restore(snapshot)
    plan = policy.schedule(batch)
    return plan, policy.snapshot()
