"""Elastic memory in the vLLM engine (engines/vllm/elastic.py, internals.py).

First the balloon alone, exactly, over vLLM's real `BlockPool` (no engine): which sets it holds, that a
set reaches vLLM only once the worker confirms its map, that a failed map leaves it in the balloon,
that deflation takes only sets whose blocks are all free, Algorithm 1's holds in arrival order, the
books. Then the engine on the CPU with the tiny model: greedy output equal to static vLLM's, the books
balanced after every step under memory pressure (requests held and sets deflated, all served), map
failures injected mid-grow with vLLM still serving, and a vLLM whose private names changed refused at
start with the reason. The engine contract suite runs on elastic vLLM too (conftest's `any_engine`).

Skipped where vllm is not installed, and failed instead under KVFLEET_REQUIRE_VLLM=1 (`make test`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
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
    pytest.skip("vllm is not installed (bash scripts/install-vllm.sh .venv)", allow_module_level=True)

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from kvfleet.worker.elastic.options import MemoryOptions  # noqa: E402
from kvfleet.worker.engines import EngineConfig, load_engine  # noqa: E402
from kvfleet.worker.engines.base import EngineError  # noqa: E402
from kvfleet.worker.engines.vllm import internals  # noqa: E402
from kvfleet.worker.engines.vllm.elastic import (  # noqa: E402
    ENV_FAIL_MAPS,
    ActivationModel,
    Balloon,
    CpuBuffer,
    ElasticSettings,
    Parked,
    SetGeometry,
    SetState,
)
from kvfleet.worker.engines.vllm.engine import VLLMEngine  # noqa: E402
from kvfleet.worker.engines.vllm.options import VLLMOptions  # noqa: E402

# -- the balloon over vLLM's BlockPool ---------------------------------------------------------------

# 4 sets of 4 blocks, 2 layers of 4 KiB pages: a block is 8 KiB, a set 32 KiB; budget 4 sets.
GEOMETRY = SetGeometry(num_layers=2, num_blocks=16, page_bytes=4096, blocks_per_set=4)
BLOCK = GEOMETRY.block_bytes
SET = GEOMETRY.set_bytes
BLOCK_TOKENS = 16


def balloon(budget_sets: int = 4, per_token: int = 0) -> Balloon:
    settings = ElasticSettings(budget_bytes=budget_sets * SET, chunk_bytes=GEOMETRY.chunk_bytes, threshold_bytes=0,
                               per_token_activation_bytes=per_token, per_sequence_activation_bytes=0)
    pool = BlockPool(num_gpu_blocks=GEOMETRY.num_blocks, enable_caching=True, hash_block_size=BLOCK_TOKENS)
    return Balloon(pool, GEOMETRY, settings, BLOCK_TOKENS, max_batched_tokens=64)


def step(scheduled: dict[str, int] | None = None, zeroed: list[int] | None = None) -> Any:
    scheduled = scheduled or {}
    return SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           new_block_ids_to_zero=zeroed)


def request(num_tokens: int, computed: int = 0) -> Any:
    return SimpleNamespace(num_tokens=num_tokens, num_computed_tokens=computed)


def test_at_start_only_the_set_with_the_null_block_is_vllms() -> None:
    b = balloon()
    assert b.state == [SetState.MAPPED, SetState.HELD, SetState.HELD, SetState.HELD]
    assert b.free_blocks == 3 and b.balloon_blocks == 12 and b.used_blocks == 0
    assert b.usage() == 0.0 and b.pool.get_usage() == 0.0  # vLLM's usage reads the balloon's
    assert b.counters.books_errors == 0


def test_a_set_reaches_vllm_only_once_the_worker_confirms_its_map() -> None:
    b = balloon()
    orders = b.plan(step())  # 3 free blocks, a set of margin wanted: one set inflates
    assert orders.maps == [1] and orders.unmaps == []
    assert b.state[1] is SetState.MAPPING and b.free_blocks == 3 and b.waiting_for_worker
    b.confirmed([1], {}, worker_slots=4, map_s=0.0, unmap_s=0.0)
    assert b.state[1] is SetState.MAPPED and b.free_blocks == 7 and b.counters.grows == 1
    assert not b.waiting_for_worker and b.counters.books_errors == 0
    # vllm:kv_cache_usage_perc: used blocks over the mapped capacity (2 of 7), not over the whole cache.
    b.pool.get_new_blocks(2)
    assert b.pool.get_usage() == 2 / 7


def test_a_failed_map_leaves_the_set_in_the_balloon_and_vllm_untouched() -> None:
    b = balloon()
    assert b.plan(step()).maps == [1]
    b.confirmed([], {1: "injected"}, worker_slots=2, map_s=0.0, unmap_s=0.0)
    assert b.state[1] is SetState.HELD and b.free_blocks == 3 and b.counters.map_failures == 1
    assert b.counters.books_errors == 0
    assert b.plan(step()).maps == [1]  # tried again next step


def test_deflation_takes_only_sets_whose_blocks_are_all_free_highest_first() -> None:
    b = balloon(budget_sets=4, per_token=SET // 64)  # a 64-token step's activations take one set
    used = []
    while b.mapped_sets < 4:  # vLLM short of blocks each step: the KV side inflates a set at a time
        used += b.pool.get_new_blocks(b.free_blocks)
        orders = b.plan(step())
        b.confirmed(orders.maps, {}, None, 0.0, 0.0)
    assert b.counters.grows == 3 and b.counters.violations == 0
    b.pool.free_blocks(used[5:])  # blocks 1-3 (set 0) and 4-5 (set 1) stay used
    assert sorted(block.block_id for block in used[:5]) == [1, 2, 3, 4, 5]
    # A 64-token prompt: 4 new blocks and one set of activations. Sets 3 then 2 are free; set 1 is not.
    assert b.admit(request(64), 0)
    assert b.state == [SetState.MAPPED, SetState.MAPPED, SetState.MAPPED, SetState.HELD]
    orders = b.plan(step({"r": 64}))
    assert orders.unmaps == [3] and b.counters.shrinks == 1 and b.counters.violations == 0
    taken = [b.pool.blocks[i] for i in GEOMETRY.blocks(3)]
    assert all(block.prev_free_block is None and block.ref_cnt == 0 for block in taken)
    assert b.counters.books_errors == 0


def test_algorithm_1_holds_a_request_that_does_not_fit_and_every_later_one_that_step() -> None:
    b = balloon(budget_sets=4, per_token=SET // 16)  # 16 tokens of activations take a set
    b.pool.get_new_blocks(3)
    # 48 tokens: 3 sets of activations beside set 0's used blocks: 4 sets, no room left for its KV.
    assert not b.admit(request(48), 0)
    assert not b.admit(request(1), 0)  # arrival order: a later, smaller one waits too
    assert b.counters.held_prefills == 1
    b.plan(step())
    assert b.admit(request(16), 0)  # a new step: one set of activations and one block fit


def test_admission_wants_blocks_for_the_whole_prompt_as_vllm_does_and_the_balloon_grows_for_them() -> None:
    b = balloon(budget_sets=4)
    # vLLM admits a request only with blocks for its whole input free (scheduler_reserve_full_isl):
    # 100 tokens are 7 blocks though its first chunk is 64 tokens; 3 are free.
    assert b.admit(request(100), 0)
    orders = b.plan(step())
    assert orders.maps == [1, 2]  # its 7 blocks and a set of margin beside 3 free: two sets
    b.confirmed(orders.maps, {}, None, 0.0, 0.0)
    assert b.free_blocks == 11


def test_a_warm_pool_short_of_a_prompt_by_one_block_grows_for_it() -> None:
    geometry = SetGeometry(num_layers=2, num_blocks=64, page_bytes=4096, blocks_per_set=4)
    settings = ElasticSettings(budget_bytes=16 * geometry.set_bytes, chunk_bytes=geometry.chunk_bytes, threshold_bytes=0,
                               per_token_activation_bytes=0, per_sequence_activation_bytes=0)
    b = Balloon(BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BLOCK_TOKENS), geometry, settings,
                BLOCK_TOKENS, max_batched_tokens=64)
    assert b.admit(request(12 * BLOCK_TOKENS), 0)
    orders = b.plan(step())
    assert orders.maps == [1, 2, 3, 4]  # 12 blocks and a set of margin beside 3 free
    b.confirmed(orders.maps, {}, None, 0.0, 0.0)
    assert b.free_blocks == 19
    # A prompt of 20 blocks beside 19 free: short by one. What must be free is its whole prompt and the
    # margin (counted net of the free blocks twice, the pool never grew for it: vLLM waited for ever).
    assert b.admit(request(20 * BLOCK_TOKENS), 0)
    assert b.plan(step()).maps == [5, 6]


def test_a_steps_activations_are_charged_on_at_most_vllms_token_budget() -> None:
    b = balloon(budget_sets=4, per_token=SET // 64)  # vLLM's whole budget of 64 tokens takes one set
    b.plan(step({"p": 64}))  # a running prefill with 64 more tokens to go: the next step is full
    b.requests["p"] = request(1000, computed=64)
    b.plan(step({"p": 64}))
    # Another prompt adds no tokens to a full step: vLLM caps the step at 64 (it would not schedule it
    # this step), so the charge stays one set and the request is not held for the other's chunk.
    assert b.admit(request(64), 0)
    assert b.counters.held_prefills == 0


def test_a_request_is_not_held_for_ever_when_nothing_runs() -> None:
    b = balloon(budget_sets=4, per_token=SET // 8)  # 64 tokens: 8 sets of activations, over the budget
    assert b.admit(request(64), 0)
    b.plan(step({"r": 64}))
    assert b.counters.violations == 1


def test_the_books_catch_a_balloon_block_back_in_vllms_free_queue() -> None:
    b = balloon()
    block = b.pool.blocks[GEOMETRY.blocks(2)[0]]
    b.pool.free_block_queue.append(block)  # what a bug in the balloon would do
    b.plan(step())
    assert b.counters.books_errors >= 1


def test_a_cached_block_taken_by_the_balloon_leaves_vllms_prefix_cache() -> None:
    b = balloon()
    orders = b.plan(step())
    b.confirmed(orders.maps, {}, 4, 0.0, 0.0)
    block = b.pool.blocks[GEOMETRY.blocks(1)[0]]
    b.pool.free_block_queue.remove(block)
    block.ref_cnt = 1
    b.pool._insert_block_hash(b"h" * 8, block, BLOCK_TOKENS)  # noqa: SLF001 (a cached block, as vLLM's cache_full_blocks leaves it)
    b.pool.free_blocks([block])
    assert block.block_hash is not None and internals.is_free(block)
    b.pool.touch([b.pool.blocks[i] for i in (1, 2, 3)])  # set 0 used: set 1 is the only one deflation may take
    b._deflate(1, keep_free_blocks=0, orders=b.plan(step()))  # noqa: SLF001
    assert b.state[1] is SetState.HELD and block.block_hash is None and b.counters.books_errors == 0


def test_the_cpu_buffer_parks_what_a_preemption_freed_and_offers_it_back() -> None:
    buffer = CpuBuffer(capacity_bytes=3 * BLOCK, block_bytes=BLOCK, block_size_tokens=BLOCK_TOKENS)
    a, b = SimpleNamespace(request_id="a", num_tokens=0, num_computed_tokens=0), SimpleNamespace(
        request_id="b", num_tokens=0, num_computed_tokens=0)
    tables = {"a": [4, 5, 6], "b": [7, 8]}
    a.num_computed_tokens, b.num_computed_tokens = 30, 17
    # A schedule runs both (tables read after it: a holds 31 tokens' KV, b 18)...
    assert buffer.snapshot(SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={"a": 1, "b": 1}),
                           {"a": a, "b": b}, lambda rid: tables[rid]) == []
    # ...the next preempts both: a's two blocks fit the buffer, b's two more do not.
    parks = buffer.snapshot(SimpleNamespace(preempted_req_ids={"a", "b"}, num_scheduled_tokens={}), {}, tables.get)
    assert [(p.request, p.block_ids, p.num_tokens) for p in parks] in (
        [("a", [4, 5], 31)], [("b", [7, 8], 18)])
    parked = parks[0].request
    assert buffer.num_refused == 1 and buffer.held_bytes == 2 * BLOCK
    buffer.reported({parked: Parked(torch.zeros(2, 2, 4), parks[0].num_tokens)})
    again = SimpleNamespace(request_id=parked, num_tokens=parks[0].num_tokens + 1)
    assert buffer.loadable(again) == parks[0].num_tokens  # vLLM computes the token after it
    assert buffer.take(again) is not None and buffer.loadable(again) == 0 and buffer.held_bytes == 0
    assert buffer.figures()["parked"] == buffer.figures()["loaded_from_buffer"] == 1


def test_a_park_the_worker_did_not_report_is_given_up() -> None:
    buffer = CpuBuffer(capacity_bytes=8 * BLOCK, block_bytes=BLOCK, block_size_tokens=BLOCK_TOKENS)
    a = SimpleNamespace(request_id="a", num_tokens=0, num_computed_tokens=15)
    buffer.snapshot(SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={"a": 1}), {"a": a}, lambda rid: [3])
    assert len(buffer.snapshot(SimpleNamespace(preempted_req_ids={"a"}, num_scheduled_tokens={}), {}, lambda rid: [])) == 1
    buffer.reported({})
    buffer.unreported()
    assert buffer.held_bytes == 0 and buffer.loadable(SimpleNamespace(request_id="a", num_tokens=17)) == 0


def test_algorithm_2_scales_what_the_buffer_may_take_by_the_objectives() -> None:
    buffer = CpuBuffer(capacity_bytes=8 * BLOCK, block_bytes=BLOCK, block_size_tokens=BLOCK_TOKENS,
                       ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert buffer.logical_bytes == BLOCK  # with objectives it starts small (as the builtin engine's)
    late = SimpleNamespace(request_id="late", num_tokens=10, num_computed_tokens=9, arrival_time=0.0)
    others = [SimpleNamespace(request_id=f"o{i}", num_tokens=10, num_computed_tokens=9, arrival_time=0.0) for i in range(2)]
    requests = {r.request_id: r for r in (late, *others)}
    # Three first tokens 5 s after arrival (TTFT 1 s) in one step: a TTFT event doubles the buffer.
    buffer.observe(5.0, SimpleNamespace(num_scheduled_tokens={rid: 1 for rid in requests}), requests)
    assert buffer.logical_bytes == 2 * BLOCK
    # Their next tokens 0.5 s later (TPOT 0.1 s): a TPOT event halves it, to its floor of one block.
    buffer.observe(5.5, SimpleNamespace(num_scheduled_tokens={rid: 1 for rid in requests}), requests)
    assert buffer.logical_bytes == BLOCK
    # A park over the logical size is refused (recomputed) though the buffer has room.
    a = SimpleNamespace(request_id="a", num_tokens=0, num_computed_tokens=30)
    buffer.snapshot(SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={"a": 1}), {"a": a}, lambda rid: [4, 5])
    assert buffer.snapshot(SimpleNamespace(preempted_req_ids={"a"}, num_scheduled_tokens={}), {}, lambda rid: []) == []
    assert buffer.num_refused == 1
    # Without objectives the whole buffer is there.
    assert CpuBuffer(8 * BLOCK, BLOCK, BLOCK_TOKENS).logical_bytes == 8 * BLOCK


def test_the_pinned_vllm_has_every_private_name_elastic_memory_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    assert internals.problems() == []
    import vllm.v1.worker.utils as utils

    def allocate_kv_cache(config: Any, layout: Any) -> None: ...

    monkeypatch.setattr(utils, "allocate_kv_cache", allocate_kv_cache)
    assert any("allocate_kv_cache" in problem for problem in internals.problems())


def test_the_activation_model_counts_the_tiny_models_shapes() -> None:
    model = ActivationModel.of_config(hidden_size=256, intermediate_size=688, num_heads=4, num_kv_heads=2, head_dim=64,
                                      vocab_size=2048, dtype_bytes=4)
    # 2h + qkv + rotary copies + attention out + o_proj + 3 x intermediate, in float32.
    assert model.per_token_bytes == 4 * (512 + 512 + 384 + 256 + 256 + 3 * 688)
    assert model.per_sequence_bytes == 2048 * 8
    assert model.charge(10, 2) == 10 * model.per_token_bytes + 2 * model.per_sequence_bytes


# -- the engine ----------------------------------------------------------------------------------------

BUDGET_BYTES = 4 * TEST_KV_CAPACITY_BYTES
PROMPTS = [[1, *range(10 + 7 * i, 10 + 7 * i + 150 + 20 * i)] for i in range(16)]


def elastic_engine(tiny_model_dir: Path, engine_loop: EngineLoop, budget_bytes: int = BUDGET_BYTES) -> VLLMEngine:
    engine = load_engine("vllm", EngineConfig(model_path=tiny_model_dir, max_model_len=TEST_MAX_MODEL_LEN, max_num_seqs=16,
                                              dtype="float32"),
                         VLLMOptions(memory=MemoryOptions(budget_bytes=budget_bytes, elastic=True)))
    assert isinstance(engine, VLLMEngine)
    engine_loop.run(engine.start(), timeout_s=300)
    return engine


@pytest.fixture(scope="module")
def pressed(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[VLLMEngine]:
    """Elastic vLLM on a budget just over one prefill step's activations and a few requests' KV."""
    engine = elastic_engine(tiny_model_dir, engine_loop, budget_bytes=40 * 1024 * 1024)
    yield engine
    engine_loop.run(engine.stop())


def test_greedy_output_equals_static_vllms_under_memory_pressure(pressed: VLLMEngine, tiny_model_dir: Path,
                                                                 engine_loop: EngineLoop,
                                                                 started_engines: dict[str, StartedEngine]) -> None:
    static = start_engine("vllm", tiny_model_dir, started_engines, engine_loop)

    async def serve(engine: Any) -> list[list[int]]:
        outs = await asyncio.gather(*(collect(engine, f"p{i}", prompt, greedy(60)) for i, prompt in enumerate(PROMPTS)))
        return [tokens(out) for out in outs]

    elastic_tokens = engine_loop.run(serve(pressed), timeout_s=300)
    assert elastic_tokens == engine_loop.run(serve(static.engine), timeout_s=300)
    books = pressed.balloon
    # It ran short: requests were held (Algorithm 1) or sets deflated, and the books stayed right.
    assert books["grows"] > 0 and books["held_prefills"] + books["shrinks"] > 0, books
    assert books["books_errors"] == 0 and books["map_failures"] == 0
    assert books["worker_slots"] == books["mapped_sets"] * books["slots_per_set"]
    state = pressed.memory_state()
    assert 0 < state.kv_capacity_bytes <= state.budget_bytes == 40 * 1024 * 1024
    assert state.cpu_buffer_capacity_bytes == 0


def test_map_failures_mid_grow_leave_vllm_serving_and_its_books_right(tiny_model_dir: Path, engine_loop: EngineLoop,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FAIL_MAPS, "1,3")  # read by the EngineCore this start spawns
    engine = elastic_engine(tiny_model_dir, engine_loop)
    try:
        async def serve() -> list[Any]:
            return await asyncio.gather(*(collect(engine, f"f{i}", prompt, greedy(40)) for i, prompt in enumerate(PROMPTS[:8])))

        outs = engine_loop.run(serve(), timeout_s=300)
        assert [len(tokens(out)) for out in outs] == [40] * 8
        books = engine.balloon
        assert books["map_failures"] == 2 and books["grows"] > 0 and books["books_errors"] == 0, books
    finally:
        engine_loop.run(engine.stop())


def test_a_vllm_without_the_names_elastic_memory_uses_is_refused_at_start(tiny_model_dir: Path, engine_loop: EngineLoop,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(internals, "problems", lambda: ["vllm.v1.worker.utils:allocate_kv_cache is gone"])
    engine = load_engine("vllm", EngineConfig(model_path=tiny_model_dir, max_model_len=TEST_MAX_MODEL_LEN, dtype="float32"),
                         VLLMOptions(memory=MemoryOptions(budget_bytes=BUDGET_BYTES, elastic=True)))
    with pytest.raises(EngineError, match="allocate_kv_cache is gone"):
        engine_loop.run(engine.start(), timeout_s=120)


@pytest.mark.parametrize(("memory", "message"), [
    (MemoryOptions(budget_bytes=BUDGET_BYTES, elastic=False, cpu_buffer_bytes=1 << 20), "need elastic memory"),
    (MemoryOptions(budget_bytes=BUDGET_BYTES, elastic=False, ttft_slo_s=1.0), "need elastic memory"),
])
def test_what_vllm_does_not_run_is_refused(tiny_model_dir: Path, memory: MemoryOptions, message: str) -> None:
    with pytest.raises(EngineError, match=message):
        load_engine("vllm", EngineConfig(model_path=tiny_model_dir), VLLMOptions(memory=memory))


def test_a_budget_with_no_room_beside_a_prefill_step_is_refused(tiny_model_dir: Path, engine_loop: EngineLoop) -> None:
    engine = load_engine("vllm", EngineConfig(model_path=tiny_model_dir, max_model_len=TEST_MAX_MODEL_LEN, dtype="float32"),
                         VLLMOptions(memory=MemoryOptions(budget_bytes=16 * 1024 * 1024, elastic=True)))
    with pytest.raises(EngineError, match="prefill step's activations"):
        engine_loop.run(engine.start(), timeout_s=120)


def test_the_cpu_buffer_parks_preempted_requests_instead_of_recomputing_them(tiny_model_dir: Path,
                                                                            engine_loop: EngineLoop) -> None:
    """Outputs that outgrow the pool make vLLM preempt; their KV goes to the CPU buffer and comes back,
    and every stream is what the request gives alone."""
    engine = load_engine("vllm", EngineConfig(model_path=tiny_model_dir, max_model_len=2048, max_num_seqs=24, dtype="float32"),
                         VLLMOptions(memory=MemoryOptions(budget_bytes=40 * 1024 * 1024, elastic=True,
                                                          cpu_buffer_bytes=32 * 1024 * 1024)))
    prompts = [[1, *range(10 + 7 * i, 110 + 7 * i)] for i in range(24)]
    engine_loop.run(engine.start(), timeout_s=300)
    try:
        async def serve() -> list[Any]:
            return await asyncio.gather(*(collect(engine, f"b{i}", prompt, greedy(900)) for i, prompt in enumerate(prompts)))

        together = [tokens(out) for out in engine_loop.run(serve(), timeout_s=600)]
        books = engine.balloon
        assert books["parked"] > 0 and books["loaded_from_buffer"] == books["parked"], books
        assert books["books_errors"] == 0 and books["cpu_buffer_bytes"] == 0, books
        assert engine.memory_state().cpu_buffer_capacity_bytes == 32 * 1024 * 1024
        # Without the crowd nothing is preempted: two of the requests again, side by side (two fit the pool
        # with room to spare; one at a time would be twice the decode steps), none of them parked.
        async def again() -> list[Any]:
            return await asyncio.gather(*(collect(engine, f"alone{i}", prompts[i], greedy(900)) for i in (0, 23)))

        parked = books["parked"]
        alone = [tokens(out) for out in engine_loop.run(again(), timeout_s=300)]
        assert engine.balloon["parked"] == parked, engine.balloon
        assert (together[0], together[23]) == (alone[0], alone[1])
    finally:
        engine_loop.run(engine.stop())
