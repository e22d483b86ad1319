"""Exact small cases for the operator's pure decisions: which workers to make or remove, what status says."""

from __future__ import annotations

from typing import Any

from kvfleet.api.models import LLMPoolSpec
from kvfleet.operator import reconcile, resources

POOL: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 4}}


def spec(**overrides: Any) -> LLMPoolSpec:
    body: dict[str, Any] = {"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"},
                            "workers": {"min": 2, "max": 4}}
    body.update(overrides)
    return LLMPoolSpec.model_validate(body)


def pod(index: int, phase: str = "Running", ready: bool = True, deleting: bool = False,
        scheduled: dict[str, str] | None = None, waiting: str = "") -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if scheduled:
        conditions.append({"type": "PodScheduled", **scheduled})
    meta: dict[str, Any] = {"name": f"p-worker-{index}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    statuses = [{"state": {"waiting": {"reason": waiting}}}] if waiting else []
    return {"metadata": meta, "status": {"phase": phase, "conditions": conditions, "containerStatuses": statuses}}


def test_desired_is_min_raised_by_replicas_capped_by_max() -> None:
    assert reconcile.desired_workers(spec()) == 2
    assert reconcile.desired_workers(spec(replicas=3)) == 3
    assert reconcile.desired_workers(spec(replicas=1)) == 2
    assert reconcile.desired_workers(spec(replicas=4, workers={"min": 0, "max": 4})) == 4


def test_scale_up_uses_indexes_above_every_existing_pod() -> None:
    pods = [pod(0), pod(3, deleting=True)]
    assert reconcile.plan_workers(pods, 3) == reconcile.WorkerChanges((4, 5), ())
    assert reconcile.plan_workers([], 2) == reconcile.WorkerChanges((0, 1), ())


def test_scale_down_removes_most_recently_activated_first() -> None:
    pods = [pod(0), pod(1), pod(5), pod(2)]
    assert reconcile.plan_workers(pods, 2) == reconcile.WorkerChanges((), ("p-worker-5", "p-worker-2"))


def test_finished_workers_are_replaced_and_removed() -> None:
    pods = [pod(0), pod(1, phase="Failed")]
    assert reconcile.plan_workers(pods, 2) == reconcile.WorkerChanges((2,), ("p-worker-1",))


def test_steady_state_changes_nothing() -> None:
    assert reconcile.plan_workers([pod(0), pod(1)], 2) == reconcile.WorkerChanges((), ())


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_status_when_all_ready() -> None:
    status = reconcile.pool_status(POOL, spec(), [pod(0), pod(1)], "T1")
    assert conditions(status) == {"Ready": ("True", "WorkersReady"), "Progressing": ("False", "Stable"),
                                  "Degraded": ("False", "AsExpected"), "WaitingForCapacity": ("False", "CapacityAvailable")}
    assert (status["workers"], status["readyWorkers"], status["desiredWorkers"]) == (2, 2, 2)
    assert status["selector"] == "kvfleet.dev/pool=p,app.kubernetes.io/component=worker"
    assert status["observedGeneration"] == 4


def test_status_waiting_for_capacity_carries_the_scheduler_reason() -> None:
    pending = pod(1, phase="Pending", ready=False, scheduled={
        "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."})
    status = reconcile.pool_status(POOL, spec(), [pod(0), pending], "T1")
    cond = {c["type"]: c for c in status["conditions"]}
    assert cond["WaitingForCapacity"]["status"] == "True"
    assert cond["WaitingForCapacity"]["message"] == "1 worker pod(s) pending: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    assert conditions(status)["Ready"] == ("False", "WorkersNotReady")
    assert conditions(status)["Progressing"] == ("True", "WaitingForWorkers")


def test_status_degraded_on_crash_loop_and_transition_times_kept() -> None:
    first = reconcile.pool_status(POOL, spec(), [pod(0), pod(1, ready=False, waiting="CrashLoopBackOff")], "T1")
    assert conditions(first)["Degraded"] == ("True", "WorkersCrashing")
    again = reconcile.pool_status({**POOL, "status": first}, spec(), [pod(0), pod(1, ready=False, waiting="CrashLoopBackOff")], "T2")
    assert all(c["lastTransitionTime"] == "T1" for c in again["conditions"])
    healed = reconcile.pool_status({**POOL, "status": again}, spec(), [pod(0), pod(1)], "T3")
    times = {c["type"]: c["lastTransitionTime"] for c in healed["conditions"]}
    assert times == {"Ready": "T3", "Progressing": "T3", "Degraded": "T3", "WaitingForCapacity": "T1"}


def test_worker_pod_applies_the_template() -> None:
    s = spec(gpusPerWorker=2, model={"name": "m", "path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
             workerTemplate={"image": "reg/kvfleet/worker:1", "nodeSelector": {"gpu": "a100"},
                             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                             "priorityClassName": "llm", "env": [{"name": "X", "value": "1"}],
                             "resources": {"limits": {"memory": "64Gi", "nvidia.com/gpu": "7"}}})
    body = resources.worker_pod(POOL, s, 3)
    container = body["spec"]["containers"][0]
    assert body["metadata"]["name"] == "p-worker-3"
    assert body["metadata"]["labels"][resources.INDEX_LABEL] == "3"
    assert body["metadata"]["ownerReferences"] == [resources.owner_reference(POOL)]
    assert container["resources"] == {"requests": {"nvidia.com/gpu": "2"}, "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"}}
    assert body["spec"]["nodeSelector"] == {"gpu": "a100"}
    assert body["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert body["spec"]["priorityClassName"] == "llm"
    assert body["spec"]["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "w", "readOnly": True}}]
    assert container["volumeMounts"] == [{"name": "model", "mountPath": "/models/m", "readOnly": True}]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["KVFLEET_KV_CAPACITY_BYTES"] == str(2**30) and env["X"] == "1"
    assert env["KVFLEET_POOL_TOKEN"] == {"secretKeyRef": {"name": "p-token", "key": "token"}}


def test_worker_rbac_is_namespaced_and_never_creates_or_deletes() -> None:
    account, role, binding = resources.worker_rbac(POOL)
    assert (account["kind"], role["kind"], binding["kind"]) == ("ServiceAccount", "Role", "RoleBinding")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert not verbs & {"create", "delete", "deletecollection", "escalate", "bind", "impersonate"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "p-worker", "namespace": "ns"}]
