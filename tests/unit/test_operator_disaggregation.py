"""A disaggregated pool in the operator: pods and environment per role, prefill workers kept out of MELL,
the prefill tier's size, and the status that counts both tiers."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from kvfleet.api.models import MAX_POOL_NAME_LENGTH, ROLE_LABEL, LLMPoolSpec, LLMPoolStatus
from kvfleet.api.reports import KVLoadReport, RequestLoad, kvload_object
from kvfleet.operator import pods, prefill, reconcile, resources
from kvfleet.operator.memory import MemoryKube
from kvfleet.operator.status import SchedulingFigures, pool_status

POOL: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 4}}


def spec(**disaggregation: Any) -> LLMPoolSpec:
    """A disaggregated pool (builtin engine, prefix cache on) with `disaggregation` fields on top."""
    return LLMPoolSpec.model_validate({
        "model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"}, "engine": "builtin",
        "workers": {"min": 2, "max": 4}, "prefixCaching": {"enabled": True},
        "disaggregation": {"enabled": True, **disaggregation}})


COLOCATED = LLMPoolSpec.model_validate({"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"},
                                        "engine": "builtin", "prefixCaching": {"enabled": True}})


def env_of(pod: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


# ------------------------------------------------------------------------------------ pods per role


def test_decode_workers_are_the_worker_pods_with_the_decode_role() -> None:
    pod = resources.worker_pod(POOL, spec(), 3, "gpu-1")
    labels = pod["metadata"]["labels"]
    assert pod["metadata"]["name"] == "p-worker-3"
    assert (labels[ROLE_LABEL], labels[resources.GPU_LABEL], labels[resources.INDEX_LABEL]) == ("decode", "gpu-1", "3")
    env = env_of(pod)
    assert (env["KVFLEET_ROLE"], env["KVFLEET_PD_CACHING"], env["KVFLEET_PD_LAYOUT"]) == ("decode", "full", "by-request-aggregated")


def test_a_colocated_pools_workers_have_no_role() -> None:
    pod = resources.worker_pod(POOL, COLOCATED, 0)
    assert ROLE_LABEL not in pod["metadata"]["labels"]
    assert not {name for name in env_of(pod) if name.startswith(("KVFLEET_ROLE", "KVFLEET_PD_"))}
    assert env_of(pod)["KVFLEET_PREFIX_CACHING"] == "1"


def test_a_prefill_worker_is_a_worker_pod_with_the_prefill_role_and_no_gpu_binding() -> None:
    s = spec(layout="by-request", caching="prefill")
    body = resources.prefill_pod(POOL, s, 2)
    worker = resources.worker_pod(POOL, s, 2)
    meta = body["metadata"]
    assert meta["name"] == "p-prefill-2"
    assert meta["labels"][ROLE_LABEL] == "prefill" and meta["labels"][resources.COMPONENT_LABEL] == "worker"
    assert resources.GPU_LABEL not in meta["labels"] and resources.INDEX_LABEL not in meta["labels"]
    container, worker_container = body["spec"]["containers"][0], worker["spec"]["containers"][0]
    # The same container as a worker (it still asks for its GPUs), but for its role's environment.
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1" == container["resources"]["limits"]["nvidia.com/gpu"]
    assert {k: v for k, v in container.items() if k != "env"} == {k: v for k, v in worker_container.items() if k != "env"}
    assert body["spec"] == {**worker["spec"], "containers": body["spec"]["containers"]}
    env = env_of(body)
    assert (env["KVFLEET_ROLE"], env["KVFLEET_PD_CACHING"], env["KVFLEET_PD_LAYOUT"]) == ("prefill", "prefill", "by-request")
    assert {k: v for k, v in env.items() if k != "KVFLEET_ROLE" and k != "KVFLEET_PREFIX_CACHING"} == {
        k: v for k, v in env_of(worker).items() if k != "KVFLEET_ROLE" and k != "KVFLEET_PREFIX_CACHING"}
    assert resources.is_prefill_pod(body) and not resources.is_prefill_pod(worker)


@pytest.mark.parametrize(("caching", "at_prefill", "at_decode"),
                         [("none", False, False), ("prefill", True, False), ("decode", True, True), ("full", True, True)])
def test_the_prefix_cache_runs_where_the_caching_milestone_caches(caching: str, at_prefill: bool, at_decode: bool) -> None:
    s = spec(caching=caching)
    on_prefill = env_of(resources.prefill_pod(POOL, s, 0)).get("KVFLEET_PREFIX_CACHING") == "1"
    on_decode = env_of(resources.worker_pod(POOL, s, 0)).get("KVFLEET_PREFIX_CACHING") == "1"
    assert (on_prefill, on_decode) == (at_prefill, at_decode)


def test_prefill_names_fit_a_hostname_like_the_workers() -> None:
    longest = "a" * MAX_POOL_NAME_LENGTH
    name = resources.prefill_name(longest, 99999)
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name)
    assert resources.prefill_index(name) == 99999 and resources.worker_index(name) is None
    assert resources.prefill_index(resources.worker_name("p", 4)) is None


def test_the_scale_selector_counts_what_status_workers_counts() -> None:
    assert resources.scaled_selector("p", COLOCATED) == resources.worker_selector("p")
    assert resources.scaled_selector("p", spec()) == f"{resources.worker_selector('p')},{ROLE_LABEL}!=prefill"


# ---------------------------------------------------------------------------- MELL never sees them


def test_pod_info_leaves_prefill_workers_to_prefill_pod_info() -> None:
    body = {**resources.prefill_pod(POOL, spec(), 1), "status": {"phase": "Running"}}
    worker = {**resources.worker_pod(POOL, spec(), 1), "status": {"phase": "Running"}}
    assert pods.pod_info(body, None) is None
    info = pods.prefill_pod_info(body, KVLoadReport(capacity_bytes=1, used_bytes=0, sequence=1, queued_prefill_tokens=5))
    assert info is not None and (info.name, info.index, info.gpu_id, info.holding) == ("p-prefill-1", 1, None, True)
    assert pods.prefill_pod_info(worker, None) is None and pods.pod_info(worker, None) is not None
    # A pod named like a worker but labelled prefill is a prefill worker's, never MELL's.
    relabelled = {**worker, "metadata": {**worker["metadata"], "labels": {ROLE_LABEL: "prefill"}}}
    assert pods.pod_info(relabelled, None) is None


def _pool_body(**disaggregation: Any) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"}, "engine": "builtin",
                     "workers": {"min": 1, "max": 4}, "prefixCaching": {"enabled": True},
                     "autoscaling": {"scaleDownDelaySeconds": 0},
                     "disaggregation": {"enabled": True, **disaggregation}}}


def _report(*request_ids: str, queued_prefill_tokens: int | None = None, kv_transfers: int | None = None,
            prefill_tokens_per_second: float | None = None, sequence: int = 1) -> KVLoadReport:
    return KVLoadReport(capacity_bytes=2**30, used_bytes=2**20 * len(request_ids), sequence=sequence,
                        requests=[RequestLoad(id=r, kv_bytes=2**20, tokens=8, size_class="tiny") for r in request_ids],
                        queued_prefill_tokens=queued_prefill_tokens, kv_transfers=kv_transfers,
                        prefill_tokens_per_second=prefill_tokens_per_second)


def _write_report(api: MemoryKube, pod_name: str, report: KVLoadReport) -> None:
    api.kvloads[pod_name] = kvload_object(pod_name, api.pods[pod_name]["metadata"]["uid"], "p", report)


def test_a_pass_makes_both_tiers_and_mell_sees_only_the_decode_workers() -> None:
    api = MemoryKube(_pool_body(prefillWorkers={"min": 2, "max": 3}))
    states = reconcile.PoolStates()
    logger = logging.getLogger("test")
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    assert sorted(api.pods) == ["p-prefill-0", "p-prefill-1", "p-worker-0"]
    assert {n: p["metadata"]["labels"][ROLE_LABEL] for n, p in api.pods.items()} == {
        "p-prefill-0": "prefill", "p-prefill-1": "prefill", "p-worker-0": "decode"}
    assert ("ScaleUp", "created 2 prefill worker pod(s)", False) in api.events

    # The prefill workers are prefilling requests: their KV is not MELL's, and none is placed on them.
    _write_report(api, "p-prefill-0", _report("pre-a", "pre-b", queued_prefill_tokens=100, kv_transfers=7))
    _write_report(api, "p-prefill-1", _report("pre-c", kv_transfers=5))
    _write_report(api, "p-worker-0", _report("dec-a"))
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    body = api.pool
    ctx = reconcile.PassContext(api, "ns", "p", body, LLMPoolSpec.model_validate(body["spec"]), logger)
    observed = reconcile.read_observed(ctx)
    assert [w.pod_name for w in observed.workers] == ["p-worker-0"]
    assert sorted(i.name for i in observed.prefill_infos) == ["p-prefill-0", "p-prefill-1"]
    state = states.get("ns", "p")
    assert state is not None and sorted(state.scheduler.sizes) == ["dec-a"]
    status = LLMPoolStatus.model_validate(api.pool["status"])
    assert {entry.worker for entry in status.routing_table} == {"p-worker-0"}
    assert (status.workers, status.ready_workers, status.lower_bound_gpus, status.gpus_in_use) == (1, 1, 1, 1)
    assert (status.prefill_workers, status.ready_prefill_workers, status.desired_prefill_workers) == (2, 2, 2)
    assert status.kv_transfers == 12
    assert all(resources.GPU_LABEL not in api.pods[n]["metadata"]["labels"] for n in ("p-prefill-0", "p-prefill-1"))
    # Busy prefill workers say so to the autoscalers, as MELL's workers holding KV do.
    assert api.pods["p-prefill-0"]["metadata"]["annotations"][pods.SAFE_TO_EVICT] == "false"


def test_queued_prompts_scale_the_prefill_tier_up_and_idle_ones_go_highest_index_first() -> None:
    api = MemoryKube(_pool_body(prefillWorkers={"min": 1, "max": 3}))
    states = reconcile.PoolStates()
    logger = logging.getLogger("test")
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    assert sorted(api.pods) == ["p-prefill-0", "p-worker-0"]
    # 5,000 tokens queued at 2,000 tokens/s against a 1 s TTFT: 3 workers.
    _write_report(api, "p-prefill-0", _report(queued_prefill_tokens=5000, prefill_tokens_per_second=2000.0))
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    assert sorted(api.pods) == ["p-prefill-0", "p-prefill-1", "p-prefill-2", "p-worker-0"]
    assert api.pool["status"]["desiredPrefillWorkers"] == 3
    # The queue drained, but p-prefill-1 is still prefilling: the idle p-prefill-2 goes, then p-prefill-0
    # (the highest-index idle one) down to min, never the busy one.
    _write_report(api, "p-prefill-0", _report(queued_prefill_tokens=0, sequence=2))
    _write_report(api, "p-prefill-1", _report("busy"))
    for _ in range(3):  # the idle clock starts, then the (zero) delay has passed
        reconcile.reconcile_pool("ns", "p", logger, api, states)
    assert sorted(api.pods) == ["p-prefill-1", "p-worker-0"]
    assert api.pool["status"]["prefillWorkers"] == 1


def test_a_pool_no_longer_disaggregated_lets_its_prefill_workers_go() -> None:
    api = MemoryKube(_pool_body())
    states = reconcile.PoolStates()
    logger = logging.getLogger("test")
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    assert "p-prefill-0" in api.pods
    api.pool["spec"]["disaggregation"]["enabled"] = False
    for _ in range(3):
        reconcile.reconcile_pool("ns", "p", logger, api, states)
    assert sorted(api.pods) == ["p-worker-0"]
    assert (api.pool["status"]["prefillWorkers"], api.pool["status"]["desiredPrefillWorkers"]) == (0, 0)


# ---------------------------------------------------------------------------------- the scaling rule


def test_desired_prefill_workers_is_queued_tokens_over_a_workers_tokens_within_ttft_clamped() -> None:
    def desired(queued: int, speed: float = 1000.0, ttft_s: float = 2.0, lo: int = 1, hi: int = 4) -> int:
        return prefill.desired_prefill_workers(prefill.PrefillDemand(queued, speed, ttft_s), lo, hi)

    assert desired(0) == 1 and desired(0, lo=0) == 0  # min when idle
    assert desired(2000) == 1 and desired(2001) == 2  # ceil: one worker prefills 1,000 x 2 s
    assert desired(6000) == 3 and desired(60_000) == 4  # max caps
    assert desired(6000, ttft_s=0.5) == 4 and desired(6000, speed=6000.0) == 1


def test_the_ttft_objective_and_the_prefill_speed_come_from_the_spec_and_reports_or_documented_defaults() -> None:
    assert prefill.ttft_objective_s(spec()) == prefill.DEFAULT_TTFT_S == 1.0
    timed = LLMPoolSpec.model_validate({**spec().model_dump(by_alias=True), "elasticMemory": {"ttftMilliseconds": 250}})
    assert prefill.ttft_objective_s(timed) == 0.25
    measured = [_report(prefill_tokens_per_second=3000.0), _report(prefill_tokens_per_second=5000.0), _report()]
    decode = [_report(prefill_tokens_per_second=9000.0)]
    assert prefill.prefill_speed_tokens_per_s(measured, decode) == 4000.0  # the prefill workers' mean
    assert prefill.prefill_speed_tokens_per_s([_report()], decode) == 9000.0  # else the decode workers'
    assert prefill.prefill_speed_tokens_per_s([], []) == prefill.CONSERVATIVE_PREFILL_TOKENS_PER_S


def test_queued_tokens_are_the_prefill_workers_unless_there_are_none_to_wake() -> None:
    at_prefill = [_report(queued_prefill_tokens=300), _report(queued_prefill_tokens=200), _report()]
    at_decode = [_report(queued_prefill_tokens=4000)]
    assert prefill.queued_prefill_tokens(at_prefill, at_decode, num_live_prefill=3) == 500
    assert prefill.queued_prefill_tokens([], at_decode, num_live_prefill=0) == 4000
    assert prefill.kv_transfers([_report(kv_transfers=4), _report(), _report(kv_transfers=1)]) == 5
    demand = prefill.PrefillDemand(10**6, 1000.0, 1.0)
    assert prefill.desired_for_pool(COLOCATED, demand) == 0
    assert prefill.desired_for_pool(spec(prefillWorkers={"min": 0, "max": 2}), demand) == 2


def _info(index: int, *, requests: int = 0, queued: int = 0, idle_since: float | None = None, live: bool = True,
          deleting: bool = False) -> pods.PodInfo:
    annotations = {} if idle_since is None else {pods.IDLE_SINCE_ANNOTATION: f"{idle_since:.3f}"}
    return pods.PodInfo(f"p-prefill-{index}", index, None, True, live, deleting, 0, requests, idle_since,
                        {ROLE_LABEL: "prefill"}, annotations, queued_prefill_tokens=queued)


def test_plan_prefill_pods_creates_up_to_desired_at_the_next_index() -> None:
    actions = pods.plan_prefill_pods([_info(0), _info(3, requests=1)], desired=4, scale_down_delay_s=30, now_s=100.0)
    assert actions.create_prefill == (4, 5) and actions.create == () and actions.delete == ()


def test_plan_prefill_pods_deletes_only_after_the_delay_highest_idle_index_first_never_a_busy_one() -> None:
    fresh = pods.plan_prefill_pods([_info(0), _info(1), _info(2)], desired=1, scale_down_delay_s=30, now_s=100.0)
    assert fresh.delete == ()  # idle, but the clock only starts now
    assert {n: m[1][pods.IDLE_SINCE_ANNOTATION] for n, m in fresh.metadata.items()} == {
        f"p-prefill-{i}": "100.000" for i in range(3)}
    infos = [_info(0, idle_since=50.0), _info(1, idle_since=50.0), _info(2, queued=10, idle_since=50.0),
             _info(3, idle_since=90.0)]
    later = pods.plan_prefill_pods(infos, desired=1, scale_down_delay_s=30, now_s=100.0)
    # p-prefill-3: idle for 10 s only; p-prefill-2 has prompts queued; so p-prefill-1, then p-prefill-0
    # (two stay, above desired, until p-prefill-3's delay has passed).
    assert later.delete == ("p-prefill-1", "p-prefill-0")
    assert pods.plan_prefill_pods(infos, desired=3, scale_down_delay_s=30, now_s=100.0).delete == ("p-prefill-1",)
    assert later.metadata["p-prefill-2"][1][pods.IDLE_SINCE_ANNOTATION] is None  # busy again: its clock stops
    gone = pods.plan_prefill_pods([_info(0, idle_since=0.0), _info(1, live=False), _info(2, live=False, deleting=True)],
                                  desired=1, scale_down_delay_s=30, now_s=100.0)
    assert gone.delete == ("p-prefill-1",) and gone.create_prefill == ()


def test_merged_plans_keep_both_tiers_actions() -> None:
    decode = pods.PodActions(((1, "gpu-1"),), ("p-worker-2",), {"p-worker-0": ({}, {"a": "b"})}, ("gpu-9",))
    prefill_plan = pods.PodActions((), ("p-prefill-3",), {"p-prefill-0": ({}, {"c": None})}, (), (4,))
    both = pods.merged(decode, prefill_plan)
    assert both == pods.PodActions(((1, "gpu-1"),), ("p-worker-2", "p-prefill-3"),
                                   {"p-worker-0": ({}, {"a": "b"}), "p-prefill-0": ({}, {"c": None})}, ("gpu-9",), (4,))


# ----------------------------------------------------------------------------------------- status


def _pod(body: dict[str, Any], ready: bool = True) -> dict[str, Any]:
    return {**body, "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_status_counts_decode_workers_as_workers_and_prefill_workers_apart() -> None:
    s = spec()
    observed = [_pod(resources.worker_pod(POOL, s, 0, "gpu-0")), _pod(resources.worker_pod(POOL, s, 1, "gpu-1")),
                _pod(resources.prefill_pod(POOL, s, 0)), _pod(resources.prefill_pod(POOL, s, 1), ready=False)]
    figures = SchedulingFigures(gpus_in_use=2, desired_prefill_workers=2, kv_transfers=9)
    status = pool_status(POOL, s, observed, figures, "2026-01-01T00:00:00Z")
    LLMPoolStatus.model_validate(status)
    assert (status["workers"], status["readyWorkers"], status["desiredWorkers"]) == (2, 2, 2)
    assert (status["prefillWorkers"], status["readyPrefillWorkers"], status["desiredPrefillWorkers"]) == (2, 1, 2)
    assert status["kvTransfers"] == 9 and status["selector"].endswith(f"{ROLE_LABEL}!=prefill")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", "WorkersNotReady")
    assert conditions["Ready"]["message"] == "2/2 workers ready, 1/2 prefill workers ready"
    assert conditions["Progressing"]["reason"] == "WaitingForWorkers"
    settled = pool_status(POOL, s, [*observed[:3], _pod(resources.prefill_pod(POOL, s, 1))], figures, "T2")
    assert {c["type"]: c["reason"] for c in settled["conditions"]}["Ready"] == "WorkersReady"
    short = pool_status(POOL, s, observed[:3], SchedulingFigures(gpus_in_use=2, desired_prefill_workers=3), "T3")
    assert {c["type"]: c["reason"] for c in short["conditions"]}["Progressing"] == "ScalingUp"


def test_a_colocated_pools_status_reads_as_before_with_zero_prefill_workers() -> None:
    observed = [_pod(resources.worker_pod(POOL, COLOCATED, 0))]
    status = pool_status(POOL, COLOCATED, observed, SchedulingFigures(gpus_in_use=1), "T1")
    assert (status["prefillWorkers"], status["readyPrefillWorkers"], status["desiredPrefillWorkers"], status["kvTransfers"]) == (
        0, 0, 0, 0)
    assert status["selector"] == resources.worker_selector("p")
    assert {c["type"]: c["message"] for c in status["conditions"]}["Ready"] == "1/1 workers ready"
