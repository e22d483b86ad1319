"""The vLLM engine (engines/vllm/engine.py) on the CPU: what the contract tests cannot see from outside.

The session's vLLM engine (worker_testing.start_engine, shared with test_engine_contract.py, since
loading takes ~25 s) is checked against vLLM's own cache config and against transformers' greedy
tokens; one more engine is started here with an odd capacity, then stopped, to see the capacity
rounded to whole blocks and that no EngineCore or worker process outlives stop(). A third, with
prefix caching on (module-scoped, another ~25 s: the session engine's config has it off), shows
vLLM's cache hits reported and the greedy tokens of the engine without it.

Sampling: every field of kvfleet's SamplingParams reaches vLLM's; log-probabilities are transformers'
log_softmax at the greedy tokens; regex and JSON-object constraints hold (decoded with the model's
tokenizer); a request resumed with output keeps its presence and frequency penalties (kvfleet's logits
processor, engines/vllm/penalties.py, checked here on vLLM's V1 runner and, for the V2 class, against
vLLM's own penalty function on CPU tensors), and a structured one its grammar where it was (kvfleet's
structured-output processor, engines/vllm/structured.py: inside vLLM's V1 runner here, and for the V2
class against engines/grammar.py's constraint on CPU tensors).

The whole module is skipped where vllm is not installed, and fails instead under
KVFLEET_REQUIRE_VLLM=1 (`make test`, which installs it with scripts/install-vllm.sh).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing.resource_tracker
import os
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_forkserver import forkserver_pid
from worker_testing import (
    TEST_KV_CAPACITY_BYTES,
    TEST_MAX_MODEL_LEN,
    EngineLoop,
    StartedEngine,
    collect,
    greedy,
    start_engine,
    tokens,
    tokens_of,
    vllm_available,
)

if not vllm_available():
    if os.environ.get("KVFLEET_REQUIRE_VLLM") == "1":
        pytest.fail("KVFLEET_REQUIRE_VLLM=1 but vllm is not installed (run: bash scripts/install-vllm.sh .venv)", pytrace=False)
    pytest.skip(
        "vllm is not installed (bash scripts/install-vllm.sh .venv); KVFLEET_REQUIRE_VLLM=1 makes this a failure",
        allow_module_level=True,
    )

import numpy as np  # noqa: E402
import psutil  # noqa: E402  (a vLLM dependency)
import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402
from vllm.model_executor.layers.utils import apply_penalties  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: E402
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState  # noqa: E402

from kvfleet.worker.engines.base import (  # noqa: E402
    EngineConfig,
    EngineError,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    StructuredOutput,
    kv_blocks_bytes,
)
from kvfleet.worker.engines.grammar import Grammars  # noqa: E402
from kvfleet.worker.engines.vllm import structured as vllm_structured  # noqa: E402
from kvfleet.worker.engines.vllm.engine import VLLMEngine, _rest_of, logits_processors  # noqa: E402
from kvfleet.worker.engines.vllm.penalties import EXTRA_KEY, CarriedPenalties, CarriedPenaltiesV2, processor_name  # noqa: E402
from kvfleet.worker.engines.vllm.structured import StructuredOutputsV1, StructuredOutputsV2  # noqa: E402
from kvfleet.worker.gpu import GPUProbe  # noqa: E402
from kvfleet.worker.metrics import WorkerMetrics  # noqa: E402

PROMPTS = [[1, 17, 300, 45, 99], [1, 5, 6, 7], [1, 1000, 1500, 20, 21, 22, 23, 24, 25, 26], [1, 400], list(range(1, 40))]
_ids = itertools.count()


def rid(prefix: str) -> str:
    return f"vllm-{prefix}-{next(_ids)}"


@pytest.fixture(scope="module")
def vllm(tiny_model_dir: Path, engine_loop: EngineLoop, started_engines: dict[str, StartedEngine]) -> StartedEngine:
    return start_engine("vllm", tiny_model_dir, started_engines, engine_loop)


@pytest.fixture(scope="module")
def vllm_prefix_cached(vllm: StartedEngine, engine_loop: EngineLoop) -> Iterator[StartedEngine]:
    """The session engine's config with prefix caching on (started after it: one load at a time)."""
    engine = VLLMEngine(replace(engine_of(vllm).config, prefix_caching=True))
    info = engine_loop.run(engine.start(), timeout_s=300)
    yield StartedEngine("vllm-prefix-cached", engine, info, engine_loop)
    engine_loop.run(engine.stop())


def engine_of(started: StartedEngine) -> VLLMEngine:
    assert isinstance(started.engine, VLLMEngine)
    return started.engine


def assert_empty(started: StartedEngine) -> None:
    engine = engine_of(started)
    assert engine.kv_usage() == []
    assert engine.num_waiting() == 0
    assert engine._llm is not None and engine._llm.get_num_unfinished_requests() == 0, "vLLM still holds a request"


def test_capacity_is_the_blocks_vllm_allocated(vllm: StartedEngine, tiny_model_dir: Path) -> None:
    info = vllm.info
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert info.kv_bytes_per_token == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    llm = engine_of(vllm)._llm
    assert llm is not None
    cache_config = llm.vllm_config.cache_config
    assert info.block_size_tokens == cache_config.block_size == 128  # vLLM's CPU default
    # Every block vLLM allocated but its null block, which no request gets.
    usable_blocks = cache_config.num_gpu_blocks - 1
    assert info.kv_capacity_bytes == usable_blocks * info.block_size_tokens * info.kv_bytes_per_token
    assert info.kv_capacity_bytes == TEST_KV_CAPACITY_BYTES  # 16 MiB is 64 whole blocks of 256 KiB
    assert info.max_model_len == TEST_MAX_MODEL_LEN
    assert info.eos_token_ids == (config["eos_token_id"],)


