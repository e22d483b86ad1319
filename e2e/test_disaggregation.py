"""Disaggregated prefill and decode on the real control plane (docs/disaggregation.md): an LLMPool with
`spec.disaggregation` (builtin engine, the tiny model) gets prefill and decode worker pods, labelled by
role and counted in its status; its router prefills each request on the prefill worker, which hands it
to the decode worker, and the client reads one whole stream equal to colocated greedy output. Under
full caching (MemServe §5, PD-Caching-3) the decode worker sends the answer's KV back, and the next
turn prefills on the prefill worker only its new tokens. A prefill worker killed while its hand-over
hangs loses no stream: the router has the request prefilled again where it decodes.
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet.worker.text import Tokenizer
from kvfleet_e2e.pools import metrics, ready
from kvfleet_e2e.processes import signal_group, worker_pid
from kvfleet_e2e.real_workers import greedy_outputs, seeded_prompt, stream_completion
from kvfleet_e2e.reports import worker_reports

POOL = "disagg"
BLOCK = 16


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-disaggregation-e2e")
    yield proc
    stop_process(proc)


def transferred(ip: str) -> float:
    return metrics(ip).get('kvfleet_worker_kv_transfers_total{layout="by-request-aggregated",outcome="transferred"}', 0.0)


def greedy_ids(ip: str, prompt: list[int], max_tokens: int) -> list[int]:
    """A worker's own greedy output, read in router mode (token ids in every chunk), no hand-over."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    request = urllib.request.Request(f"http://{ip}:8000/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "X-Kvfleet-Stream": "tokens"})
    ids: list[int] = []
    with urllib.request.urlopen(request, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                ids += json.loads(line[6:]).get("kvfleet", {}).get("token_ids", [])
    return ids


def test_a_disaggregated_pool_serves_whole_streams_and_reuses_decode_kv_at_the_prefill_worker(
        cluster: Cluster, namespace: str, operator: Process, model_dir: Path) -> None:
    pool = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": POOL}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": "16Mi"},
        "workers": {"min": 1, "max": 1},
        "scheduling": {"epochSeconds": 1},
        "prefixCaching": {"enabled": True},
        "disaggregation": {"enabled": True, "prefillWorkers": {"min": 1, "max": 1}, "caching": "full",
                           "choice": "always"},
        "workerTemplate": {"image": "kvfleet/worker:dev"},
    }}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool))
    reference: dict[str, list[int]] = {}
    computing = threading.Thread(target=lambda: reference.update(greedy_outputs(
        model_dir, [("first", 200, 64), ("killed", 120, 300)], 16 * 2**20)), daemon=True)
    computing.start()

    def pods_of(role: str) -> list[dict[str, Any]] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = [p for p in cluster.get_json("pods", "-n", namespace, "-l",
                                             f"kvfleet.dev/pool={POOL},kvfleet.dev/role={role}")["items"] if ready(p)]
        return pods or None

    prefill = wait_for(lambda: pods_of("prefill"), "a Ready prefill worker", timeout_s=180, interval_s=0.5)[0]
    decode = wait_for(lambda: pods_of("decode"), "a Ready decode worker", timeout_s=180, interval_s=0.5)[0]
    assert prefill["metadata"]["name"].startswith(f"{POOL}-prefill-")
    env = {e["name"]: e.get("value") for e in prefill["spec"]["containers"][0]["env"]}
    assert (env["KVFLEET_ROLE"], env["KVFLEET_PD_CACHING"], env.get("KVFLEET_PREFIX_CACHING")) == ("prefill", "full", "1")
    router_ip = wait_for(lambda: [p for p in cluster.get_json("pods", "-n", namespace, "-l", f"kvfleet.dev/router={POOL}")[
        "items"] if ready(p)] or None, "a Ready router", timeout_s=60, interval_s=0.5)[0]["status"]["podIP"]
    # `kubectl get llmpools` shows the prefill workers beside the decode ones.
    wait_for(lambda: (cluster.get_json("llmpool", POOL, "-n", namespace).get("status") or {}).get("readyPrefillWorkers") == 1,
             "the status to count the prefill worker", timeout_s=60, interval_s=0.5)
    table = cluster.kubectl("get", "llmpools", "-n", namespace).stdout
    assert "PREFILL" in table.splitlines()[0], table

    p_ip, d_ip = prefill["status"]["podIP"], decode["status"]["podIP"]
    computing.join(300)
    assert reference, "the greedy reference was not computed"
    tokenizer = Tokenizer(model_dir)

    # Turn 1: prefilled on P, decoded on D, one whole stream equal to colocated greedy output.
    before = transferred(p_ip)
    first_prompt = seeded_prompt(200, 0)
    text, tokens, finish = stream_completion(router_ip, "pd-first", {
        "model": "tiny", "prompt": first_prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True})
    assert (tokens, finish) == (64, "length")
    assert text == tokenizer.completion_text(reference["first"])
    assert transferred(p_ip) == before + 1
    # PD-Caching-3: the decode worker sent the answer's KV back to the prefill worker's cache.
    wait_for(lambda: metrics(p_ip).get("kvfleet_worker_kv_returned_blocks_total", 0) > 0,
             "the decode phase's KV back at the prefill worker", timeout_s=30, interval_s=0.3)

    # Turn 2: the conversation so far and a new question; P prefills only past what came back.
    conversation = first_prompt + greedy_ids(d_ip, first_prompt, 64)
    assert conversation[len(first_prompt):] == reference["first"]
    second_prompt = conversation + seeded_prompt(40, 7)[1:]
    hits = metrics(p_ip)["kvfleet_worker_prefix_cache_hit_tokens"]
    stream_completion(router_ip, "pd-second", {"model": "tiny", "prompt": second_prompt, "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True})
    hit = metrics(p_ip)["kvfleet_worker_prefix_cache_hit_tokens"] - hits
    # Prompt + answer but its last token (whose KV is never computed), by whole blocks: more than the
    # first prompt alone, which is all P would hold without the decode worker's KV.
    assert hit == (len(conversation) - 1) // BLOCK * BLOCK > len(first_prompt)

    # The status sums the prefill worker's hand-overs.
    wait_for(lambda: (cluster.get_json("llmpool", POOL, "-n", namespace).get("status") or {}).get("kvTransfers", 0) >= 2,
             "the status to count the transfers", timeout_s=60, interval_s=0.5)

    # A prefill worker killed while its hand-over hangs (the decode worker stopped: the handshake
    # waits): the router prefills the request again where it decodes, and the stream stays whole.
    d_pid, p_pid = worker_pid(decode), worker_pid(prefill)
    result: list[tuple[str, int, str | None]] = []
    body = {"model": "tiny", "prompt": seeded_prompt(120, 1), "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    signal_group(d_pid, signal.SIGSTOP)
    try:
        client = threading.Thread(target=lambda: result.append(stream_completion(router_ip, "pd-killed", body)))
        client.start()
        def on_prefill_worker() -> bool:
            report = worker_reports(cluster, namespace, POOL).get(prefill["metadata"]["name"])
            return report is not None and "pd-killed" in {r.id for r in report.requests}

        wait_for(on_prefill_worker, "the request on the prefill worker", timeout_s=30, interval_s=0.2)
        signal_group(p_pid, signal.SIGKILL)
    finally:
        signal_group(d_pid, signal.SIGCONT)
    client.join(300)
    assert result, "the stream never ended"
    text, tokens, finish = result[0]
    assert (tokens, finish) == (300, "length")
    assert text == tokenizer.completion_text(reference["killed"])
    cluster.kubectl("delete", "llmpool", POOL, "-n", namespace, "--wait=false")
