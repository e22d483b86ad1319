"""Disaggregated prefill and decode between two real agents (kvfleet.worker.disaggregation).

A prefill worker P is sent a request naming a decode worker D (as the router sends it); P prefills it,
streams the first token and hands it over; the rest comes from D. The caching milestones of
"MemServe: Flexible Mem Pool for Building Disaggregated LLM Serving with Caching" §5 (Figure 4) are
checked by what crosses and what each side's prefix cache then serves.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from migration_testing import (
    TOKEN,
    Streamed,
    Worker,
    follow_target,
    read_sse,
    reference,
    serve_app,
    start_worker,
)
from worker_testing import EngineLoop, SharedEngine, StartedEngine, start_engine

from kvfleet.router.app import Router, RouterConfig
from kvfleet.router.placement import PDSettings, PoolSnapshot, WorkerState
from kvfleet.router.pool import StaticPoolView
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.serving.httpapi import DecodeTarget, header_of
from kvfleet.worker.disaggregation import PDConfig
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.migration.wire import kv_parts

PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[tuple[Worker, Worker]]:
    workers = []
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        engine = load_engine("builtin", EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=8 * 1024 * 1024,
                                                     max_model_len=1024, prefix_caching=True))
        workers.append(start_worker(name, tiny_model_dir, engine_loop, engine=engine,
                                    disaggregation=PDConfig(role=role)))  # type: ignore[arg-type]
    yield workers[0], workers[1]
    for w in workers:
        engine_loop.run(w.runner.cleanup())


def body(prompt: str | list[int] = PROMPT, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


def decode_target(decode: Worker) -> DecodeTarget:
    return DecodeTarget(decode.name, decode.address, f"127.0.0.1:{decode.agent.migration_port}")


def post(worker: Worker, request_id: str, payload: dict[str, Any], target: DecodeTarget | None,
         token: str | None = TOKEN, extra: dict[str, str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=120)
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id, "X-Kvfleet-Stream": "tokens"}
    if target is not None:
        headers.update(target.header())
    headers.update(extra or {})
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request("POST", "/v1/completions", json.dumps(payload).encode(), headers)
    return conn.getresponse()


def disaggregated(prefill: Worker, decode: Worker, request_id: str, payload: dict[str, Any]) -> tuple[Streamed, Streamed]:
    """What the router reads: the prefill worker's stream, ended by the hand-off, then the decode worker's."""
    response = post(prefill, request_id, payload, decode_target(decode))
    assert response.status == 200, response.read()
    head = read_sse(response)
    event, data = head.events[-1]
    assert event == "kvfleet.migrated", head.events
    moved = json.loads(data)
    assert moved["target"]["pod"] == decode.name
    return head, follow_target(decode, request_id, int(moved["index"]))


def token_ids(*streams: Streamed) -> list[int]:
    return [t for s in streams for c in s.chunks if "kvfleet" in c for t in c["kvfleet"]["token_ids"]]


def transfers(worker: Worker, outcome: str = "transferred", layout: str = "by-request-aggregated") -> float:
    value = worker.agent.metrics.registry.get_sample_value("kvfleet_worker_kv_transfers_total",
                                                           {"layout": layout, "outcome": outcome})
    return value or 0.0


def counter(worker: Worker, name: str) -> float:
    return worker.agent.metrics.registry.get_sample_value(name) or 0.0


def wait_for(check: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def idle(*workers: Worker) -> None:
    wait_for(lambda: all(not w.agent.engine.kv_usage() for w in workers))


def test_a_request_prefilled_on_one_worker_decodes_on_the_other_as_one_whole_stream(pd: tuple[Worker, Worker]) -> None:
    prefill, decode = pd
    prefill.agent.handovers.config = PDConfig("prefill", "none")  # type: ignore[union-attr]
    _, expected = reference(decode, body(max_tokens=MAX_TOKENS))
    before = transfers(prefill)
    head, rest = disaggregated(prefill, decode, "pd-basic", body())
    assert rest.done
    # The prefill worker goes on decoding only while it connects to the decode worker (a few steps of
    # this tiny model), then stops it and sends its KV in one stage: most of the output is D's.
    assert 1 <= len(token_ids(head)) < MAX_TOKENS // 4
    assert token_ids(head, rest) == expected
    assert head.text + rest.text == reference(decode, body())[0]
    assert transfers(prefill) == before + 1
    # Both report their role's figures: the operator sizes the prefill tier by the queued prompt tokens
    # and sums the prefill workers' hand-overs in the pool's status; a hand-over alone is news (the
    # request came and went within one report interval, leaving the requests as they were).
    wait_for(lambda: prefill.reports and prefill.reports[-1].kv_transfers == prefill.agent.transfer_metrics.count)
    requests_before = [r.id for r in prefill.reports[-1].requests]
    disaggregated(prefill, decode, "pd-basic-again", body())
    wait_for(lambda: prefill.reports[-1].kv_transfers == prefill.agent.transfer_metrics.count)
    assert [r.id for r in prefill.reports[-1].requests] == requests_before
    assert decode.reports[-1].queued_prefill_tokens == 0 and decode.reports[-1].kv_transfers is None
    idle(prefill, decode)


def test_the_decode_worker_is_sent_only_the_blocks_its_cache_lacks(pd: tuple[Worker, Worker]) -> None:
    """PD-Caching-2 (`transfer_with_insert`): the decode worker caches what it decoded; a later request
    with the same prompt is handed over without the blocks it holds."""
    prefill, decode = pd
    prefill.agent.handovers.config = PDConfig("prefill", "decode")  # type: ignore[union-attr]
    prompt = PROMPT + " and the cat"
    disaggregated(prefill, decode, "pd-cache-d-1", body(prompt))
    idle(prefill, decode)
    cached_before, bytes_before = counter(prefill, "kvfleet_worker_kv_transfer_cached_blocks_total"), \
        counter(prefill, "kvfleet_worker_kv_transfer_bytes_total")
    decode_cache = decode.agent.engine.capabilities.prefix_cache
    assert decode_cache is not None
    decode_hits = decode_cache.prefix_cache_stats().hit_tokens
    head, rest = disaggregated(prefill, decode, "pd-cache-d-2", body(prompt))
    _, expected = reference(prefill, body(prompt))
    assert token_ids(head, rest) == expected
    prompt_blocks = len(decode.agent.tokenizer.encode(prompt)) // decode.agent.engine.info.block_size_tokens
    assert counter(prefill, "kvfleet_worker_kv_transfer_cached_blocks_total") - cached_before == prompt_blocks
    # The decode worker counts what its cache served as hits, as a prefill from its cache would.
    bs = decode.agent.engine.info.block_size_tokens
    assert decode_cache.prefix_cache_stats().hit_tokens - decode_hits == prompt_blocks * bs
    # Only the prompt's partial last block crossed (and its first output token).
    block_bytes = decode.agent.engine.info.block_size_tokens * decode.agent.engine.info.kv_bytes_per_token
    assert counter(prefill, "kvfleet_worker_kv_transfer_bytes_total") - bytes_before == block_bytes
    idle(prefill, decode)


def test_the_decode_worker_caches_a_prompt_it_received_while_the_request_still_runs(
        pd: tuple[Worker, Worker]) -> None:
    """The imported prompt joins the decode worker's cache at once (MemServe's transfer_with_insert), not
    only when its request ends: a request with the same prompt meanwhile shares it."""
    prefill, decode = pd
    prefill.agent.handovers.config = PDConfig("prefill", "decode")  # type: ignore[union-attr]
    cache = decode.agent.engine.capabilities.prefix_cache
    assert cache is not None
    prompt = "a prompt the decode worker has not seen, " + PROMPT
    prompt_blocks = len(decode.agent.tokenizer.encode(prompt)) // decode.agent.engine.info.block_size_tokens
    response = post(prefill, "pd-insert-early", body(prompt, max_tokens=400), decode_target(decode))
    head = read_sse(response)
    event, data = head.events[-1]
    assert event == "kvfleet.migrated"
    # The hand-over's commit answered after the request's first token on the decode worker: it runs there.
    running = {r.request_id for r in decode.agent.engine.kv_usage()}
    assert "pd-insert-early" in running
    hits = cache.prefix_cache_stats().hit_tokens
    # The same prompt, straight to the decode worker while the first still decodes there: a cache hit.
    reference(decode, body(prompt, max_tokens=4))
    assert cache.prefix_cache_stats().hit_tokens - hits == prompt_blocks * decode.agent.engine.info.block_size_tokens
    rest = follow_target(decode, "pd-insert-early", int(json.loads(data)["index"]))
    assert rest.done
    idle(prefill, decode)


def test_full_caching_sends_the_decode_phase_back_so_the_next_turn_prefills_only_its_new_tokens(
        pd: tuple[Worker, Worker]) -> None:
    """PD-Caching-3: the next turn (prompt + answer + a new question) finds the whole conversation
    cached on the prefill worker, the answer's blocks included."""
    prefill, decode = pd
    prefill.agent.handovers.config = PDConfig("prefill", "full")  # type: ignore[union-attr]
    tokenizer = prefill.agent.tokenizer
    first = tokenizer.encode("a conversation about ships " + PROMPT)
    received = counter(prefill, "kvfleet_worker_kv_returned_blocks_total")
    head, rest = disaggregated(prefill, decode, "pd-full-1", body(first, max_tokens=64))
    answer = token_ids(head, rest)
    wait_for(lambda: counter(prefill, "kvfleet_worker_kv_returned_blocks_total") > received)
    bs = prefill.agent.engine.info.block_size_tokens
    conversation = first + answer
    # The decode worker cached prompt + answer but the last token (its KV is never computed).
    assert counter(prefill, "kvfleet_worker_kv_returned_blocks_total") - received == \
        (len(conversation) - 1) // bs - len(first) // bs
    cache = prefill.agent.engine.capabilities.prefix_cache
    assert cache is not None
    hits = cache.prefix_cache_stats().hit_tokens
    second = conversation + tokenizer.encode(" and then what happened to the ships")
    head2, rest2 = disaggregated(prefill, decode, "pd-full-2", body(second, max_tokens=8))
    assert cache.prefix_cache_stats().hit_tokens - hits == (len(conversation) - 1) // bs * bs
    assert token_ids(head2, rest2) == reference(decode, body(second, max_tokens=8))[1]
    idle(prefill, decode)