def test_greedy_tokens_are_transformers_greedy_tokens(vllm: StartedEngine, tiny_model_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        got = tokens(vllm.loop.run(collect(engine_of(vllm), rid("hf"), prompt, greedy(16))))
        assert got == ids[len(prompt) :], f"prompt {prompt}"
    assert_empty(vllm)


def test_streams_its_tokens_as_deltas_with_its_kv_tokens(vllm: StartedEngine) -> None:
    prompt = PROMPTS[2]
    outs = vllm.loop.run(collect(engine_of(vllm), rid("delta"), prompt, greedy(9)))
    # One token a step, except that AsyncLLM merges the deltas of steps its reader has not taken yet
    # (a loaded machine): every output is new tokens, none is empty, and the sum is the budget.
    sizes = [len(o.new_token_ids) for o in outs]
    assert all(n >= 1 for n in sizes) and sum(sizes) == 9, sizes
    assert [o.num_tokens for o in outs] == [len(prompt) + sum(sizes[:i + 1]) for i in range(len(outs))]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length"
    assert_empty(vllm)


def test_sampling_params_map_to_vllm(vllm: StartedEngine) -> None:
    engine = engine_of(vllm)
    mapped = engine._sampling_params(SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop_token_ids=(9,)),
                                     "r-1", False)
    assert (mapped.max_tokens, mapped.temperature, mapped.top_p, mapped.seed) == (7, 0.5, 0.9, 3)
    # EOS becomes a stop token (said explicitly, whatever vLLM's tokenizer says); the agent owns the text.
    assert mapped.stop_token_ids == [9, 2] and not mapped.ignore_eos and not mapped.detokenize
    assert mapped.output_kind.name == "DELTA"
    # The request's own id travels to kvfleet's KV connector (vLLM suffixes the id it uses inside).
    assert mapped.extra_args == {"kv_transfer_params": {"kvfleet": {"id": "r-1", "load": False}}}
    resumed = engine._sampling_params(SamplingParams(ignore_eos=True), "r-2", True)
    assert resumed.stop_token_ids == [] and resumed.extra_args == {"kv_transfer_params": {"kvfleet": {"id": "r-2", "load": True}}}
    # Defaults are vLLM's: top_k 0 is "every token" in vLLM 0.32 too, no logprobs, no constraint.
    assert (mapped.top_k, mapped.min_p, mapped.logprobs, mapped.structured_outputs, mapped.logit_bias) == (0, 0.0, None, None, None)


def test_every_sampling_field_reaches_vllm(vllm: StartedEngine) -> None:
    engine = engine_of(vllm)
    params = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.8, top_k=40, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias=((5, -3.0), (17, 2.5)),
                            min_tokens=4, seed=11, stop_token_ids=(9, 10), ignore_eos=False, logprobs=3,
                            structured=StructuredOutput("regex", "[a-z]+"))
    mapped = engine._sampling_params(params, "r-all", False)
    assert (mapped.n, mapped.max_tokens, mapped.temperature, mapped.top_p, mapped.top_k, mapped.min_p) == (1, 20, 0.7, 0.8, 40, 0.05)
    assert (mapped.presence_penalty, mapped.frequency_penalty, mapped.repetition_penalty) == (0.5, -0.25, 1.2)
    assert mapped.logit_bias == {5: -3.0, 17: 2.5}
    assert (mapped.min_tokens, mapped.seed, mapped.logprobs, mapped.ignore_eos) == (4, 11, 3, False)
    assert mapped.stop_token_ids == [9, 10, 2]
    # The constraint goes to kvfleet's processor, not to vLLM's structured outputs (engines/vllm/structured.py).
    assert mapped.structured_outputs is None
    assert not mapped.detokenize and mapped.output_kind.name == "DELTA"
    assert mapped.extra_args == {"kv_transfer_params": {"kvfleet": {"id": "r-all", "load": False}},
                                 vllm_structured.EXTRA_KEY: {"kind": "regex", "spec": "[a-z]+", "any_whitespace": True,
                                                             "carried": 0}}
    # logprobs=0: the sampled token's only.
    assert engine._sampling_params(SamplingParams(logprobs=0), "r-0", False).logprobs == 0


@pytest.mark.parametrize("structured", [
    StructuredOutput("json_object"),
    StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}', any_whitespace=False),
    StructuredOutput("regex", r"\d{3}"),
    StructuredOutput("choice", '["yes", "no"]'),
    StructuredOutput("grammar", 'start: "a"+'),
])
def test_structured_outputs_go_to_kvfleets_processor(vllm: StartedEngine, structured: StructuredOutput) -> None:
    """Every kind reaches the processor whole (the spec, the whitespace switch, the output a resumed request
    carries), and vLLM's own structured outputs get nothing; vLLM loads no tokenizer."""
    engine = engine_of(vllm)
    for carried in (0, 3):
        mapped = engine._sampling_params(SamplingParams(max_tokens=8, structured=structured), "r-so", False, carried)
        assert mapped.structured_outputs is None
        assert vllm_structured.structured_request(mapped) == vllm_structured.StructuredRequest(structured, carried)
        # Once the grammar is complete only EOS may come: a stop token, so the request ends "stop".
        assert 2 in (mapped.stop_token_ids or [])
    llm = engine._llm
    assert llm is not None and llm.vllm_config.model_config.skip_tokenizer_init


