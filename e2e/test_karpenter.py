"""A real node autoscaler in the loop: Karpenter provisions and consolidates GPU nodes while MELL packs
and drains (kvfleet.localcluster.karpenter; docs/autoscaling.md).

The cluster of this module starts with one node of one GPU; every other GPU comes from Karpenter's
NodePool (1- and 2-GPU instance types, a "cloud" that boots a node in 1 s). The workers are the
scripted stand-in, so what is tested is the handshake: pods Pending -> WaitingForCapacity -> a
NodeClaim -> a node the node agent serves -> workers Ready; nodes MELL empties removed by Karpenter;
workers holding KV or in a move never disrupted; headroom placeholders provisioning ahead of demand.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, local_cluster, wait_for
from kvfleet.localcluster.controlplane import stop_process
from kvfleet.operator.pods import DO_NOT_DISRUPT
from kvfleet_e2e.operators import OperatorHandle
from kvfleet_e2e.pools import post, ready
from kvfleet_e2e.pools import scripted_pool as pool
from kvfleet_e2e.reports import worker_reports

REGISTRATION_DELAY_S = 1.0


@pytest.fixture(scope="module")
def kcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with local_cluster(num_nodes=1, gpus_per_node=1, num_zones=1, work_dir=tmp_path_factory.mktemp("karpenter"),
                       extra_python_path=[Path(__file__).parent], karpenter=True,
                       node_registration_delay_s=REGISTRATION_DELAY_S, consolidate_after_s=2) as running:
        yield running


@pytest.fixture(scope="module")
def operator(kcluster: Cluster) -> Iterator[OperatorHandle]:
    handle = OperatorHandle(kcluster)
    yield handle
    stop_process(handle.proc)


@pytest.fixture
def ns(kcluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = "k-" + request.node.name.removeprefix("test_")[:40].replace("_", "-").strip("-")
    kcluster.kubectl("create", "namespace", name)
    kcluster.wait_default_service_account(name)
    yield name
    # The next test starts from the one fixed node, its GPU free: this test's pods gone, every Karpenter
    # node emptied and removed. Waiting for the namespace itself to go took 15-23 s a test (the
    # namespace controller's requeue, which follows the pods' 30 s grace period, and the pool's
    # finalizer); nothing of it but its pods matters to the next test. The namespace goes first, so
    # nothing (the operator, for one) can make a pod in it again; its pods are then deleted at once.
    kcluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    kcluster.kubectl("delete", "pods", "--all", "-n", name, "--wait=false", check=False)
    wait_for(lambda: not (kcluster.get_json("pods", "-n", name, check=False) or {}).get("items") or None,
             "the test's pods to go", timeout_s=120, interval_s=0.5)
    wait_for(lambda: not gpu_pods(kcluster) or None, "every GPU of the cluster to be free", timeout_s=60, interval_s=0.5)
    # Karpenter would consolidate its empty nodes within half a minute; the tests that need that wait
    # for it themselves, so here the NodeClaims go at once (Karpenter drains and deletes their nodes).
    kcluster.kubectl("delete", "nodeclaims", "--all", "--wait=false", check=False)
    wait_for(lambda: not karpenter_nodes(kcluster) or None, "Karpenter to remove its nodes", timeout_s=120, interval_s=1)


def gpu_pods(cluster: Cluster) -> list[str]:
    """Pods of any namespace that hold or ask for a GPU and have not ended."""
    pods = cluster.get_json("pods", "-A", "--field-selector", "status.phase!=Succeeded,status.phase!=Failed")["items"]
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods
            if any("nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {}) for c in p["spec"]["containers"])]


def karpenter_nodes(cluster: Cluster) -> dict[str, dict[str, Any]]:
    nodes = cluster.get_json("nodes", "-l", "karpenter.sh/nodepool")["items"]
    return {n["metadata"]["name"]: n for n in nodes}


def pods_of(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    return list(cluster.get_json("pods", "-n", namespace, "-l", selector)["items"])


def workers(cluster: Cluster, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in pods_of(cluster, namespace, f"kvfleet.dev/pool={name},app.kubernetes.io/component=worker")
            if not p["metadata"].get("deletionTimestamp")}


def status(cluster: Cluster, namespace: str, name: str, operator: OperatorHandle) -> dict[str, Any]:
    operator.check()
    cluster.check_alive()
    return dict((cluster.get_json("llmpool", name, "-n", namespace, check=False) or {}).get("status") or {})


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions", []) if c["type"] == type_), {})


def held(cluster: Cluster, namespace: str, name: str) -> dict[str, list[str]]:
    reports = worker_reports(cluster, namespace, name)
    return {pod: sorted(r.id for r in report.requests) for pod, report in reports.items()}


def finished_requests(cluster: Cluster, namespace: str, name: str) -> set[str]:
    logs = "".join(p.read_text() for p in cluster.plane.work_dir.glob(f"agent/pods/{namespace}_{name}-worker-*/worker.log"))
    assert "LOST" not in logs, logs[-3000:]
    return {line.split("request ", 1)[1].split()[0] for line in logs.splitlines() if " finished" in line and "request " in line}


def seconds(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone


def pending_to_ready_s(pod: dict[str, Any]) -> float:
    """From the pod's creation to its Ready condition (1 s resolution, the API's timestamps)."""
    ready_at = next(c["lastTransitionTime"] for c in pod["status"]["conditions"] if c["type"] == "Ready")
    return seconds(ready_at) - seconds(pod["metadata"]["creationTimestamp"])


def node_of(cluster: Cluster, namespace: str, pod_name: str) -> str:
    return str(cluster.get_json("pod", pod_name, "-n", namespace)["spec"]["nodeName"])


def finish(cluster: Cluster, namespace: str, name: str, request_id: str) -> str:
    """End a request now on whichever worker holds it; returns that worker."""
    holder = next(pod for pod, rs in held(cluster, namespace, name).items() if request_id in rs)
    post(workers(cluster, namespace, name)[holder], "/script/finish", {"id": request_id})
    return holder


def test_scale_up_then_consolidation_removes_the_nodes_mell_empties_first(kcluster: Cluster, ns: str,
                                                                            operator: OperatorHandle) -> None:
    # C = 1,000,000 bytes: three L-requests need three GPUs; the cluster has one.
    kcluster.apply_json(pool("grow", capacity={"kvCapacityPerWorker": "1M"}, workers={"min": 1, "max": 4},
                             migration={"mode": "kv"}), ns)
    wait_for(lambda: status(kcluster, ns, "grow", operator).get("readyWorkers") == 1, "the floor worker", timeout_s=60)
    first = workers(kcluster, ns, "grow")["grow-worker-0"]
    assert not first["spec"]["nodeName"].startswith("kwok-")
    for rid in ("l1", "l2", "l3"):
        post(first, "/script/requests", {"id": rid, "kvBytes": 600_000, "durationS": 300})

    # The new workers cannot be scheduled: the pool says so, and Karpenter claims nodes for them.
    waiting = wait_for(lambda: (c := condition(status(kcluster, ns, "grow", operator), "WaitingForCapacity"))
                       .get("status") == "True" and c, "WaitingForCapacity", timeout_s=60)
    assert waiting["reason"] == "WorkersUnschedulable" and "nvidia.com/gpu" in waiting["message"]
    wait_for(lambda: kcluster.get_json("nodeclaims")["items"], "a NodeClaim", timeout_s=60)
    spread = wait_for(lambda: (st := status(kcluster, ns, "grow", operator)).get("readyWorkers") == 3
                      and st.get("migrationsInFlight") == 0
                      and sorted(sum((h := held(kcluster, ns, "grow")).values(), [])) == ["l1", "l2", "l3"]
                      and all(len(rs) == 1 for rs in h.values()) and len(h) == 3 and h,
                      "three workers, one L-request each", timeout_s=90)
    assert condition(status(kcluster, ns, "grow", operator), "WaitingForCapacity")["status"] == "False"
    pods = workers(kcluster, ns, "grow")
    node_of_pod = {name: p["spec"]["nodeName"] for name, p in pods.items()}
    assert {n for n, node in node_of_pod.items() if node in karpenter_nodes(kcluster)} == {"grow-worker-1", "grow-worker-2"}
    waits = sorted(pending_to_ready_s(pods[name]) for name in ("grow-worker-1", "grow-worker-2"))
    print(f"\npending-to-ready with a new node: {waits} s (node registration delay {REGISTRATION_DELAY_S:g} s)")
    # Karpenter's nodes carry what the agent serves: the instance type's GPUs, Ready.
    for node in karpenter_nodes(kcluster).values():
        assert node["metadata"]["labels"]["node.kubernetes.io/instance-type"] in ("gpu-1x", "gpu-2x")
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])

    # The requests on worker-0 and worker-1 end; MELL empties worker-1 and the operator deletes it.
    # Karpenter removes its node, unless worker-2 shares it: worker-2 holds KV, says do-not-disrupt,
    # and its node stays (Karpenter may not move it to a cheaper node either).
    kept = {rid for rid in ("l1", "l2", "l3") if rid not in spread["grow-worker-0"] + spread["grow-worker-1"]}
    for rid in spread["grow-worker-0"] + spread["grow-worker-1"]:
        finish(kcluster, ns, "grow", rid)
    holder_node = node_of_pod["grow-worker-2"]
    wait_for(lambda: "grow-worker-1" not in workers(kcluster, ns, "grow"), "the emptied worker-1 to go", timeout_s=60)
    wait_for(lambda: set(karpenter_nodes(kcluster)) == {holder_node}, "the emptied worker's node to go",
             timeout_s=90, interval_s=1)
    assert workers(kcluster, ns, "grow")["grow-worker-2"]["metadata"]["annotations"][DO_NOT_DISRUPT] == "true"
    time.sleep(8)  # past consolidateAfter (2 s) and a disruption pass: the holder's node is still there
    assert holder_node in karpenter_nodes(kcluster) and held(kcluster, ns, "grow")["grow-worker-2"] == sorted(kept)

    # The last request ends: its worker goes, then its node; the pool is back on the fixed node.
    finish(kcluster, ns, "grow", kept.pop())
    wait_for(lambda: not karpenter_nodes(kcluster), "the last Karpenter node to go", timeout_s=90, interval_s=1)
    assert finished_requests(kcluster, ns, "grow") == {"l1", "l2", "l3"}
    assert list(workers(kcluster, ns, "grow")) == ["grow-worker-0"]


def nodeclaim_of(cluster: Cluster, node: str) -> dict[str, Any]:
    return next(c for c in cluster.get_json("nodeclaims")["items"] if (c.get("status") or {}).get("nodeName") == node)


def disrupting(node: dict[str, Any]) -> bool:
    """Whether Karpenter has begun to take the node away (its disruption taint, or deletion)."""
    return bool(node["metadata"].get("deletionTimestamp")) or any(
        t["key"] == "karpenter.sh/disrupted" for t in node["spec"].get("taints") or [])


def test_a_worker_in_a_move_is_not_disrupted_until_the_move_ends(kcluster: Cluster, ns: str, operator: OperatorHandle) -> None:
    # A move's KV copy takes 20 s; meanwhile the target reports nothing: only the move keeps it.
    env = [{"name": "KVFLEET_SCRIPTED_MOVE_S", "value": "20"}]
    kcluster.apply_json(pool("move", capacity={"kvCapacityPerWorker": "1M"}, workers={"min": 1, "max": 3},
                             migration={"mode": "kv"}, workerTemplate={"image": "kvfleet/scripted-worker:dev", "env": env}), ns)
    wait_for(lambda: status(kcluster, ns, "move", operator).get("readyWorkers") == 1, "the floor worker", timeout_s=60)
    first = workers(kcluster, ns, "move")["move-worker-0"]
    for rid in ("l1", "l2"):
        post(first, "/script/requests", {"id": rid, "kvBytes": 600_000, "durationS": 300})
    move = wait_for(lambda: next((m for m in kcluster.get_json("kvmigrations", "-n", ns)["items"]
                                  if (m.get("status") or {}).get("phase") == "Transferring"), None),
                    "a move under way", timeout_s=90)
    # The floor worker has the fixed node's GPU, so the move's target is on a node of Karpenter's.
    moved, mover = move["spec"]["requestId"], move["spec"]["targetPod"]
    node = node_of(kcluster, ns, mover)
    assert node in karpenter_nodes(kcluster) and node_of(kcluster, ns, move["spec"]["sourcePod"]) not in karpenter_nodes(kcluster)
    pod = wait_for(lambda: (p := workers(kcluster, ns, "move")[mover])["metadata"]["annotations"][DO_NOT_DISRUPT] == "true"
                   and p, "the worker in the move to say do-not-disrupt", timeout_s=10)
    assert moved not in held(kcluster, ns, "move").get(mover, [])  # by its report the target holds nothing yet
    assert pod["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"

    # Ask Karpenter to replace every node of the pool: a new template drifts them all.
    template_label = {"spec": {"template": {"metadata": {"labels": {"nvidia.com/gpu.present": "true", "kvfleet.dev/rev": "2"}}}}}
    kcluster.kubectl("patch", "nodepool", "kvfleet-gpu", "--type=merge", "-p", json.dumps(template_label))
    try:
        wait_for(lambda: any(c["type"] == "Drifted" and c["status"] == "True"
                             for c in nodeclaim_of(kcluster, node)["status"].get("conditions", [])),
                 "Karpenter to find the node drifted", timeout_s=30, interval_s=1)
        drifted_at = time.monotonic()
        # Until the move ends, Karpenter leaves the node alone.
        while kcluster.get_json("kvmigration", move["metadata"]["name"], "-n", ns)["status"]["phase"] == "Transferring":
            assert not disrupting(karpenter_nodes(kcluster)[node]), "Karpenter disrupted a node in a move"
            time.sleep(1)
        # The loop above means something only if Karpenter had time to act on the drifted node while
        # the move held it: a whole period of its disruption controller (it looks for nodes to disrupt
        # every 10 s), not a drift found as the copy ended.
        held_drifted_s = time.monotonic() - drifted_at
        print(f"\nthe move held the drifted node {held_drifted_s:.0f} s")
        assert held_drifted_s >= 10, f"the move held the drifted node only {held_drifted_s:.1f} s (drift found late)"
        assert kcluster.get_json("kvmigration", move["metadata"]["name"], "-n", ns)["status"]["phase"] == "Succeeded"
        wait_for(lambda: held(kcluster, ns, "move").get(mover) == [moved], "the target to hold the request", timeout_s=15)
        # The move is over; the target keeps its node while it holds the request: end it, and nothing
        # keeps the node.
        time.sleep(3)  # a disruption pass or two with the worker holding KV
        assert not disrupting(karpenter_nodes(kcluster)[node])
        finish(kcluster, ns, "move", moved)
        # Empty and in no move, the worker no longer keeps its drifted node: it goes.
        wait_for(lambda: node not in karpenter_nodes(kcluster), "the drifted node to go once its worker is empty",
                 timeout_s=90, interval_s=1)
        for rid in sorted({"l1", "l2"} - finished_requests(kcluster, ns, "move")):
            finish(kcluster, ns, "move", rid)
        wait_for(lambda: finished_requests(kcluster, ns, "move") == {"l1", "l2"}, "both requests to finish", timeout_s=30)
    finally:
        template_label["spec"]["template"]["metadata"]["labels"]["kvfleet.dev/rev"] = None  # type: ignore[assignment]
        kcluster.kubectl("patch", "nodepool", "kvfleet-gpu", "--type=merge", "-p", json.dumps(template_label))


def blocker(name: str) -> dict[str, Any]:
    """A pod that holds the fixed node's GPU, so the next worker needs a node from Karpenter."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "hold", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


