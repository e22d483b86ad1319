"""The demo's node bill (`make demo KARPENTER=1`): nodes sampled once a second, each billed its GPUs
from the first sighting to the last, idle or not, only inside the window asked for."""

from __future__ import annotations

from typing import Any, cast

from kvfleet.demo.story import NodeLog
from kvfleet.localcluster.cluster import Cluster
from kvfleet.replay.streams import Clock


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now_s(self) -> float:
        return self.t


class FakeCluster:
    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []

    def get_json(self, *args: str, check: bool = True) -> Any:
        assert args == ("nodes",)
        return {"items": self.nodes}


def node(name: str, gpus: int, instance_type: str | None = None) -> dict[str, Any]:
    labels = {"node.kubernetes.io/instance-type": instance_type} if instance_type else {}
    return {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def test_each_node_is_billed_its_gpus_while_it_exists_inside_the_window() -> None:
    clock, fake = FakeClock(), FakeCluster()
    log = NodeLog(cast(Clock, clock))
    cluster = cast(Cluster, fake)
    fake.nodes = [node("fixed", 2)]
    log.sample(cluster)  # t = 0
    clock.t = 10.0
    fake.nodes = [node("fixed", 2), node("k1", 1, "gpu-1x")]
    log.sample(cluster)
    clock.t = 30.0
    log.sample(cluster)
    clock.t = 40.0
    fake.nodes = [node("fixed", 2)]  # Karpenter removed k1
    log.sample(cluster)
    assert log.nodes["k1"].instance_type == "gpu-1x" and log.nodes["k1"].gone
    assert log.nodes["fixed"].instance_type == "fixed" and not log.nodes["fixed"].gone
    assert [g for _, g in log.samples] == [2, 3, 3, 2] and log.peak_gpus() == 3
    # fixed: 2 GPUs x 40 s; k1: 1 GPU from its first sighting (10 s) to its last (30 s).
    assert log.gpu_seconds(0.0, 40.0) == 2 * 40 + 1 * 20
    assert log.gpu_seconds(20.0, 40.0) == 2 * 20 + 1 * 10
