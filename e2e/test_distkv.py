"""DistKV on the real control plane (docs/operator.md "DistKV"; Infinite-LLM §4.3-4.5): a request three
times one worker's KV capacity is served by borrowing KV blocks from the other workers of the pool.

A pool of four real workers of either engine (the tiny model, float32 on the CPU: 2 KiB of KV a token)
with a KV capacity C each (`SETUPS`: builtin workers 256 tokens in 16-token blocks, vLLM workers 512
tokens in 128-token blocks) and `spec.distkv` on, each lending at most 90% of C. The operator
publishes every worker's creditors in `status.distkv.candidates`; one request of about 3C goes through
the router to one worker, which admits it on the strength of its own blocks and what the others can
lend, prefills it in chunks and moves its oldest blocks to leases at them (2C at the end). While it
decodes (50 ms a step or more) the pool's status shows the lending: lentBytes, the debtor's debts to
its creditors, the request's span. Once it ends the leases are freed and the status says so within a
few epochs. The stream equals one big worker's greedy output for the same prompt.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet.worker.text import Tokenizer
from kvfleet_e2e.pools import ready
from kvfleet_e2e.real_workers import greedy_outputs, require_vllm, seeded_prompt, stream_completion

NUM_WORKERS = 4
KIB = 2**10
LEND_CAP_FRACTION = 0.9


@dataclass(frozen=True)
class Setup:
    engine: str
    kv_capacity_bytes: int            # C
    request: tuple[str, int, int]     # (request id, prompt tokens, output tokens)


SETUPS = {
    # C = 256 tokens of the tiny model, 16 blocks; 14 lent by each: three lenders hold 42, with the
    # borrower's 16 room for 58. The request: 760 tokens, about 3C (48 blocks), within max_model_len
    # 2048. The prompt alone (42 blocks) is more than the borrower's 16 and one lender's 14: its prefill
    # borrows from two lenders (a lender short of what is asked grants the room it has), its decoding
    # from a third.
    "builtin": Setup("builtin", 512 * KIB, ("distkv-long", 660, 100)),
    # vLLM's CPU blocks are 128 tokens: C = 512 tokens, 4 blocks, 3 lent by each (9 in all). The request:
    # 1,460 tokens, about 3C (12 blocks); vLLM prefills it 256 tokens a step and moves its oldest blocks
    # out as it goes (engines/vllm/borrowing.py).
    "vllm": Setup("vllm", 1024 * KIB, ("distkv-vllm-long", 1400, 60)),
}


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-distkv-e2e")
    yield proc
    stop_process(proc)


def pool(model_dir: Path, setup: Setup) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": f"distkv-{setup.engine}"}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": setup.engine,
        "capacity": {"kvCapacityPerWorker": f"{setup.kv_capacity_bytes // KIB}Ki"},
        # A fixed count: a lender holds KV for the operator, but nothing here may scale a worker away.
        "workers": {"min": NUM_WORKERS, "max": NUM_WORKERS},
        "scheduling": {"epochSeconds": 1},
        "distkv": {"enabled": True, "lendCapFraction": LEND_CAP_FRACTION},
        # 50 ms a step or more: the request decodes for 5 s or more, several epochs to see it in the status.
        # One torch thread a worker: four workers and the router share this machine's few cores, and
        # each step of the borrower waits on three lenders' micro-attentions (7x slower with the default).
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "OMP_NUM_THREADS", "value": "1"},
                                                                  {"name": "KVFLEET_MIN_STEP_S", "value": "0.05"}]},
    }}


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_a_request_three_times_a_workers_kv_borrows_from_the_pool_and_equals_one_big_workers_greedy(
        cluster: Cluster, namespace: str, operator: Process, model_dir: Path, engine: str) -> None:
    if engine == "vllm":
        require_vllm()
    setup = SETUPS[engine]
    POOL, KV_CAPACITY_BYTES = f"distkv-{engine}", setup.kv_capacity_bytes  # noqa: N806
    started_s = time.monotonic()
    request_id, prompt_tokens, max_tokens = setup.request
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool(model_dir, setup)))
    # One big worker's greedy output (sdpa, a cache that holds the whole request), while the pods start.
    reference = greedy_outputs(model_dir, [setup.request], 16 * KV_CAPACITY_BYTES)[request_id]
    want = Tokenizer(model_dir).completion_text(reference)

    def ready_pods(selector: str, count: int) -> list[dict[str, Any]] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = [p for p in cluster.get_json("pods", "-n", namespace, "-l", selector)["items"] if ready(p)]
        return sorted(pods, key=lambda p: p["metadata"]["name"]) if len(pods) >= count else None

    workers = wait_for(lambda: ready_pods(f"kvfleet.dev/pool={POOL},app.kubernetes.io/component=worker", NUM_WORKERS),
                       f"{NUM_WORKERS} Ready workers", timeout_s=300, interval_s=0.5)
    names = {p["metadata"]["name"] for p in workers}
    env = {e["name"]: e.get("value") for e in workers[0]["spec"]["containers"][0]["env"]}
    assert (env["KVFLEET_ATTENTION"], env["KVFLEET_DISTKV"], env["KVFLEET_LEND_CAP_BYTES"]) == (
        "distattention", "1", str(int(LEND_CAP_FRACTION * KV_CAPACITY_BYTES)))
    router = wait_for(lambda: ready_pods(f"kvfleet.dev/router={POOL}", 1), "a Ready router", timeout_s=60, interval_s=0.5)[0]

    def distkv() -> dict[str, Any]:
        assert operator.popen.poll() is None, operator.tail(40)
        st = (cluster.get_json("llmpool", POOL, "-n", namespace, check=False) or {}).get("status") or {}
        return dict(st.get("distkv") or {})

    def plan_published() -> dict[str, Any] | None:
        st = distkv()
        candidates = {c["worker"]: c["creditors"] for c in st.get("candidates") or []}
        if set(candidates) != names:
            return None
        # Every worker may borrow from the three others, each lending about 0.9 C.
        if not all(len(cs) == NUM_WORKERS - 1 for cs in candidates.values()):
            return None
        return st

    published = wait_for(plan_published, "the DistKV plan (creditor candidates for every worker)", timeout_s=60)
    for entry in published["candidates"]:
        for creditor in entry["creditors"]:
            assert creditor["pod"] in names and creditor["pod"] != entry["worker"], entry
            assert creditor["address"].endswith(":8001"), creditor
            assert 0 < creditor["lendableBytes"] <= LEND_CAP_FRACTION * KV_CAPACITY_BYTES, creditor
    assert published.get("lentBytes", 0) == 0 and not published.get("debts") and not published.get("spans"), published

    # A worker reads its candidates from the pool's status itself (kvfleet.worker.distkv.creditors, every
    # few seconds) and admits a request larger than its cache only on what they say they can lend.
    def worker_log(name: str) -> str:
        return "".join(p.read_text(errors="replace")
                       for p in cluster.plane.work_dir.glob(f"agent/pods/{namespace}_{name}_*/worker.log"))

    def read_its_plan(name: str) -> bool:
        lines = [line for line in worker_log(name).splitlines() if "DistKV creditors: " in line]
        return bool(lines) and len(lines[-1].split("DistKV creditors: ")[1].split(", ")) == NUM_WORKERS - 1

    wait_for(lambda: all(read_its_plan(n) for n in names), "every worker to read its creditors", timeout_s=30,
             interval_s=0.25)

    seen: list[dict[str, Any]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(distkv())
            time.sleep(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        body = {"model": "tiny", "prompt": seeded_prompt(prompt_tokens, 0), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        text, completion_tokens, finish = stream_completion(router["status"]["podIP"], request_id, body)
    finally:
        done.set()
        watcher.join(30)
    assert (completion_tokens, finish) == (max_tokens, "length")
    assert text == want, "the borrowed request's output differs from one big worker's greedy output"

    # While it ran the status showed the lending: lent bytes, the debtor's debts, the request's span.
    lending = [st for st in seen if st.get("lentBytes", 0) > 0 and st.get("debts") and st.get("spans")]
    assert lending, f"status.distkv never showed the request's lending: {seen[-5:]}"
    spans = [s for st in lending for s in st["spans"]]
    assert {s["request"] for s in spans} == {request_id}, spans
    debtor = spans[0]["worker"]
    assert debtor in names and all(s["worker"] == debtor and s["borrowedBytes"] > 0 for s in spans), spans
    debts = [d for st in lending for d in st["debts"]]
    assert all(d["debtor"] == debtor and d["creditor"] in names - {debtor} and d["bytes"] > 0 for d in debts), debts
    most = max(lending, key=lambda st: st["lentBytes"])
    # About 2C is lent at the peak (the borrower keeps its newest KV in its own C).
    assert most["lentBytes"] > KV_CAPACITY_BYTES, most
    assert most["borrowedBytes"] == sum(d["bytes"] for d in most["debts"]), most
    assert len({d["creditor"] for st in lending for d in st["debts"]}) >= 2, debts

    # Once it ended the leases are freed and the status says so within a few epochs.
    idle = wait_for(lambda: (st := distkv()) and st.get("lentBytes", 0) == 0 and st.get("borrowedBytes", 0) == 0
                    and st.get("debts") == [] and st.get("spans") == [] and st, "status.distkv without lending",
                    timeout_s=20, interval_s=0.25)
    assert {c["worker"] for c in idle["candidates"]} == names

    logs = "".join(worker_log(n) for n in sorted(names))
    assert "Traceback" not in logs, logs[-4000:]
    print(f"DistKV e2e: {time.monotonic() - started_s:.0f} s from the pool's creation")