def test_the_by_request_layout_sends_one_frame_per_layer_k_or_v_and_block(pd: tuple[Worker, Worker]) -> None:
    prefill, decode = pd
    prefill.agent.handovers.config = PDConfig("prefill", "none", "by-request")  # type: ignore[union-attr]
    prompt = "a fresh prompt nobody cached, " + PROMPT
    sends = prefill.agent.metrics.registry.get_sample_value("kvfleet_worker_kv_transfer_sends_total",
                                                            {"layout": "by-request"}) or 0.0
    sent_bytes = counter(prefill, "kvfleet_worker_kv_transfer_bytes_total")
    head, rest = disaggregated(prefill, decode, "pd-by-request", body(prompt))
    assert token_ids(head, rest) == reference(prefill, body(prompt))[1]
    info = prefill.agent.engine.info
    num_blocks = (counter(prefill, "kvfleet_worker_kv_transfer_bytes_total") - sent_bytes) // (
        info.block_size_tokens * info.kv_bytes_per_token)
    migration = prefill.agent.engine.capabilities.migration
    assert migration is not None and num_blocks >= 2
    layers = migration.kv_format().layers
    after = prefill.agent.metrics.registry.get_sample_value("kvfleet_worker_kv_transfer_sends_total",
                                                            {"layout": "by-request"})
    assert after == sends + kv_parts(torch.empty(layers, 2, int(num_blocks))) == sends + layers * 2 * num_blocks
    assert transfers(prefill, layout="by-request") >= 1
    idle(prefill, decode)


