"""The vLLM engine (engines/vllm/engine.py) on the CPU: what the contract tests cannot see from outside.

The session's vLLM engine (worker_testing.start_engine, shared with test_engine_contract.py, since
loading takes ~25 s) is checked against vLLM's own cache config and against transformers' greedy
tokens; one more engine is started here with an odd capacity, then stopped, to see the capacity
rounded to whole blocks and that no EngineCore or worker process outlives stop(). A third, with
prefix caching on (module-scoped, another ~25 s: the session engine's config has it off), shows
vLLM's cache hits reported and the greedy tokens of the engine without it.

The whole module is skipped where vllm is not installed, and fails instead under
KVFLEET_REQUIRE_VLLM=1 (`make test`, which installs it with scripts/install-vllm.sh).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing.resource_tracker
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from worker_testing import (
    TEST_KV_CAPACITY_BYTES,
    TEST_MAX_MODEL_LEN,
    EngineLoop,
    StartedEngine,
    collect,
    greedy,
    start_engine,
    tokens,
    vllm_available,
)

if not vllm_available():
    if os.environ.get("KVFLEET_REQUIRE_VLLM") == "1":
        pytest.fail("KVFLEET_REQUIRE_VLLM=1 but vllm is not installed (run: bash scripts/install-vllm.sh .venv)", pytrace=False)
    pytest.skip(
        "vllm is not installed (bash scripts/install-vllm.sh .venv); KVFLEET_REQUIRE_VLLM=1 makes this a failure",
        allow_module_level=True,
    )

import psutil  # noqa: E402  (a vLLM dependency)
import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from kvfleet.worker.engines.base import (  # noqa: E402
    EngineConfig,
    EngineError,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    kv_blocks_bytes,
)
from kvfleet.worker.engines.vllm.engine import VLLMEngine  # noqa: E402
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
    # EOS becomes a stop token (vLLM loads no tokenizer here to learn it); the agent owns the text.
    assert mapped.stop_token_ids == [9, 2] and not mapped.ignore_eos and not mapped.detokenize
    assert mapped.output_kind.name == "DELTA"
    # The request's own id travels to kvfleet's KV connector (vLLM suffixes the id it uses inside).
    assert mapped.extra_args == {"kv_transfer_params": {"kvfleet": {"id": "r-1", "load": False}}}
    resumed = engine._sampling_params(SamplingParams(ignore_eos=True), "r-2", True)
    assert resumed.stop_token_ids == [] and resumed.extra_args == {"kv_transfer_params": {"kvfleet": {"id": "r-2", "load": True}}}


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
            assert not psutil.pid_exists(pid) or pid == _resource_tracker_pid(), f"process {pid} outlived stop()"
        with pytest.raises(RuntimeError):
            engine.generate("after-stop", [1, 2], greedy(2))

    asyncio.run(asyncio.wait_for(run(), 300))


def _resource_tracker_pid() -> int | None:
    # multiprocessing's resource tracker starts with the first spawned process and lives as long as
    # this one: it is not the engine's.
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
