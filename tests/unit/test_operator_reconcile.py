"""Exact small cases for the operator's pure decisions: which workers to make or remove, what status says."""

from __future__ import annotations

import json
import logging
from typing import Any

from kvfleet.api.models import LLMPoolSpec
from kvfleet.operator import pods, resources
from kvfleet.operator.memory import MemoryKube
from kvfleet.operator.status import SchedulingFigures, floor_workers, pool_status

POOL: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 4}}
FIGURES = SchedulingFigures(gpus_in_use=2, lower_bound_gpus=1, used_bytes=2**30, migrations_in_flight=1)


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


def test_floor_is_min_raised_by_replicas_capped_by_max() -> None:
    assert floor_workers(spec()) == 2
    assert floor_workers(spec(replicas=3)) == 3
    assert floor_workers(spec(replicas=1)) == 2
    assert floor_workers(spec(replicas=4, workers={"min": 0, "max": 4})) == 4


def info(index: int, gpu: str | None = None, *, ready: bool = True, live: bool = True, deleting: bool = False, requests: int = 0,
         idle_since: float | None = None, labels: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None) -> pods.PodInfo:
    return pods.PodInfo(f"p-worker-{index}", index, gpu, ready, live, deleting, requests * 100 * 2**20, requests, idle_since,
                        labels or ({resources.GPU_LABEL: gpu} if gpu else {}), annotations or {})


def plan(infos: list[pods.PodInfo], *, unserved: tuple[str, ...] = (), released: tuple[str, ...] = (),
         targets: tuple[str, ...] = (), moving: tuple[str, ...] = (), routed: tuple[str, ...] = (), floor: int = 1,
         max_workers: int = 4, now_s: float = 100.0) -> pods.PodActions:
    return pods.plan_pods(infos, unserved_gpu_ids=unserved, released_pods=released, migration_targets=targets,
                          moving=moving, routed=routed, floor=floor, max_workers=max_workers, scale_down_delay_s=30, now_s=now_s)


def test_a_new_gpu_binds_a_warm_floor_pod_before_creating_one() -> None:
    actions = plan([info(0), info(1, "gpu-0", requests=1)], unserved=("gpu-1", "gpu-2"))
    assert actions.create == ((2, "gpu-2"),)
    assert actions.metadata["p-worker-0"][0] == {resources.GPU_LABEL: "gpu-1"}


def test_gpus_beyond_max_wait_and_the_floor_is_filled() -> None:
    actions = plan([info(0, "gpu-0", requests=1)], unserved=("gpu-1", "gpu-2"), max_workers=2)
    assert actions.create == ((1, "gpu-1"),) and actions.waiting_for_max == ("gpu-2",)
    assert plan([], floor=2).create == ((0, None), (1, None))


def test_released_pods_idle_out_then_go_newest_first_down_to_the_floor() -> None:
    fresh = plan([info(0, "gpu-0", requests=1), info(1, "gpu-1"), info(2, "gpu-2")], released=("p-worker-1", "p-worker-2"))
    assert fresh.delete == ()
    labels, annotations = fresh.metadata["p-worker-2"]
    assert labels == {resources.GPU_LABEL: None} and annotations[resources.IDLE_SINCE_ANNOTATION] == "100.000"
    later = plan([info(0, "gpu-0", requests=1), info(1, idle_since=60.0), info(2, idle_since=80.0)], floor=2, now_s=110.0)
    assert later.delete == ("p-worker-2",)  # worker-1 stays: the floor is 2


