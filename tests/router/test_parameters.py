"""vLLM's request parameters end to end on the builtin engine, straight to a worker and through the
router: `n`, logprobs (completions' and chat's layouts), echo, penalties, top_k, min_p, logit_bias,
min_tokens, per-sample seeds, include_stop_str_in_output and structured outputs. The router answers
exactly as a worker does (it rebuilds the answer from the workers' token streams), streamed or whole."""

from __future__ import annotations

import http.client
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
from router_testing import MODEL, TOKEN, Server, serve, start_worker
from worker_testing import TEST_KV_CAPACITY_BYTES, EngineLoop

from kvfleet.router.app import Router, RouterConfig
from kvfleet.router.placement import PoolSnapshot, WorkerState
from kvfleet.router.pool import StaticPoolView
from kvfleet.serving.credentials import PoolCredentials


@pytest.fixture(scope="module")
def routed(workers: list[Server], engine_loop: EngineLoop) -> Iterator[tuple[Router, Server]]:
    snapshot = PoolSnapshot(tuple(WorkerState(f"w{i}", w.address, True, i, TEST_KV_CAPACITY_BYTES)
                                  for i, w in enumerate(workers)), {})
    router = Router(RouterConfig(pool_name="test", credentials=PoolCredentials.of(TOKEN)), StaticPoolView(snapshot))
    server = serve(engine_loop, router.app())
    yield router, server
    engine_loop.run(server.runner.cleanup())


@pytest.fixture(scope="module")
def router(routed: tuple[Router, Server]) -> Server:
    return routed[1]


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, **kw}


