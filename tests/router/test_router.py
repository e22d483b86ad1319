"""The router in front of two real workers (builtin engine, tiny model): what a client gets through it
equals what a worker gives directly (greedy), in every shape; a worker killed mid-stream costs the
client nothing; no worker is a 503, too many requests a 429."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from router_testing import MODEL, TOKEN, Server, serve, start_worker
from worker_testing import TEST_KV_CAPACITY_BYTES, EngineLoop

from kvfleet.api.speed import SpeedProfile, merge_profiles
from kvfleet.mell import SizeClass
from kvfleet.router import app as app_module
from kvfleet.router.app import Router, RouterConfig
from kvfleet.router.placement import PoolSnapshot, ReportedRequest, WorkerState
from kvfleet.router.pool import StaticPoolView
from kvfleet.serving.credentials import PoolCredentials


def snapshot(workers: list[Server]) -> PoolSnapshot:
    return PoolSnapshot(tuple(WorkerState(f"w{i}", w.address, True, i, TEST_KV_CAPACITY_BYTES)
                              for i, w in enumerate(workers)), {})


def start_router(loop: EngineLoop, view: StaticPoolView, **config: Any) -> tuple[Router, Server]:
    router = Router(RouterConfig(pool_name="test", credentials=PoolCredentials.of(TOKEN), **config), view)
    return router, serve(loop, router.app())


@pytest.fixture(scope="module")
def routed(workers: list[Server], engine_loop: EngineLoop) -> Iterator[tuple[Router, Server]]:
    router, server = start_router(engine_loop, StaticPoolView(snapshot(workers)))
    yield router, server
    engine_loop.run(server.runner.cleanup())


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say something long"}], "max_tokens": 20,
            "temperature": 0, "ignore_eos": True, **kw}


def text_of(chunks: list[Any]) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content", "")
                   for c in chunks if c.get("choices"))


def counted(router_obj: Router, counter: str, **labels: str) -> float:
    """A kvfleet_router_<counter>_total count, read from the router's own registry (0 before its first)."""
    return router_obj.metrics.registry.get_sample_value(f"kvfleet_router_{counter}_total", labels) or 0.0


def worker_of(router_obj: Router, request_id: str) -> str:
    pod_name = router_obj.worker_of(request_id)
    assert pod_name is not None, f"request {request_id} is not in flight on any worker"
    return pod_name


@pytest.mark.parametrize(("module", "forbidden"), [
    ("kvfleet.serving.httpapi", ("torch", "transformers", "vllm", "kubernetes", "kopf", "kvfleet.worker")),
    ("kvfleet.router.app", ("torch", "transformers", "vllm", "kopf", "kvfleet.worker")),
])
def test_the_router_and_the_protocol_load_no_worker_and_no_model_runtime(module: str, forbidden: tuple[str, ...]) -> None:
    """The router runs beside the workers, not on a GPU: what it shares with them is in kvfleet.serving."""
    code = (f"import sys, {module}; forbidden = {forbidden!r}\n"
            "sys.exit(int(any(m == f or m.startswith(f + '.') for m in sys.modules for f in forbidden)))")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_completion_through_the_router_equals_the_worker(workers: list[Server], routed: tuple[Router, Server]) -> None:
    _, router = routed
    status, direct = workers[1].post("/v1/completions", completion())
    assert status == 200, direct
    status, whole = router.post("/v1/completions", completion())
    assert status == 200, whole
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == direct["choices"][0]["text"]
    assert whole["usage"] == direct["usage"] and whole["choices"][0]["finish_reason"] == "length"
    chunks = router.stream("/v1/completions", completion(stream_options={"include_usage": True}))
    assert text_of(chunks) == direct["choices"][0]["text"]
    assert chunks[-1]["usage"] == direct["usage"]
    assert all("kvfleet" not in c for c in chunks), "router-mode fields stay between the router and the workers"
    assert len({c["id"] for c in chunks}) == 1


