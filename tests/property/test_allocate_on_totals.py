"""`allocate_on_totals` decides as `allocate_one` does on the rebuilt cluster, wherever it decides.

The router places every request with it instead of rebuilding the cluster per request
(kvfleet.router.placement), so a difference would put requests where the operator's next epoch
moves them. Random views: GPUs with requests of every size class (duplicated ids, as mid-migration),
some overfull, under the default knobs, a TPOT cap, and without filling the headroom.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.mell import (
    GpuLoad,
    GpuTotals,
    MellDefaultConfig,
    PolicyConfig,
    allocate_on_snapshot,
    allocate_on_totals,
    allocate_one,
    cluster_snapshot,
)
from kvfleet.mell.models import Location
from kvfleet.mell.state import ClusterSnapshot, GpuSnapshot, ItemSnapshot

C = 1000
PROFILE = settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONFIGS = (
    MellDefaultConfig(capacity_bytes=C),
    MellDefaultConfig(capacity_bytes=C, fill_without_headroom=False, headroom_fraction=0.1),
    MellDefaultConfig(capacity_bytes=C, max_load_bytes=900, load_bytes_per_request=40),
    PolicyConfig(capacity_bytes=C),  # the pool's shared knobs only: the default policy's own at their defaults
)


@st.composite
def views(draw: st.DrawFn) -> list[GpuLoad]:
    num_gpus = draw(st.integers(0, 6))
    orders = draw(st.lists(st.integers(0, 8), min_size=num_gpus, max_size=num_gpus))
    ids = [f"r{i}" for i in range(12)]
    gpus = []
    for index, order in enumerate(orders):
        requests = draw(st.lists(st.tuples(st.sampled_from(ids), st.integers(0, 700)), min_size=1, max_size=5))
        name = draw(st.sampled_from([f"gpu-{index}", f"pool-worker-{index}"]))
        gpus.append(GpuLoad(name, order, tuple(requests)))
    return gpus


def totals_of(gpus: list[GpuLoad]) -> list[GpuTotals]:
    return [GpuTotals(g.gpu_id, g.activation_order, sum(b for _, b in g.requests), len(g.requests)) for g in gpus]


@PROFILE
@given(views(), st.integers(1, C), st.sampled_from(CONFIGS))
def test_the_same_decision_as_the_rebuilt_cluster(gpus: list[GpuLoad], size_bytes: int, config: PolicyConfig) -> None:
    fast = allocate_on_totals(totals_of(gpus), size_bytes, config)
    if fast is not None:
        assert fast == allocate_one(cluster_snapshot(gpus, C), size_bytes, config)


def test_it_decides_wherever_no_gpu_is_over_its_cap() -> None:
    gpus = [GpuLoad("a", 0, (("r1", 500),)), GpuLoad("b", 1, (("r2", 300), ("r3", 200))), GpuLoad("c", 2, (("r4", 100),))]
    config = MellDefaultConfig(capacity_bytes=C)
    fast = allocate_on_totals(totals_of(gpus), 300, config)
    assert fast is not None and fast == allocate_one(cluster_snapshot(gpus, C), 300, config)
    # The fullest with headroom (50 bytes at 5%): a and b hold 500 each, a was activated first.
    assert (fast.gpu_id, fast.step) == ("a", "best-fit")
    assert allocate_on_totals(totals_of(gpus), 460, config) == allocate_one(cluster_snapshot(gpus, C), 460, config)
    assert allocate_on_totals(totals_of(gpus), 950, config) == allocate_one(cluster_snapshot(gpus, C), 950, config)


def test_it_leaves_the_rest_to_the_rebuilt_cluster() -> None:
    overfull = [GpuLoad("a", 0, (("r1", 700), ("r2", 400))), GpuLoad("b", 1, (("r3", 100),))]
    assert allocate_on_totals(totals_of(overfull), 100, MellDefaultConfig(capacity_bytes=C)) is None
    fine = [GpuLoad("a", 0, (("r1", 100),))]
    assert allocate_on_totals(totals_of(fine), 100, PolicyConfig(capacity_bytes=C), "mell-paper") is None
    assert allocate_on_totals(totals_of(fine), 100, PolicyConfig(capacity_bytes=C), "bf") is None


@st.composite
def policy_snapshots(draw: st.DrawFn) -> ClusterSnapshot:
    """A policy's own state: GPUs with activation seqs and locations, some without items (emptied
    this batch, idle once restored), items of one or more requests; no spans."""
    num_gpus = draw(st.integers(0, 6))
    seqs = draw(st.permutations(list(range(num_gpus))))
    gpus = tuple(GpuSnapshot(f"gpu-{i}", i, seqs[i], Location(f"node-{i // 2}", f"zone-{i % 2}")) for i in range(num_gpus))
    items = []
    names = iter(f"r{i}" for i in range(100))
    for gpu in gpus:
        for _ in range(draw(st.integers(0, 3))):
            members = tuple((next(names), draw(st.integers(0, 400))) for _ in range(draw(st.integers(1, 3))))
            items.append(ItemSnapshot(members, len(members) > 1, gpu.gpu_id))
    next_index = num_gpus + draw(st.integers(0, 3))
    return ClusterSnapshot(gpus, tuple(items), (), next_index, num_gpus)


@PROFILE
@given(policy_snapshots(), st.integers(1, C), st.sampled_from(CONFIGS), st.sampled_from(["mell", "mell-paper", "bf"]))
def test_a_policys_own_state_gets_the_same_decision(snapshot: ClusterSnapshot, size_bytes: int, config: PolicyConfig,
                                                    policy: str) -> None:
    if policy != "mell" and type(config) is not PolicyConfig:
        config = PolicyConfig(capacity_bytes=C)
    assert allocate_on_snapshot(snapshot, size_bytes, config, policy) == allocate_one(snapshot, size_bytes, config, policy)
