"""Live migration between two real agents over HTTP and the migration port: the client's stream stays whole.

Two workers with their own builtin engines run on the test's event loop. A client streams a long
greedy request from the source; mid-stream the source is told to move it (POST
/internal/requests/{id}/migrate, what the KVMigration watcher does). Whatever the mode, what the
client reads is token for token the unmigrated greedy output: in router mode by following the
`kvfleet.migrated` event to the target's stream, in direct mode through the source's relay.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from migration_testing import (
    MAX_TOKENS,
    MODEL,
    TOKEN,
    Worker,
    body,
    follow_target,
    read_sse,
    reference,
    stream_with_migration,
    two_workers,
    wait_idle,
)
from worker_testing import EngineLoop


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[tuple[Worker, Worker]]:
    yield from two_workers(tiny_model_dir, engine_loop)


@pytest.mark.parametrize("mode", ["kv", "token", "hybrid"])
def test_router_mode_stream_ends_with_the_handoff_and_the_target_continues_it(workers: tuple[Worker, Worker],
                                                                               mode: str) -> None:
    a, b = workers
    ref_text, ref_ids = reference(a)
    request_id = f"router-{mode}"
    streamed, result = stream_with_migration(a, b, request_id, mode, router=True)
    assert result["phase"] == "Succeeded", result
    assert result["mode"] == mode
    assert not streamed.done, "a handed-over router stream ends without [DONE]"
    event, data = streamed.events[-1]
    assert event == "kvfleet.migrated"
    moved = json.loads(data)
    source_ids = [t for c in streamed.chunks for t in c["kvfleet"]["token_ids"]]
    assert moved == {"request_id": request_id, "index": len(source_ids),
                     "target": {"pod": "worker-b", "address": b.address}}
    assert 0 < moved["index"] < MAX_TOKENS
    if mode == "kv":
        # Only the hand-off index (or a later chunk boundary) starts the stream; one reader at a time.
        assert b.call("GET", f"/internal/requests/{request_id}/stream?after={moved['index'] - 1}")[0] == 400
        assert b.call("GET", f"/internal/requests/{request_id}/stream?after=x")[0] == 400
        first = http.client.HTTPConnection("127.0.0.1", b.port, timeout=120)
        first.request("GET", f"/internal/requests/{request_id}/stream?after={moved['index']}",
                      headers={"Authorization": "Bearer " + TOKEN})
        reader = first.getresponse()
        assert reader.status == 200
        assert b.call("GET", f"/internal/requests/{request_id}/stream?after={moved['index']}")[0] == 409
        rest = read_sse(reader)
    else:
        rest = follow_target(b, request_id, moved["index"])
    assert rest.done
    assert rest.chunks[0]["kvfleet"]["index"] == moved["index"]
    rest_ids = [t for c in rest.chunks for t in c["kvfleet"]["token_ids"]]
    assert source_ids + rest_ids == ref_ids
    assert streamed.text + rest.text == ref_text
    assert rest.chunks[-1]["choices"][0]["finish_reason"] == "length"
    if mode == "token":
        assert result["bytesMoved"] == 0
    else:
        assert result["bytesMoved"] > 0
    assert result["downtimeSeconds"] > 0
    wait_idle(a, b)


@pytest.mark.parametrize("mode", ["kv", "token"])
def test_direct_client_gets_the_whole_stream_through_the_source(workers: tuple[Worker, Worker], mode: str) -> None:
    a, b = workers
    ref_text, _ = reference(a)
    payload = body(stream_options={"include_usage": True})
    streamed, result = stream_with_migration(a, b, f"direct-{mode}", mode, payload=payload)
    assert result["phase"] == "Succeeded", result
    assert streamed.done
    assert all(e == "" for e, _ in streamed.events), "a direct client never sees the hand-off event"
    assert all("kvfleet" not in c for c in streamed.chunks)
    assert streamed.text == ref_text
    assert streamed.chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert [c["choices"][0]["finish_reason"] for c in streamed.chunks if c["choices"]][-1] == "length"
    wait_idle(a, b)


def test_direct_chat_stream_and_a_migration_back_again(workers: tuple[Worker, Worker]) -> None:
    """Chat chunks through the relay, and a second hand-off (b -> a) that the relay follows."""
    a, b = workers
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    status, whole = a.call("POST", "/v1/chat/completions", chat)
    assert status == 200, whole
    conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({**chat, "stream": True}).encode(),
                 {"Content-Type": "application/json", "X-Request-Id": "chat-twice"})
    response = conn.getresponse()
    results: list[dict[str, Any]] = []

    def migrate_twice() -> None:
        results.append(a.migrate("chat-twice", b, "kv"))
        # The request now runs on b (relayed by a): move it back to a's engine.
        deadline = time.monotonic() + 30
        while "chat-twice" not in {r.request_id for r in b.agent.engine.kv_usage()} and time.monotonic() < deadline:
            time.sleep(0.01)
        results.append(b.migrate("chat-twice", a, "kv"))

    threads: list[threading.Thread] = []

    def on_chunk(n: int) -> None:
        if n == 4:
            threads.append(threading.Thread(target=migrate_twice))
            threads[0].start()

    streamed = read_sse(response, on_chunk)
    threads[0].join(60)
    assert [r["phase"] for r in results] == ["Succeeded", "Succeeded"], results
    assert streamed.done
    assert streamed.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in streamed.chunks)
    assert streamed.text == whole["choices"][0]["message"]["content"]
    wait_idle(a, b)


def test_a_non_streaming_request_is_answered_whole_across_a_handoff(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    ref_text, _ = reference(a)
    answers: list[tuple[int, Any]] = []
    thread = threading.Thread(target=lambda: answers.append(a.call("POST", "/v1/completions", body(), token=None,
                                                                    **{"X-Request-Id": "whole-1"})))
    thread.start()
    deadline = time.monotonic() + 30
    while "whole-1" not in {r.request_id for r in a.agent.engine.kv_usage()}:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    result = a.migrate("whole-1", b, "hybrid")
    thread.join(60)
    assert result["phase"] == "Succeeded", result
    status, answer = answers[0]
    assert status == 200
    assert answer["choices"][0]["text"] == ref_text
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    wait_idle(a, b)


def test_the_target_stream_needs_the_pool_token_and_a_known_request(workers: tuple[Worker, Worker]) -> None:
    _, b = workers
    assert b.call("GET", "/internal/requests/nope/stream?after=0", token=None)[0] == 401
    assert b.call("GET", "/internal/requests/nope/stream?after=0", token="wrong")[0] == 401
    assert b.call("GET", "/internal/requests/nope/stream?after=0")[0] == 404
    assert b.call("POST", "/internal/requests/nope/migrate", {"target": {"pod": "x", "address": "127.0.0.1:1"}},
                  token=None)[0] == 401
