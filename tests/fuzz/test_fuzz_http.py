"""Hostile HTTP, fuzzed: the worker's and the router's every endpoint answers any input with a success
or a 4xx in OpenAI's error format, never a 5xx, a crash or a hung connection (docs/operations.md).

One real worker (builtin engine, tiny model) and a router in front of it (conftest.py). Bodies are
arbitrary JSON, valid requests with one field made hostile, raw bytes, wrong Content-Types, empty
and oversized bodies, unicode edge cases; paths carry hostile request ids; `/internal/*` is tried
with and without the pool token. Valid-looking requests ask for a few tokens at most, so a case
that succeeds stays cheap.
"""

from __future__ import annotations

import http.client
import json
import math
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from router_testing import MODEL, TOKEN, Server

from kvfleet.serving.openai_api import MAX_BODY_BYTES

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
FEW = settings(SETTINGS, max_examples=15)

JSON = {"Content-Type": "application/json"}
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(params=["worker", "router"])
def server(request: pytest.FixtureRequest) -> Server:
    return request.getfixturevalue(f"fuzz_{request.param}")


# A request that takes longer than this is a hung connection (every fuzzed request generates a few
# tokens at most on the tiny model, or none).
REQUEST_TIMEOUT_S = 30.0


def send(server: Server, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request, any bytes; raises (fails the test) when the server does not answer in time."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def assert_client_error(status: int, raw: bytes) -> dict[str, Any]:
    """A 4xx whose body is OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    assert 400 <= status < 500, (status, raw[:500])
    body = json.loads(raw)
    assert isinstance(body, dict) and set(body) == {"error"}, raw[:500]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, raw[:500]
    assert isinstance(error["message"], str) and error["message"], raw[:500]
    assert isinstance(error["type"], str) and error["type"], raw[:500]
    assert error["param"] is None or isinstance(error["param"], str), raw[:500]
    assert error["code"] is None or isinstance(error["code"], str), raw[:500]
    return error


def assert_answered(status: int, headers: dict[str, str], raw: bytes) -> None:
    """A success in the shape its Content-Type says, or a client error in OpenAI's format; never a 5xx."""
    if status >= 300:
        assert_client_error(status, raw)
        return
    assert status == 200, (status, raw[:500])
    content_type = headers.get("content-type", "")
    if content_type.startswith("application/json"):
        assert isinstance(json.loads(raw), dict)
    elif content_type.startswith("text/event-stream"):
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        assert events and events[-1] == b"data: [DONE]", raw[-500:]
        assert not any(b'"error"' in e for e in events), raw[-500:]


# --------------------------------------------------------------------------------------- strategies

# Text with what breaks naive code: lone surrogates (valid in JSON as escapes, not in UTF-8), NUL,
# direction marks, a BOM, astral characters.
hostile_chars = st.characters(codec=None, exclude_categories=()) | st.sampled_from(
    ["\ud800", "\udfff", "\x00", "\u202e", "\ufeff", "\U0001f600", "\uffff"])
hostile_text = st.text(hostile_chars, max_size=24)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | hostile_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner, max_size=4),
    max_leaves=16,
)

big_ints = st.sampled_from([-1, 0, 2**31, 2**63, 2**64, 10**18, -(10**18), 10**30])
odd_numbers = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e-308, 1.5, -0.0])
odd_scalars = st.sampled_from([None, True, False, "", "1", "x" * 5000, [], {}, [[]], {"a": 1}])
hostile_values = big_ints | odd_numbers | odd_scalars | json_values

VOCAB_BREAKERS = [[-1], [10**9], [2**63], [2**64], [1.5], [True], [[1, 2]], [], [["a"]], [0] * 600]

