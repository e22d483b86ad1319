"""MELL's Allocate for one new request on a view of the cluster: the rule's one home for the router.

The operator runs Allocate inside its epochs (the pool policy's: mell_default.py, or MELL §VI-C's
Fig. 10 in mell_paper.py). Between epochs the router places new requests itself, and it must place them where the operator's Allocate
would, with the pool's GPU-priority weights, or the next epoch moves them. So it does not carry a
copy of the rule: it describes what it sees (each worker's requests and activation order) as
`GpuLoad`s, and `allocate_one` restores a policy from that view, schedules one `Arrive`, and says
where the request went, by which branch of Fig. 10, and which moves the plan ordered besides
(evicting T-requests from an L-GPU, pulling an S/M-request into a new L-GPU, refilling). The router
cannot make those moves; the operator's next epoch does.

Rebuilding the cluster costs time in the number of requests in flight (tens of milliseconds at a thousand),
once per placement. `allocate_on_totals` gives the same decision from each GPU's totals alone, in time
in the number of GPUs, wherever the policy's Allocate reads nothing else (the default policy while no
GPU is over its cap); elsewhere it says it cannot, and the caller rebuilds.

Pure: the same view, size and config always give the same decision; nothing survives the call.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvfleet.mell.cluster import PolicyConfig
from kvfleet.mell.mell_default import MellDefaultConfig, MellDefaultPolicy
from kvfleet.mell.models import Arrive, EventBatch, Location, Migration
from kvfleet.mell.policy import make_policy
from kvfleet.mell.size_classes import SizeClass, size_class
from kvfleet.mell.state import ClusterSnapshot, GpuSnapshot, ItemSnapshot

# Not a request id any caller uses (ids come from HTTP headers and reports, never with a NUL).
_PROBE_ID = "\0allocate"
_GPU_ID = re.compile(r"^gpu-(\d+)$")
_UNKNOWN = Location("", "")


@dataclass(frozen=True)
class GpuLoad:
    """One GPU as an observer sees it: the requests it holds and when it was activated."""

    gpu_id: str
    # Higher is more recently activated (MELL's "most recently activated GPU", §VI-C).
    activation_order: int
    requests: tuple[tuple[str, int], ...]  # (request id, KV bytes)
    # Only the distance term of a GPU-to-GPU priority uses it (the source of a move, never the target
    # of a new request), so an observer that does not know it loses nothing on its own choice.
    location: Location = _UNKNOWN


@dataclass(frozen=True)
class AllocateDecision:
    """Where Allocate put one new request, and what else the plan did for it."""

    # The GPU the request's KV (its tail beyond whole GPUs, if larger than C) went on; a GPU that
    # Allocate activated for it has an id no GpuLoad named (see `new_gpu`).
    gpu_id: str
    # Allocate activated a GPU for the request (Fig. 10 case 3, or cases 1 and 2 with nothing fitting).
    new_gpu: bool
    # The rule that chose: the default policy's (mell_default.py) "best-fit", "best-fit-in-headroom" or
    # "new-GPU"; for mell-paper the branch of Fig. 10: "T-on-L-GPU", "T-on-latest-T-GPU",
    # "T-on-underfilled-T-GPU", "tiny-in-multi-item", "T-on-SM-GPU", "SM-on-L-GPU", "SM-on-latest-SM-GPU"
    # or "new-GPU".
    step: str
    # Moves the plan also ordered (causes as in Plan.migrations: "evict-t", "pull-sm", "refill-sm").
    moves: tuple[Migration, ...]


@dataclass(frozen=True)
class GpuTotals:
    """One GPU as `allocate_on_totals` reads it: what its requests add up to, not the requests."""

    gpu_id: str
    activation_order: int
    load_bytes: int
    num_requests: int


def items_of(gpu_id: str, requests: Iterable[tuple[str, int]], capacity_bytes: int) -> list[ItemSnapshot]:
    """The items of one GPU rebuilt from the requests it holds, in the order given: a tiny request (at
    most C/8) joins the GPU's open multi-item while that stays within C/4, else opens the next one
    (MELL §VI-C); any other request is an item of its own. The one rule for every rebuilt state: the
    operator's after a restart and an observer's (`cluster_snapshot`)."""
    items: list[ItemSnapshot] = []
    bundle: list[tuple[str, int]] = []
    bundle_bytes = 0
    for request_id, kv_bytes in requests:
        if size_class(kv_bytes, capacity_bytes) is not SizeClass.TINY:
            items.append(ItemSnapshot(((request_id, kv_bytes),), False, gpu_id))
            continue
        if bundle and 4 * (bundle_bytes + kv_bytes) > capacity_bytes:
            items.append(ItemSnapshot(tuple(bundle), True, gpu_id))
            bundle, bundle_bytes = [], 0
        bundle.append((request_id, kv_bytes))
        bundle_bytes += kv_bytes
    if bundle:
        items.append(ItemSnapshot(tuple(bundle), True, gpu_id))
    return items


def cluster_snapshot(gpus: Sequence[GpuLoad], capacity_bytes: int) -> ClusterSnapshot:
    """The scheduling state of GPUs whose requests are where the observer says (not re-decided).

    Tiny requests are bundled into multi-items in request-id order (`items_of`), as the operator does
    when it rebuilds from reports. A request reported on two
    GPUs (mid-migration) holds memory on both, so each copy is kept, the later one under a derived id.
    Overfull GPUs stay overfull: a GPU without room is one Allocate will not choose.
    """
    ordered = sorted(gpus, key=lambda g: (g.activation_order, g.gpu_id))
    gpu_snaps = tuple(GpuSnapshot(g.gpu_id, seq, seq, g.location) for seq, g in enumerate(ordered))
    items: list[ItemSnapshot] = []
    seen: set[str] = set()
    for gpu in ordered:
        requests: list[tuple[str, int]] = []
        for request_id, kv_bytes in sorted(gpu.requests):
            if request_id in seen:
                request_id = f"{request_id}\0{gpu.gpu_id}"
            seen.add(request_id)
            requests.append((request_id, kv_bytes))
        items.extend(items_of(gpu.gpu_id, requests, capacity_bytes))
    # GPUs the policy activates are named gpu-<next index>: past every id of that form already given.
    taken = [int(m.group(1)) + 1 for g in ordered if (m := _GPU_ID.match(g.gpu_id))]
    next_index = max([len(ordered), *taken])
    return ClusterSnapshot(gpu_snaps, tuple(items), (), next_index, len(ordered))


def allocate_one(snapshot: ClusterSnapshot, size_bytes: int, config: PolicyConfig,
                 policy_name: str = "mell") -> AllocateDecision:
    """Allocate for one new request of `size_bytes` on `snapshot` under the pool's policy (the
    default's rule 1, mell_default.py; MELL's Fig. 10 for `mell-paper`, with the GPU priority of `config`,
    whose weights are the pool's; a baseline's dispatch). For a baseline `step` names the Fig. 10
    branch its choice matches."""
    policy = make_policy(policy_name, config)
    policy.restore(snapshot)
    in_use = {gid: (gpu.category, gpu.seq) for gid, gpu in policy.gpus.items() if not gpu.idle}
    # Allocate alone: not the end of an epoch, so no policy's per-epoch work (the default's relief and
    # consolidation, the load balancer's rebalancing) moves the probe after it was placed.
    plan = policy.schedule(EventBatch(0.0, (Arrive(_PROBE_ID, size_bytes),)), end_of_epoch=False)
    gpu_id = policy.gpu_of(_PROBE_ID)
    item = policy.item_of[_PROBE_ID]
    moves = tuple(m for m in plan.migrations if m.request_id != _PROBE_ID)
    before = in_use.get(gpu_id)
    if before is None:
        return AllocateDecision(gpu_id, True, "new-GPU", moves)
    if isinstance(policy, MellDefaultPolicy):
        return AllocateDecision(gpu_id, False, policy.last_allocate_step, moves)
    category, seq = before
    cls = size_class(size_bytes, config.capacity_bytes)
    small = cls in (SizeClass.TINY, SizeClass.T)
    if category is SizeClass.L:
        step = "T-on-L-GPU" if small else "SM-on-L-GPU"
    elif category is SizeClass.T and item.is_bundle and len(item.members) > 1:
        step = "tiny-in-multi-item"
    elif category is SizeClass.T:
        latest_t = max(s for c, s in in_use.values() if c is SizeClass.T)
        step = "T-on-latest-T-GPU" if seq == latest_t else "T-on-underfilled-T-GPU"
    elif small:
        step = "T-on-SM-GPU"  # MellPaperConfig.t_on_sm_gpus
    else:
        step = "SM-on-latest-SM-GPU"
    return AllocateDecision(gpu_id, False, step, moves)


def allocate_on_totals(gpus: Sequence[GpuTotals], size_bytes: int, config: PolicyConfig,
                       policy_name: str = "mell", new_gpu_id: str | None = None) -> AllocateDecision | None:
    """`allocate_one(cluster_snapshot(gpus, C), size_bytes, config, policy_name)` from the GPUs' totals,
    or None where the decision needs more than totals (then call that). `new_gpu_id`: the GPU Allocate
    activates when it starts one (default: the next `gpu-<n>` as `cluster_snapshot` numbers them).

    The default policy's Allocate (mell_default.py, rule 1: `_target`) is the fullest GPU in use that
    holds the request with headroom under its cap, else without headroom, else a new GPU; "fullest" is
    the least free bytes, then the earliest activated (the free index's order). Before it, `on_arrive`
    relieves GPUs over their cap (rule 2), which moves whole requests: a view with such a GPU gets None,
    as does every other policy (MELL §VI-C's Fig. 10 reads size classes and multi-items; the baselines
    have rules of their own), and a config that is not the default policy's.
    """
    if policy_name != "mell":
        return None
    if type(config) is PolicyConfig:  # as make_policy reads it: the policy's own knobs at their defaults
        config = MellDefaultConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(PolicyConfig)})
    if not isinstance(config, MellDefaultConfig):
        return None
    capacity = config.capacity_bytes
    headroom = int(config.headroom_fraction * capacity)
    passes = [("best-fit", headroom)] + ([("best-fit-in-headroom", 0)] if config.fill_without_headroom else [])
    in_use = [gpu for gpu in gpus if gpu.num_requests]  # one without requests is idle once restored
    max_load, per_request = config.max_load_bytes, config.load_bytes_per_request

    def cap(gpu: GpuTotals, extra_requests: int) -> int:
        """MellDefaultPolicy._cap: C, or less under a TPOT objective."""
        if max_load is None:
            return capacity
        return min(capacity, max_load - (gpu.num_requests + extra_requests) * per_request)

    # A GPU over its cap is relieved (rule 2) before Allocate, which moves requests: only the rebuilt
    # state says where. Otherwise the fullest GPU that holds the request, as `_target`.
    if any(gpu.load_bytes > cap(gpu, 0) for gpu in in_use):
        return None
    for step, room in passes:
        fitting = [gpu for gpu in in_use if gpu.load_bytes + size_bytes + room <= cap(gpu, 1)]
        if fitting:
            return AllocateDecision(_fullest(fitting).gpu_id, False, step, ())
    if new_gpu_id is None:
        taken = [int(m.group(1)) + 1 for g in gpus if (m := _GPU_ID.match(g.gpu_id))]
        new_gpu_id = f"gpu-{max([len(gpus), *taken])}"
    return AllocateDecision(new_gpu_id, True, "new-GPU", ())


def allocate_on_snapshot(snapshot: ClusterSnapshot, size_bytes: int, config: PolicyConfig,
                         policy_name: str = "mell") -> AllocateDecision:
    """`allocate_one(snapshot, ...)`, decided from the snapshot's per-GPU totals where
    `allocate_on_totals` can (no span: a span head is no GPU's total), else by restoring the policy.

    What the operator's routing table previews every pass for each size class: restoring the whole
    cluster per class cost time in the number of requests (0.17 s a pass at 1,000 workers)."""
    if not snapshot.spans:
        totals: dict[str, list[int]] = {gpu.gpu_id: [0, 0] for gpu in snapshot.gpus}
        for item in snapshot.items:
            gpu_total = totals[item.gpu_id]
            gpu_total[0] += sum(kv_bytes for _, kv_bytes in item.members)
            gpu_total[1] += len(item.members)
        # A GPU without items is idle once restored, and the one Allocate starts is the last of
        # those (ClusterPolicy._activate reuses it), else a new index.
        idle = [gpu.gpu_id for gpu in snapshot.gpus if not totals[gpu.gpu_id][1]]
        decision = allocate_on_totals(
            [GpuTotals(gpu.gpu_id, gpu.seq, *totals[gpu.gpu_id]) for gpu in snapshot.gpus], size_bytes, config,
            policy_name, new_gpu_id=idle[-1] if idle else f"gpu-{snapshot.next_gpu_index}")
        if decision is not None:
            return decision
    return allocate_one(snapshot, size_bytes, config, policy_name)


def _fullest(gpus: Sequence[GpuTotals]) -> GpuTotals:
    """The best fit among GPUs that hold a request: the fullest (least free bytes, one C for all), then
    the earliest activated (the free index orders ties by seq, which is the rank in activation order:
    cluster_snapshot), then the smallest id."""
    return min(gpus, key=lambda gpu: (-gpu.load_bytes, gpu.activation_order, gpu.gpu_id))
