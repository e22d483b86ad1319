"""What a pool's status says, and the readings of worker pods it rests on.

`pool_status` turns (pool, spec, observed pods, the last epoch's figures, now) into the status
subresource: counts, conditions with reasons, the selector for `/scale`. `is_live`, `is_ready` and
`unschedulable_reason` read a pod's state, `floor_workers` is the pool's floor (workers.min raised by
`kubectl scale`). In a disaggregated pool the worker counts are the decode workers' (MELL's GPUs) and
the prefill workers are counted apart. Which pods to create, bind or delete is `kvfleet.operator.pods`. Pure functions, so
every branch is unit-tested without a cluster; `kvfleet.operator.reconcile` does the reads and writes around them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet.api.models import HELD_FRESH_S, HELD_REQUESTS_ANNOTATION, LLMPoolSpec
from kvfleet.operator.resources import is_prefill_pod, scaled_selector


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


def floor_workers(spec: LLMPoolSpec, held_requests: int = 0) -> int:
    """Workers kept even when idle: workers.min, raised by `kubectl scale` (spec.replicas), and to one
    while the router holds requests for want of a Ready worker (a pool scaled to zero wakes); capped by max."""
    return min(spec.workers.max, max(spec.workers.min, spec.replicas or 0, 1 if held_requests > 0 else 0))


def held_requests(pool: dict[str, Any], now_unix_s: float, fresh_s: float = HELD_FRESH_S) -> int:
    """The requests the pool's router says it holds (its HELD_ANNOTATION, "<count> <unix seconds>"),
    or 0 when it said so more than `fresh_s` ago (a router that died leaves no demand behind) or
    wrote nothing readable."""
    text = ((pool.get("metadata") or {}).get("annotations") or {}).get(HELD_REQUESTS_ANNOTATION, "")
    try:
        count_text, when_text = text.split()
        count, when_s = int(count_text), float(when_text)
    except ValueError:
        return 0
    return max(0, count) if now_unix_s - when_s <= fresh_s else 0


@dataclass(frozen=True)
class SchedulingFigures:
    """What the last epoch decided, for the status."""

    gpus_in_use: int = 0
    lower_bound_gpus: int = 0
    used_bytes: int = 0
    migrations_in_flight: int = 0
    waiting_for_max: int = 0
    # The KV capacity per worker the epoch planned with (the workers' reports, else the spec's), and
    # the KV the workers parked in their CPU buffers.
    capacity_bytes: int | None = None
    cpu_buffer_bytes: int = 0
    # Requests the router holds for want of a Ready worker, and when they woke the pool (this pass).
    held_requests: int = 0
    woken_at: str | None = None
    # A disaggregated pool's prefill workers (kvfleet.operator.prefill): how many it wants, and the KV
    # hand-overs its prefill workers report.
    desired_prefill_workers: int = 0
    kv_transfers: int = 0


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def pool_status(pool: dict[str, Any], spec: LLMPoolSpec, pods: list[dict[str, Any]], figures: SchedulingFigures,
                now: str, router_ready: bool | None = None) -> dict[str, Any]:
    """The status subresource: counts, conditions with reasons, the selector for `/scale`. Conditions
    weigh both tiers of a disaggregated pool: Ready needs enough decode and prefill workers Ready."""
    name = pool["metadata"]["name"]
    live = [p for p in pods if is_live(p) and not is_prefill_pod(p)]
    ready = [p for p in live if is_ready(p)]
    desired = min(spec.workers.max, max(floor_workers(spec, figures.held_requests), figures.gpus_in_use))
    live_prefill = [p for p in pods if is_live(p) and is_prefill_pod(p)]
    ready_prefill = [p for p in live_prefill if is_ready(p)]
    desired_prefill = figures.desired_prefill_workers
    pending = [(p["metadata"]["name"], reason) for p in live + live_prefill if (reason := unschedulable_reason(p))]
    if figures.waiting_for_max:
        pending.append(("", f"{figures.waiting_for_max} more GPU(s) needed but workers.max={spec.workers.max} is reached"))
    crashing = sorted(
        p["metadata"]["name"]
        for p in pods
        if p.get("status", {}).get("phase") == "Failed"
        or any((s.get("state") or {}).get("waiting", {}).get("reason") == "CrashLoopBackOff"
               for s in p.get("status", {}).get("containerStatuses") or [])
    )
    all_ready = len(ready) >= desired and len(ready_prefill) >= desired_prefill
    # A colocated pool has no prefill tier (none live, none desired): then these say what they always did.
    prefill_shown = spec.disaggregation.enabled or bool(live_prefill)
    scaling_up = len(live) < desired or len(live_prefill) < desired_prefill
    scaling_down = len(live) > desired or len(live_prefill) > desired_prefill
    starting = len(ready) < len(live) or len(ready_prefill) < len(live_prefill)
    conditions = [
        _condition("Ready", all_ready, ("WorkersReady" if desired else "ScaledToZero") if all_ready else "WorkersNotReady",
                   f"{len(ready)}/{desired} workers ready"
                   + (f", {len(ready_prefill)}/{desired_prefill} prefill workers ready" if prefill_shown else "")),
        _condition("Progressing", scaling_up or scaling_down or starting,
                   ("WakingUp" if figures.held_requests and not ready else "ScalingUp") if scaling_up
                   else "ScalingDown" if scaling_down
                   else "WaitingForWorkers" if starting else "Stable",
                   f"{len(live)} workers, {desired} desired, {len(ready)} ready"
                   + (f"; {len(live_prefill)} prefill workers, {desired_prefill} desired, {len(ready_prefill)} ready"
                      if prefill_shown else "")),
        _condition("Degraded", bool(crashing), "WorkersCrashing" if crashing else "AsExpected",
                   f"crashing or failed: {', '.join(crashing)}" if crashing else "no worker is failing"),
        _condition("WaitingForCapacity", bool(pending),
                   ("MaxWorkersReached" if figures.waiting_for_max else "WorkersUnschedulable") if pending else "CapacityAvailable",
                   _waiting_message(pending) if pending else "every worker pod is scheduled"),
    ]
    if router_ready is not None:
        conditions.append(_condition("RouterReady", router_ready, "RouterAvailable" if router_ready else "RouterNotReady",
                                     f"the Service {name}-router has {'a' if router_ready else 'no'} Ready router"))
    previous = {c.get("type"): c for c in (pool.get("status") or {}).get("conditions") or []}
    generation = pool["metadata"].get("generation")
    for cond in conditions:
        before = previous.get(cond["type"], {})
        cond["lastTransitionTime"] = before.get("lastTransitionTime", now) if before.get("status") == cond["status"] else now
        cond["observedGeneration"] = generation
    capacity_bytes = figures.capacity_bytes or spec.kv_capacity_per_worker_bytes()
    active_bytes = figures.gpus_in_use * capacity_bytes
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "workers": len(live),
        "readyWorkers": len(ready),
        "desiredWorkers": desired,
        "prefillWorkers": len(live_prefill),
        "readyPrefillWorkers": len(ready_prefill),
        "desiredPrefillWorkers": desired_prefill,
        "kvTransfers": figures.kv_transfers,
        "gpusInUse": figures.gpus_in_use,
        "lowerBoundGpus": figures.lower_bound_gpus,
        "kvUtilizationPercent": min(100, round(100 * figures.used_bytes / active_bytes)) if active_bytes else 0,
        "migrationsInFlight": figures.migrations_in_flight,
        "kvCapacityPerWorkerBytes": capacity_bytes,
        "cpuBufferBytes": figures.cpu_buffer_bytes,
        "heldRequests": figures.held_requests,
        **({"lastWokenAt": woke} if (woke := figures.woken_at or (pool.get("status") or {}).get("lastWokenAt")) else {}),
        "selector": scaled_selector(name, spec),
    }


def _waiting_message(pending: list[tuple[str, str]]) -> str:
    unschedulable = [reason for pod, reason in pending if pod]
    if not unschedulable:
        return pending[0][1]
    return f"{len(unschedulable)} worker pod(s) pending: {unschedulable[0]}"