FIELD_VALUES: dict[str, Any] = {
    "model": st.sampled_from(["", "x" * 1000, "other", MODEL + "\x00", "\ud800"]),
    "max_tokens": st.sampled_from([-1, 0, 10**18, 2**63, "16", 1.5, 512, math.nan, math.inf]),
    "max_completion_tokens": st.sampled_from([-1, 0, 10**18, "2", math.nan]),
    "temperature": odd_numbers | st.sampled_from([-1, 2.0001, 0, 2, "0", 10**400 // 10**399]),
    "top_p": odd_numbers | st.sampled_from([0, 1.0001, -1]),
    "n": st.sampled_from([0, 2, 17, 10**6, -1]),
    "stream": st.sampled_from([True, "yes", 1, None]),
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": "x"}, [], {"a": {}}, "x"]),
    "stop": st.sampled_from([["a"] * 10_000, "", [""], [1], "x" * 100_000, ["\ud800"], ["\x00"], ["a", "b"]]),
    "seed": big_ints | odd_numbers,
    "presence_penalty": odd_numbers | st.sampled_from([0.5, 0]),
    "frequency_penalty": odd_numbers | st.sampled_from([-2.0, 0]),
    "user": st.sampled_from([1, "x" * 10_000, "\ud800", None]),
    "stop_token_ids": st.sampled_from([[-1], [2**63], [10**30], [1.5], ["a"], list(range(10_000))]),
    "ignore_eos": st.sampled_from(["true", 2, None]),
    "logprobs": st.sampled_from([True, 5, 0, None, 21, -1]),
    "echo": st.sampled_from([True, 1]),
    "include_stop_str_in_output": st.sampled_from([True, None, "x"]),
    "suffix": st.sampled_from(["x", ""]),
    "best_of": st.sampled_from([2, 1]),
    "unknown_field": hostile_values,
    # vLLM's parameters: served ones at good and bad values, the others at the values that ask for nothing
    # (accepted) and at others (refused by name).
    "top_k": st.sampled_from([-1, 0, None, 5, False, -2]) | hostile_values,
    "min_p": st.sampled_from([0.0, None, 0.5, 1.0]) | odd_numbers,
    "repetition_penalty": st.sampled_from([1.0, None, 1.3, 0.0]) | odd_numbers,
    "logit_bias": st.sampled_from([{}, None, {"5": 100}, {"\ud800": 1}, {"999999": 1}, {"-1": 1}, {"5": 1e308},
                                   {"5": math.nan}, {str(i): -100 for i in range(3000)}]) | hostile_values,
    "min_tokens": st.sampled_from([0, 2, 3, -1]) | big_ints,
    "bad_words": st.sampled_from([[], ["x"], None]) | hostile_values,
    "response_format": st.sampled_from([
        None, {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}]) | hostile_values,
    "structured_outputs": st.sampled_from([
        None, {}, {"regex": "("}, {"regex": "[0-9]+"}, {"regex": "(a*)*b"}, {"regex": ""}, {"choice": []}, {"choice": [""]},
        {"choice": ["a", "a"]}, {"json": {"type": "nonsense"}}, {"json": "{"}, {"grammar": "x"}, {"grammar": ""},
        {"json_object": True}, {"json_object": False}, {"regex": "a", "choice": ["b"]}]) | hostile_values,
    "kv_transfer_params": st.sampled_from([None, {"kvfleet": {"id": "x", "load": True}}]) | hostile_values,
    "request_id": st.sampled_from([None, "x", "\ud800"]),
    "top_logprobs": st.sampled_from([0, None, 5, -1]),
    "tools": st.sampled_from([None, [], [{"type": "function", "function": {"name": "f"}}],
                              [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                              [{"type": "function", "function": {"name": "f", "parameters": {"$defs": 1}}}]])
    | hostile_values,
    "tool_choice": st.sampled_from(["none", None, "auto", "required", {"type": "function"},
                                    {"type": "function", "function": {"name": "f"}}]),
    "parallel_tool_calls": st.sampled_from([False, None, "x"]),
    "chat_template_kwargs": st.sampled_from([None, {}, {"enable_thinking": True}, {"tokenize": True},
                                             {"messages": []}, {"raise_exception": 1}]) | hostile_values,
    "continue_final_message": st.sampled_from([True, False, None, "x"]),
    "add_generation_prompt": st.sampled_from([True, False, None, "x"]),
    "documents": st.sampled_from([None, [], [{"title": "t", "text": "x"}], [{"a": 1}], "x"]),
}
PROMPTS = st.sampled_from(VOCAB_BREAKERS) | hostile_text | st.lists(st.integers(-5, 40_000), max_size=8) | hostile_values
MESSAGES = st.sampled_from([
    [], [{"role": "tool", "content": "x"}], [{"role": "function", "content": "x"}], [{"role": "", "content": "x"}],
    [{"role": "SYSTEM", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 1}]}], [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [1]}], ["hello"], [None], [{"role": "user", "content": "x", "extra": 1}],
    [{"role": "user", "content": "\ud800\x00"}], [{"role": "assistant", "content": "x"}],
    [{"role": "user", "content": "x" * 5000}],
    [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "f", "arguments": "{not json"}}]},
     {"role": "tool", "tool_call_id": "c", "content": "x"}],
    [{"role": "assistant", "tool_calls": []}], [{"role": "user", "content": "x", "tool_calls": None}],
]) | st.lists(st.fixed_dictionaries({"role": hostile_values, "content": hostile_values}), max_size=3) | hostile_values


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0.7, "ignore_eos": True, **fields}


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
            "max_completion_tokens": 2, "temperature": 0.7, "ignore_eos": True, **fields}