def test_a_request_whose_decode_worker_is_unreachable_decodes_where_it_was_prefilled(
        pd: tuple[Worker, Worker]) -> None:
    prefill, _ = pd
    prefill.agent.handovers.config = PDConfig("prefill", "none")  # type: ignore[union-attr]
    before = transfers(prefill, "decoded_here")
    response = post(prefill, "pd-nowhere", body(), DecodeTarget("gone", "127.0.0.1:9", "127.0.0.1:9"))
    streamed = read_sse(response)
    assert streamed.done
    assert token_ids(streamed) == reference(prefill, body())[1]
    assert transfers(prefill, "decoded_here") == before + 1
    idle(prefill)


def test_a_hand_over_the_first_decode_worker_refuses_goes_to_the_next(pd: tuple[Worker, Worker]) -> None:
    """A decode worker without room (or gone) refuses before the request stops: the prefill worker tries
    the next the router named, and only when none takes it decodes it itself."""
    prefill, decode = pd
    prefill.agent.handovers.config = PDConfig("prefill", "none")  # type: ignore[union-attr]
    alternates = counter(prefill, "kvfleet_worker_kv_transfer_alternates_total")
    before = transfers(prefill)
    gone = DecodeTarget("gone", "127.0.0.1:9", "127.0.0.1:9")
    response = post(prefill, "pd-alternate", body(), None, extra=header_of((gone, decode_target(decode))))
    head = read_sse(response)
    event, data = head.events[-1]
    assert event == "kvfleet.migrated" and json.loads(data)["target"]["pod"] == decode.name
    rest = follow_target(decode, "pd-alternate", int(json.loads(data)["index"]))
    assert token_ids(head, rest) == reference(decode, body())[1]
    assert counter(prefill, "kvfleet_worker_kv_transfer_alternates_total") == alternates + 1
    assert transfers(prefill) == before + 1
    idle(prefill, decode)


