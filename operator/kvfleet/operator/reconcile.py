"""Level-triggered decisions for one pool: which worker pods to create or delete, and what status to show.

Pure functions of (pool, spec, observed pods, now) so every branch is unit-tested without a cluster;
`kvfleet.operator.handlers` does the reads and writes around them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet.api.models import LLMPoolSpec
from kvfleet.operator.resources import worker_index, worker_selector

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "WaitingForCapacity")


@dataclass(frozen=True)
class WorkerChanges:
    """What to do with worker pods: create these indexes, delete these pod names."""

    create_indexes: tuple[int, ...]
    delete_names: tuple[str, ...]


def is_live(pod: dict[str, Any]) -> bool:
    """A pod that counts as a worker: not being deleted and not finished."""
    return not pod["metadata"].get("deletionTimestamp") and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed")


def pod_condition(pod: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


def is_ready(pod: dict[str, Any]) -> bool:
    return is_live(pod) and pod_condition(pod, "Ready").get("status") == "True"


def unschedulable_reason(pod: dict[str, Any]) -> str:
    """The scheduler's message for a pod it could not place, or "" when it is placed or not yet tried."""
    cond = pod_condition(pod, "PodScheduled")
    if cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
        return str(cond.get("message", "no node fits"))
    return ""


def desired_workers(spec: LLMPoolSpec) -> int:
    """The floor the pool asks for: workers.min, raised by `kubectl scale` (spec.replicas), capped by max."""
    return min(spec.workers.max, max(spec.workers.min, spec.replicas or 0))


def plan_workers(pods: list[dict[str, Any]], desired: int) -> WorkerChanges:
    """Create or delete workers so `desired` live ones exist; finished pods are replaced.

    New workers get indexes above every existing one, so index order is activation order. Scale-down
    removes the most recently activated workers first (MELL terminates from the back of that order).
    """
    indexed = [(worker_index(p["metadata"]["name"]), p) for p in pods]
    known = [(i, p) for i, p in indexed if i is not None]
    live = sorted((i, p["metadata"]["name"]) for i, p in known if is_live(p))
    finished = tuple(p["metadata"]["name"] for _, p in known
                     if not p["metadata"].get("deletionTimestamp") and p.get("status", {}).get("phase") in ("Succeeded", "Failed"))
    next_index = max((i for i, _ in known), default=-1) + 1
    if len(live) < desired:
        return WorkerChanges(tuple(range(next_index, next_index + desired - len(live))), finished)
    excess = [name for _, name in live[desired:]]
    return WorkerChanges((), finished + tuple(reversed(excess)))


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def pool_status(pool: dict[str, Any], spec: LLMPoolSpec, pods: list[dict[str, Any]], now: str) -> dict[str, Any]:
    """The status subresource: counts, conditions with reasons, the selector for `/scale`."""
    name = pool["metadata"]["name"]
    live = [p for p in pods if is_live(p)]
    ready = [p for p in live if is_ready(p)]
    desired = desired_workers(spec)
    pending = [(p["metadata"]["name"], reason) for p in live if (reason := unschedulable_reason(p))]
    crashing = sorted(
        p["metadata"]["name"]
        for p in pods
        if p.get("status", {}).get("phase") == "Failed"
        or any((s.get("state") or {}).get("waiting", {}).get("reason") == "CrashLoopBackOff"
               for s in p.get("status", {}).get("containerStatuses") or [])
    )
    all_ready = len(ready) >= desired
    conditions = [
        _condition("Ready", all_ready, ("WorkersReady" if desired else "ScaledToZero") if all_ready else "WorkersNotReady",
                   f"{len(ready)}/{desired} workers ready"),
        _condition("Progressing", len(live) != desired or len(ready) < len(live),
                   "ScalingUp" if len(live) < desired else "ScalingDown" if len(live) > desired
                   else "WaitingForWorkers" if len(ready) < len(live) else "Stable",
                   f"{len(live)} workers, {desired} desired, {len(ready)} ready"),
        _condition("Degraded", bool(crashing), "WorkersCrashing" if crashing else "AsExpected",
                   f"crashing or failed: {', '.join(crashing)}" if crashing else "no worker is failing"),
        _condition("WaitingForCapacity", bool(pending), "WorkersUnschedulable" if pending else "CapacityAvailable",
                   f"{len(pending)} worker pod(s) pending: {pending[0][1]}" if pending else "every worker pod is scheduled"),
    ]
    previous = {c.get("type"): c for c in (pool.get("status") or {}).get("conditions") or []}
    generation = pool["metadata"].get("generation")
    for cond in conditions:
        before = previous.get(cond["type"], {})
        cond["lastTransitionTime"] = before.get("lastTransitionTime", now) if before.get("status") == cond["status"] else now
        cond["observedGeneration"] = generation
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "workers": len(live),
        "readyWorkers": len(ready),
        "desiredWorkers": desired,
        "selector": worker_selector(name),
    }
