"""One entry point for every policy, and the pure form (snapshot, batch) -> (plan, snapshot).

The operator names a policy in the LLMPool spec (`mell`, `mell-paper`, `best-fit`, `worst-fit`,
`load-balance`); the simulator runs all five. Each lives in a module named after it and reads a
config dataclass of its own (`ClusterPolicy.config_type`): `mell` is kvfleet's default
(mell_default.py), `mell-paper` MELL's Fig. 10 exactly as the paper states it (mell_paper.py), kept
so that the default's gain is always measured against it, and the baselines `bf`, `wf` and `lb`
(best_fit.py, worst_fit.py, load_balance.py); `hpa` (kv_autoscaler.py) is no LLMPool's policy but the
simulator's model of what teams run today, worst-fit under a HorizontalPodAutoscaler on KV usage
(`kvfleet simulate --stack today`). Callers name the policy and give either its config or
its knobs: `make_policy("mell", capacity_bytes=C)`. `plan_epoch` is the core as a pure function of
(snapshot, events) -> plan: no state survives the call, so the operator can rebuild the snapshot from
worker reports after a restart.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvfleet.mell.best_fit import BestFitPolicy
from kvfleet.mell.cluster import ClusterPolicy, PolicyConfig
from kvfleet.mell.kv_autoscaler import KvAutoscalerPolicy
from kvfleet.mell.load_balance import LoadBalancePolicy
from kvfleet.mell.mell_default import MellDefaultPolicy
from kvfleet.mell.mell_paper import MellPaperPolicy
from kvfleet.mell.models import EventBatch, Plan
from kvfleet.mell.state import ClusterSnapshot
from kvfleet.mell.worst_fit import WorstFitPolicy

POLICIES: dict[str, type[ClusterPolicy]] = {
    "mell": MellDefaultPolicy,
    "mell-paper": MellPaperPolicy,
    "bf": BestFitPolicy,
    "wf": WorstFitPolicy,
    "lb": LoadBalancePolicy,
    # Not an LLMPool policy: today's stack in the simulator (kv_autoscaler.py).
    "hpa": KvAutoscalerPolicy,
}
# The LLMPool spec spells the baselines out.
ALIASES = {"best-fit": "bf", "worst-fit": "wf", "load-balance": "lb"}


def policy_class(name: str) -> type[ClusterPolicy]:
    """The policy a user-facing name (or an LLMPool alias) stands for."""
    key = ALIASES.get(name, name)
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join([*POLICIES, *ALIASES])}")
    return POLICIES[key]


def policy_config(name: str, capacity_bytes: int, **knobs: Any) -> PolicyConfig:
    """The config `name` runs with: its own config dataclass with these knobs, the rest at their
    defaults (a knob the policy does not have is a TypeError)."""
    return policy_class(name).config_type(capacity_bytes=capacity_bytes, **knobs)


def make_policy(name: str, config: PolicyConfig | None = None, **knobs: Any) -> ClusterPolicy:
    """A fresh policy by name: `make_policy("mell", capacity_bytes=C)`, or with a config.

    `config` is the policy's own (`policy_config`), or a plain PolicyConfig, which carries only what
    every policy shares: the policy's own knobs then take their defaults. `knobs` override fields of
    either. A config of another policy is refused: its knobs would be silently dropped.
    """
    cls = policy_class(name)
    if config is None:
        return cls(cls.config_type(**knobs))
    if type(config) is PolicyConfig and cls.config_type is not PolicyConfig:
        config = cls.config_type(**{f.name: getattr(config, f.name) for f in dataclasses.fields(PolicyConfig)})
    if not isinstance(config, cls.config_type):
        raise TypeError(f"policy {name!r} takes a {cls.config_type.__name__}, not a {type(config).__name__}")
    return cls(dataclasses.replace(config, **knobs) if knobs else config)


def plan_epoch(
    policy_name: str, config: PolicyConfig, snapshot: ClusterSnapshot, batch: EventBatch
) -> tuple[Plan, ClusterSnapshot]:
    """Pure: the same (policy, config, snapshot, batch) always gives the same plan and next snapshot."""
    policy = make_policy(policy_name, config)
    policy.restore(snapshot)
    plan = policy.schedule(batch)
    return plan, policy.snapshot()
