"""MELL: the pure KV-cache scheduling core (papers/mell.txt). No kubernetes, kopf, torch, vllm or triton.

`make_policy(name, SchedulerConfig(capacity_bytes=C))` gives MELL or a baseline; `policy.schedule(batch)`
turns one epoch of events into a Plan. `plan_epoch` is the same as a pure function of a snapshot.
"""

from kvfleet.mell.cluster import ClusterPolicy, ClusterSnapshot, SchedulerConfig
from kvfleet.mell.models import (
    Arrive,
    EventBatch,
    Finish,
    Grow,
    Migration,
    Placement,
    Plan,
    SizeClass,
    Span,
    size_class,
)
from kvfleet.mell.policy import POLICIES, make_policy, plan_epoch

__all__ = [
    "POLICIES",
    "Arrive",
    "ClusterPolicy",
    "ClusterSnapshot",
    "EventBatch",
    "Finish",
    "Grow",
    "Migration",
    "Placement",
    "Plan",
    "SchedulerConfig",
    "SizeClass",
    "Span",
    "make_policy",
    "plan_epoch",
    "size_class",
]