@st.composite
def mutated(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """A valid request with one field replaced (or dropped) by something hostile."""
    body = chat_body() if chat else completion_body()
    field = draw(st.sampled_from([*FIELD_VALUES, "messages" if chat else "prompt"]))
    if draw(st.integers(0, 9)) == 0:
        body.pop(field, None)
        return body
    if field == "prompt":
        body[field] = draw(PROMPTS)
    elif field == "messages":
        body[field] = draw(MESSAGES)
    else:
        body[field] = draw(FIELD_VALUES[field] | hostile_values) if draw(st.booleans()) else draw(FIELD_VALUES[field])
    return body


def encode(body: Any) -> bytes:
    """JSON as a client could send it: non-finite numbers as NaN/Infinity, surrogates as escapes."""
    return json.dumps(body, allow_nan=True).encode()


def post(server: Server, path: str, body: bytes | None, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    return send(server, "POST", path, body, JSON if headers is None else headers)


# ---------------------------------------------------------------------------------- OpenAI endpoints


@SETTINGS
@given(path=st.sampled_from(OPENAI_PATHS), body=json_values)
@example(path="/v1/completions", body=None)
@example(path="/v1/chat/completions", body=[{"role": "user", "content": "x"}])
@example(path="/v1/completions", body={"model": MODEL})
def test_any_json_value_is_a_client_error(server: Server, path: str, body: Any) -> None:
    status, _, raw = post(server, path, encode(body))
    assert_client_error(status, raw)


@settings(SETTINGS, max_examples=60)
@given(body=mutated(chat=False))
@example(body=completion_body(max_tokens=10**18))
@example(body=completion_body(temperature=math.nan))
@example(body=completion_body(prompt=[[1, 2]]))
@example(body=completion_body(prompt=[2**63]))
@example(body=completion_body(prompt=[-1]))
@example(body=completion_body(stop=["a"] * 10_000))
@example(body=completion_body(n=2))
@example(body=completion_body(logprobs=1))
@example(body=completion_body(structured_outputs={"regex": "("}))
@example(body=completion_body(structured_outputs={"choice": [""]}))
@example(body=completion_body(structured_outputs={"regex": ""}))
@example(body=completion_body(logit_bias={str(i): -100 for i in range(3000)}))
@example(body=completion_body(prompt="\ud800"))
@example(body=completion_body(seed=2**64))
@example(body=completion_body(stop_token_ids=[10**30]))
def test_a_completion_with_one_hostile_field_is_answered(server: Server, body: dict[str, Any]) -> None:
    assert_answered(*post(server, "/v1/completions", encode(body)))


@settings(SETTINGS, max_examples=60)
@given(body=mutated(chat=True))
@example(body=chat_body(messages=[{"role": "tool", "content": "x"}]))
@example(body=chat_body(messages=[{"role": "user", "content": "\ud800"}]))
@example(body=chat_body(max_completion_tokens=10**18))
@example(body=chat_body(logprobs=True))
@example(body=chat_body(seed=2**64))
def test_a_chat_with_one_hostile_field_is_answered(server: Server, body: dict[str, Any]) -> None:
    assert_answered(*post(server, "/v1/chat/completions", encode(body)))


@settings(SETTINGS, max_examples=60)
@given(path=st.sampled_from(["/tokenize", "/detokenize"]),
       body=st.fixed_dictionaries({}, optional={
           "model": st.sampled_from([MODEL, "other", None, 1]), "prompt": PROMPTS, "messages": MESSAGES,
           "tokens": st.sampled_from(VOCAB_BREAKERS) | hostile_values, "return_token_strs": hostile_values,
           "add_special_tokens": hostile_values, "add_generation_prompt": hostile_values, "tools": hostile_values,
           "unknown_field": hostile_values}) | hostile_values)
@example(path="/tokenize", body={"prompt": "\ud800"})
@example(path="/detokenize", body={"tokens": [2**64]})
@example(path="/tokenize", body={"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False})
def test_tokenize_and_detokenize_answer_any_body(server: Server, path: str, body: Any) -> None:
    assert_answered(*post(server, path, encode(body)))


@FEW
@given(path=st.sampled_from(OPENAI_PATHS), raw=st.binary(max_size=64),
       content_type=st.sampled_from([None, "application/json", "text/plain", "multipart/form-data; boundary=x",
                                     "application/x-www-form-urlencoded", "application/json; charset=latin-1", ""]))
@example(path="/v1/completions", raw=b"", content_type="application/json")
@example(path="/v1/completions", raw=b"\xff\xfe{}", content_type="application/json")
@example(path="/v1/completions", raw=b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', content_type="application/json")
@example(path="/v1/chat/completions", raw=b"[" * 100_000, content_type="application/json")
@example(path="/v1/chat/completions", raw=b'{"a": 1e999999}', content_type="application/json")
@example(path="/v1/completions", raw=b"\x00", content_type=None)
def test_bytes_that_are_not_a_json_object_are_a_client_error(server: Server, path: str, raw: bytes,
                                                              content_type: str | None) -> None:
    status, _, answer = post(server, path, raw, {} if content_type is None else {"Content-Type": content_type})
    assert_client_error(status, answer)


@pytest.mark.parametrize(("path", "raw", "param", "code"), [
    # Found by the fuzzing: a tokenizer raised TypeError on the lone surrogate (a 500).
    ("/v1/chat/completions", encode(chat_body(messages=[{"role": "user", "content": "\ud800"}])), "messages.0.content",
     "invalid_encoding"),
    ("/v1/completions", encode(completion_body(prompt="a\udfffb")), "prompt", "invalid_encoding"),
    # Found by the fuzzing: json.loads raised RecursionError (a 500).
    ("/v1/completions", b"[" * 100_000, None, "invalid_json"),
])
def test_what_the_fuzzing_found_is_a_400_naming_the_field(server: Server, path: str, raw: bytes, param: str | None,
                                                          code: str) -> None:
    status, _, answer = post(server, path, raw)
    error = assert_client_error(status, answer)
    assert status == 400 and (error["param"], error["code"]) == (param, code), error


@pytest.mark.parametrize("path", OPENAI_PATHS)
def test_a_body_just_over_the_limit_is_413(server: Server, path: str) -> None:
    padding = b" " * (MAX_BODY_BYTES + 1 - len(encode(completion_body())))
    status, _, raw = post(server, path, encode(completion_body()) + padding)
    assert status == 413 and assert_client_error(status, raw)["type"] == "invalid_request_error"
    # The limit itself is fine: the same request padded to exactly MAX_BODY_BYTES is served.
    status, headers, raw = post(server, "/v1/completions", encode(completion_body()) + padding[:-1])
    assert status == 200, raw[:500]
    assert_answered(status, headers, raw)


@FEW
@given(request_id=hostile_text | st.sampled_from(["x" * 129, "..", "../..", "-a", "a b", "%2e%2e", "a\tb"]))
@example(request_id="x" * 8000)
def test_a_hostile_request_id_header_is_refused_or_ignored(server: Server, request_id: str) -> None:
    try:
        header = request_id.encode("latin-1").decode("latin-1")
    except UnicodeEncodeError:
        header = pct(request_id)
    if any(ord(c) < 0x20 or ord(c) == 0x7f for c in header) or header != header.strip():
        # Control characters: http.client refuses some, aiohttp's parser the rest (the test below).
        header = pct(header)
    status, headers, raw = post(server, "/v1/completions", encode(completion_body()), {**JSON, "X-Request-Id": header})
    assert_answered(status, headers, raw)
    if status == 400:
        assert assert_client_error(status, raw)["param"] == "X-Request-Id"


@pytest.mark.parametrize("request_id", ["x" * 10_000, "\x1b", "a\x7fb", "a\tb\x01"])
def test_a_header_the_http_parser_refuses_is_400(server: Server, request_id: str) -> None:
    """aiohttp's parser refuses a header line over 8 KiB, or with control characters, before any
    handler runs: a plain-text 400, nothing reaches the app (docs/operations.md)."""
    status, _, _ = post(server, "/v1/completions", encode(completion_body()), {**JSON, "X-Request-Id": request_id})
    assert status == 400


# ------------------------------------------------------------------------------- the other endpoints


@FEW
@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "POST"]),
       path=st.sampled_from(["/", "/v1", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/internal",
                             "/kvfleet/speed-profile/x", "/%2e%2e/etc/passwd", "/v1/completions/..", "//v1/models"]))
def test_unknown_paths_and_wrong_methods_are_client_errors(server: Server, method: str, path: str) -> None:
    status, headers, raw = send(server, method, path, b"{}" if method in ("POST", "PUT", "PATCH") else None, JSON)
    assert_answered(status, headers, raw)
    if path in OPENAI_PATHS and method != "POST":
        assert status == 405


WORKER_GETS = ("/healthz", "/readyz", "/metrics", "/v1/models", "/kvfleet/speed-profile", "/kvfleet/tokenizer")
ROUTER_GETS = ("/healthz", "/readyz", "/metrics", "/v1/models", "/kvfleet/speed-profile")


@FEW
@given(path=st.sampled_from(WORKER_GETS), query=st.dictionaries(hostile_text, hostile_text, max_size=3),
       method=st.sampled_from(["GET", "HEAD", "POST", "DELETE"]), body=st.binary(max_size=32))
def test_the_workers_probes_and_facts_answer_anything(fuzz_worker: Server, path: str, query: dict[str, str],
                                                      method: str, body: bytes) -> None:
    status, headers, raw = send(fuzz_worker, method, _with_query(path, query), body or None)
    if method == "HEAD" and status < 400:
        return
    if status == 404 and path == "/kvfleet/speed-profile":
        assert assert_client_error(status, raw)["code"] in ("no_speed_profile", "speed_not_measured")
        return
    if path == "/metrics" and status == 200:
        assert headers["content-type"].startswith("text/plain") and raw
        return
    assert_answered(status, headers, raw)


@FEW
@given(path=st.sampled_from(ROUTER_GETS), query=st.dictionaries(hostile_text, hostile_text, max_size=3))
def test_the_routers_probes_and_facts_answer_anything(fuzz_router: Server, path: str, query: dict[str, str]) -> None:
    status, headers, raw = send(fuzz_router, "GET", _with_query(path, query))
    if path == "/metrics" and status == 200:
        assert headers["content-type"].startswith("text/plain") and raw
        return
    assert_answered(status, headers, raw)


def _with_query(path: str, query: dict[str, str]) -> str:
    return path + ("?" + "&".join(f"{pct(k)}={pct(v)}" for k, v in query.items()) if query else "")


def pct(text: str) -> str:
    """Percent-encoded UTF-8, a lone surrogate included (as the invalid UTF-8 bytes it would be)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


# ------------------------------------------------------------------------------------ /internal/*

hostile_ids = (st.text(hostile_chars, min_size=1, max_size=40).map(pct)
               | st.sampled_from(["..", "%2e%2e", "%2F", "x" * 5000, "a%00b", "%ud800", "cmpl-1", "%", "%%", "%zz"]))


@SETTINGS
@given(request_id=hostile_ids, action=st.sampled_from(["abort", "migrate", "stream"]),
       token=st.sampled_from([None, TOKEN, "wrong", "", TOKEN + "x", "\u00e9"]),
       body=st.none() | json_values.map(encode) | st.binary(max_size=32),
       after=st.none() | hostile_text)
@example(request_id="..", action="abort", token=TOKEN, body=None, after=None)
@example(request_id="cmpl-1", action="stream", token=TOKEN, body=None, after="-1")
@example(request_id="cmpl-1", action="migrate", token=TOKEN, body=b'{"target": {"pod": "p", "address": "x"}}', after=None)
def test_internal_request_paths_answer_anything(fuzz_worker: Server, request_id: str, action: str, token: str | None,
                                                body: bytes | None, after: str | None) -> None:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    if action == "stream":
        path = f"/internal/requests/{request_id}/stream" + ("" if after is None else f"?after={pct(after)}")
        status, answer_headers, raw = send(fuzz_worker, "GET", path, None, _latin1(headers))
    else:
        status, answer_headers, raw = send(fuzz_worker, "POST", f"/internal/requests/{request_id}/{action}", body,
                                           {**JSON, **_latin1(headers)})
    if token != TOKEN:
        assert status == 401 and assert_client_error(status, raw)["type"] == "authentication_error"
        return
    assert_answered(status, answer_headers, raw)


def _latin1(headers: dict[str, str]) -> dict[str, str]:
    return {k: v.encode("utf-8").decode("latin-1") for k, v in headers.items()}


MIGRATE_FIELDS = {
    "target": st.sampled_from([None, "x", [], {}, {"pod": "p"}, {"pod": 1, "address": "a:1"}, {"pod": "p", "address": ""},
                               {"pod": "p", "address": "no-port"}, {"pod": "p", "address": ":1"},
                               {"pod": "p", "address": "h:99999999999999999999"},
                               {"pod": "p", "address": "127.0.0.1:1", "migrationAddress": ["x"]},
                               {"pod": "p", "address": "127.0.0.1:1", "migrationAddress": 5}]),
    "mode": st.sampled_from(["kv", "token", "hybrid", "KV", "", None, 1, [], {}]),
    "kvBytes": st.sampled_from([-1, 0, 2**63, 10**30, 1.5, "1", True, None, []]),
}


@SETTINGS
@given(body=st.fixed_dictionaries({}, optional={k: v | hostile_values for k, v in MIGRATE_FIELDS.items()}),
       request_id=st.sampled_from(["cmpl-1", "..", "x" * 200]))
@example(body={"target": {"pod": "p", "address": "127.0.0.1:1"}, "mode": {}}, request_id="cmpl-1")
@example(body={"target": {"pod": "p", "address": "127.0.0.1:1"}, "kvBytes": 10**30}, request_id="cmpl-1")
def test_a_migrate_body_is_checked_before_anything_moves(fuzz_worker: Server, body: dict[str, Any], request_id: str) -> None:
    status, headers, raw = post(fuzz_worker, f"/internal/requests/{request_id}/migrate", encode(body), {**JSON, **AUTH})
    assert_answered(status, headers, raw)
    if status == 200:  # no such request runs here: the migration is refused in its result, not attempted
        assert json.loads(raw)["phase"] == "Failed"


@FEW
@given(token=st.sampled_from([None, "wrong", "", "Bearer", f"Basic {TOKEN}", f"bearer {TOKEN}", f"Bearer  {TOKEN}"]),
       method=st.sampled_from(["GET", "POST"]))
def test_internal_endpoints_need_the_pool_token(fuzz_worker: Server, token: str | None, method: str) -> None:
    headers = {} if token is None else {"Authorization": token}
    status, _, raw = send(fuzz_worker, method, "/internal/requests", None, headers)
    assert status == 401 and assert_client_error(status, raw)["type"] == "authentication_error"
    status, headers_back, raw = send(fuzz_worker, "GET", "/internal/requests", None, AUTH)
    assert status == 200 and "requests" in json.loads(raw), raw[:300]
    assert headers_back["content-type"].startswith("application/json")