def headroom_pods(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return [p for p in pods_of(cluster, namespace, "app.kubernetes.io/component=headroom") if not p["metadata"].get("deletionTimestamp")]


def test_headroom_placeholders_make_karpenter_provision_ahead_of_demand(kcluster: Cluster, ns: str,
                                                                        operator: OperatorHandle) -> None:
    kcluster.apply_json(pool("warm", capacity={"kvCapacityPerWorker": "1M"}, workers={"min": 1, "max": 3},
                             migration={"mode": "kv"}, autoscaling={"scaleDownDelaySeconds": 1, "headroomWorkers": 1}), ns)
    wait_for(lambda: status(kcluster, ns, "warm", operator).get("readyWorkers") == 1, "the floor worker", timeout_s=60)
    # The placeholder does not fit beside the floor worker: Karpenter adds a node for it, before any demand.
    placeholder = wait_for(lambda: next((p for p in headroom_pods(kcluster, ns) if ready(p)), None),
                           "the placeholder running on a new node", timeout_s=60)
    warm_node = placeholder["spec"]["nodeName"]
    assert warm_node in karpenter_nodes(kcluster)

    # Demand: a second GPU. Its worker preempts the placeholder and starts on the warm node at once;
    # the placeholder, recreated, makes Karpenter add the next node.
    first = workers(kcluster, ns, "warm")["warm-worker-0"]
    for rid in ("l1", "l2"):
        post(first, "/script/requests", {"id": rid, "kvBytes": 600_000, "durationS": 300})
    second = wait_for(lambda: next((p for name, p in workers(kcluster, ns, "warm").items() if name != "warm-worker-0"
                                    and ready(p)), None), "a second worker", timeout_s=60)
    assert second["spec"]["nodeName"] == warm_node
    wait_for(lambda: placeholder["metadata"]["uid"] not in {p["metadata"]["uid"] for p in headroom_pods(kcluster, ns)},
             "the preempted placeholder to go", timeout_s=30)
    renewed = wait_for(lambda: next((p for p in headroom_pods(kcluster, ns) if ready(p)), None),
                       "the recreated placeholder on the next new node", timeout_s=60)
    assert renewed["spec"]["nodeName"] in karpenter_nodes(kcluster) and renewed["spec"]["nodeName"] != warm_node
    print(f"\nworker on a node the placeholder kept warm: pending-to-ready {pending_to_ready_s(second):.0f} s")
    for rid in ("l1", "l2"):
        finish(kcluster, ns, "warm", rid)


def test_mell_asking_for_a_gpu_shape_no_nodepool_offers_waits_and_says_so(kcluster: Cluster, ns: str,
                                                                           operator: OperatorHandle) -> None:
    # The NodePool offers 1- and 2-GPU nodes; a 4-GPU worker fits none of them (the 8-GPU type exists
    # but the NodePool does not allow it). Karpenter claims nothing; the pool waits and says why.
    kcluster.apply_json(pool("wide", gpusPerWorker=4, workers={"min": 1, "max": 1}), ns)
    waiting = wait_for(lambda: (c := condition(status(kcluster, ns, "wide", operator), "WaitingForCapacity"))
                       .get("status") == "True" and c, "WaitingForCapacity", timeout_s=60)
    assert waiting["reason"] == "WorkersUnschedulable" and "Insufficient nvidia.com/gpu" in waiting["message"]

    def karpenter_said() -> list[str]:
        events = kcluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=wide-worker-0")["items"]
        return [e["message"] for e in events if (e.get("source") or {}).get("component") == "karpenter"
                or e.get("reportingComponent") == "karpenter"]

    said = wait_for(karpenter_said, "Karpenter's word on the pod", timeout_s=60)
    assert any("nvidia.com/gpu" in m for m in said), said
    # The event is the verdict of a provisioning pass over the pod, so Karpenter has looked already; the
    # sleep leaves room for another pass (a batch closes after 1 s with no new pod) to claim nothing either.
    time.sleep(2)
    assert kcluster.get_json("nodeclaims")["items"] == [] and not karpenter_nodes(kcluster)
    assert condition(status(kcluster, ns, "wide", operator), "Ready")["status"] == "False"


def test_karpenter_moving_an_empty_worker_mell_still_wants_loses_nothing(kcluster: Cluster, ns: str,
                                                                         operator: OperatorHandle) -> None:
    # The fixed node's GPU is taken, so the pool's floor worker starts on a node from Karpenter.
    kcluster.apply_json(blocker("blocker"), ns)
    wait_for(lambda: ready(kcluster.get_json("pod", "blocker", "-n", ns)), "the blocker", timeout_s=30)
    kcluster.apply_json(pool("floor", workers={"min": 1, "max": 2}), ns)
    # The floor worker, whatever its name (a pod replaced before it was ready takes the next index).
    first = wait_for(lambda: status(kcluster, ns, "floor", operator).get("readyWorkers") == 1
                     and [p for p in workers(kcluster, ns, "floor").values() if ready(p)], "the floor worker",
                     timeout_s=60)
    assert len(first) == 1
    node = first[0]["spec"]["nodeName"]
    assert node in karpenter_nodes(kcluster)
    first_uid = first[0]["metadata"]["uid"]
    # The fixed node's GPU frees: Karpenter consolidates by moving the empty floor worker there (it
    # says do-not-disrupt "false"); the operator replaces the evicted pod, and the node goes.
    kcluster.kubectl("delete", "pod", "blocker", "-n", ns)
    wait_for(lambda: node not in karpenter_nodes(kcluster), "Karpenter to consolidate the floor worker's node",
             timeout_s=90, interval_s=1)
    # A new pod, told by its uid: once the evicted one is gone, the replacement may take its name
    # again (the operator numbers new workers after the highest it sees).
    back = wait_for(lambda: [p for p in workers(kcluster, ns, "floor").values()
                             if p["metadata"]["uid"] != first_uid and ready(p)],
                    "the floor worker back", timeout_s=60)
    assert len(back) == 1 and back[0]["spec"]["nodeName"] not in karpenter_nodes(kcluster)
    wait_for(lambda: status(kcluster, ns, "floor", operator).get("readyWorkers") == 1, "the pool ready again", timeout_s=30)