def whole(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = server.post(path, body)
    assert status == 200, answer
    return dict(answer)


def choices_of_stream(chunks: list[Any], chat_: bool) -> dict[int, dict[str, Any]]:
    """Each choice's text, finish reason and logprobs entries, put together from a stream's chunks."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.get("choices", []):
            got = out.setdefault(c["index"], {"text": "", "finish_reason": None, "logprobs": []})
            got["text"] += (c["delta"].get("content") or "") if chat_ else c["text"]
            got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
            if c["logprobs"] is not None:
                got["logprobs"].append(c["logprobs"])
    return out


def test_n_samples_are_seeded_as_vllm_seeds_them(workers: list[Server], routed: tuple[Router, Server]) -> None:
    router_obj, router = routed
    body = completion(n=3, temperature=1.0, seed=7)
    direct = whole(workers[0], "/v1/completions", body)
    texts = [c["text"] for c in direct["choices"]]
    assert [c["index"] for c in direct["choices"]] == [0, 1, 2]
    assert direct["usage"]["completion_tokens"] == 36
    # Sample i is the request with seed 7 + i (vLLM's parallel sampling).
    for i, text in enumerate(texts):
        assert whole(workers[1], "/v1/completions", completion(temperature=1.0, seed=7 + i))["choices"][0]["text"] == text
    assert len(set(texts)) > 1
    siblings = router_obj.metrics.registry.get_sample_value("kvfleet_router_placements_total", {"rule": "sibling"}) or 0
    assert [c["text"] for c in whole(router, "/v1/completions", body)["choices"]] == texts
    # Samples 1 and 2 go where sample 0 runs (they share its prompt).
    assert router_obj.metrics.registry.get_sample_value("kvfleet_router_placements_total",
                                                        {"rule": "sibling"}) == siblings + 2
    streamed = choices_of_stream(router.stream("/v1/completions", body), chat_=False)
    assert [streamed[i]["text"] for i in range(3)] == texts
    assert [streamed[i]["text"] for i in range(3)] == [
        choices_of_stream(workers[0].stream("/v1/completions", body), chat_=False)[i]["text"] for i in range(3)]


def test_completion_logprobs_are_vllms_layout_and_the_router_gives_the_same(workers: list[Server],
                                                                            router: Server) -> None:
    body = completion(logprobs=3)
    direct = whole(workers[0], "/v1/completions", body)["choices"][0]
    lp = direct["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 12
    # A token that is a byte of a character shows the character it completes, or "" (vLLM's way).
    assert "".join(lp["tokens"]) == direct["text"].replace("\ufffd", "")
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(12)]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        # Greedy: the chosen token is the most likely one; the dict holds it and the 3 most likely.
        assert logprob <= 0 and top[token] == logprob and math.isclose(max(top.values()), logprob)
        assert 1 <= len(top) <= 4
    routed = whole(router, "/v1/completions", body)["choices"][0]
    assert routed["text"] == direct["text"]
    assert routed["logprobs"]["tokens"] == lp["tokens"] and routed["logprobs"]["text_offset"] == lp["text_offset"]
    assert routed["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    for streamed_by in (workers[0], router):
        parts = choices_of_stream(streamed_by.stream("/v1/completions", body), chat_=False)[0]["logprobs"]
        assert sum((p["tokens"] for p in parts), []) == lp["tokens"]
        assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]


def test_chat_logprobs_are_openais_layout_and_the_router_gives_the_same(workers: list[Server], router: Server) -> None:
    body = chat(logprobs=True, top_logprobs=2)
    direct = whole(workers[0], "/v1/chat/completions", body)["choices"][0]
    content = direct["logprobs"]["content"]
    assert len(content) == 10
    assert "".join(e["token"] for e in content) == direct["message"]["content"].replace("\ufffd", "")
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert [t["logprob"] for t in entry["top_logprobs"]] == sorted((t["logprob"] for t in entry["top_logprobs"]),
                                                                      reverse=True)
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]
    routed = whole(router, "/v1/chat/completions", body)["choices"][0]
    assert [e["token"] for e in routed["logprobs"]["content"]] == [e["token"] for e in content]
    streamed = choices_of_stream(router.stream("/v1/chat/completions", body), chat_=True)[0]
    assert [e["token"] for part in streamed["logprobs"] for e in part["content"]] == [e["token"] for e in content]
    without = whole(router, "/v1/chat/completions", chat())["choices"][0]
    assert without["logprobs"] is None


def test_echo_puts_the_prompt_before_the_output(workers: list[Server], router: Server) -> None:
    plain = whole(workers[0], "/v1/completions", completion())["choices"][0]["text"]
    for server in (workers[0], router):
        assert whole(server, "/v1/completions", completion(echo=True))["choices"][0]["text"] == "The quick brown fox" + plain
        streamed = choices_of_stream(server.stream("/v1/completions", completion(echo=True)), chat_=False)
        assert streamed[0]["text"] == "The quick brown fox" + plain


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1.5}, {"frequency_penalty": 1.5}, {"presence_penalty": 1.5}, {"top_k": 1, "temperature": 1.0},
    {"min_p": 0.5, "temperature": 1.0, "seed": 3}, {"top_k": 5, "temperature": 0.8, "seed": 3}])
def test_sampling_parameters_answer_alike_through_the_router(workers: list[Server], router: Server,
                                                              params: dict[str, Any]) -> None:
    direct = whole(workers[0], "/v1/completions", completion(**params))["choices"][0]["text"]
    assert whole(router, "/v1/completions", completion(**params))["choices"][0]["text"] == direct
    assert whole(workers[1], "/v1/completions", completion(**params))["choices"][0]["text"] == direct


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}])
def test_penalties_hold_back_a_token_the_output_repeats(workers: list[Server], router: Server, tiny_model_dir: Any,
                                                        penalty: dict[str, float]) -> None:
    from kvfleet.worker.text import Tokenizer

    tokenizer = Tokenizer(tiny_model_dir)
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]

    def count(server: Server, **params: Any) -> int:
        body = completion(max_tokens=24, logit_bias={str(token): 30}, **params)
        answer = whole(server, "/v1/completions", body)
        return tokenizer.encode(answer["choices"][0]["text"], add_special_tokens=False).count(token)

    plain = count(workers[0])
    assert plain >= 12, "the bias no longer makes the tiny model repeat the token"
    assert count(workers[0], **penalty) < plain
    assert count(router, **penalty) == count(workers[1], **penalty)
    # 1.0 asks for nothing (vllm bench serve sends it).
    assert count(workers[0], repetition_penalty=1.0) == plain


def test_logit_bias_and_min_tokens(workers: list[Server], router: Server, tiny_model_dir: Any) -> None:
    from kvfleet.worker.text import Tokenizer

    tokenizer = Tokenizer(tiny_model_dir)
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    for server in (workers[0], router):
        biased = whole(server, "/v1/completions", completion(logit_bias={str(token): 100}, max_tokens=4))
        assert tokenizer.encode(biased["choices"][0]["text"], add_special_tokens=False).count(token) == 4
    eos = tokenizer.eos_token_id
    assert eos is not None
    # EOS pushed to the top ends the request at once, unless min_tokens holds it back.
    ended = whole(workers[0], "/v1/completions", completion(logit_bias={str(eos): 100}, ignore_eos=False))
    assert ended["usage"]["completion_tokens"] == 1 and ended["choices"][0]["finish_reason"] == "stop"
    held = whole(router, "/v1/completions", completion(logit_bias={str(eos): 100}, ignore_eos=False, min_tokens=5))
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string(workers: list[Server], router: Server) -> None:
    text = whole(workers[0], "/v1/completions", completion(max_tokens=24))["choices"][0]["text"]
    stop = text[6:9]
    cut = text[:text.index(stop)]
    for server in (workers[0], router):
        assert whole(server, "/v1/completions", completion(max_tokens=24, stop=[stop]))["choices"][0]["text"] == cut
        kept = whole(server, "/v1/completions", completion(max_tokens=24, stop=[stop], include_stop_str_in_output=True))
        assert kept["choices"][0]["text"] == cut + stop and kept["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("fmt", "check"), [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, lambda t: t in ("yes", "no", "maybe")),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    # The tiny model with random weights writes whitespace forever where JSON allows any.
    ({"structured_outputs": {"disable_any_whitespace": True, "json": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"enum": ["a", "b"]}}}},
     lambda t: json.loads(t) in ("a", "b")),
])
def test_structured_outputs_constrain_the_text(workers: list[Server], router: Server, fmt: dict[str, Any],
                                               check: Any) -> None:
    body = chat(max_tokens=60, ignore_eos=False, **fmt)
    direct = whole(workers[0], "/v1/chat/completions", body)["choices"][0]
    assert direct["finish_reason"] == "stop" and check(direct["message"]["content"]), direct
    assert whole(router, "/v1/chat/completions", body)["choices"][0]["message"]["content"] == direct["message"]["content"]


def test_bad_values_are_a_400_naming_the_field_through_the_router(router: Server) -> None:
    for body, param in [(completion(n=0), "n"), (completion(logit_bias={"999999": 1}), "logit_bias"),
                        (completion(structured_outputs={"regex": "("}), None),
                        (chat(top_logprobs=3), "top_logprobs"), (completion(echo=True, logprobs=1), "echo")]:
        status, answer = router.post("/v1/chat/completions" if "messages" in body else "/v1/completions", body)
        assert status == 400, answer
        if param is not None:
            assert answer["error"]["param"] == param, answer


@pytest.mark.parametrize("mode", ["kv", "token"])
def test_a_request_moved_mid_stream_keeps_its_penalties_draws_logprobs_and_grammar(
        workers: list[Server], routed: tuple[Router, Server], mode: str) -> None:
    """Live migration of a request that uses everything at once: the client's text and log-probabilities
    equal the unmoved run's (penalties counted over the output so far, the seeded draws per position,
    the grammar replayed over the output at the target), none lost or repeated."""
    router_obj, router = routed
    body = completion(max_tokens=200, prompt="Once upon a time", temperature=0.9, seed=5, frequency_penalty=0.7,
                      repetition_penalty=1.2, logprobs=2, structured_outputs={"regex": "[a-z ]{150,200}"},
                      ignore_eos=False)
    direct = whole(workers[0], "/v1/completions", body)["choices"][0]
    assert re.fullmatch("[a-z ]{150,200}", direct["text"]), direct["text"]
    request_id = f"move-everything-{mode}"
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json", "X-Request-Id": request_id})
    response = conn.getresponse()
    assert response.status == 200
    received = [response.readline() for _ in range(6)]
    source_pod = router_obj.worker_of(request_id)
    assert source_pod is not None
    source_index = int(source_pod.removeprefix("w"))
    source, target = workers[source_index], workers[1 - source_index]
    status, result = source.post(f"/internal/requests/{request_id}/migrate", {
        "target": {"pod": f"w{1 - source_index}", "address": target.address,
                   "migrationAddress": f"127.0.0.1:{target.agent.migration_port}"}, "mode": mode},
        Authorization=f"Bearer {TOKEN}")
    assert status == 200 and result["phase"] == "Succeeded", result
    raw = b"".join(received) + response.read()
    events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    streamed = choices_of_stream([json.loads(e) for e in events[:-1]], chat_=False)[0]
    assert streamed["text"] == direct["text"]
    assert sum((p["tokens"] for p in streamed["logprobs"]), []) == direct["logprobs"]["tokens"]
    assert sum((p["token_logprobs"] for p in streamed["logprobs"]), []) == pytest.approx(
        direct["logprobs"]["token_logprobs"], abs=1e-4)


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}


def no_whitespace(tiny_model_dir: Any) -> dict[str, float]:
    """A logit_bias that keeps the random-weight tiny model from writing JSON's optional whitespace forever
    (vLLM's structured outputs allow any whitespace, and so does kvfleet)."""
    from kvfleet.worker.text import Tokenizer

    tokenizer = Tokenizer(tiny_model_dir)
    texts = tokenizer.token_texts(list(range(tokenizer.vocab_size)))
    return {str(i): -100.0 for i, text in enumerate(texts) if text and not text.strip()}


def tool_chat(tiny_model_dir: Any, **kw: Any) -> dict[str, Any]:
    return chat(max_tokens=60, ignore_eos=False, tools=[WEATHER, TIME], logit_bias=no_whitespace(tiny_model_dir), **kw)


def test_a_named_tool_choice_is_a_call_of_that_tool_with_arguments_that_follow_its_schema(
        workers: list[Server], router: Server, tiny_model_dir: Any) -> None:
    body = tool_chat(tiny_model_dir, tool_choice={"type": "function", "function": {"name": "weather"}})
    direct = whole(workers[0], "/v1/chat/completions", body)["choices"][0]
    assert direct["finish_reason"] == "stop" and direct["message"]["content"] == ""
    [call] = direct["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "weather" and call["id"].startswith("chatcmpl-tool-")
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["city"] in ("Paris", "Oslo") and arguments["unit"] in ("c", "f")
    routed = whole(router, "/v1/chat/completions", body)["choices"][0]
    assert routed["message"]["tool_calls"][0]["function"] == call["function"]
    # Streamed: the call's id and name first, then its arguments delta by delta.
    for server in (workers[0], router):
        deltas = [c["choices"][0]["delta"] for c in server.stream("/v1/chat/completions", body) if c["choices"]]
        calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
        assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["function"]["name"] == "weather"
        assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]


def test_a_required_tool_choice_is_calls_of_the_tools_and_finishes_with_tool_calls(
        workers: list[Server], router: Server, tiny_model_dir: Any) -> None:
    body = tool_chat(tiny_model_dir, tool_choice="required", parallel_tool_calls=False)
    direct = whole(workers[0], "/v1/chat/completions", body)["choices"][0]
    assert direct["finish_reason"] == "tool_calls", direct
    [call] = direct["message"]["tool_calls"]
    assert call["function"]["name"] in ("weather", "time") and isinstance(json.loads(call["function"]["arguments"]), dict)
    routed = whole(router, "/v1/chat/completions", body)["choices"][0]
    assert [c["function"] for c in routed["message"]["tool_calls"]] == [call["function"]]
    chunks = router.stream("/v1/chat/completions", body)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    streamed = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert finishes[-1] == "tool_calls" and [d["function"] for d in streamed] == [call["function"]]


def test_a_conversation_with_tool_calls_and_results_is_rendered_and_answered(workers: list[Server], router: Server) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call-1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "21 C and sunny"}]
    body = {**chat(), "messages": messages, "tools": [WEATHER]}
    # tool_choice defaults to "auto" with tools, and without a tool-call parser (vLLM's default server)
    # the reply is the model's text.
    direct = whole(workers[0], "/v1/chat/completions", body)["choices"][0]
    assert direct["message"]["content"] and "tool_calls" not in direct["message"]
    assert whole(router, "/v1/chat/completions", body)["choices"][0]["message"] == direct["message"]
    _, tokens = workers[0].post("/tokenize", {"messages": messages})
    assert "21 C and sunny" in workers[0].post("/detokenize", {"tokens": tokens["tokens"]})[1]["prompt"]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_usage_is_a_400_naming_the_field(router: Server, body: dict[str, Any], param: str) -> None:
    status, answer = router.post("/v1/chat/completions", {**chat(), **body})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_a_request_resumed_after_its_worker_died_keeps_its_grammar_penalties_and_draws(
        tiny_model_dir: Any, engine_loop: EngineLoop) -> None:
    """The router continues a request whose worker died on another one after the output the client has
    (POST /internal/resume): the penalties count that output, the grammar is replayed over it, the seeded
    draws go on from their positions; the client's text equals the unbroken run."""
    pair = [start_worker(engine_loop, tiny_model_dir) for _ in range(2)]
    alive = list(pair)
    snapshot = PoolSnapshot(tuple(WorkerState(f"w{i}", w.address, True, i, TEST_KV_CAPACITY_BYTES)
                                  for i, w in enumerate(pair)), {})
    router_obj = Router(RouterConfig(pool_name="test", credentials=PoolCredentials.of(TOKEN)), StaticPoolView(snapshot))
    router = serve(engine_loop, router_obj.app())
    try:
        body = completion(max_tokens=200, prompt="Once upon a time", temperature=0.9, seed=11, frequency_penalty=0.7,
                          min_tokens=160, logprobs=1, structured_outputs={"regex": "[a-z ]{150,200}"}, ignore_eos=False)
        direct = whole(pair[0], "/v1/completions", body)["choices"][0]
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                     {"Content-Type": "application/json", "X-Request-Id": "kill-constrained"})
        response = conn.getresponse()
        assert response.status == 200
        received = [response.readline() for _ in range(6)]
        pod = router_obj.worker_of("kill-constrained")
        assert pod is not None
        victim = pair[int(pod.removeprefix("w"))]
        alive.remove(victim)
        engine_loop.run(victim.runner.cleanup())
        raw = b"".join(received) + response.read()
        events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", raw[-500:]
        assert router_obj.metrics.registry.get_sample_value("kvfleet_router_resumes_total") == 1, \
            "the kill did not land mid-stream"
        streamed = choices_of_stream([json.loads(e) for e in events[:-1]], chat_=False)[0]
        assert streamed["text"] == direct["text"] and re.fullmatch("[a-z ]{150,200}", streamed["text"])
        assert sum((p["tokens"] for p in streamed["logprobs"]), []) == direct["logprobs"]["tokens"]
    finally:
        engine_loop.run(router.runner.cleanup())
        for server in alive:
            engine_loop.run(server.runner.cleanup())


