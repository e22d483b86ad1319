"""Context caching on the real control plane: a pool of three real workers (builtin engine, the tiny
model) with `spec.prefixCaching` on, and its router. Two requests sharing a long text prefix, sent
one after the other through the router, land on the same worker, and the second prefills only its
new tokens: the worker's metrics count its cached prefix as hit tokens (whole KV blocks) and the rest
as prefilled. The router tokenized the text with the worker's tokenizer to match its prompt tree.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import Process, stop_process
from kvfleet.worker.text import Tokenizer
from kvfleet_e2e.pools import metrics, ready

BLOCK = 16
SHARED = " ".join(f"The fleet keeps its caches warm, section {i}." for i in range(40))


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Process]:
    proc = start_operator(cluster, "operator-caching-e2e")
    yield proc
    stop_process(proc)


def complete(ip: str, prompt: str) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"http://{ip}:8000/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as resp:
        result: dict[str, Any] = json.loads(resp.read())
        return result


def test_two_requests_sharing_a_prefix_land_on_one_worker_and_the_second_prefills_only_its_new_tokens(
        cluster: Cluster, namespace: str, operator: Process, model_dir: Path) -> None:
    pool = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": "cached"}, "spec": {
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": "builtin",
        "capacity": {"kvCapacityPerWorker": "16Mi"},
        "workers": {"min": 3, "max": 3},
        "scheduling": {"epochSeconds": 1},
        "prefixCaching": {"enabled": True},
        "workerTemplate": {"image": "kvfleet/worker:dev"},
    }}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pool))

    def ready_pods(selector: str, count: int) -> list[dict[str, Any]] | None:
        assert operator.popen.poll() is None, operator.tail(40)
        pods = [p for p in cluster.get_json("pods", "-n", namespace, "-l", selector)["items"] if ready(p)]
        return pods if len(pods) >= count else None

    workers = wait_for(lambda: ready_pods("kvfleet.dev/pool=cached,app.kubernetes.io/component=worker", 3),
                       "three Ready workers", timeout_s=180, interval_s=0.5)
    env = {e["name"]: e.get("value") for e in workers[0]["spec"]["containers"][0]["env"]}
    assert env.get("KVFLEET_PREFIX_CACHING") == "1"
    router_ip = wait_for(lambda: ready_pods("kvfleet.dev/router=cached", 1), "a Ready router",
                         timeout_s=60, interval_s=0.5)[0]["status"]["podIP"]
    ips = {w["metadata"]["name"]: w["status"]["podIP"] for w in workers}
    tokenizer = Tokenizer(model_dir)
    first, second = SHARED + " First question: why?", SHARED + " Second question: how so?"
    first_ids, second_ids = tokenizer.encode(first), tokenizer.encode(second)
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    assert common > 300

    before = {name: metrics(ip) for name, ip in ips.items()}
    complete(router_ip, first)
    after_first = {name: metrics(ip) for name, ip in ips.items()}
    served = [n for n in ips if after_first[n]["kvfleet_worker_prefilled_tokens"] > before[n]["kvfleet_worker_prefilled_tokens"]]
    assert len(served) == 1, served
    home = served[0]
    assert after_first[home]["kvfleet_worker_prefilled_tokens"] - before[home]["kvfleet_worker_prefilled_tokens"] == len(first_ids)

    complete(router_ip, second)
    after_second = {name: metrics(ip) for name, ip in ips.items()}
    for name in ips:
        if name != home:  # the second request went nowhere else
            assert after_second[name]["kvfleet_worker_prefilled_tokens"] == after_first[name]["kvfleet_worker_prefilled_tokens"]
    hit = after_second[home]["kvfleet_worker_prefix_cache_hit_tokens"] - after_first[home]["kvfleet_worker_prefix_cache_hit_tokens"]
    prefilled = after_second[home]["kvfleet_worker_prefilled_tokens"] - after_first[home]["kvfleet_worker_prefilled_tokens"]
    assert hit == common // BLOCK * BLOCK  # the shared prefix, by whole blocks
    assert prefilled == len(second_ids) - hit  # only the new tokens
    assert after_second[home]["kvfleet_worker_prefix_cache_blocks"] > 0

    # The router matched the text against its prompt tree (it tokenized it as the worker does).
    with urllib.request.urlopen(f"http://{router_ip}:8000/metrics", timeout=30) as resp:
        router_metrics = resp.read().decode()
    matched = [float(line.rpartition(" ")[2]) for line in router_metrics.splitlines()
               if line.startswith("kvfleet_router_prefix_matched_tokens_total ")]
    assert matched and matched[0] >= hit, router_metrics
    cluster.kubectl("delete", "llmpool", "cached", "-n", namespace, "--wait=false")