def test_naming_a_decode_worker_needs_the_pool_token(pd: tuple[Worker, Worker]) -> None:
    prefill, decode = pd
    response = post(prefill, "pd-no-token", body(), decode_target(decode), token=None)
    assert response.status == 401
    response = post(prefill, "pd-bad-header", body(), None)
    response.read()
    conn = http.client.HTTPConnection("127.0.0.1", prefill.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body()).encode(),
                 {"Content-Type": "application/json", "X-Kvfleet-Stream": "tokens", "X-Kvfleet-Decode-Target": "{",
                  "Authorization": f"Bearer {TOKEN}"})
    bad = conn.getresponse()
    assert bad.status == 400
    assert "X-Kvfleet-Decode-Target" in json.loads(bad.read())["error"]["message"]


# ------------------------------------------------------------------------------------ through a router


@pytest.fixture(scope="module")
def router(pd: tuple[Worker, Worker], engine_loop: EngineLoop) -> Iterator[tuple[Router, int]]:
    """A router over the two workers as a disaggregated pool's view shows them (roles from pod labels)."""
    prefill, decode = pd
    workers = tuple(WorkerState(w.name, w.address, True, i, 8 * 1024 * 1024, role=role,
                                migration_address=f"127.0.0.1:{w.agent.migration_port}")
                    for i, (w, role) in enumerate(((prefill, "prefill"), (decode, "decode"))))
    view = StaticPoolView(PoolSnapshot(workers, {}, locality="prompt-tree",
                                       disaggregation=PDSettings(caching="full", choice="always")))
    router = Router(RouterConfig(pool_name="test", credentials=PoolCredentials.of(TOKEN)), view)
    runner, port = serve_app(engine_loop, router.app())
    yield router, port
    engine_loop.run(runner.cleanup())


def through(port: int, payload: dict[str, Any]) -> Streamed:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(payload).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return read_sse(response)


def placements(router: Router, rule: str) -> float:
    return router.metrics.registry.get_sample_value("kvfleet_router_placements_total", {"rule": rule}) or 0.0


