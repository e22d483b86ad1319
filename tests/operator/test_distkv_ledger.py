"""DistKV's gManager in the operator (Infinite-LLM §4.3-4.5): reports in, `status.distkv` out, MELL around it.

Exact small cases, no cluster: the ledger and the published candidates (kvfleet.operator.distkv),
DGFM on a debt cycle, spanning requests and lent blocks in MELL's epoch (kvfleet.operator.epoch),
the spec, the workers' environment and Role, and one whole pass against the in-memory API.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet.api.models import DistKVStatus, LLMPoolSpec
from kvfleet.api.reports import ANNOTATION, KVLoadReport, RequestLoad
from kvfleet.mell import PolicyConfig
from kvfleet.operator import distkv, pods, resources
from kvfleet.operator.epoch import PoolScheduler, WorkerView, lent_request_id
from kvfleet.operator.memory import MemoryKube

C = 1000  # bytes of KV per worker


def load(*, used: int = 0, cap: int | None = None, lent: int | None = None, borrowed: dict[str, int] | None = None,
         requests: tuple[RequestLoad, ...] = (), block_size_tokens: int | None = None) -> KVLoadReport:
    return KVLoadReport(capacity_bytes=C, used_bytes=used, sequence=1, requests=list(requests), lend_cap_bytes=cap,
                        lent_bytes=lent, borrowed=borrowed, block_size_tokens=block_size_tokens)


def request(rid: str, kv_bytes: int, borrowed_bytes: int | None = None, tokens: int = 10) -> RequestLoad:
    return RequestLoad(id=rid, kv_bytes=kv_bytes, tokens=tokens, size_class="L", borrowed_bytes=borrowed_bytes)


def worker(index: int, report: KVLoadReport | None, node: str = "node-a", zone: str = "zone-1", *, ip: str | None = None,
           ready: bool = True, gpu: bool = True) -> WorkerView:
    return WorkerView(f"w{index}", f"gpu-{index}" if gpu else None, index, node, zone, ready, report,
                      f"10.0.0.{index}" if ip is None else ip)


def creditors(status: dict[str, Any], name: str) -> list[tuple[str, int]]:
    entry = next(c for c in status["candidates"] if c["worker"] == name)
    return [(c["pod"], c["lendableBytes"]) for c in entry["creditors"]]


# ---- the ledger and status.distkv ----


def test_reports_become_the_published_debts_spans_and_candidates() -> None:
    workers = [
        # w0 runs a long request: 100 bytes of it at w1, 50 at a pod that is not in the pool.
        worker(0, load(used=900, cap=500, borrowed={"w1": 100, "ghost": 50}, requests=(request("long", 900, 100),))),
        # w1 lends 100 of its 500 cap: 400 left under the cap, 900 free. Same node as w0.
        worker(1, load(cap=500, lent=100)),
        worker(2, load(cap=500), node="node-b"),  # same zone, 500 of room
        worker(5, load(used=600, cap=500), node="node-d"),  # same zone, 400 free
        worker(3, load(used=800, cap=500), node="node-c", zone="zone-2"),  # elsewhere, 200 free
        worker(4, load(used=0)),  # no cap: lends nothing
        worker(6, load(cap=500), node="node-b", ready=False),  # not ready: nobody is sent there
    ]
    status = distkv.plan(workers, "ns/p").status
    DistKVStatus.model_validate(status)  # the shape the CRD declares
    assert status["lentBytes"] == 100
    assert status["borrowedBytes"] == 150  # what the workers report, the unknown creditor too
    assert status["debts"] == [{"debtor": "w0", "creditor": "w1", "bytes": 100}]
    assert status["spans"] == [{"request": "long", "worker": "w0", "borrowedBytes": 100}]
    # Closest first (same node, same zone, elsewhere), then most room; no self, no room-less, no unready.
    assert creditors(status, "w0") == [("w1", 400), ("w2", 500), ("w5", 400), ("w3", 200)]
    assert creditors(status, "w1") == [("w0", 100), ("w2", 500), ("w5", 400), ("w3", 200)]
    assert next(c for c in status["candidates"] if c["worker"] == "w0")["creditors"][0]["address"] == "10.0.0.1:8001"
    assert [c["worker"] for c in status["candidates"]] == ["w0", "w1", "w2", "w3", "w4", "w5"]
    assert status["dgfm"] == {"swaps": 0, "swappedBytes": 0, "generation": 0, "recalls": []}


def test_a_creditor_without_an_address_is_not_listed_and_ipv6_is_bracketed() -> None:
    status = distkv.plan([worker(0, load()), worker(1, load(cap=300), ip=""), worker(2, load(cap=200), ip="fd00::2")],
                         "ns/p").status
    assert [c["worker"] for c in status["candidates"]] == ["w0", "w2"]
    entry = next(c for c in status["candidates"] if c["worker"] == "w0")
    assert entry["creditors"] == [{"pod": "w2", "address": "[fd00::2]:8001", "lendableBytes": 200}]


def test_at_most_eight_creditors_are_listed() -> None:
    status = distkv.plan([worker(i, load(cap=100 + i)) for i in range(12)], "ns/p").status
    listed = creditors(status, "w0")
    assert len(listed) == 8 and listed[0] == ("w11", 111)


def test_the_ledger_counts_in_blocks_of_the_engine() -> None:
    # 16-token blocks, 64 bytes a token: a block is 1024 bytes; room is rounded down to whole blocks.
    running = request("r", 2048, tokens=20)  # two blocks for 20 tokens
    reports = [load(used=2048, cap=3000, requests=(running,), block_size_tokens=16)]
    assert distkv.kv_block_bytes(reports) == 1024
    assert distkv.kv_block_bytes([load()]) == 1  # nothing to tell: bytes are the unit
    big = KVLoadReport(capacity_bytes=100_000, used_bytes=2048, sequence=1, requests=[running], lend_cap_bytes=3000,
                       block_size_tokens=16)
    plan = distkv.plan([worker(0, big), worker(1, load())], "ns/p")
    assert plan.ledger.block_bytes == 1024
    assert creditors(plan.status, "w1") == [("w0", 2048)]  # 3000 bytes under the cap: two whole blocks


def test_dgfm_finds_a_two_cycle_and_the_pool_seed_makes_it_repeatable() -> None:
    workers = [worker(0, load(used=300, cap=500, borrowed={"w1": 300})),
               worker(1, load(used=200, cap=500, borrowed={"w0": 200}))]
    plan = distkv.plan(workers, "ns/p")
    recalls = [{"worker": "w0", "creditor": "w1", "bytes": 200, "downToBytes": 100},
               {"worker": "w1", "creditor": "w0", "bytes": 200, "downToBytes": 0}]
    # each of two recalls 200; the first set of recalls is generation 1
    assert plan.status["dgfm"] == {"swaps": 1, "swappedBytes": 400, "generation": 1, "recalls": recalls}
    assert plan.ledger.debt_blocks("w0", "w1") == 300 and plan.dgfm.ledger.debt_blocks("w0", "w1") == 100
    assert plan.dgfm.ledger.debt_blocks("w1", "w0") == 0
    assert distkv.plan(workers, "ns/p").status == plan.status
    assert "the workers on them recall their KV" in distkv.cycle_message(plan.dgfm, plan.ledger.block_bytes)


def test_recalls_keep_their_generation_while_unchanged_and_a_new_set_gets_the_next() -> None:
    cycle = [worker(0, load(used=300, cap=500, borrowed={"w1": 300})),
             worker(1, load(used=200, cap=500, borrowed={"w0": 200}))]
    first = distkv.plan(cycle, "ns/p", previous_status={"distkv": {"dgfm": {"generation": 6, "recalls": []}}})
    assert first.status["dgfm"]["generation"] == 7
    again = distkv.plan(cycle, "ns/p", previous_status={"distkv": first.status})
    assert again.status["dgfm"] == first.status["dgfm"], "the same order is not carried out twice"
    # The swap done: w1's debt is gone, w0 owes 100; no cycle, no recalls, and that is news too.
    done = [worker(0, load(used=300, cap=500, borrowed={"w1": 100})), worker(1, load(used=200, cap=500))]
    after = distkv.plan(done, "ns/p", previous_status={"distkv": again.status})
    assert after.status["dgfm"] == {"swaps": 0, "swappedBytes": 0, "generation": 8, "recalls": []}
    assert distkv.dgfm_changed({"distkv": again.status}, after.status)


def test_with_dgfm_off_cycles_are_reported_and_nothing_is_recalled() -> None:
    cycle = [worker(0, load(used=300, cap=500, borrowed={"w1": 300})),
             worker(1, load(used=200, cap=500, borrowed={"w0": 200}))]
    plan = distkv.plan(cycle, "ns/p", execute=False)
    assert plan.status["dgfm"] == {"swaps": 1, "swappedBytes": 400, "generation": 0, "recalls": []}
    assert "spec.distkv.dgfm is false" in distkv.cycle_message(plan.dgfm, plan.ledger.block_bytes, execute=False)


# ---- MELL around spans and lent blocks ----


def scheduler() -> PoolScheduler:
    return PoolScheduler("mell", PolicyConfig(capacity_bytes=C))


def test_a_spanning_request_is_packed_by_its_local_part_and_never_moved() -> None:
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C),
                                  [worker(0, load(used=700, requests=(request("big", 700),))), worker(1, load())])
    # The router put a spanning request on w1; Allocate would put a plain one of that size beside big.
    spanning = load(used=250, borrowed={"w0": 900}, requests=(request("long", 250, 900),))
    out = sched.epoch([worker(0, load(used=700, requests=(request("big", 700),))), worker(1, spanning)], {}, now_s=1.0)
    assert sched.sizes["long"] == 250
    assert out.moves == () and out.num_deferred_moves == 0
    plain = load(used=250, requests=(request("t", 250),))
    again = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C),
                                  [worker(0, load(used=700, requests=(request("big", 700),))), worker(1, load())])
    moved = again.epoch([worker(0, load(used=700, requests=(request("big", 700),))), worker(1, plain)], {}, now_s=1.0)
    assert [m.request_id for m in moved.moves] == ["t"], "the same request without borrowed blocks would move"
    # Before its first lease its worker says it spans (larger than its cache): not moved either.
    early = load(used=250, requests=(RequestLoad(id="t", kv_bytes=250, tokens=10, size_class="L", spans=True),))
    again = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C),
                                  [worker(0, load(used=700, requests=(request("big", 700),))), worker(1, load())])
    assert again.epoch([worker(0, load(used=700, requests=(request("big", 700),))), worker(1, early)], {},
                       now_s=1.0).moves == ()


def test_lent_blocks_are_load_mell_places_around_them_and_never_moves() -> None:
    lender = load(cap=800, lent=700)
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C), [worker(0, lender), worker(1, load())])
    assert sched.policy.gpu_of(lent_request_id("w0")) == "gpu-0"
    # A 400-byte request the router put on the lender does not fit beside 700 lent bytes: it moves.
    crowded = load(cap=800, lent=700, used=400, requests=(request("r", 400),))
    out = sched.epoch([worker(0, crowded), worker(1, load())], {}, now_s=1.0)
    assert [(m.request_id, m.source_pod, m.target_pod) for m in out.moves] == [("r", "w0", "w1")]
    assert sched.policy.gpu_of(lent_request_id("w0")) == "gpu-0"
    assert all(not m.request_id.startswith("lent:") for m in out.moves)
    assert sched.routes()  # the routing table names GPUs, never the pseudo request
    assert out.used_bytes == 1100  # lent blocks are KV in use


def test_lent_blocks_arriving_later_are_pinned_to_their_worker() -> None:
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C),
                                  [worker(0, load(used=300, requests=(request("a", 300),))), worker(1, load())])
    # w1 starts lending 700; MELL's Allocate alone would put that beside `a` on gpu-0.
    out = sched.epoch([worker(0, load(used=300, requests=(request("a", 300),))), worker(1, load(cap=800, lent=700))],
                      {}, now_s=1.0)
    assert sched.policy.gpu_of(lent_request_id("w1")) == "gpu-1"
    assert out.moves == ()
    # Lent blocks shrink as debts are repaid, and go when the worker lends nothing.
    sched.epoch([worker(0, load(used=300, requests=(request("a", 300),))), worker(1, load(cap=800, lent=200))], {}, now_s=2.0)
    assert sched.sizes[lent_request_id("w1")] == 200 and sched.policy.gpu_of(lent_request_id("w1")) == "gpu-1"
    sched.epoch([worker(0, load(used=300, requests=(request("a", 300),))), worker(1, load(cap=800))], {}, now_s=3.0)
    assert lent_request_id("w1") not in sched.sizes


def test_a_lending_worker_is_not_released_nor_deleted() -> None:
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C), [worker(0, load()), worker(1, load())])
    out = sched.epoch([worker(0, load()), worker(1, load(cap=800, lent=100))], {}, now_s=1.0)
    assert "w1" not in out.released_pods
    info = pods.pod_info({"metadata": {"name": "p-worker-1"}, "status": {"phase": "Running"}}, load(cap=800, lent=100))
    assert info is not None and info.holding
    actions = pods.plan_pods([info], unserved_gpu_ids=(), released_pods=(), migration_targets=(), floor=0, max_workers=4,
                             scale_down_delay_s=0, now_s=100.0)
    assert actions.delete == ()
    assert actions.metadata["p-worker-1"][1][pods.SAFE_TO_EVICT] == "false"


# ---- the spec, the workers' environment and Role ----


def spec(**overrides: Any) -> LLMPoolSpec:
    body: dict[str, Any] = {"model": {"name": "m", "path": "/m"}, "engine": "builtin", "capacity": {"kvCapacityPerWorker": "1Gi"}}
    body.update(overrides)
    return LLMPoolSpec.model_validate(body)


POOL: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 1}}


def test_the_spec_validates_distkv() -> None:
    assert (spec().distkv.enabled, spec().distkv.lend_cap_fraction) == (False, 0.5)
    assert spec(distkv={"enabled": True, "lendCapFraction": 0.25}).lend_cap_bytes() == 2**28
    for bad, field in (({"lendCapFraction": 1.5}, "lendCapFraction"), ({"lendCapFraction": -0.1}, "lendCapFraction"),
                       ({"enabled": True, "lendCap": 0.5}, "lendCap")):
        with pytest.raises(ValidationError) as err:
            spec(distkv=bad)
        assert f"distkv.{field}" in str(err.value)
    # A vLLM worker that borrows moves a request's own blocks, never shared prefix blocks.
    assert spec(engine="vllm", distkv={"enabled": True}).distkv.enabled
    with pytest.raises(ValidationError, match="distkv.enabled on a vllm pool needs prefixCaching.enabled: false"):
        spec(engine="vllm", distkv={"enabled": True}, prefixCaching={"enabled": True})
    assert spec(engine="builtin", distkv={"enabled": True}, prefixCaching={"enabled": True}).prefix_caching.enabled


def env_of(s: LLMPoolSpec) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in resources.worker_pod(POOL, s, 0)["spec"]["containers"][0]["env"]}


def test_workers_get_distattention_and_their_lend_cap_only_when_enabled() -> None:
    env = env_of(spec(distkv={"enabled": True, "lendCapFraction": 0.5}))
    assert (env["KVFLEET_ATTENTION"], env["KVFLEET_DISTKV"], env["KVFLEET_LEND_CAP_BYTES"]) == ("distattention", "1", str(2**29))
    assert not {"KVFLEET_ATTENTION", "KVFLEET_DISTKV", "KVFLEET_LEND_CAP_BYTES"} & set(env_of(spec()))


@pytest.mark.parametrize("engine", ["vllm", "builtin"])
def test_spec_attention_asks_workers_for_distattention_without_distkv(engine: str) -> None:
    env = env_of(spec(engine=engine, attention="distattention"))
    assert env["KVFLEET_ATTENTION"] == "distattention"
    assert not {"KVFLEET_DISTKV", "KVFLEET_LEND_CAP_BYTES"} & set(env)
    assert "KVFLEET_ATTENTION" not in env_of(spec(engine=engine, attention="default"))
    with pytest.raises(ValidationError, match="attention"):
        spec(attention="flash")


def test_the_workers_role_reads_their_own_pool_by_name() -> None:
    role = next(o for o in resources.worker_rbac(POOL) if o["kind"] == "Role")
    assert {"apiGroups": ["kvfleet.dev"], "resources": ["llmpools"], "resourceNames": ["p"], "verbs": ["get"]} in role["rules"]
    assert [r for r in role["rules"] if "llmpools" in r["resources"]][0]["verbs"] == ["get"]  # read only


# ---- one pass against the in-memory API ----


def test_a_pass_publishes_status_distkv_posts_debt_cycle_once_and_a_quiet_pass_writes_nothing() -> None:
    from kvfleet.operator import reconcile

    body = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": dict(POOL["metadata"]),
            "spec": {"model": {"name": "m", "path": "/m"}, "engine": "builtin", "capacity": {"kvCapacityPerWorker": "1Gi"},
                     "workers": {"min": 2, "max": 4}, "distkv": {"enabled": True, "dgfm": True}}}
    api = MemoryKube(body)
    states = reconcile.PoolStates()
    logger = logging.getLogger("test")
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    assert sorted(api.pods) == ["p-worker-0", "p-worker-1"]
    gib = 2**30
    for index, (name, other) in enumerate((("p-worker-0", "p-worker-1"), ("p-worker-1", "p-worker-0"))):
        report = KVLoadReport(capacity_bytes=gib, used_bytes=gib // 4, sequence=1, lend_cap_bytes=gib // 2,
                              lent_bytes=gib // 8, borrowed={other: gib // 8})
        api.pods[name]["metadata"]["annotations"][ANNOTATION] = report.to_annotation()
        api.pods[name]["status"]["podIP"] = f"10.0.0.{index}"
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    status = api.pool["status"]["distkv"]
    assert status["dgfm"] == {"swaps": 1, "swappedBytes": gib // 4, "generation": 1,
                              "recalls": [{"worker": "p-worker-0", "creditor": "p-worker-1", "bytes": gib // 8,
                                           "downToBytes": 0},
                                          {"worker": "p-worker-1", "creditor": "p-worker-0", "bytes": gib // 8,
                                           "downToBytes": 0}]}
    assert status["debts"] == [{"debtor": "p-worker-0", "creditor": "p-worker-1", "bytes": gib // 8},
                               {"debtor": "p-worker-1", "creditor": "p-worker-0", "bytes": gib // 8}]
    assert creditors(status, "p-worker-0") == [("p-worker-1", gib // 2 - gib // 8)]
    assert [e[0] for e in api.events].count("DebtCycle") == 1
    for _ in range(3):
        reconcile.reconcile_pool("ns", "p", logger, api, states)
    state = states.get("ns", "p")
    assert state is not None and state.last_writes == {}, "the same ledger writes nothing and posts no Event again"
    assert [e[0] for e in api.events].count("DebtCycle") == 1
    # DGFM's swaps turned off (the default): the cycle is still reported, nothing is recalled.
    api.pool["spec"]["distkv"] = {"enabled": True}
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    dgfm = api.pool["status"]["distkv"]["dgfm"]
    assert dgfm["swaps"] == 1 and dgfm["recalls"] == [] and dgfm["generation"] == 2
    # Turned off, the pool's status has no distkv any more.
    api.pool["spec"]["distkv"] = {"enabled": False}
    reconcile.reconcile_pool("ns", "p", logger, api, states)
    assert api.pool["status"].get("distkv") is None