def test_malformed_processor_entries_are_refused_at_admission() -> None:
    for entry in ("regex", {"kind": "regex", "spec": "a"}, {"kind": "sql", "spec": "", "any_whitespace": True, "carried": 0},
                  {"kind": "regex", "spec": "a", "any_whitespace": True, "carried": -1}):
        with pytest.raises(ValueError, match=vllm_structured.EXTRA_KEY):
            StructuredOutputsV1.validate_params(SimpleNamespace(extra_args={vllm_structured.EXTRA_KEY: entry}))  # type: ignore[arg-type]
    StructuredOutputsV1.validate_params(SimpleNamespace(extra_args=None))  # type: ignore[arg-type]


def test_malformed_or_uncompilable_constraints_are_refused(vllm: StartedEngine) -> None:
    engine = engine_of(vllm)
    for structured in (StructuredOutput("json_schema", "{not json"), StructuredOutput("json_schema", "[1]"),
                       StructuredOutput("choice", "[]"), StructuredOutput("choice", '["a", 1]')):
        with pytest.raises(EngineError):
            engine.generate(rid("bad-spec"), PROMPTS[0], greedy(4, structured=structured))
    # Well-formed, but no regex: llguidance refuses it when the engine compiles it, before vLLM sees it.
    with pytest.raises(EngineError, match="regex"):
        engine.generate(rid("bad-regex"), PROMPTS[0], greedy(4, structured=StructuredOutput("regex", "(")))
    with pytest.raises(EngineError, match="presence_penalty"):
        engine.generate(rid("bad-penalty"), PROMPTS[0], greedy(4, presence_penalty=2.5))
    with pytest.raises(EngineError, match="logit_bias"):
        engine.generate(rid("bad-bias"), PROMPTS[0], greedy(4, logit_bias=((4096, 1.0),)))
    with pytest.raises(EngineError, match="logprobs"):
        engine.generate(rid("many-logprobs"), PROMPTS[0], greedy(4, logprobs=21))  # vLLM's max_logprobs is 20
    assert_empty(vllm)