def test_a_router_serves_a_disaggregated_pool_one_whole_stream_per_request(
        pd: tuple[Worker, Worker], router: tuple[Router, int]) -> None:
    prefill, decode = pd
    prefill.agent.handovers.config = PDConfig("prefill", "full")  # type: ignore[union-attr]
    app, port = router
    before = transfers(prefill)
    prompt = "a router's request, " + PROMPT
    streamed = through(port, body(prompt))
    assert streamed.done
    assert streamed.text == reference(decode, body(prompt))[0]
    assert transfers(prefill) == before + 1
    assert sum(placements(app, rule) for rule in ("pd:least-loaded", "pd:least-queued", "pd:prefix")) >= 1
    assert app.metrics.registry.get_sample_value("kvfleet_router_time_to_second_token_seconds_count") >= 1
    # The tree now believes both roles cache the conversation (full caching): the next turn's
    # prefill worker is found by its prefix, and the decode worker too.
    tree = app.prefix.tree
    assert tree is not None and tree.blocks_of(prefill.name) > 0 and tree.blocks_of(decode.name) > 0
    idle(prefill, decode)


def test_a_prefill_worker_lost_before_the_hand_over_costs_the_stream_nothing(
        pd: tuple[Worker, Worker], router: tuple[Router, int], engine_loop: EngineLoop) -> None:
    """The router resumes a request whose prefill worker failed on another worker (here the decode
    worker, the only one left), and the client's stream stays whole."""
    prefill, decode = pd
    app, port = router
    view = app.view
    assert isinstance(view, StaticPoolView)
    snapshot = view.snapshot()
    # A prefill worker that accepts the connection and dies: its address answers nothing.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead.listen()
    dead_address = f"127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    view.set(dataclasses.replace(snapshot, workers=(
        dataclasses.replace(snapshot.workers[0], address=dead_address), snapshot.workers[1])))
    try:
        prompt = "a request whose prefill worker is gone, " + PROMPT
        streamed = through(port, body(prompt))
        assert streamed.done
        assert streamed.text == reference(decode, body(prompt))[0]
    finally:
        view.set(snapshot)
    idle(prefill, decode)


# -------------------------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def vllm_and_builtin(tiny_model_dir: Path, engine_loop: EngineLoop,
                     started_engines: dict[str, StartedEngine]) -> Iterator[tuple[Worker, Worker]]:
    started = start_engine("vllm", tiny_model_dir, started_engines, engine_loop)
    v = start_worker("vllm-0", tiny_model_dir, engine_loop, engine=SharedEngine(started),
                     disaggregation=PDConfig("prefill", "none"))
    b = start_worker("builtin-0", tiny_model_dir, engine_loop, disaggregation=PDConfig("prefill", "none"))
    yield v, b
    for w in (v, b):
        engine_loop.run(w.runner.cleanup())


@pytest.mark.parametrize(("direction", "layout"), [("vllm-to-builtin", "by-request-aggregated"),
                                                   ("builtin-to-vllm", "by-request-aggregated"),
                                                   ("builtin-to-vllm", "by-layer")])
def test_vllm_prefills_and_exports_or_imports_and_decodes_through_its_kv_connector(
        vllm_and_builtin: tuple[Worker, Worker], direction: str, layout: str) -> None:
    """vLLM's prefill-then-export pattern (its NIXL connector's do_remote_decode) through kvfleet's KV
    connector: a vLLM worker hands a prefilled request to a decode worker, or decodes one handed to it,
    and the stream is the colocated greedy output (the two engines agree on greedy tokens). vLLM takes
    no KV layer by layer: a by-layer hand-over to it sends the KV whole, on the channel it opened."""
    v, b = vllm_and_builtin
    prefill, decode = (v, b) if direction == "vllm-to-builtin" else (b, v)
    prefill.agent.handovers.config = PDConfig("prefill", "none", layout)  # type: ignore[union-attr,arg-type]
    payload = {**body(), "max_tokens": 32}
    expected = reference(decode, payload)[1]
    assert reference(prefill, payload)[1] == expected, "the engines disagree on greedy tokens"
    before = transfers(prefill, layout=layout)
    head, rest = disaggregated(prefill, decode, f"pd-{direction}-{layout}", payload)
    assert rest.done
    assert token_ids(head, rest) == expected
    assert transfers(prefill, layout=layout) == before + 1
    assert counter(prefill, "kvfleet_worker_kv_transfer_bytes_total") > 0  # KV crossed, not tokens
    idle(prefill, decode)