def test_a_pod_holding_requests_or_awaiting_a_migration_is_never_deleted() -> None:
    infos = [info(0, "gpu-0", requests=1), info(1, requests=2, idle_since=0.0), info(2, idle_since=0.0)]
    assert plan(infos, floor=0, targets=("p-worker-2",)).delete == ()
    # A pod in the routing table is not idle: its idle clock restarts when it leaves the table.
    idle_routed = info(2, idle_since=0.0, annotations={resources.IDLE_SINCE_ANNOTATION: "0.000"})
    routed = plan([*infos[:2], idle_routed], floor=0, routed=("p-worker-2",))
    assert routed.delete == () and routed.metadata["p-worker-2"][1][resources.IDLE_SINCE_ANNOTATION] is None
    holding = plan(infos, floor=0).metadata["p-worker-1"][1]
    assert holding[pods.SAFE_TO_EVICT] == "false" and holding[pods.DO_NOT_DISRUPT] == "true"
    assert holding[pods.DELETION_COST] == "9"  # 200 MiB: 1 + its bit length
    assert [pods.deletion_cost(mib << 20) for mib in (0, 1, 2, 3, 4, 200, 255, 256)] == [1, 2, 3, 3, 4, 9, 9, 10]


def test_the_source_and_target_of_a_move_may_not_be_disrupted_until_it_ends() -> None:
    # The source handed its request over in the move's first step and reports nothing; the target
    # does not report it yet. Neither holds KV by its report, yet a node autoscaler must leave both.
    empty = {pods.SAFE_TO_EVICT: "true", pods.DO_NOT_DISRUPT: "false", pods.DELETION_COST: "0"}
    infos = [info(0, "gpu-0", annotations=empty), info(1, "gpu-1", annotations=empty)]
    during = plan(infos, targets=("p-worker-1",), moving=("p-worker-0", "p-worker-1")).metadata
    for name in ("p-worker-0", "p-worker-1"):
        assert during[name][1] == {pods.SAFE_TO_EVICT: "false", pods.DO_NOT_DISRUPT: "true"}
    # Once it has ended, an empty source says so again.
    marked = {pods.SAFE_TO_EVICT: "false", pods.DO_NOT_DISRUPT: "true", pods.DELETION_COST: "0"}
    after = plan([info(0, "gpu-0", annotations=marked), info(1, "gpu-1", requests=1, annotations=marked)]).metadata
    assert after["p-worker-0"][1] == {pods.SAFE_TO_EVICT: "true", pods.DO_NOT_DISRUPT: "false"}
    assert after["p-worker-1"][1] == {pods.DELETION_COST: "8"}


def test_finished_pods_are_deleted_and_steady_state_writes_nothing() -> None:
    done = info(1, "gpu-1", live=False)
    assert plan([info(0, "gpu-0", requests=1), done]).delete == ("p-worker-1",)
    # A pod already terminating is not deleted again every epoch.
    assert plan([info(0, "gpu-0", requests=1), info(1, "gpu-1", live=False, deleting=True)]).delete == ()
    settled = info(0, "gpu-0", requests=1, annotations={pods.SAFE_TO_EVICT: "false", pods.DO_NOT_DISRUPT: "true",
                                                        pods.DELETION_COST: "8"})
    assert plan([settled]).metadata == {}