def test_logprobs_are_transformers_log_softmax_one_per_token(vllm: StartedEngine, tiny_model_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    k = 4
    for prompt in (PROMPTS[0], PROMPTS[2]):
        outs = vllm.loop.run(collect(engine_of(vllm), rid("logprobs"), prompt, greedy(12, logprobs=k)))
        ids = list(prompt)
        for out in outs:
            assert len(out.logprobs) == len(out.new_token_ids), "one entry per new token, deltas only"
            for token, entry in zip(out.new_token_ids, out.logprobs, strict=True):
                with torch.no_grad():
                    want = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
                assert entry.token_id == token == int(want.argmax())
                assert entry.rank == 1  # greedy
                assert abs(entry.logprob - float(want[token])) < 1e-3
                assert len(entry.top) == k
                assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
                top_want = torch.topk(want, k)
                assert [t for t, _ in entry.top] == top_want.indices.tolist()
                assert all(abs(lp - float(w)) < 1e-3 for (_, lp), w in zip(entry.top, top_want.values, strict=True))
                ids.append(token)
    # Without logprobs asked for, none come back; with 0, the sampled token's alone.
    plain = vllm.loop.run(collect(engine_of(vllm), rid("no-logprobs"), PROMPTS[1], greedy(3)))
    assert all(out.logprobs == () for out in plain)
    only = vllm.loop.run(collect(engine_of(vllm), rid("logprobs-0"), PROMPTS[1], greedy(3, logprobs=0)))
    assert all(len(out.logprobs) == len(out.new_token_ids) and all(e.top == () for e in out.logprobs) for out in only)
    assert_empty(vllm)


def test_a_regex_constrains_the_output(vllm: StartedEngine, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pattern = r"[a-z]{3,8}@[a-z]{2,5}\.com"
    params = SamplingParams(max_tokens=40, structured=StructuredOutput("regex", pattern))
    outs = vllm.loop.run(collect(engine_of(vllm), rid("regex"), PROMPTS[0], params))
    # Once the regex is matched only EOS may follow: the request stops by itself.
    assert outs[-1].finish_reason == "stop"
    ids = tokens(outs)
    assert ids[-1] == 2
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert re.fullmatch(pattern, text), text
    # Unconstrained, the tiny model writes no such thing.
    free = tokenizer.decode(tokens(vllm.loop.run(collect(engine_of(vllm), rid("free"), PROMPTS[0], greedy(len(ids))))))
    assert not re.fullmatch(pattern, free)
    assert_empty(vllm)


def test_a_json_object_output_parses(vllm: StartedEngine, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(max_tokens=100, structured=StructuredOutput("json_object"))
    # A prompt for which the tiny (random) model closes its object within the budget: on most it
    # writes one endless string, as the grammar lets it.
    outs = vllm.loop.run(collect(engine_of(vllm), rid("json"), PROMPTS[0], params))
    assert outs[-1].finish_reason == "stop"
    value = json.loads(tokenizer.decode(tokens(outs), skip_special_tokens=True))
    assert isinstance(value, dict)
    assert_empty(vllm)


PENALTIES = {"presence_penalty": 2.0, "frequency_penalty": 1.0}


def test_a_resumed_request_keeps_its_presence_and_frequency_penalties(vllm: StartedEngine) -> None:
    """Resumed with half its output, greedy under penalties: the rest is the unmoved request's, which
    only holds if the penalties count the output it brought (vLLM alone counts what it generates)."""
    engine = engine_of(vllm)
    prompt, carried = PROMPTS[3], 20  # a prompt on which the tiny model repeats itself, so penalties matter

    async def resume(params: SamplingParams, output: list[int]) -> list[int]:
        stream = engine.continue_request(rid("pen-resumed"), prompt, output, params, load=False)
        return [t async for out in stream for t in out.new_token_ids]

    for params in (greedy(40, **PENALTIES), greedy(40, repetition_penalty=1.3, **PENALTIES)):
        full = tokens(vllm.loop.run(collect(engine, rid("pen-full"), prompt, params)))
        assert vllm.loop.run(resume(params, full[:carried])) == full[carried:]
    full = tokens(vllm.loop.run(collect(engine, rid("pen-full"), prompt, greedy(40, **PENALTIES))))
    assert full != tokens(vllm.loop.run(collect(engine, rid("pen-none"), prompt, greedy(40)))), "penalties change nothing here"
    # What vLLM alone gives the same tokens as a prompt: the earlier output goes uncounted. (With a
    # repetition penalty too, which covers the prompt, this prompt does not show the difference.)
    naive = tokens(vllm.loop.run(collect(engine, rid("pen-naive"), prompt + full[:carried], greedy(40 - carried, **PENALTIES))))
    assert naive != full[carried:], "this prompt does not tell a carried penalty from none"
    # vLLM's own penalties are neutral for a request the processor penalizes.
    rest = engine._sampling_params(greedy(20, repetition_penalty=1.3, **PENALTIES), "r-pen", False, carried)
    assert (rest.presence_penalty, rest.frequency_penalty, rest.repetition_penalty) == (0.0, 0.0, 1.0)
    assert rest.extra_args is not None
    assert rest.extra_args[EXTRA_KEY] == {"carried": carried, "presence": 2.0, "frequency": 1.0, "repetition": 1.3}
    # The processor vLLM loaded is the one for its model runner (V1 in vLLM's CPU build).
    llm = engine._llm
    assert llm is not None and not llm.vllm_config.use_v2_model_runner
    assert llm.vllm_config.model_config.logits_processors == logits_processors(False)
    assert logits_processors(False) == [processor_name(False), vllm_structured.processor_name(False)]
    # Only repetition (over prompt and output, the same set after a move): vLLM's own stage does it.
    rep_only = engine._sampling_params(greedy(5, repetition_penalty=1.3), "r-rep", False, carried)
    assert rep_only.repetition_penalty == 1.3 and rep_only.extra_args is not None and EXTRA_KEY not in rep_only.extra_args
    assert_empty(vllm)


def test_min_tokens_and_max_tokens_count_the_output_a_resumed_request_brought(vllm: StartedEngine) -> None:
    engine = engine_of(vllm)
    prompt = PROMPTS[1]
    # EOS made the most likely token everywhere: the request ends as soon as min_tokens lets it.
    params = greedy(12, ignore_eos=False, min_tokens=8, logit_bias=((2, 100.0),))
    full = tokens(vllm.loop.run(collect(engine, rid("mt-full"), prompt, params)))
    assert len(full) == 9 and full[-1] == 2

    async def resume(carried: int) -> list[StepOutput]:
        return [out async for out in engine.continue_request(rid("mt-resumed"), prompt, full[:carried], params, load=False)]

    # 5 brought: 3 more before EOS may end it, as unmoved (vLLM alone would count 8 from the move on).
    outs = vllm.loop.run(resume(5))
    assert tokens(outs) == full[5:] and outs[-1].finish_reason == "stop"
    assert _rest_of(params, 5) == replace(params, max_tokens=7, min_tokens=3)
    # 10 of 12 brought: min_tokens (8) above what remains of max_tokens (2) is no error; none is left to wait for.
    assert _rest_of(params, 10) == replace(params, max_tokens=2, min_tokens=0)
    assert_empty(vllm)


LETTERS = "[a-z]{40}"


def test_a_resumed_structured_request_follows_its_grammar_from_where_it_was(vllm: StartedEngine,
                                                                          tiny_model_dir: Path) -> None:
    """Resumed with part of its output, greedy under a regex: the rest is the unmoved request's, which only
    holds if the grammar was advanced over the output it brought (vLLM's own structured outputs would
    restart it: a fresh grammar after the carried letters lets 40 more come)."""
    engine = engine_of(vllm)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = PROMPTS[0]
    params = greedy(60, ignore_eos=False, structured=StructuredOutput("regex", LETTERS))
    full_outs = vllm.loop.run(collect(engine, rid("so-full"), prompt, params))
    full = tokens(full_outs)
    assert full_outs[-1].finish_reason == "stop" and full[-1] == 2, full
    assert re.fullmatch(LETTERS, tokenizer.decode(full, skip_special_tokens=True))

    async def resume(output: list[int], p: SamplingParams = params) -> list[StepOutput]:
        return [out async for out in engine.continue_request(rid("so-resumed"), prompt, output, p, load=False)]

    for carried in (1, len(full) // 2, len(full) - 2):
        outs = vllm.loop.run(resume(full[:carried]))
        assert tokens(outs) == full[carried:] and outs[-1].finish_reason == "stop", carried
    # The grammar complete in what it brought: only EOS may come.
    outs = vllm.loop.run(resume(full[:-1]))
    assert tokens(outs) == [2] and outs[-1].finish_reason == "stop"
    # What a fresh grammar after the same tokens gives: not the rest of the unmoved output.
    carried = len(full) // 2
    naive = tokens(vllm.loop.run(collect(engine, rid("so-naive"), prompt + full[:carried], replace(params, max_tokens=60))))
    assert naive != full[carried:]
    # Output that breaks the grammar is refused before anything streams.
    digits = tokenizer.encode("123", add_special_tokens=False)
    with pytest.raises(EngineError, match="does not follow"):
        engine.continue_request(rid("so-broken"), prompt, digits, params, load=False)
    assert_empty(vllm)


def test_a_structured_request_is_suspended_like_any_other(vllm: StartedEngine) -> None:
    """No refusal: a structured request stops for a move, and resumed here (a rolled-back move) it goes on
    with its grammar where it was, giving the unmoved output."""
    engine = engine_of(vllm)
    migration = engine.capabilities.migration
    assert migration is not None
    params = greedy(60, ignore_eos=False, structured=StructuredOutput("regex", LETTERS))
    full = tokens(vllm.loop.run(collect(engine, rid("so-unmoved"), PROMPTS[0], params)))
    request_id = rid("so-suspend")

    async def run() -> list[int]:
        stream = engine.generate(request_id, PROMPTS[0], params)
        got = list((await anext(stream)).new_token_ids)
        # The stream is read on while the request stops: it ends, unfinished, at the suspension.
        reader = asyncio.create_task(tokens_of(stream))
        state = await migration.suspend(request_id)
        got += await reader
        assert list(state.output_token_ids) == got and len(got) < len(full)
        rest = migration.resume(request_id, state.prompt_token_ids, state.output_token_ids, state.params)
        return got + await tokens_of(rest)

    assert vllm.loop.run(run()) == full
    assert_empty(vllm)


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def test_the_v2_runner_processor_computes_vllms_penalties_over_the_carried_output() -> None:
    """The V2 model runner (vLLM's default on CUDA) is not runnable here; its processor class is checked
    on CPU tensors against vLLM's own penalty function with the carried tokens as output, as is the
    V1 per-request processor the engine tests above run inside vLLM."""
    vocab, max_len = 50, 32
    generator = torch.Generator().manual_seed(0)
    prompts = [[3, 4, 5, 4, 9], [7, 7, 1], [2, 11, 12, 13]]
    carried = [2, 0, 3]       # the prompt's last tokens that are output brought by a resumed request
    generated = [[5, 9, 9, 30], [7, 8], [13, 40]]
    penalties = [CarriedPenalties(c, 1.5, 0.75, 1.3) for c in carried]
    logits = torch.randn(len(prompts), vocab, generator=generator) * 3
    # vLLM's own function (the V1 sampler's), with the carried tokens where they belong: in the output.
    pad = vocab
    real_prompts = [p[:len(p) - c] for p, c in zip(prompts, carried, strict=True)]
    outputs = [p[len(p) - c:] + g for p, c, g in zip(prompts, carried, generated, strict=True)]
    width_p, width_o = max(map(len, real_prompts)), max(map(len, outputs))
    want = apply_penalties(logits.clone(), torch.tensor([p + [pad] * (width_p - len(p)) for p in real_prompts]),
                           torch.tensor([o + [pad] * (width_o - len(o)) for o in outputs]),
                           torch.tensor([1.5] * 3), torch.tensor([0.75] * 3), torch.tensor([1.3] * 3))
    # V1: the per-request processor on each row, with the prompt vLLM was given and its own output.
    v1 = torch.stack([penalties[i](prompts[i], generated[i], logits[i].clone()) for i in range(3)])
    torch.testing.assert_close(v1, want, rtol=0, atol=1e-6)
    # V2: the requests in slots 4, 0 and 2, their tokens in the runner's device buffer (stale after total_len).
    slots = [4, 0, 2]
    all_token_ids = torch.randint(0, vocab, (6, max_len), generator=generator, dtype=torch.int32)
    prompt_len = np.zeros(6, dtype=np.int32)
    total_len = torch.zeros(6, dtype=torch.int32)
    for slot, prompt, gen in zip(slots, prompts, generated, strict=True):
        all_token_ids[slot, :len(prompt) + len(gen)] = torch.tensor(prompt + gen, dtype=torch.int32)
        prompt_len[slot], total_len[slot] = len(prompt), len(prompt) + len(gen)
    states = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=6, vocab_size=vocab,
                                    all_token_ids=SimpleNamespace(gpu=all_token_ids),  # type: ignore[arg-type]
                                    prompt_len=SimpleNamespace(np=prompt_len),  # type: ignore[arg-type]
                                    prefill_len=SimpleNamespace(np=prompt_len),  # type: ignore[arg-type]
                                    total_len=SimpleNamespace(gpu=total_len))  # type: ignore[arg-type]
    processor = CarriedPenaltiesV2(SimpleNamespace(speculative_config=None), states)  # type: ignore[arg-type]
    for slot, p in zip(slots, penalties, strict=True):
        params = SimpleNamespace(extra_args={EXTRA_KEY: {"carried": p.carried, "presence": 1.5, "frequency": 0.75,
                                                         "repetition": 1.3}})
        assert processor.add_request(slot, params)  # type: ignore[arg-type]
    assert not processor.add_request(5, SimpleNamespace(extra_args=None))  # type: ignore[arg-type]
    mapping = torch.tensor(slots + [5])
    ctx = LogitsContext(expanded_idx_mapping=mapping, idx_mapping=mapping, idx_mapping_np=mapping.numpy(),
                        expanded_local_pos=torch.zeros(4, dtype=torch.int32), input_ids=torch.zeros(4, dtype=torch.int32),
                        pos=torch.zeros(4, dtype=torch.int32), seq_lens_upper_bound_np=np.zeros(4, dtype=np.int32))
    untouched = torch.randn(1, vocab, generator=generator)
    v2 = processor.apply(torch.cat([logits.clone(), untouched]), ctx)
    torch.testing.assert_close(v2[:3], want, rtol=0, atol=1e-6)
    assert torch.equal(v2[3:], untouched), "a request without carried penalties is left alone"
    assert processor_name(True).endswith(":CarriedPenaltiesV2") and processor_name(False).endswith(":CarriedPenaltiesV1")


def _fake_vllm_config(model_dir: Path, vocab: int) -> Any:
    return SimpleNamespace(speculative_config=None,
                           model_config=SimpleNamespace(tokenizer=str(model_dir), get_vocab_size=lambda: vocab))


def _structured_params(spec: StructuredOutput | None, carried: int = 0) -> Any:
    extra = vllm_structured.structured_extra_args(spec, carried) if spec is not None else {}
    return SimpleNamespace(extra_args=extra or None)


def _masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~allowed, float("-inf"))


def _valid_tokens(grammars: Grammars, spec: StructuredOutput, n: int, seed: int = 0) -> list[int]:
    """n tokens the grammar allows one after another (random logits, the best allowed)."""
    constraint, generator, out = grammars.constraint(spec), torch.Generator().manual_seed(seed), []
    for _ in range(n):
        token = int(_masked(torch.randn(grammars.vocab_size, generator=generator), constraint.allowed()).argmax())
        constraint.advance(token)
        out.append(token)
    return out


def test_the_structured_processors_mask_as_kvfleets_grammar_over_the_carried_output(tiny_model_dir: Path) -> None:
    """Both model runners' classes on CPU tensors (V2 is not runnable here; V1 also runs inside vLLM above):
    each row's logits are the grammar's mask over the carried tokens and what vLLM generated, steps
    advance it, a row without a constraint is left alone, and a complete grammar held back by min_tokens
    still gets its EOS."""
    vocab = 2048
    grammars = Grammars(tiny_model_dir, vocab)
    regex = StructuredOutput("regex", "[0-9]{3}-[a-z]{2}x*")
    seq = _valid_tokens(grammars, regex, 6)
    yes = StructuredOutput("choice", '["yes", "no"]')
    yes_tokens = AutoTokenizer.from_pretrained(tiny_model_dir).encode("yes", add_special_tokens=False)
    generator = torch.Generator().manual_seed(1)
    # Request A: carried 2 tokens at its prompt's end, generated 1; B: json_object, nothing yet;
    # C: no constraint; D: "yes" complete, its EOS held back (-inf) as min_tokens would.
    prompts = {"a": [1, 5, *seq[:2]], "b": [1, 7], "c": [1, 9], "d": [1, 4, *yes_tokens]}
    specs = {"a": (regex, 2), "b": (StructuredOutput("json_object"), 0), "c": None, "d": (yes, len(yes_tokens))}
    want_prefix = {"a": seq[:3], "b": [], "d": yes_tokens}
    outputs = {"a": [seq[2]], "b": [], "c": [3], "d": []}
    order = ["a", "b", "c", "d"]

    def want(logits: torch.Tensor) -> torch.Tensor:
        rows = []
        for i, name in enumerate(order):
            if specs[name] is None:
                rows.append(logits[i])
                continue
            spec, _ = specs[name]  # type: ignore[misc]
            allowed = grammars.constraint(spec, want_prefix[name]).allowed()
            row = _masked(logits[i], allowed)
            rows.append(row if bool((row > float("-inf")).any()) else torch.where(allowed, 0.0, row))
        return torch.stack(rows)

    def step_logits() -> torch.Tensor:
        logits = torch.randn(len(order), vocab, generator=generator)
        logits[3, 2] = float("-inf")  # D's EOS held back
        return logits

    # V1: rows are batch indices; vLLM hands each request its prompt and live output list when it is added.
    v1 = StructuredOutputsV1(_fake_vllm_config(tiny_model_dir, vocab), torch.device("cpu"), False)
    assert not v1.is_argmax_invariant()
    live = {name: list(outputs[name]) for name in order}
    v1.update_state(BatchUpdate(batch_size=4, removed=[], moved=[], added=[
        (i, _structured_params(*(specs[n] or (None,))), prompts[n], live[n]) for i, n in enumerate(order)]))
    logits = step_logits()
    torch.testing.assert_close(v1.apply(logits.clone()), want(logits), rtol=0, atol=0)
    # A step: A's next token, and B's first; a placeholder (-1, async scheduling) is no token yet.
    b_first = _valid_tokens(grammars, specs["b"][0], 1)[0]  # type: ignore[index]
    live["a"].append(seq[3])
    live["b"] += [b_first, -1]
    want_prefix["a"], want_prefix["b"] = seq[:4], [b_first]
    logits = step_logits()
    torch.testing.assert_close(v1.apply(logits.clone()), want(logits), rtol=0, atol=0)
    # vLLM dropped A's last token (a failed KV load): the grammar starts again from what is left.
    live["a"].pop()
    want_prefix["a"] = seq[:3]
    logits = step_logits()
    torch.testing.assert_close(v1.apply(logits.clone()), want(logits), rtol=0, atol=0)

    # V2: the requests in slots 5, 0, 2, 3 with their tokens in the runner's device buffer.
    want_prefix = {"a": seq[:3], "b": [], "d": yes_tokens}
    slots = [5, 0, 2, 3]
    all_token_ids = torch.zeros((6, 32), dtype=torch.int32)
    prompt_len = np.zeros(6, dtype=np.int32)
    total_len = torch.zeros(6, dtype=torch.int32)
    for slot, name in zip(slots, order, strict=True):
        tokens_now = prompts[name] + outputs[name]
        all_token_ids[slot, :len(tokens_now)] = torch.tensor(tokens_now, dtype=torch.int32)
        prompt_len[slot], total_len[slot] = len(prompts[name]), len(tokens_now)
    states = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=6, vocab_size=vocab,
                                    all_token_ids=SimpleNamespace(gpu=all_token_ids),  # type: ignore[arg-type]
                                    prompt_len=SimpleNamespace(np=prompt_len),  # type: ignore[arg-type]
                                    prefill_len=SimpleNamespace(np=prompt_len),  # type: ignore[arg-type]
                                    total_len=SimpleNamespace(gpu=total_len))  # type: ignore[arg-type]
    v2 = StructuredOutputsV2(_fake_vllm_config(tiny_model_dir, vocab), states)
    for slot, name in zip(slots, order, strict=True):
        assert v2.add_request(slot, _structured_params(*(specs[name] or (None,)))) == (specs[name] is not None)
    mapping = torch.tensor(slots)

    def ctx() -> LogitsContext:
        return LogitsContext(expanded_idx_mapping=mapping, idx_mapping=mapping, idx_mapping_np=mapping.numpy(),
                             expanded_local_pos=torch.zeros(4, dtype=torch.int32), input_ids=torch.zeros(4, dtype=torch.int32),
                             pos=torch.zeros(4, dtype=torch.int32), seq_lens_upper_bound_np=np.zeros(4, dtype=np.int32))

    logits = step_logits()
    torch.testing.assert_close(v2.apply(logits.clone(), ctx()), want(logits), rtol=0, atol=0)
    for slot, token in ((5, seq[3]), (0, b_first)):
        all_token_ids[slot, int(total_len[slot])] = token
        total_len[slot] += 1
    want_prefix["a"], want_prefix["b"] = seq[:4], [b_first]
    logits = step_logits()
    torch.testing.assert_close(v2.apply(logits.clone(), ctx()), want(logits), rtol=0, atol=0)
    # A slot's new occupant without a constraint is left alone.
    assert not v2.add_request(5, _structured_params(None))
    specs["a"] = None
    logits = step_logits()
    torch.testing.assert_close(v2.apply(logits.clone(), ctx()), want(logits), rtol=0, atol=0)
    assert vllm_structured.processor_name(True).endswith(":StructuredOutputsV2")
    assert vllm_structured.processor_name(False).endswith(":StructuredOutputsV1")


def test_requests_beyond_the_batch_wait_and_kv_stays_within_capacity(vllm: StartedEngine) -> None:
    engine = engine_of(vllm)
    info = vllm.info
    num_requests = 20  # the session engine decodes at most 16 at once (max_num_seqs)
    samples: list[tuple[int, int, int]] = []  # (requests holding KV, their bytes, requests waiting)

    async def watch(done: asyncio.Event) -> None:
        while not done.is_set():
            usage = engine.kv_usage()
            samples.append((len(usage), sum(r.kv_bytes for r in usage), engine.num_waiting()))
            for r in usage:
                assert r.kv_bytes == kv_blocks_bytes(r.tokens, info.block_size_tokens, info.kv_bytes_per_token)
            await asyncio.sleep(0.01)

    async def run() -> list[list[StepOutput]]:
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        runs = [collect(engine, rid("many"), [1, 100 + i, 7], greedy(24)) for i in range(num_requests)]
        results = await asyncio.gather(*runs)
        done.set()
        await watcher
        return results

    results = vllm.loop.run(run())
    assert all(len(tokens(outs)) == 24 for outs in results)
    assert max(held for held, _, _ in samples) <= 16
    assert max(kv for _, kv, _ in samples) <= info.kv_capacity_bytes
    assert max(waiting for _, _, waiting in samples) >= num_requests - 16
    assert all(held + waiting <= num_requests for held, _, waiting in samples)
    assert_empty(vllm)


def test_abort_before_the_first_output_ends_the_stream(vllm: StartedEngine) -> None:
    engine = engine_of(vllm)
    request_id = rid("early-abort")

    async def run() -> list[StepOutput]:
        task = asyncio.create_task(collect(engine, request_id, PROMPTS[4], greedy(300)))
        while request_id not in {r.request_id for r in engine._requests.values()}:
            await asyncio.sleep(0)
        await engine.abort(request_id)
        await engine.abort("no-such-request")  # ignored
        return await task

    outs = vllm.loop.run(run())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(tokens(outs)) < 300
    assert_empty(vllm)


def test_prompts_vllm_cannot_take_are_refused_before_it_sees_them(vllm: StartedEngine) -> None:
    engine = engine_of(vllm)
    with pytest.raises(RequestTooLong, match="512 tokens"):
        engine.generate(rid("long"), [1] * 500, greedy(13))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.generate(rid("oov"), [1, 2048], greedy(4))
    with pytest.raises(EngineError, match="empty"):
        engine.generate(rid("empty"), [], greedy(4))
    # Exactly the context fits.
    outs = vllm.loop.run(collect(engine, rid("fits"), [1] * 500, greedy(12)))
    assert outs[-1].num_tokens == TEST_MAX_MODEL_LEN
    assert_empty(vllm)


def test_own_engine_rounds_capacity_to_blocks_and_stop_leaves_no_process(tiny_model_dir: Path) -> None:
    block_bytes = 128 * 2048
    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=5 * block_bytes + 1000, max_num_seqs=4))
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}

    async def run() -> None:
        info = await engine.start()
        assert info.kv_capacity_bytes == 5 * block_bytes, "whole blocks, never more than asked"
        assert info.max_model_len == 5 * 128, "lowered from the model's 2048 so that one request fits"
        assert engine._llm is not None and engine._llm.vllm_config.cache_config.num_gpu_blocks == 5 + 1  # + null block
        with pytest.raises(RequestTooLong):
            engine.generate("too-long", [1] * 600, greedy(41))
        started = {p.pid for p in me.children(recursive=True)} - before
        # The EngineCore, and its model worker unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (engines/vllm/engine.py).
        assert "VLLM::EngineCore" in {psutil.Process(pid).name() for pid in started}
        # A request still running when stop() comes is aborted, its stream ended.
        stream = engine.generate("running", [1, 2, 3], greedy(400))
        first = await anext(stream)  # type: ignore[call-overload]
        assert not first.finished
        await engine.stop()
        rest = [out async for out in stream]
        assert rest and rest[-1].finish_reason == "abort"
        await engine.stop()  # idempotent
        for pid in started:
            assert not psutil.pid_exists(pid) or pid in (_resource_tracker_pid(), forkserver_pid()), \
                f"process {pid} outlived stop()"
        with pytest.raises(RuntimeError):
            engine.generate("after-stop", [1, 2], greedy(2))

    asyncio.run(asyncio.wait_for(run(), 300))