def test_the_by_layer_layout_streams_the_prompt_while_it_is_prefilled(pd: tuple[Worker, Worker]) -> None:
    """MemServe §5.2's by-layer transfer: each layer's KV leaves as the prefill writes it, on a channel
    opened before the prefill; the hand-over then sends, all layers at once, only the prompt's last
    partial block and what was decoded since. The output is the colocated one."""
    prefill, decode = pd
    prefill.agent.handovers.config = PDConfig("prefill", "none", "by-layer")  # type: ignore[union-attr]
    parts = counter(prefill, "kvfleet_worker_kv_transfer_layer_parts_total")
    sent_bytes = counter(prefill, "kvfleet_worker_kv_transfer_bytes_total")
    before = transfers(prefill, layout="by-layer")
    prompt = "streamed layer by layer, " + PROMPT + " and once more " + PROMPT
    head, rest = disaggregated(prefill, decode, "pd-by-layer", body(prompt))
    assert token_ids(head, rest) == reference(prefill, body(prompt))[1]
    assert transfers(prefill, layout="by-layer") == before + 1
    migration = prefill.agent.engine.capabilities.migration
    assert migration is not None
    layers = migration.kv_format().layers
    # One part per layer of the (single) prefill step: the prompt fits one step of this engine.
    assert counter(prefill, "kvfleet_worker_kv_transfer_layer_parts_total") - parts == layers
    info = prefill.agent.engine.info
    prompt_tokens = len(prefill.agent.tokenizer.encode(prompt))
    block_bytes = info.block_size_tokens * info.kv_bytes_per_token
    streamed = -(-prompt_tokens // info.block_size_tokens) * block_bytes
    moved = counter(prefill, "kvfleet_worker_kv_transfer_bytes_total") - sent_bytes
    # The stream carried every prompt block; the final stage re-sent at most the last one or two
    # (the prompt's partial block, and a block the tokens decoded since may have opened).
    assert streamed + block_bytes <= moved <= streamed + 2 * block_bytes
    idle(prefill, decode)


def test_a_by_layer_hand_over_sends_the_prefix_the_prefill_worker_held_once_then_the_new_layers(
        pd: tuple[Worker, Worker]) -> None:
    """A prompt whose prefix the prefill worker caches is prefilled from there: those blocks were
    computed by no step, so the stream sends them first, all layers, then the new tokens' layers."""
    prefill, decode = pd
    prefill.agent.handovers.config = PDConfig("prefill", "prefill", "by-layer")  # type: ignore[union-attr]
    shared = "a prefix only the prefill worker will hold, " + PROMPT
    disaggregated(prefill, decode, "pd-layer-held-1", body(shared))
    idle(prefill, decode)
    # The decode worker forgets it (its cache would trim the part): evict everything nobody reads.
    cache = decode.agent.engine
    assert hasattr(cache, "scheduler")
    sched = cache.scheduler
    sched.evict_cached(sched.prefix.num_blocks if sched.prefix is not None else 0)
    parts = counter(prefill, "kvfleet_worker_kv_transfer_layer_parts_total")
    prompt = shared + " and a new question about it"
    head, rest = disaggregated(prefill, decode, "pd-layer-held-2", body(prompt))
    assert token_ids(head, rest) == reference(decode, body(prompt))[1]
    migration = prefill.agent.engine.capabilities.migration
    assert migration is not None
    # The held prefix (one part, all layers) and one part per layer of the step that prefilled the rest.
    assert counter(prefill, "kvfleet_worker_kv_transfer_layer_parts_total") - parts == 1 + migration.kv_format().layers
    idle(prefill, decode)