def test_holding_pods_whose_kv_crosses_a_step_are_rewritten_a_few_a_pass_the_most_out_of_date_first() -> None:
    # 20 pods holding 100 MiB (cost 8) that say 2, 3, ... 21: each would be a cost-only rewrite.
    held = {pods.SAFE_TO_EVICT: "false", pods.DO_NOT_DISRUPT: "true"}
    stale = [info(i, f"gpu-{i}", requests=1, annotations={**held, pods.DELETION_COST: str(2 + i)}) for i in range(20)]
    # And lifecycle changes, never deferred: one pod now holding (cost 0 before), one emptied.
    filled = info(20, "gpu-20", requests=1, annotations={**held, pods.DELETION_COST: "0"})
    emptied = info(21, "gpu-21", annotations={**held, pods.DELETION_COST: "8"})
    metadata = plan([*stale, filled, emptied], max_workers=30).metadata
    refreshed = sorted((n for n, (_, notes) in metadata.items() if n.startswith("p-worker-") and n not in
                        ("p-worker-20", "p-worker-21")), key=lambda n: int(n.rsplit("-", 1)[1]))
    assert len(refreshed) == pods.COST_REFRESHES_PER_PASS
    # Furthest from 8 first: 21, 20, ..., then 2 and 3 (6 away) before 13 (5 away); 8 itself is current.
    gaps = sorted(abs(2 + i - 8) for i in range(20) if 2 + i != 8)
    assert sorted(abs(int(n.rsplit("-", 1)[1]) + 2 - 8) for n in refreshed) == gaps[-pods.COST_REFRESHES_PER_PASS:]
    assert all(metadata[n] == ({}, {pods.DELETION_COST: "8"}) for n in refreshed)
    assert metadata["p-worker-20"][1] == {pods.DELETION_COST: "8"}
    assert metadata["p-worker-21"][1] == {pods.SAFE_TO_EVICT: "true", pods.DO_NOT_DISRUPT: "false", pods.DELETION_COST: "0"}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_status_when_all_ready() -> None:
    status = pool_status(POOL, spec(), [pod(0), pod(1)], FIGURES, "T1")
    assert conditions(status) == {"Ready": ("True", "WorkersReady"), "Progressing": ("False", "Stable"),
                                  "Degraded": ("False", "AsExpected"), "WaitingForCapacity": ("False", "CapacityAvailable")}
    assert (status["workers"], status["readyWorkers"], status["desiredWorkers"]) == (2, 2, 2)
    assert status["selector"] == "kvfleet.dev/pool=p,app.kubernetes.io/component=worker"
    assert status["observedGeneration"] == 4
    assert (status["gpusInUse"], status["lowerBoundGpus"], status["kvUtilizationPercent"], status["migrationsInFlight"]) == (2, 1, 50, 1)


def test_status_says_when_workers_max_holds_gpus_back() -> None:
    figures = SchedulingFigures(gpus_in_use=4, waiting_for_max=2)
    cond = {c["type"]: c for c in pool_status(POOL, spec(), [pod(0), pod(1)], figures, "T")["conditions"]}
    assert (cond["WaitingForCapacity"]["status"], cond["WaitingForCapacity"]["reason"]) == ("True", "MaxWorkersReached")
    assert cond["WaitingForCapacity"]["message"] == "2 more GPU(s) needed but workers.max=4 is reached"


def test_status_waiting_for_capacity_carries_the_scheduler_reason() -> None:
    pending = pod(1, phase="Pending", ready=False, scheduled={
        "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."})
    status = pool_status(POOL, spec(), [pod(0), pending], FIGURES, "T1")
    cond = {c["type"]: c for c in status["conditions"]}
    assert cond["WaitingForCapacity"]["status"] == "True"
    assert cond["WaitingForCapacity"]["message"] == "1 worker pod(s) pending: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    assert conditions(status)["Ready"] == ("False", "WorkersNotReady")
    assert conditions(status)["Progressing"] == ("True", "WaitingForWorkers")


def test_status_degraded_on_crash_loop_and_transition_times_kept() -> None:
    first = pool_status(POOL, spec(), [pod(0), pod(1, ready=False, waiting="CrashLoopBackOff")], FIGURES, "T1")
    assert conditions(first)["Degraded"] == ("True", "WorkersCrashing")
    again = pool_status({**POOL, "status": first}, spec(), [pod(0), pod(1, ready=False, waiting="CrashLoopBackOff")], FIGURES,
                                  "T2")
    assert all(c["lastTransitionTime"] == "T1" for c in again["conditions"])
    healed = pool_status({**POOL, "status": again}, spec(), [pod(0), pod(1)], FIGURES, "T3")
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
    assert body["spec"]["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "w", "readOnly": True}},
                                       *resources.SCRATCH_VOLUMES]
    assert container["volumeMounts"] == [{"name": "model", "mountPath": "/models/m", "readOnly": True},
                                         *resources.SCRATCH_MOUNTS]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["KVFLEET_KV_CAPACITY_BYTES"] == str(2**30) and env["X"] == "1"
    assert env["KVFLEET_POOL_TOKEN"] == {"secretKeyRef": {"name": "p-token", "key": "token"}}
    # The migration key is optional (a Secret of an older release has none), and the Secret's name lets
    # the worker re-read it when it rotates.
    assert env["KVFLEET_MIGRATION_KEY"] == {"secretKeyRef": {"name": "p-token", "key": "migration-key", "optional": True}}
    assert env["KVFLEET_POOL_SECRET"] == "p-token"