def _resource_tracker_pid() -> int | None:
    # multiprocessing's resource tracker starts with the first spawned process and lives as long as
    # this one: it is not the engine's. Nor is the forkserver the tests start EngineCores from
    # (vllm_forkserver.py), which lives as long as this process too.
    return multiprocessing.resource_tracker._resource_tracker._pid  # type: ignore[attr-defined]


# Two prompts of 300 tokens sharing their first 290: two whole 128-token blocks and 34 tokens of a third.
SHARED_PREFIX = [(7 * i + 3) % 2000 + 1 for i in range(290)]
SHARING_PROMPTS = [SHARED_PREFIX + list(range(1500, 1510)), SHARED_PREFIX + list(range(1600, 1610))]


def test_prefix_caching_hits_the_shared_whole_blocks_and_keeps_greedy_tokens(
    vllm: StartedEngine, vllm_prefix_cached: StartedEngine
) -> None:
    engine = engine_of(vllm_prefix_cached)
    assert engine._llm is not None and engine._llm.vllm_config.cache_config.enable_prefix_caching
    assert engine_of(vllm).capabilities.prefix_cache is None
    cache = engine.capabilities.prefix_cache
    assert cache is not None
    block = vllm_prefix_cached.info.block_size_tokens
    assert block == 128  # vLLM's CPU default: the shared prefix holds 2 whole blocks
    got: list[list[int]] = []
    stats = []
    for prompt in SHARING_PROMPTS:  # one after the other: the first's blocks are cached when the second comes
        got.append(tokens(vllm_prefix_cached.loop.run(collect(engine, rid("cached"), prompt, greedy(8)))))
        stats.append(cache.prefix_cache_stats())
    first, second = stats
    assert (first.hit_tokens, first.prefilled_tokens) == (0, 300)
    # vLLM hits whole blocks only: 256 of the 290 shared tokens; the other 44 are prefilled again.
    assert second.hit_tokens == len(SHARED_PREFIX) // block * block == 256
    assert second.prefilled_tokens == 300 + (300 - 256)
    assert second.cached_blocks is None and second.evictable_blocks is None  # vLLM's block pool is out of reach
    # Attention over cached KV gives the tokens a full prefill gives (the session engine caches nothing).
    want = [tokens(vllm.loop.run(collect(engine_of(vllm), rid("uncached"), prompt, greedy(8)))) for prompt in SHARING_PROMPTS]
    assert got == want
    assert_empty(vllm_prefix_cached)
    assert_empty(vllm)


def test_the_worker_exports_vllms_hits_and_leaves_out_the_block_counts_it_cannot_see(
    vllm_prefix_cached: StartedEngine,
) -> None:
    engine = engine_of(vllm_prefix_cached)
    cache = engine.capabilities.prefix_cache
    assert cache is not None
    metrics = WorkerMetrics(lambda: 0.0, lambda: 0.0, lambda: 0.0, lambda: 0.0, GPUProbe(),
                            prefix_cache=cache.prefix_cache_stats)
    before = cache.prefix_cache_stats()
    for _ in range(2):  # the second hits the first's blocks whichever test ran before
        vllm_prefix_cached.loop.run(collect(engine, rid("metrics"), SHARING_PROMPTS[0], greedy(2)))
    stats = cache.prefix_cache_stats()
    assert stats.hit_tokens - before.hit_tokens >= 256
    sample = metrics.registry.get_sample_value
    assert sample("kvfleet_worker_prefix_cache_hit_tokens") == stats.hit_tokens
    assert sample("kvfleet_worker_prefilled_tokens") == stats.prefilled_tokens
    assert sample("kvfleet_worker_prefix_cache_blocks") is None
    assert sample("kvfleet_worker_prefix_cache_evictable_blocks") is None