def test_chat_through_the_router_equals_the_worker(workers: list[Server], routed: tuple[Router, Server]) -> None:
    _, router = routed
    _, direct = workers[0].post("/v1/chat/completions", chat())
    status, whole = router.post("/v1/chat/completions", chat())
    assert status == 200, whole
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == direct["choices"][0]["message"]
    assert whole["usage"] == direct["usage"]
    chunks = router.stream("/v1/chat/completions", chat())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert text_of(chunks) == direct["choices"][0]["message"]["content"]


def test_stop_strings_cut_where_the_worker_cuts(workers: list[Server], routed: tuple[Router, Server]) -> None:
    _, router = routed
    _, free = workers[0].post("/v1/completions", completion(max_tokens=30))
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    _, direct = workers[0].post("/v1/completions", completion(max_tokens=30, stop=[stop]))
    _, routed_whole = router.post("/v1/completions", completion(max_tokens=30, stop=[stop]))
    assert routed_whole["choices"][0]["text"] == direct["choices"][0]["text"]
    assert routed_whole["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"] == "stop"
    assert text_of(router.stream("/v1/completions", completion(max_tokens=30, stop=[stop]))) == direct["choices"][0]["text"]


def test_client_errors_come_back_as_the_workers_do(routed: tuple[Router, Server]) -> None:
    _, router = routed
    status, body = router.post("/v1/completions", completion(max_tokens=0))
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = router.post("/v1/completions", completion(model="other"))
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = router.post("/v1/completions", completion(max_tokens=10_000))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, _, raw = router.request("GET", "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL


def test_tokenize_detokenize_and_version_through_the_router_answer_as_a_worker(workers: list[Server],
                                                                              routed: tuple[Router, Server]) -> None:
    _, router = routed
    for path, body in (("/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/detokenize", {"tokens": [5, 6, 7]})):
        assert router.post(path, body) == workers[0].post(path, body)
    status, body = router.post("/tokenize", {"prompt": "x", "frobnicate": 1})
    assert (status, body["error"]["param"]) == (400, "frobnicate")  # refused by the router, no worker asked
    status, _, raw = router.request("GET", "/version")
    assert status == 200 and json.loads(raw) == json.loads(workers[0].request("GET", "/version")[2])


def test_the_router_sizes_requests_with_the_workers_kv_facts(routed: tuple[Router, Server]) -> None:
    router_obj, router = routed
    assert router.post("/v1/completions", completion())[0] == 200
    info = router_obj.model_info.info
    # 2 KV heads x 64 dims x 2 layers x K,V x 4 bytes (worker_testing), read from /internal/requests.
    assert info is not None and info.kv_bytes_per_token == 2048 and info.capacity_bytes == TEST_KV_CAPACITY_BYTES
    assert counted(router_obj, "placements", rule="allocate:new-GPU") >= 1


def test_the_pools_speed_profile_is_each_workers_own_and_their_merge(workers: list[Server],
                                                                   routed: tuple[Router, Server]) -> None:
    _, router = routed
    for worker in workers:  # each has run steps, whatever the tests before did
        assert worker.post("/v1/completions", completion(max_tokens=4))[0] == 200
    time.sleep(0.2)  # a step is recorded once its period ends, just after its last token left
    own = []
    for worker in workers:
        status, _, raw = worker.request("GET", "/kvfleet/speed-profile")
        assert status == 200, raw
        own.append(json.loads(raw))
    status, _, raw = router.request("GET", "/kvfleet/speed-profile")
    assert status == 200, raw
    body = json.loads(raw)
    # The workers are idle: what the router relays is what each serves itself, by pod name.
    assert body["workers"] == {"w0": own[0], "w1": own[1]} and body["unreachable"] == [] and body["unmeasured"] == {}
    assert own[0]["engine"] == "builtin" and own[0]["model"] == MODEL and own[0]["capacityBytes"] == TEST_KV_CAPACITY_BYTES
    merged = SpeedProfile.model_validate(body["merged"])
    assert merged == merge_profiles(SpeedProfile.model_validate(p) for p in own)
    assert merged.num_samples == sum(SpeedProfile.model_validate(p).num_samples for p in own) >= 2 * 4


def test_no_ready_worker_within_the_hold_timeout_is_a_503_with_retry_after(engine_loop: EngineLoop) -> None:
    view = StaticPoolView(PoolSnapshot((), {}))
    _, server = start_router(engine_loop, view, hold_timeout_s=0.5)
    try:
        status, headers, raw = server.request("POST", "/v1/completions", completion())
        body = json.loads(raw)
        assert status == 503 and body["error"]["code"] == "no_ready_worker" and headers["Retry-After"] == "1"
        assert "within 0.5 s" in body["error"]["message"]
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert view.held == 0  # the demand was signalled, and withdrawn when the wait ended
    finally:
        engine_loop.run(server.runner.cleanup())


def test_a_request_held_while_the_pool_has_no_worker_is_served_when_one_is_ready(workers: list[Server],
                                                                                 engine_loop: EngineLoop) -> None:
    import threading

    view = StaticPoolView(PoolSnapshot((), {}))
    router, server = start_router(engine_loop, view, max_held=1)
    try:
        result: dict[str, Any] = {}
        client = threading.Thread(target=lambda: result.update(answer=server.request("POST", "/v1/completions",
                                                                                     completion())))
        client.start()
        deadline = time.monotonic() + 10
        while getattr(view, "held", 0) != 1:
            assert time.monotonic() < deadline, "the request was never held"
            time.sleep(0.02)
        # A second request finds the queue full: 429 at once, with Retry-After.
        status, headers, raw = server.request("POST", "/v1/completions", completion())
        assert status == 429 and json.loads(raw)["error"]["code"] == "pool_waking" and headers["Retry-After"] == "1"
        view.set(snapshot(workers))  # a worker is Ready
        client.join(60)
        status, _, raw = result["answer"]
        assert status == 200 and json.loads(raw)["choices"][0]["text"], raw
        assert view.held == 0
        held = {s.labels["outcome"]: s.value for m in router.metrics.held_outcomes.collect() for s in m.samples
                if s.name.endswith("_total")}
        assert held == {"released": 1.0, "full": 1.0}
    finally:
        engine_loop.run(server.runner.cleanup())


def test_a_pool_without_room_queues_the_request_on_a_worker_instead_of_refusing_it(workers: list[Server],
                                                                                  engine_loop: EngineLoop) -> None:
    # Both workers report being all but full (as their KV-load reports would say): the request is
    # sent anyway, to the emptiest, whose engine queues it until it has blocks (and whose report lets
    # MELL allocate it a GPU). Here the engines are in fact empty, so it is served at once.
    full = tuple(WorkerState(f"w{i}", w.address, True, i, TEST_KV_CAPACITY_BYTES,
                             (ReportedRequest(f"other-{i}", TEST_KV_CAPACITY_BYTES - 4096 * (i + 1), SizeClass.L),))
                 for i, w in enumerate(workers))
    _, server = start_router(engine_loop, StaticPoolView(PoolSnapshot(full, {})))
    try:
        status, _, raw = server.request("POST", "/v1/completions", completion(max_tokens=100))
        assert status == 200, raw
    finally:
        engine_loop.run(server.runner.cleanup())


def test_over_the_in_flight_bound_is_a_429(workers: list[Server], engine_loop: EngineLoop) -> None:
    _, server = start_router(engine_loop, StaticPoolView(snapshot(workers)), max_in_flight=1)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(completion(max_tokens=200, stream=True)).encode(),
                      {"Content-Type": "application/json"})
        first = conn.getresponse()
        assert first.status == 200
        first.readline()  # the first request is being relayed now
        status, headers, raw = server.request("POST", "/v1/completions", completion())
        assert status == 429 and headers["Retry-After"] == "1" and json.loads(raw)["error"]["type"] == "rate_limit_error"
        assert first.read().endswith(b"data: [DONE]\n\n")
        conn.close()
        assert server.post("/v1/completions", completion())[0] == 200  # and admitted again once it ended
    finally:
        engine_loop.run(server.runner.cleanup())