def test_worker_rbac_is_namespaced_and_creates_only_its_report_and_deletes_nothing() -> None:
    account, role, binding = resources.worker_rbac(POOL)
    assert (account["kind"], role["kind"], binding["kind"]) == ("ServiceAccount", "Role", "RoleBinding")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert not verbs & {"delete", "deletecollection", "escalate", "bind", "impersonate"}
    # Its KVLoad (the admission policy keeps it to its own, e2e/test_worker_report_policy.py).
    assert [r["resources"] for r in role["rules"] if "create" in r["verbs"]] == [["kvloads"]]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "p-worker", "namespace": "ns"}]
    # Of Secrets, the pool's own and only to read it (it rotates while the worker runs).
    secret_rules = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert secret_rules == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["p-token"], "verbs": ["get"]}]


def test_router_objects_are_a_role_reading_the_pool_a_deployment_and_a_service() -> None:
    from kvfleet.operator.resources import router_image, router_objects

    objs = {o["kind"]: o for o in router_objects(POOL, spec())}
    assert sorted(objs) == ["Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]
    assert all(o["metadata"]["name"] == "p-router" and o["metadata"]["ownerReferences"][0]["uid"] == "u-1" for o in objs.values())
    rules = objs["Role"]["rules"]
    assert rules == [
        # patch: its held-requests annotation, which wakes a pool scaled to zero; its own pool only.
        {"apiGroups": ["kvfleet.dev"], "resources": ["llmpools"], "resourceNames": ["p"],
         "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        # The workers' KV-load reports (the router places by them).
        {"apiGroups": ["kvfleet.dev"], "resources": ["kvloads"], "verbs": ["list", "watch"]},
        # The pool's Secret, by name: the router follows its rotation (kvfleet.serving.credentials).
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["p-token"], "verbs": ["get"]}]
    service = objs["Service"]["spec"]
    assert service["type"] == "ClusterIP" and service["ports"][0]["port"] == 80 and service["ports"][0]["targetPort"] == "http"
    pod = objs["Deployment"]["spec"]["template"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    assert objs["Deployment"]["spec"]["selector"]["matchLabels"] == service["selector"]
    assert "kvfleet.dev/pool" not in pod["metadata"]["labels"], "a pool's pod selector must not catch its router"
    container = pod["spec"]["containers"][0]
    assert pod["spec"]["serviceAccountName"] == "p-router" and container["ports"][0]["containerPort"] == 8000
    env = {e["name"]: e for e in container["env"]}
    assert env["KVFLEET_POOL"]["value"] == "p"
    assert env["KVFLEET_POOL_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "p-token", "key": "token"}
    assert env["KVFLEET_POOL_SECRET"]["value"] == "p-token" and "KVFLEET_MIGRATION_KEY" not in env
    assert "nvidia.com/gpu" not in json.dumps(container)
    # The router image is the worker's sibling, same registry and tag; a custom worker image runs the router itself.
    assert router_image("kvfleet/worker:0.1.0") == ("kvfleet/router:0.1.0", None)
    assert router_image("reg.example:5000/kvfleet/worker:0.1.0-cuda") == ("reg.example:5000/kvfleet/router:0.1.0-cuda", None)
    assert router_image("worker") == ("router", None)
    assert router_image("me/llm:1") == ("me/llm:1", ["python", "-m", "kvfleet.router"])
    assert router_image("kvfleet/worker@sha256:" + "0" * 64)[1] == ["python", "-m", "kvfleet.router"]


def test_status_says_whether_the_router_is_ready() -> None:
    figures = SchedulingFigures(gpus_in_use=0, lower_bound_gpus=0, used_bytes=0, migrations_in_flight=0,
                                          waiting_for_max=0)
    status = pool_status(POOL, spec(), [], figures, "2026-01-01T00:00:00Z", router_ready=False)
    assert conditions(status)["RouterReady"] == ("False", "RouterNotReady")
    status = pool_status(POOL, spec(), [], figures, "2026-01-01T00:00:00Z", router_ready=True)
    assert conditions(status)["RouterReady"] == ("True", "RouterAvailable")


def test_reconcile_router_creates_once_rolls_on_a_new_image_and_reports_readiness() -> None:
    from kvfleet.operator.owned import reconcile_router

    pool = {**POOL, "metadata": {**POOL["metadata"], "namespace": "ns"}}
    api = MemoryKube(pool)
    assert reconcile_router(api, "ns", pool, spec()) is False
    assert api.writes() == {"create_deployment": 1, "create_role": 1, "create_rolebinding": 1, "create_service": 1,
                            "create_serviceaccount": 1}
    api.ready_replicas["p-router"] = 1
    assert reconcile_router(api, "ns", pool, spec()) is True
    assert api.writes() == {}, "a pass with nothing changed writes nothing"
    newer = spec(workerTemplate={"image": "reg/kvfleet/worker:0.2.0"})
    reconcile_router(api, "ns", pool, newer)
    assert api.writes() == {"patch_deployment": 1}
    assert api.deployment_image_and_ready("ns", "p-router") == ("reg/kvfleet/router:0.2.0", 1)


def test_a_role_made_by_an_older_release_gets_this_releases_rules() -> None:
    from kvfleet.operator.owned import reconcile_router
    from kvfleet.operator.resources import router_objects

    pool = {**POOL, "metadata": {**POOL["metadata"], "namespace": "ns"}}
    api = MemoryKube(pool)
    reconcile_router(api, "ns", pool, spec())
    api.writes()
    # The router's Role as a release before scale from zero made it: no patch on its pool.
    api.patch_role_rules("ns", "p-router", [{"apiGroups": ["kvfleet.dev"], "resources": ["llmpools"],
                                             "resourceNames": ["p"], "verbs": ["get", "list", "watch"]}])
    api.writes()
    reconcile_router(api, "ns", pool, spec())
    assert api.writes() == {"patch_role": 1}
    want = next(o for o in router_objects(pool, spec()) if o["kind"] == "Role")["rules"]
    assert api.role_rules("ns", "p-router") == want
    reconcile_router(api, "ns", pool, spec())
    assert api.writes() == {}, "rules as this release makes them are not written again"


def test_a_pass_over_a_new_pool_makes_what_it_owns_then_a_quiet_pass_writes_nothing() -> None:
    """The whole pass (kvfleet.operator.reconcile.reconcile_pool) against the in-memory API."""
    from kvfleet.operator import reconcile

    body = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"},
                     "workers": {"min": 2, "max": 4}}}
    api = MemoryKube(body)
    states = reconcile.PoolStates()
    logger = logging.getLogger("test")
    assert reconcile.reconcile_pool("ns", "p", logger, api, states) == spec().scheduling.epoch_seconds
    assert sorted(api.pods) == ["p-worker-0", "p-worker-1"]  # the floor, workers.min
    assert {kind for kind, _ in api.objects} == {"Secret", "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
    assert api.pool["status"]["workers"] == 2 and api.events[0][0] == "ScaleUp"
    state = states.get("ns", "p")
    assert state is not None and state.epoch == 1 and state.last_writes["create_pod"] == 2
    reconcile.reconcile_pool("ns", "p", logger, api, states)  # the floor pods' metadata settles (idle-since)
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    assert state.last_writes == {}, "a pass with nothing changed writes nothing"
    api.pool["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert reconcile.reconcile_pool("ns", "p", logger, api, states) == reconcile.RETRY_S
    assert states.get("ns", "p") is None


def test_a_pass_reads_kvloads_and_during_an_upgrade_old_workers_annotations() -> None:
    """New workers report in their KVLoad, workers from before it in their pod's annotation; a KVLoad
    left by a previous pod of the same name is not the new pod's."""
    from kvfleet.api.reports import ANNOTATION, KVLoadReport, RequestLoad, kvload_object
    from kvfleet.operator import reconcile

    body = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"},
                     "workers": {"min": 3, "max": 4}}}
    api = MemoryKube(body)
    states = reconcile.PoolStates()
    logger = logging.getLogger("test")
    reconcile.reconcile_pool("ns", "p", logger, api, states)

    def load(request_id: str) -> KVLoadReport:
        return KVLoadReport(capacity_bytes=2**30, used_bytes=2**20, sequence=1, requests=[
            RequestLoad(id=request_id, kv_bytes=2**20, tokens=8, size_class="tiny")])

    uid = {name: pod["metadata"]["uid"] for name, pod in api.pods.items()}
    api.kvloads["p-worker-0"] = kvload_object("p-worker-0", uid["p-worker-0"], "p", load("new"))
    api.pods["p-worker-1"]["metadata"]["annotations"][ANNOTATION] = load("old").to_annotation()
    api.kvloads["p-worker-2"] = kvload_object("p-worker-2", "a-previous-pod", "p", load("gone"))
    ctx = reconcile.PassContext(api, "ns", "p", body, LLMPoolSpec.model_validate(body["spec"]), logger)
    reported = {w.pod_name: [r.id for r in w.report.requests] if w.report else None
                for w in reconcile.read_observed(ctx).workers}
    assert reported == {"p-worker-0": ["new"], "p-worker-1": ["old"], "p-worker-2": None}
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    state = states.get("ns", "p")
    assert state is not None and sorted(state.scheduler.sizes) == ["new", "old"]


def test_elastic_memory_gives_workers_one_pool_and_a_cpu_buffer() -> None:
    plain = {e["name"] for e in resources.worker_pod(POOL, spec(engine="builtin"), 0)["spec"]["containers"][0]["env"]}
    assert not {n for n in plain if "MEMORY" in n or "BUFFER" in n}
    s = spec(engine="builtin", capacity={"gpuMemory": "80Gi", "modelWeights": "16Gi", "activationReserveFraction": 0.1},
             elasticMemory={"enabled": True, "cpuBuffer": "32Gi", "ttftMilliseconds": 2000})
    env = {e["name"]: e.get("value") for e in resources.worker_pod(POOL, s, 0)["spec"]["containers"][0]["env"]}
    gib = 2**30
    # KV capacity (80 x 0.9 - 16 = 56 GiB) plus the 8 GiB activation reserve, within 80 - 16 GiB.
    assert env["KVFLEET_MEMORY_BUDGET_BYTES"] == str(64 * gib)
    assert (env["KVFLEET_ELASTIC_MEMORY"], env["KVFLEET_CPU_BUFFER_BYTES"], env["KVFLEET_TTFT_SLO_MS"]) == ("1", str(32 * gib), "2000.0")
    assert "KVFLEET_TPOT_SLO_MS" not in env


def test_elastic_memory_runs_on_vllm_workers_with_their_cpu_buffer_and_objectives() -> None:
    s = spec(engine="vllm", capacity={"gpuMemory": "80Gi", "modelWeights": "16Gi", "activationReserveFraction": 0.1},
             elasticMemory={"enabled": True, "cpuBuffer": "8Gi", "tpotMilliseconds": 50})
    env = {e["name"]: e.get("value") for e in resources.worker_pod(POOL, s, 0)["spec"]["containers"][0]["env"]}
    gib = 2**30
    assert (env["KVFLEET_ENGINE"], env["KVFLEET_ELASTIC_MEMORY"], env["KVFLEET_MEMORY_BUDGET_BYTES"],
            env["KVFLEET_CPU_BUFFER_BYTES"], env["KVFLEET_TPOT_SLO_MS"]) == ("vllm", "1", str(64 * gib), str(8 * gib), "50.0")
    # The budget sizes a vLLM worker's KV cache: the worker refuses a KV capacity beside it.
    assert "KVFLEET_KV_CAPACITY_BYTES" not in env
    # Without elastic memory a vLLM worker is given its KV capacity, as before.
    plain = {e["name"]: e.get("value") for e in resources.worker_pod(POOL, spec(engine="vllm"), 0)["spec"]["containers"][0]["env"]}
    assert plain["KVFLEET_KV_CAPACITY_BYTES"] == str(gib) and "KVFLEET_MEMORY_BUDGET_BYTES" not in plain


def test_no_elastic_memory_setting_depends_on_the_engine_any_more() -> None:
    from kvfleet.api.crdgen import all_crds

    for engine in ({"engine": "vllm"}, {}, {"engine": "builtin"}):  # an absent engine is vllm
        spec(**engine, elasticMemory={"enabled": True, "cpuBuffer": "32Gi", "ttftMilliseconds": 2000, "tpotMilliseconds": 50})
    schema = all_crds()["llmpools.yaml"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert not [r for r in schema["properties"]["spec"]["x-kubernetes-validations"] if "elasticMemory" in r["rule"]]


def test_status_shows_the_capacity_planned_with_and_the_parked_kv() -> None:
    figures = SchedulingFigures(gpus_in_use=2, used_bytes=2**30, capacity_bytes=2**30, cpu_buffer_bytes=5 * 2**20)
    status = pool_status(POOL, spec(), [pod(0), pod(1)], figures, "2026-01-01T00:00:00Z")
    assert (status["kvCapacityPerWorkerBytes"], status["cpuBufferBytes"], status["kvUtilizationPercent"]) == (2**30, 5 * 2**20, 50)


def test_the_pool_replans_when_its_workers_report_another_capacity() -> None:
    from kvfleet.api.reports import KVLoadReport
    from kvfleet.operator import reconcile
    from kvfleet.operator.epoch import WorkerView

    body = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"}}}
    api = MemoryKube(body)
    states = reconcile.PoolStates()
    ctx = reconcile.PassContext(api, "ns", "p", body, spec(), logging.getLogger("test"))

    def workers(*capacities: int) -> list[WorkerView]:
        return [WorkerView(f"p-worker-{i}", f"gpu-{i}", i, "n", "z", True,
                           KVLoadReport(capacity_bytes=c, used_bytes=0, sequence=1)) for i, c in enumerate(capacities)]

    state = reconcile.scheduler_state(ctx, states, workers(2**30 + 2**29, 2**30 + 2**28))
    assert state.scheduler.config.capacity_bytes == 2**30 + 2**28  # the smallest report, from the start
    assert reconcile.scheduler_state(ctx, states, workers(2**30 + 2**28 + 2**20)) is state and api.events == []
    reconcile.scheduler_state(ctx, states, workers(2**30 + 2**29))
    assert state.scheduler.config.capacity_bytes == 2**30 + 2**29
    assert api.events == [("CapacityChanged", "KV capacity per worker now 1536Mi (was 1280Mi), the smallest the workers "
                                              "report", False)]


def test_held_requests_raise_the_floor_to_one_while_the_routers_word_is_fresh() -> None:
    from kvfleet.api.models import HELD_FRESH_S, HELD_REQUESTS_ANNOTATION
    from kvfleet.operator.status import held_requests

    def pool(value: str) -> dict[str, Any]:
        return {"metadata": {"name": "p", "annotations": {HELD_REQUESTS_ANNOTATION: value}}}

    assert held_requests(pool("3 1000.0"), now_unix_s=1000.0 + HELD_FRESH_S) == 3
    assert held_requests(pool("3 1000.0"), now_unix_s=1000.1 + HELD_FRESH_S) == 0  # a router that died said it
    assert held_requests(pool("nonsense"), now_unix_s=1000.0) == 0
    assert held_requests({"metadata": {"name": "p"}}, now_unix_s=1000.0) == 0
    zero = spec(workers={"min": 0, "max": 4})
    assert (floor_workers(zero), floor_workers(zero, held_requests=3), floor_workers(spec(), held_requests=3)) == (0, 1, 2)
    assert floor_workers(spec(workers={"min": 0, "max": 1}, replicas=1), held_requests=3) == 1  # max still caps


def test_status_says_a_pool_scaled_to_zero_is_waking_for_held_requests() -> None:
    zero = spec(workers={"min": 0, "max": 4})
    idle = pool_status(POOL, zero, [], SchedulingFigures(), "2026-11-25T00:00:00Z")
    ready = {c["type"]: c for c in idle["conditions"]}["Ready"]
    assert (idle["desiredWorkers"], ready["status"], ready["reason"], idle["heldRequests"]) == (0, "True", "ScaledToZero", 0)
    waking = pool_status(POOL, zero, [pod(0, phase="Pending", ready=False)],
                         SchedulingFigures(held_requests=2, woken_at="2026-11-25T00:01:00Z"), "2026-11-25T00:01:00Z")
    progressing = {c["type"]: c for c in waking["conditions"]}["Progressing"]
    assert (waking["desiredWorkers"], waking["heldRequests"], waking["lastWokenAt"]) == (1, 2, "2026-11-25T00:01:00Z")
    assert progressing["status"] == "False" or progressing["reason"] in ("WakingUp", "WaitingForWorkers")
    later = pool_status({**POOL, "status": waking}, zero, [], SchedulingFigures(), "2026-11-25T00:09:00Z")
    assert later["lastWokenAt"] == "2026-11-25T00:01:00Z"  # kept until the next wake


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """What keeps a pod spec from the Pod Security Standard "restricted" (the checks of the standard's
    "restricted" profile that apply to what the operator writes), plus a read-only root filesystem."""
    found = []
    pod_ctx = pod_spec.get("securityContext") or {}
    if pod_ctx.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        found.append("seccompProfile")
    for c in pod_spec["containers"]:
        ctx = c.get("securityContext") or {}
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{c['name']}: allowPrivilegeEscalation")
        if ctx.get("capabilities", {}).get("drop") != ["ALL"] or ctx.get("capabilities", {}).get("add"):
            found.append(f"{c['name']}: capabilities")
        if not (ctx.get("runAsNonRoot") or pod_ctx.get("runAsNonRoot")) or ctx.get("runAsUser") == 0 or pod_ctx.get("runAsUser") == 0:
            found.append(f"{c['name']}: runAsNonRoot")
        if ctx.get("privileged"):
            found.append(f"{c['name']}: privileged")
        if not ctx.get("readOnlyRootFilesystem"):
            found.append(f"{c['name']}: readOnlyRootFilesystem")
    if any("hostPath" in v for v in pod_spec.get("volumes", [])):
        found.append("hostPath volume")
    return found


def test_worker_and_router_pods_meet_the_restricted_pod_security_standard() -> None:
    from kvfleet.operator.resources import router_objects

    assert restricted_violations(resources.worker_pod(POOL, spec(), 0)["spec"]) == []
    router = next(o for o in router_objects(POOL, spec()) if o["kind"] == "Deployment")
    assert restricted_violations(router["spec"]["template"]["spec"]) == []
    # A model on a hostPath volume is the user's choice, and the one thing "restricted" refuses.
    on_host = spec(model={"name": "m", "path": "/models/m", "volume": {"hostPath": {"path": "/data/m"}}})
    assert restricted_violations(resources.worker_pod(POOL, on_host, 0)["spec"]) == ["hostPath volume"]
