"""Which worker pods to create, bind, release or delete after an epoch, and what their metadata says.

Pure decisions over the observed pods and the epoch's outcome (kvfleet.operator.epoch). A worker pod
is either bound to a scheduler GPU (label `kvfleet.dev/gpu-id`) or unbound: kept warm by the pool's
floor (workers.min, `kubectl scale`) or waiting out the scale-down delay. A pod is deleted only when
it holds no request, lends no KV blocks (DistKV) and no migration is heading to it, so a worker holding live KV is never deleted;
the autoscaler annotations say the same to the cluster autoscaler and Karpenter. A disaggregated
pool's prefill workers are never MELL's workers (`pod_info` leaves them out); `prefill_pod_info` reads
them for kvfleet.operator.prefill, which scales them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.api.reports import KVLoadReport
from kvfleet.operator.resources import GPU_LABEL, IDLE_SINCE_ANNOTATION, is_prefill_pod, prefill_index, worker_index
from kvfleet.operator.status import is_live, is_ready

SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class PodInfo:
    name: str
    index: int
    gpu_id: str | None
    ready: bool
    live: bool
    deleting: bool
    used_bytes: int
    num_requests: int
    idle_since_s: float | None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    # KV blocks it lends to other workers' requests (DistKV): its debtors read them every step, so a
    # lending pod holds KV cache as much as one running requests does.
    lent_bytes: int = 0
    # Prompt tokens waiting to be prefilled on it (disaggregated pools): work it has taken on.
    queued_prefill_tokens: int = 0

    @property
    def holding(self) -> bool:
        """Whether it holds live KV cache or work: its own requests, blocks it lent, prompts queued to prefill."""
        return self.num_requests > 0 or self.lent_bytes > 0 or self.queued_prefill_tokens > 0


def pod_info(pod: dict[str, Any], report: KVLoadReport | None) -> PodInfo | None:
    """The operator's view of one of MELL's worker pods with its KV-load report, if it has one yet (None
    for a pod that is not one of the pool's MELL workers: a prefill worker is not)."""
    if is_prefill_pod(pod):
        return None
    return _info(pod, report, worker_index(pod["metadata"]["name"]))


def prefill_pod_info(pod: dict[str, Any], report: KVLoadReport | None) -> PodInfo | None:
    """The operator's view of one prefill worker of a disaggregated pool (None for any other pod)."""
    if not is_prefill_pod(pod):
        return None
    return _info(pod, report, prefill_index(pod["metadata"]["name"]))


def _info(pod: dict[str, Any], report: KVLoadReport | None, index: int | None) -> PodInfo | None:
    meta = pod["metadata"]
    if index is None:
        return None
    annotations = dict(meta.get("annotations") or {})
    idle = annotations.get(IDLE_SINCE_ANNOTATION)
    try:
        idle_since_s = float(idle) if idle else None
    except ValueError:
        idle_since_s = None
    return PodInfo(
        name=meta["name"],
        index=index,
        gpu_id=(meta.get("labels") or {}).get(GPU_LABEL),
        ready=is_ready(pod),
        live=is_live(pod),
        deleting=bool(meta.get("deletionTimestamp")),
        used_bytes=report.used_bytes if report else 0,
        num_requests=len(report.requests) if report else 0,
        idle_since_s=idle_since_s,
        labels=dict(meta.get("labels") or {}),
        annotations=annotations,
        lent_bytes=(report.lent_bytes or 0) if report else 0,
        queued_prefill_tokens=(report.queued_prefill_tokens or 0) if report else 0,
    )


@dataclass(frozen=True)
class PodActions:
    create: tuple[tuple[int, str | None], ...]  # (pod index, GPU to bind or None for a floor pod)
    delete: tuple[str, ...]
    # pod name -> label/annotation values to set (None removes); only pods whose metadata changes
    metadata: Mapping[str, tuple[Mapping[str, str | None], Mapping[str, str | None]]]
    waiting_for_max: tuple[str, ...]  # GPUs MELL wants that workers.max does not allow
    create_prefill: tuple[int, ...] = ()  # prefill worker indices to create (kvfleet.operator.prefill)


def plan_pods(
    pods: Iterable[PodInfo],
    *,
    unserved_gpu_ids: Iterable[str],
    released_pods: Iterable[str],
    migration_targets: Iterable[str],
    moving: Iterable[str] = (),
    routed: Iterable[str] = (),
    floor: int,
    max_workers: int,
    scale_down_delay_s: float,
    now_s: float,
) -> PodActions:
    pods = sorted(pods, key=lambda p: p.index)
    live = [p for p in pods if p.live]
    released = set(released_pods)
    # A pod in the routing table may get a request at any moment: it counts as busy, and its idle
    # clock starts only when it leaves the table, so a router's table is never older than the
    # scale-down delay when the pod goes.
    targets = set(migration_targets)
    routed_pods = set(routed)
    gpu_of = {p.name: (None if p.name in released else p.gpu_id) for p in live}
    next_index = max((p.index for p in pods), default=-1) + 1
    create, waiting = _bind_or_create(live, gpu_of, unserved_gpu_ids, next_index, floor, max_workers)
    num_live = len(live) + len(create)

    # Scale down: unbound, empty, not a migration target, idle for the delay; newest first, to the floor.
    delete = [p.name for p in pods if not p.live and not p.deleting]
    removable = [p for p in reversed(live) if gpu_of[p.name] is None and not p.holding and p.name not in targets
                 and p.name not in routed_pods]
    for pod in removable:
        if num_live <= floor:
            break
        since = pod.idle_since_s
        if since is not None and now_s - since >= scale_down_delay_s:
            delete.append(pod.name)
            num_live -= 1

    in_moves = set(moving)
    metadata = {pod.name: changes for pod in live if pod.name not in delete
                and (changes := _metadata_changes(pod, gpu_of[pod.name], routed_pods, now_s, pod.name in in_moves))}
    return PodActions(tuple(create), tuple(delete), _within_cost_refreshes(metadata, live), tuple(waiting))


def _within_cost_refreshes(metadata: dict[str, tuple[dict[str, str | None], dict[str, str | None]]],
                           live: Iterable[PodInfo]) -> dict[str, tuple[dict[str, str | None], dict[str, str | None]]]:
    """At most COST_REFRESHES_PER_PASS pods whose deletion cost only moves between two non-zero steps
    (a holding pod's KV crossing a power of two) are rewritten a pass, the most out of date first.

    Under churn about half of a busy pool's pods cross a step every epoch (a worker's KV straddles a
    power of two), and rewriting them was nearly all of the operator's pod writes: ~500 a pass at
    1,000 workers (bench/report_scale.py, docs/scale.md). Every other change (a GPU label, emptied or
    holding, the autoscaler annotations, the idle clock) is written at once; the ranking among holding
    pods converges over a few passes, which is all its readers need (docs/autoscaling.md)."""
    written = {p.name: p.annotations.get(DELETION_COST) for p in live}

    def refresh_only(name: str) -> int | None:
        """How far a holding pod's cost moves, when that is its only change of cost state."""
        new, old = metadata[name][1].get(DELETION_COST), written.get(name)
        if new is None or old is None or not old.isdigit() or int(old) == 0 or int(new) == 0:
            return None
        return abs(int(new) - int(old))

    refreshes = sorted((-gap, name) for name in metadata if (gap := refresh_only(name)) is not None)
    kept: dict[str, tuple[dict[str, str | None], dict[str, str | None]]] = {}
    deferred = {name for _, name in refreshes[COST_REFRESHES_PER_PASS:]}
    for name, (labels, notes) in metadata.items():
        if name in deferred:
            notes = {k: v for k, v in notes.items() if k != DELETION_COST}
        if labels or notes:
            kept[name] = (labels, notes)
    return kept


def plan_prefill_pods(pods: Iterable[PodInfo], *, desired: int, scale_down_delay_s: float, now_s: float) -> PodActions:
    """A disaggregated pool's prefill workers toward `desired` (kvfleet.operator.prefill): new ones at
    the next index; above it, the highest-index pod that has been idle (no request, no prompt queued)
    for the scale-down delay goes first, one whose report says it is busy never. Finished pods go.
    Their autoscaler annotations and idle clock as MELL's workers' (no GPU to bind)."""
    pods = sorted(pods, key=lambda p: p.index)
    live = [p for p in pods if p.live]
    next_index = max((p.index for p in pods), default=-1) + 1
    create = tuple(range(next_index, next_index + max(0, desired - len(live))))
    delete = [p.name for p in pods if not p.live and not p.deleting]
    num_live = len(live)
    for pod in reversed(live):
        if num_live <= desired:
            break
        since = pod.idle_since_s
        if not pod.holding and since is not None and now_s - since >= scale_down_delay_s:
            delete.append(pod.name)
            num_live -= 1
    metadata = {pod.name: changes for pod in live
                if pod.name not in delete and (changes := _metadata_changes(pod, None, set(), now_s))}
    return PodActions((), tuple(delete), metadata, (), create)


def merged(first: PodActions, second: PodActions) -> PodActions:
    """Both plans' actions (they name different pods: MELL's workers, and a disaggregated pool's prefill workers)."""
    return PodActions(first.create + second.create, first.delete + second.delete, {**first.metadata, **second.metadata},
                      first.waiting_for_max + second.waiting_for_max, first.create_prefill + second.create_prefill)


def _bind_or_create(live: list[PodInfo], gpu_of: dict[str, str | None], unserved_gpu_ids: Iterable[str], next_index: int,
                    floor: int, max_workers: int) -> tuple[list[tuple[int, str | None]], list[str]]:
    """Newly needed GPUs: a warm unbound pod first (ready ones, oldest first), else a new pod; then
    new pods up to the floor. Binds in `gpu_of`; returns the pods to create and the GPUs left waiting."""
    candidates = sorted((p for p in live if gpu_of[p.name] is None), key=lambda p: (not p.ready, p.index))
    create: list[tuple[int, str | None]] = []
    waiting: list[str] = []
    num_live = len(live)
    for gpu_id in unserved_gpu_ids:
        if candidates:
            gpu_of[candidates.pop(0).name] = gpu_id
        elif num_live < max_workers:
            create.append((next_index, gpu_id))
            next_index += 1
            num_live += 1
        else:
            waiting.append(gpu_id)
    while num_live < min(floor, max_workers):
        create.append((next_index, None))
        next_index += 1
        num_live += 1
    return create, waiting


# Holding pods whose deletion cost moves a step are rewritten at most this many a pass (the pool's other
# pod writes are its real changes): the operator's writes per epoch stay flat in pool size.
COST_REFRESHES_PER_PASS = 8


def deletion_cost(held_bytes: int) -> int:
    """Whatever removes pods should pick the emptiest first: the KV a pod holds, in power-of-two steps
    of MiB (1 for under 1 MiB, 2 for under 2, 3 for under 4, ...). An exact figure would change with
    nearly every KV-load report, and the operator would then rewrite the pod, an event for every pod
    watcher of the cluster, once per report (docs/scale.md); a step changes when the KV doubles or halves."""
    return 1 + (held_bytes >> 20).bit_length()


def _metadata_changes(pod: PodInfo, gpu_id: str | None, routed_pods: set[str], now_s: float, in_move: bool = False,
                      ) -> tuple[dict[str, str | None], dict[str, str | None]] | None:
    """The labels and annotations of a live pod that differ from what they should say (None: none do).

    A node autoscaler may evict a worker only when that loses nothing: it holds no KV cache and no
    move is leaving or heading to it (`in_move`: a source may have handed its request over in a
    move's first step, and a target receives KV it does not report yet)."""
    holding = pod.holding
    idle = gpu_id is None and not holding and pod.name not in routed_pods
    keep = holding or in_move
    labels = {GPU_LABEL: gpu_id}
    annotations = {
        SAFE_TO_EVICT: "false" if keep else "true",
        DO_NOT_DISRUPT: "true" if keep else "false",
        DELETION_COST: str(deletion_cost(pod.used_bytes + pod.lent_bytes) if holding else 0),
        IDLE_SINCE_ANNOTATION: (f"{pod.idle_since_s:.3f}" if pod.idle_since_s is not None else f"{now_s:.3f}")
        if idle else None,
    }
    label_diff = {k: v for k, v in labels.items() if pod.labels.get(k) != v}
    annotation_diff = {k: v for k, v in annotations.items() if pod.annotations.get(k) != v}
    return (label_diff, annotation_diff) if label_diff or annotation_diff else None