def read_stream(response: http.client.HTTPResponse, received: list[bytes]) -> list[Any]:
    raw = b"".join(received) + response.read()
    events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-500:]
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("mode", ["kv", "token", "hybrid"])
def test_a_stream_followed_across_a_live_migration_is_whole(workers: list[Server], routed: tuple[Router, Server],
                                                            mode: str) -> None:
    """The source ends its router-mode stream with kvfleet.migrated; the router reads the rest from the
    target (docs/migration.md). No token is repeated or lost, and nothing had to be re-prefilled."""
    router_obj, router = routed
    body = completion(max_tokens=300, prompt="Once upon a time, in a land far away")
    _, direct = workers[0].post("/v1/completions", body)
    before = (counted(router_obj, "migrations_followed"), counted(router_obj, "resumes"))
    request_id = f"move-{mode}"
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json", "X-Request-Id": request_id})
    response = conn.getresponse()
    assert response.status == 200
    received = [response.readline() for _ in range(6)]
    source_index = int(worker_of(router_obj, request_id).removeprefix("w"))
    source, target = workers[source_index], workers[1 - source_index]
    status, result = source.post(f"/internal/requests/{request_id}/migrate", {
        "target": {"pod": f"w{1 - source_index}", "address": target.address,
                   "migrationAddress": f"127.0.0.1:{target.agent.migration_port}"}, "mode": mode},
        Authorization=f"Bearer {TOKEN}")
    assert status == 200 and result["phase"] == "Succeeded", result
    chunks = read_stream(response, received)
    assert text_of(chunks) == direct["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert (counted(router_obj, "migrations_followed"), counted(router_obj, "resumes")) == (before[0] + 1, before[1])


def test_a_sampled_request_resumed_after_a_worker_death_keeps_its_draws(tiny_model_dir: Path, engine_loop: EngineLoop,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The router gives a sampled request without a seed one of its own, so the worker that resumes it
    after its first worker died continues the same random stream (builtin engine: per-position draws)."""
    pair = [start_worker(engine_loop, tiny_model_dir) for _ in range(2)]
    alive = list(pair)
    router_obj, router = start_router(engine_loop, StaticPoolView(snapshot(pair)))
    try:
        monkeypatch.setattr(app_module, "new_seed", lambda: 4242)
        body = completion(max_tokens=200, prompt="Once upon a time", temperature=0.9, top_p=0.95)
        _, direct = pair[0].post("/v1/completions", {**body, "seed": 4242})
        _, greedy = pair[0].post("/v1/completions", {**body, "temperature": 0})
        assert direct["choices"][0]["text"] != greedy["choices"][0]["text"], "the request does not sample"
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                     {"Content-Type": "application/json", "X-Request-Id": "kill-sampled"})
        response = conn.getresponse()
        assert response.status == 200
        received = [response.readline() for _ in range(6)]
        victim = pair[int(worker_of(router_obj, "kill-sampled").removeprefix("w"))]
        alive.remove(victim)
        engine_loop.run(victim.runner.cleanup())
        chunks = read_stream(response, received)
        assert counted(router_obj, "resumes") == 1, "the kill did not land mid-stream"
        assert text_of(chunks) == direct["choices"][0]["text"]
    finally:
        engine_loop.run(router.runner.cleanup())
        for server in alive:
            engine_loop.run(server.runner.cleanup())


def test_a_worker_killed_mid_stream_costs_the_client_nothing(workers: list[Server], routed: tuple[Router, Server],
                                                            engine_loop: EngineLoop) -> None:
    """Last in this module: it stops one of the two workers."""
    router_obj, router = routed
    body = completion(max_tokens=300, prompt="Once upon a time")
    _, direct = workers[1].post("/v1/completions", body)
    resumes_before = counted(router_obj, "resumes")
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json", "X-Request-Id": "kill-1"})
    response = conn.getresponse()
    assert response.status == 200
    received = [response.readline() for _ in range(6)]  # a few chunks in
    victim = worker_of(router_obj, "kill-1")
    server = workers[int(victim.removeprefix("w"))]
    engine_loop.run(server.runner.cleanup())
    chunks = read_stream(response, received)
    assert text_of(chunks) == direct["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert counted(router_obj, "resumes") == resumes_before + 1, "the kill did not land mid-stream"
    # The survivor serves new requests, the dead one is skipped without the pool view telling.
    time.sleep(0.1)
    status, again = router.post("/v1/completions", completion())
    assert status == 200 and again["choices"][0]["finish_reason"] == "length"
