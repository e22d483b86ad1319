"""MELL: the pure KV-cache scheduling core (papers/mell.txt). No kubernetes, kopf, torch, vllm or triton.

`make_policy(name, SchedulerConfig(capacity_bytes=C))` gives MELL or a baseline; `policy.schedule(batch)`
turns one epoch of events into a Plan. `plan_epoch` is the same as a pure function of a snapshot, and
`allocate_one` is MELL's Allocate for one new request on a snapshot (what the router calls).
"""

from kvfleet.mell.allocate import AllocateDecision, GpuLoad, allocate_one, cluster_snapshot
from kvfleet.mell.cluster import ClusterPolicy, SchedulerConfig
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
    kv_capacity_bytes,
    size_class,
)
from kvfleet.mell.policy import POLICIES, make_policy, plan_epoch
from kvfleet.mell.state import ClusterSnapshot

__all__ = [
    "POLICIES",
    "AllocateDecision",
    "Arrive",
    "ClusterPolicy",
    "ClusterSnapshot",
    "EventBatch",
    "Finish",
    "GpuLoad",
    "Grow",
    "Migration",
    "Placement",
    "Plan",
    "SchedulerConfig",
    "SizeClass",
    "Span",
    "allocate_one",
    "cluster_snapshot",
    "kv_capacity_bytes",
    "make_policy",
    "plan_epoch",
    "size_class",
]