def test_n_samples_read_one_copy_of_their_prompt_with_prefix_caching(tiny_model_dir: Any, engine_loop: EngineLoop) -> None:
    """With prefix caching the first sample runs alone until its first token; its prompt's full blocks
    are then in the cache, and the other samples start after them instead of prefilling them again."""
    from kvfleet.worker.agent import Agent, AgentConfig
    from kvfleet.worker.engines import EngineConfig, load_engine
    from kvfleet.worker.text import Tokenizer

    engine = load_engine("builtin", EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                                                 max_model_len=512, prefix_caching=True))
    agent = Agent(AgentConfig(model_name=MODEL), engine, Tokenizer(tiny_model_dir), None)
    worker = serve(engine_loop, agent.app())
    try:
        prompt = "Once upon a time, in a land far away, there lived a king who had three daughters and a dog."
        prompt_tokens = len(Tokenizer(tiny_model_dir).encode(prompt))
        cache = engine.capabilities.prefix_cache
        assert cache is not None and prompt_tokens >= 32
        answer = whole(worker, "/v1/completions", completion(prompt=prompt, n=3, max_tokens=8))
        assert len(answer["choices"]) == 3
        block = engine.info.block_size_tokens
        # Samples 1 and 2 matched the first's full prompt blocks (the last token is always computed).
        assert cache.prefix_cache_stats().hit_tokens == 2 * ((prompt_tokens - 1) // block * block)
    finally:
        engine_loop.run(worker.runner.cleanup())


def test_the_chat_templates_arguments_shape_the_prompt(workers: list[Server], router: Server) -> None:
    """add_generation_prompt, continue_final_message, documents and chat_template_kwargs reach the template
    (the tiny model's renders `role: content` lines and `assistant:` for the reply), on /tokenize too."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]

    def rendered(server: Server, **fields: Any) -> str:
        status, tokens = server.post("/tokenize", {"model": MODEL, "messages": messages, **fields})
        assert status == 200, tokens
        return str(server.post("/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})[1]["prompt"])

    assert rendered(workers[0]).endswith("assistant: Hello th\nassistant:")
    # Continuing the last message: no generation prompt, and (transformers) the message left open.
    continued = rendered(workers[0], add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("assistant: Hello th") and rendered(router, add_generation_prompt=False,
                                                                   continue_final_message=True) == continued
    body = chat(messages=messages, add_generation_prompt=False, continue_final_message=True,
                chat_template_kwargs={"enable_thinking": False}, documents=[{"title": "t", "text": "x"}])
    assert whole(router, "/v1/chat/completions", body)["choices"][0]["message"]["content"] == \
        whole(workers[0], "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    for bad, param in [({"continue_final_message": True}, "continue_final_message"),
                       ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                       ({"chat_template": "{{ messages }}"}, "chat_template")]:
        status, answer = router.post("/v1/chat/completions", chat(messages=messages, **bad))
        assert status == 400 and answer["error"]["param"] == param, answer


def test_a_request_resumed_after_a_death_then_moved_live_stays_whole(tiny_model_dir: Any, engine_loop: EngineLoop) -> None:
    """A resumed request's stream counts the output it carried: its position, the budget and the
    indices a migration hands on are the whole output's (a move of a resumed request once handed on
    only the new tokens, and the target wrote the carried ones again)."""
    trio = [start_worker(engine_loop, tiny_model_dir) for _ in range(3)]
    alive = list(trio)
    snapshot = PoolSnapshot(tuple(WorkerState(f"w{i}", w.address, True, i, TEST_KV_CAPACITY_BYTES)
                                  for i, w in enumerate(trio)), {})
    router_obj = Router(RouterConfig(pool_name="test", credentials=PoolCredentials.of(TOKEN)), StaticPoolView(snapshot))
    router = serve(engine_loop, router_obj.app())
    try:
        body = completion(max_tokens=240, prompt="Once upon a time", stream_options={"include_usage": True})
        direct = whole(trio[0], "/v1/completions", body)["choices"][0]["text"]
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                     {"Content-Type": "application/json", "X-Request-Id": "kill-then-move"})
        response = conn.getresponse()
        assert response.status == 200
        received = [response.readline() for _ in range(6)]

        def holder() -> int:
            pod = router_obj.worker_of("kill-then-move")
            assert pod is not None
            return int(pod.removeprefix("w"))

        first = holder()
        alive.remove(trio[first])
        engine_loop.run(trio[first].runner.cleanup())
        received += [response.readline() for _ in range(20)]
        assert router_obj.metrics.registry.get_sample_value("kvfleet_router_resumes_total") == 1
        source_index = holder()
        target_index = next(i for i in range(3) if i not in (first, source_index))
        source, target = trio[source_index], trio[target_index]
        status, result = source.post("/internal/requests/kill-then-move/migrate", {
            "target": {"pod": f"w{target_index}", "address": target.address,
                       "migrationAddress": f"127.0.0.1:{target.agent.migration_port}"}, "mode": "kv"},
            Authorization=f"Bearer {TOKEN}")
        assert status == 200 and result["phase"] == "Succeeded", result
        raw = b"".join(received) + response.read()
        events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", raw[-500:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 240
        assert choices_of_stream(chunks, chat_=False)[0]["text"] == direct
    finally:
        engine_loop.run(router.runner.cleanup())
        for server in alive:
            engine_loop.run(server.runner.cleanup())
