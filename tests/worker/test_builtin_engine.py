"""The builtin engine against transformers, and its scheduling and migration behaviour.

Logits are compared with transformers' LlamaForCausalLM on the tiny model's weights in float32:
within LOGIT_ATOL (max abs), at prefill and at every decode step through the paged cache (logits
of this model are up to about 20 in size; the difference measured is about 1e-5). Everything else is
compared token for token with the same engine run without the feature under test (batching,
preemption, migration), since greedy decoding of this model has clear top-1 margins.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from worker_testing import Sequenced  # noqa: E402

from kvfleet.worker.engines.base import (  # noqa: E402
    DuplicateRequest,
    Engine,
    EngineConfig,
    EngineError,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    StructuredOutput,
    kv_blocks_bytes,
)
from kvfleet.worker.engines.builtin.engine import BuiltinEngine  # noqa: E402
from kvfleet.worker.engines.builtin.model import LlamaForward, PagedKVCache, SeqBatchEntry  # noqa: E402
from kvfleet.worker.engines.builtin.sampling import MakeConstraint, Sampling, sample_token  # noqa: E402
from kvfleet.worker.engines.capabilities import KVBlocks, KVMigratable, MigrationError  # noqa: E402

T = TypeVar("T")
LOGIT_ATOL = 1e-4
BLOCK_BYTES = 16 * 2048  # 16 tokens x 2 KiB (tiny model, float32)
PROMPTS = [
    [1, 17, 300, 45, 99],
    [1, 5, 6, 7],
    [1, 1000, 1500, 20, 21, 22, 23, 24, 25, 26],
    [1, 400],
    list(range(1, 40)),
    [1, 77, 78],
    [1, 900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910, 911, 912, 913, 914, 915, 916, 917, 918, 919, 920],
    [1, 2000, 3, 2047],
]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


def engine_config(model_dir: Path, **kw: Any) -> EngineConfig:
    kw.setdefault("kv_capacity_bytes", 4 * 1024 * 1024)
    kw.setdefault("max_model_len", 512)
    return EngineConfig(model_path=model_dir, **kw)


async def started(model_dir: Path, make_constraint: MakeConstraint | None = None, **kw: Any) -> BuiltinEngine:
    engine = BuiltinEngine(engine_config(model_dir, **kw), make_constraint=make_constraint)
    await engine.start()
    return engine


def migration_of(engine: BuiltinEngine) -> KVMigratable:
    """The engine's KV migration capability (the builtin engine always has it)."""
    migration = engine.capabilities.migration
    assert migration is not None
    return migration


async def tokens_of(stream: AsyncIterator[StepOutput]) -> list[int]:
    return [t async for out in stream for t in out.new_token_ids]


def num_blocks(engine: BuiltinEngine) -> int:
    return engine.info.kv_capacity_bytes // BLOCK_BYTES


async def assert_all_free(engine: BuiltinEngine) -> None:
    for _ in range(50):  # an abandoned stream is closed by the loop a moment later
        if not engine.kv_usage() and engine.num_waiting() == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.kv_usage() == []
    assert engine.num_waiting() == 0
    assert sorted(engine.scheduler.space.free) == list(range(num_blocks(engine)))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()
    return model


# -- the forward ------------------------------------------------------------------------------------


def test_prefill_and_paged_decode_logits_match_transformers(tiny_model_dir: Path, reference: Any) -> None:
    model = LlamaForward.load(tiny_model_dir, torch.float32, torch.device("cpu"), 512)
    cache = PagedKVCache(model.arch, 32, 16, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 2048, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    tables = [[7, 3, 20, 11, 0], [30, 1, 2, 29, 4]]  # scattered on purpose
    worst = 0.0
    # Sequence 0: prefill 37 tokens (a partial third block), then decode one token at a time.
    # Sequence 1: prefill 16, a 20-token chunk on top of the cache (a re-prefilled tail), then decode.
    out = model.forward([SeqBatchEntry(ids[0, :37].tolist(), 0, tables[0]), SeqBatchEntry(ids[1, :16].tolist(), 0, tables[1])],
                        cache, all_logits=True)
    worst = max(worst, (out[:37] - expected[0, :37]).abs().max().item(), (out[37:] - expected[1, :16]).abs().max().item())
    out = model.forward([SeqBatchEntry(ids[1, 16:36].tolist(), 16, tables[1])], cache, all_logits=True)
    worst = max(worst, (out - expected[1, 16:36]).abs().max().item())
    out = model.forward([SeqBatchEntry([int(ids[1, 36])], 36, tables[1])], cache)
    worst = max(worst, (out[0] - expected[1, 36]).abs().max().item())
    for position in range(37, 70):  # both decode in one batch from here
        entries = [SeqBatchEntry([int(ids[b, position])], position, tables[b]) for b in (0, 1)]
        rows = [expected[0, position], expected[1, position]]
        out = model.forward(entries, cache)
        worst = max(worst, (out - torch.stack(rows)).abs().max().item())
    assert worst < LOGIT_ATOL


def test_llama3_rope_scaling_and_sharded_checkpoints_match_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    variant = tmp_path / "llama3"
    shutil.copytree(tiny_model_dir, variant)
    config = json.loads((variant / "config.json").read_text())
    # A short original context so the scaling changes frequencies at these lengths.
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    config.update(rope_parameters=rope, rope_scaling=rope)
    del config["rope_theta"]
    (variant / "config.json").write_text(json.dumps(config))
    tensors = load_file(variant / "model.safetensors")
    (variant / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file_name, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, variant / file_name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (variant / "model.safetensors.index.json").write_text(json.dumps(index))

    reference = transformers.LlamaForCausalLM.from_pretrained(variant, dtype=torch.float32)
    model = LlamaForward.load(variant, torch.float32, torch.device("cpu"), 512)
    cache = PagedKVCache(model.arch, 16, 16, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 2048, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[0]
    got = model.forward([SeqBatchEntry(ids[0].tolist(), 0, list(range(7)))], cache, all_logits=True)
    assert (got - expected).abs().max().item() < LOGIT_ATOL


# -- generation -------------------------------------------------------------------------------------


def test_greedy_generation_equals_transformers_generate(tiny_model_dir: Path, reference: Any) -> None:
    async def generate_all() -> list[list[int]]:
        engine = await started(tiny_model_dir)
        try:
            return [await tokens_of(engine.generate(f"r{i}", p, greedy(24, ignore_eos=False))) for i, p in enumerate(PROMPTS[:4])]
        finally:
            await engine.stop()

    ours = run(generate_all())
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert got == out[0, len(prompt):].tolist(), f"prompt {prompt}"


def test_batching_does_not_change_greedy_outputs(tiny_model_dir: Path) -> None:
    async def both() -> tuple[list[list[int]], list[list[int]]]:
        engine = await started(tiny_model_dir, max_num_seqs=8)
        try:
            alone = [await tokens_of(engine.generate(f"a{i}", p, greedy(10 + 3 * i))) for i, p in enumerate(PROMPTS)]
            together = await asyncio.gather(*(tokens_of(engine.generate(f"b{i}", p, greedy(10 + 3 * i)))
                                              for i, p in enumerate(PROMPTS)))
            await assert_all_free(engine)
            return alone, list(together)
        finally:
            await engine.stop()

    alone, together = run(both())
    assert together == alone
    assert [len(t) for t in alone] == [10 + 3 * i for i in range(len(PROMPTS))]


def test_preemption_under_a_tiny_kv_cache_keeps_greedy_outputs(tiny_model_dir: Path) -> None:
    async def both() -> tuple[list[list[int]], list[list[int]], int]:
        # 10 blocks; each request needs up to 4 (about 20 + 40 tokens), so 4 at once cannot fit.
        engine = await started(tiny_model_dir, kv_capacity_bytes=10 * BLOCK_BYTES)
        prompts = [PROMPTS[i] + list(range(100, 112)) for i in (0, 1, 2, 5)]
        try:
            alone = [await tokens_of(engine.generate(f"a{i}", p, greedy(40))) for i, p in enumerate(prompts)]
            assert engine.num_preemptions == 0
            together = await asyncio.gather(*(tokens_of(engine.generate(f"b{i}", p, greedy(40)))
                                              for i, p in enumerate(prompts)))
            await assert_all_free(engine)
            return alone, list(together), engine.num_preemptions
        finally:
            await engine.stop()

    alone, together, preemptions = run(both())
    assert preemptions > 0
    assert together == alone


def test_seeded_sampling_is_reproducible_alone_and_batched(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.5, top_p=0.95, seed=42, ignore_eos=True)

    async def sample() -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        engine = await started(tiny_model_dir)
        try:
            first = await tokens_of(engine.generate("s1", PROMPTS[0], params))
            batched = await asyncio.gather(
                tokens_of(engine.generate("s2", PROMPTS[0], params)),
                *(tokens_of(engine.generate(f"o{i}", p, greedy(12))) for i, p in enumerate(PROMPTS[1:5])),
            )
            other = await tokens_of(engine.generate("s3", PROMPTS[0], SamplingParams(
                max_tokens=20, temperature=1.5, top_p=0.95, seed=43, ignore_eos=True)))
            # A vanishing top_p keeps only the best token: greedy.
            narrow = await tokens_of(engine.generate("s4", PROMPTS[0], SamplingParams(
                max_tokens=20, temperature=1.5, top_p=1e-9, seed=42, ignore_eos=True)))
            plain = await tokens_of(engine.generate("s5", PROMPTS[0], greedy(20)))
            await assert_all_free(engine)
            return first, batched[0], other, narrow, plain
        finally:
            await engine.stop()

    first, batched, other, narrow, plain = run(sample())
    assert batched == first
    assert other != first
    assert narrow == plain
    assert first != plain


def test_sample_token_follows_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    counts = torch.zeros(4)
    for step in range(2000):
        counts[sample_token(logits, Sampling(SamplingParams(temperature=1.0), 7, step))] += 1
    assert torch.allclose(counts / counts.sum(), torch.softmax(logits, 0), atol=0.03)
    # top_p 0.7 keeps the two best (0.64 mass before the second), never the others.
    kept = {sample_token(logits, Sampling(SamplingParams(temperature=1.0, top_p=0.7), 7, step)) for step in range(300)}
    assert kept == {0, 1}


def test_stops_limits_aborts_and_early_exits_free_every_block(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        engine = await started(tiny_model_dir)
        try:
            free_run = await tokens_of(engine.generate("free", PROMPTS[2], greedy(30)))
            stop_at = next(i for i in range(3, 30) if free_run[i] not in free_run[:i])
            outs = [o async for o in engine.generate("stop", PROMPTS[2], greedy(30, stop_token_ids=(free_run[stop_at],)))]
            assert [t for o in outs for t in o.new_token_ids] == free_run[: stop_at + 1]
            assert outs[-1].finish_reason == "stop" and outs[-1].num_tokens == len(PROMPTS[2]) + stop_at + 1

            # The model's EOS ends a request unless ignore_eos.
            engine.scheduler.eos_ids = frozenset({free_run[stop_at]})
            eos = await tokens_of(engine.generate("eos", PROMPTS[2], greedy(30, ignore_eos=False)))
            assert eos == free_run[: stop_at + 1]
            assert await tokens_of(engine.generate("no-eos", PROMPTS[2], greedy(30))) == free_run

            outs = [o async for o in engine.generate("len", PROMPTS[0], greedy(5))]
            assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 5

            # abort() mid-stream ends the stream with "abort"; so does abort() of a queued request.
            outs = []
            async for out in engine.generate("abort", PROMPTS[4], greedy(300)):
                outs.append(out)
                if len(outs) == 3:
                    await engine.abort("abort")
            assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs) < 300

            # Leaving early: aclose() frees at once; a plain break frees when the loop finalizes the stream.
            stream = engine.generate("close", PROMPTS[1], greedy(300))
            await stream.__anext__()
            await stream.aclose()  # type: ignore[attr-defined]
            assert "close" not in {r.request_id for r in engine.kv_usage()}
            async for _ in engine.generate("break", PROMPTS[1], greedy(300)):
                break
            gc.collect()
            await engine.abort("never-seen")
            await assert_all_free(engine)
        finally:
            await engine.stop()

    run(scenario())


def test_refusals_and_kv_accounting(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        engine = await started(tiny_model_dir, kv_capacity_bytes=10 * BLOCK_BYTES, max_num_seqs=2)
        try:
            assert isinstance(engine, Engine)  # (after start: `info` raises before, as the protocol says)
            info = engine.info
            assert info.kv_bytes_per_token == 2 * 2 * 2 * 64 * 4
            assert info.kv_capacity_bytes == 10 * BLOCK_BYTES and info.block_size_tokens == 16
            assert info.eos_token_ids == (2,)
            with pytest.raises(RequestTooLong):  # past max_model_len
                engine.generate("long", [1] * 500, greedy(20))
            with pytest.raises(RequestTooLong):  # fits the context but never the 10 blocks (160 tokens)
                engine.generate("big", [1] * 150, greedy(20))
            streams = [engine.generate(f"q{i}", PROMPTS[4], greedy(60)) for i in range(3)]
            with pytest.raises(DuplicateRequest):
                engine.generate("q0", PROMPTS[0], greedy(4))
            firsts = await asyncio.gather(*(s.__anext__() for s in streams[:2]))
            assert all(len(f.new_token_ids) == 1 for f in firsts)
            # Two run (max_num_seqs), the third waits without KV.
            assert engine.num_waiting() == 1
            usage = engine.kv_usage()
            assert [u.request_id for u in usage] == ["q0", "q1"]
            for u in usage:
                assert u.tokens >= len(PROMPTS[4]) + 1
                assert u.kv_bytes == kv_blocks_bytes(u.tokens, 16, info.kv_bytes_per_token)
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]
            await assert_all_free(engine)
        finally:
            await engine.stop()
        assert engine.kv_usage() == []
        await engine.stop()  # idempotent

    run(scenario())


def test_bfloat16_runs_and_halves_the_kv_per_token(tiny_model_dir: Path) -> None:
    async def scenario() -> tuple[list[int], int]:
        engine = await started(tiny_model_dir, dtype="bfloat16")
        try:
            return await tokens_of(engine.generate("bf16", PROMPTS[0], greedy(8))), engine.info.kv_bytes_per_token
        finally:
            await engine.stop()

    generated, kv_bytes_per_token = run(scenario())
    assert len(generated) == 8 and kv_bytes_per_token == 2 * 2 * 2 * 64 * 2


# -- migration --------------------------------------------------------------------------------------

MIGRATE_PROMPT = PROMPTS[4]  # 39 tokens: 2 full blocks and a partial one
MIGRATE_TOKENS = 40


async def _migrate(model_dir: Path, mode: str, params: SamplingParams) -> tuple[list[int], list[int], dict[str, Any]]:
    """Generate MIGRATE_TOKENS unmigrated on one engine, then again moved from S to D after ~10 tokens.

    mode: "kv" (staged copy while decoding, then the rest after suspend), "hybrid" (full blocks
    staged while decoding, the tail re-prefilled), "token" (no KV), "rollback" (resumed on S).
    """
    source = await started(model_dir)
    target = await started(model_dir)
    source_kv, target_kv = migration_of(source), migration_of(target)
    facts: dict[str, Any] = {}
    try:
        unmigrated = await tokens_of(source.generate("ref", MIGRATE_PROMPT, params))
        stream = source.generate("m", MIGRATE_PROMPT, params)
        before: list[int] = []
        async for out in stream:
            before.extend(out.new_token_ids)
            if len(before) >= 10:
                break
        sent = 0
        if mode in ("kv", "hybrid"):
            stage = await source_kv.export_kv("m")  # while it keeps decoding: full blocks only
            assert stage.num_tokens == stage.num_blocks * 16 and stage.num_blocks >= 2
            await target_kv.import_kv("m", stage)
            sent = stage.end_block
        state = await source_kv.suspend("m")
        async for out in stream:  # tokens produced before the suspension, then the stream ends
            assert not out.finished
            before.extend(out.new_token_ids)
        assert list(state.output_token_ids) == before
        assert state.num_cached_tokens == len(MIGRATE_PROMPT) + len(before) - 1
        assert state.params.seed is not None
        assert {u.request_id for u in source.kv_usage()} == {"m"}
        if mode == "kv":
            last = await source_kv.export_kv("m", first_block=sent)
            assert last.end_token == state.num_cached_tokens
            await target_kv.import_kv("m", last)
        home = source if mode == "rollback" else target
        if mode != "rollback":
            source_kv.release("m")
            assert source.kv_usage() == []
        prefilled = home.num_prefilled_tokens
        after = await tokens_of(migration_of(home).resume("m", state.prompt_token_ids, state.output_token_ids, state.params))
        facts["recomputed_tokens"] = home.num_prefilled_tokens - prefilled
        facts["num_tokens"] = len(MIGRATE_PROMPT) + len(before)
        facts["sent_blocks"] = sent
        await assert_all_free(source)
        await assert_all_free(target)
        return unmigrated, before + after, facts
    finally:
        await source.stop()
        await target.stop()


@pytest.mark.parametrize("mode", ["kv", "hybrid", "token", "rollback"])
def test_migration_continues_greedy_output_exactly(tiny_model_dir: Path, mode: str) -> None:
    unmigrated, migrated, facts = run(_migrate(tiny_model_dir, mode, greedy(MIGRATE_TOKENS)))
    assert migrated == unmigrated
    num_tokens = facts["num_tokens"]
    expected_recompute = {
        "kv": 1,  # only the last token, whose logits give the next
        "rollback": 1,
        "hybrid": num_tokens - facts["sent_blocks"] * 16,
        "token": num_tokens,
    }[mode]
    assert facts["recomputed_tokens"] == expected_recompute


def test_migration_continues_the_seeded_random_stream(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=MIGRATE_TOKENS, temperature=1.2, top_p=0.9, seed=5, ignore_eos=True)
    unmigrated, migrated, _ = run(_migrate(tiny_model_dir, "kv", params))
    assert migrated == unmigrated


def test_imported_kv_is_really_used(tiny_model_dir: Path) -> None:
    """Zeroed KV blocks must change the continuation: KV mode does not quietly recompute."""

    async def scenario() -> tuple[list[int], list[int]]:
        source = await started(tiny_model_dir)
        target = await started(tiny_model_dir)
        source_kv, target_kv = migration_of(source), migration_of(target)
        try:
            reference = await tokens_of(source.generate("ref", MIGRATE_PROMPT, greedy(20)))
            stream = source.generate("m", MIGRATE_PROMPT, greedy(20))
            await stream.__anext__()
            state = await source_kv.suspend("m")
            before = list(state.output_token_ids)
            kv = await source_kv.export_kv("m")
            zeroed = KVBlocks(kv.request_id, kv.first_block, kv.num_tokens, kv.block_size_tokens, torch.zeros_like(kv.data))
            await target_kv.import_kv("m", zeroed)
            source_kv.release("m")
            after = await tokens_of(target_kv.resume("m", state.prompt_token_ids, state.output_token_ids, state.params))
            return reference, before + after
        finally:
            await source.stop()
            await target.stop()

    reference, corrupted = run(scenario())
    assert corrupted != reference


def test_the_migration_capability_is_declared_before_start(tiny_model_dir: Path) -> None:
    """capabilities is the same before and after start (base.py); calls needing the cache wait for start."""

    async def scenario() -> None:
        engine = BuiltinEngine(engine_config(tiny_model_dir))
        migration = migration_of(engine)
        with pytest.raises(RuntimeError):
            migration.reserve_kv("m", 1)
        await engine.start()
        try:
            assert migration_of(engine) is migration
            migration.reserve_kv("m", 1)
            migration.release("m")
            await assert_all_free(engine)
        finally:
            await engine.stop()

    run(scenario())


def test_migration_refusals(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        source = await started(tiny_model_dir)
        target = await started(tiny_model_dir, kv_capacity_bytes=2 * BLOCK_BYTES)
        source_kv, target_kv = migration_of(source), migration_of(target)
        try:
            with pytest.raises(MigrationError):
                await source_kv.suspend("nobody")
            with pytest.raises(MigrationError):
                await source_kv.export_kv("nobody")
            stream = source.generate("m", MIGRATE_PROMPT, greedy(100))
            await stream.__anext__()
            with pytest.raises(MigrationError):  # past the blocks written so far
                await source_kv.export_kv("m", 0, 5)
            with pytest.raises(MigrationError):
                await source_kv.export_kv("m", 2, 1)
            with pytest.raises(MigrationError):
                source_kv.release("m")
            state = await source_kv.suspend("m")
            kv = await source_kv.export_kv("m")
            assert kv.num_blocks == 3 and kv.nbytes == 3 * BLOCK_BYTES
            with pytest.raises(MigrationError):  # 3 blocks do not fit in 2
                await target_kv.import_kv("m", kv)
            with pytest.raises(MigrationError):  # a gap: block 1 before block 0
                await target_kv.import_kv("m", await source_kv.export_kv("m", 1, 2))
            with pytest.raises(DuplicateRequest):
                await source_kv.import_kv("m", kv)
            with pytest.raises(MigrationError):
                source_kv.resume("m", state.prompt_token_ids, list(range(3, 103)), state.params)
            await target_kv.import_kv("m", await source_kv.export_kv("m", 0, 1))
            assert [u.tokens for u in target.kv_usage()] == [16]
            target_kv.release("m")  # the migration is called off: the destination frees its blocks
            source_kv.release("m")
            await assert_all_free(source)
            await assert_all_free(target)
        finally:
            await source.stop()
            await target.stop()

    run(scenario())


# -- vLLM's sampling parameters (builtin/sampling.py; exact effects in test_sampling.py) ---------------


def sequences(replayed: list[list[int]]) -> MakeConstraint:
    """A factory of `Sequenced` over the tiny model's 2048 tokens, its spec the sequence as JSON; each
    call's replayed output tokens are recorded."""

    def make(spec: StructuredOutput, done: Sequence[int]) -> Sequenced:
        replayed.append(list(done))
        return Sequenced(json.loads(spec.spec), done=done)

    return make


def test_logprobs_come_one_per_token_of_the_raw_distribution(tiny_model_dir: Path) -> None:
    async def scenario() -> tuple[list[StepOutput], list[StepOutput], list[StepOutput]]:
        engine = await started(tiny_model_dir)
        try:
            plain = [o async for o in engine.generate("plain", PROMPTS[0], greedy(6))]
            ranked = [o async for o in engine.generate("lp", PROMPTS[0], greedy(6, logprobs=3, repetition_penalty=0.5))]
            drawn = [o async for o in engine.generate("drawn", PROMPTS[0], SamplingParams(
                max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logprobs=0))]
            await assert_all_free(engine)
            return plain, ranked, drawn
        finally:
            await engine.stop()

    plain, ranked, drawn = run(scenario())
    assert all(out.logprobs == () for out in plain)
    for out in ranked + drawn:
        (token,) = out.new_token_ids
        (lp,) = out.logprobs
        assert lp.token_id == token and lp.logprob < 0 and lp.rank >= 1
    # The raw distribution's top, most likely first; the first token (no penalty yet) is its argmax.
    for out in ranked:
        (lp,) = out.logprobs
        assert len(lp.top) == 3 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert (lp.token_id, lp.logprob) in lp.top or lp.rank > 3
    first = ranked[0].logprobs[0]
    assert first.rank == 1 and first.top[0] == (first.token_id, first.logprob)
    assert first.token_id == plain[0].new_token_ids[0]
    assert all(out.logprobs[0].top == () for out in drawn)


def test_penalties_bias_and_min_tokens_change_greedy_output(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        engine = await started(tiny_model_dir)
        try:
            free = await tokens_of(engine.generate("free", PROMPTS[0], greedy(24)))
            neutral = await tokens_of(engine.generate("neutral", PROMPTS[0], greedy(24, repetition_penalty=1.0)))
            assert neutral == free
            # The tiny model never repeats itself greedily; a penalty below 1 rewards what it has seen.
            rewarded = await tokens_of(engine.generate("rp", PROMPTS[0], greedy(24, repetition_penalty=0.5)))
            assert rewarded != free and len(set(rewarded)) < len(rewarded)
            biased = await tokens_of(engine.generate("bias", PROMPTS[0], greedy(5, logit_bias=((7, 100.0),))))
            assert biased == [7] * 5
            # min_tokens holds the model's EOS back (here a token greedy decoding soon produces).
            stop_at = next(i for i in range(2, 24) if free[i] not in free[:i])
            engine.scheduler.eos_ids = frozenset({free[stop_at]})
            early = await tokens_of(engine.generate("eos", PROMPTS[0], greedy(24, ignore_eos=False)))
            assert early == free[: stop_at + 1]
            held = await tokens_of(engine.generate("min", PROMPTS[0], greedy(24, ignore_eos=False, min_tokens=stop_at + 4)))
            assert held[:stop_at] == free[:stop_at] and free[stop_at] not in held[: stop_at + 4]
            assert len(held) >= stop_at + 4
            with pytest.raises(EngineError, match="logit_bias"):
                engine.generate("bad", PROMPTS[0], greedy(4, logit_bias=((5000, 1.0),)))
            await assert_all_free(engine)
        finally:
            await engine.stop()

    run(scenario())


def test_structured_output_follows_its_constraint_across_a_move_and_stops(tiny_model_dir: Path) -> None:
    sequence = [5, 900, 17, 1999, 3, 44, 45, 46, 47, 48, 1000, 7]
    spec = StructuredOutput("grammar", json.dumps(sequence))

    async def scenario() -> None:
        replayed: list[list[int]] = []
        plain = await started(tiny_model_dir)
        source = await started(tiny_model_dir, sequences(replayed), min_step_s=0.05)
        target = await started(tiny_model_dir, sequences(replayed))
        try:
            # Without a factory of its own the engine compiles specs with llguidance (grammar.py), which
            # refuses this one (a token list is no grammar) before the request starts.
            with pytest.raises(EngineError, match="invalid grammar"):
                plain.generate("s", PROMPTS[0], greedy(20, structured=spec))
            outs = [o async for o in source.generate("g", PROMPTS[0], greedy(20, structured=spec))]
            assert [t for o in outs for t in o.new_token_ids] == sequence
            assert outs[-1].finished and outs[-1].finish_reason == "stop"
            drawn = await tokens_of(source.generate("d", PROMPTS[1], SamplingParams(
                max_tokens=20, temperature=1.5, seed=1, structured=spec, logit_bias=((8, 50.0),))))
            assert drawn == sequence
            # Moved mid-way (token mode): the target replays the output so far into its grammar.
            stream = source.generate("m", PROMPTS[2], greedy(20, structured=spec))
            before: list[int] = []
            async for out in stream:
                before.extend(out.new_token_ids)
                if len(before) >= 4:
                    break
            state = await migration_of(source).suspend("m")
            before.extend([t async for out in stream for t in out.new_token_ids])
            assert list(state.output_token_ids) == before and len(before) < len(sequence)
            migration_of(source).release("m")
            resumed = [o async for o in migration_of(target).resume("m", state.prompt_token_ids, state.output_token_ids,
                                                                    state.params)]
            assert before + [t for o in resumed for t in o.new_token_ids] == sequence
            assert resumed[-1].finish_reason == "stop"
            assert replayed == [[], [], [], before]
            for engine in (source, target):
                await assert_all_free(engine)
        finally:
            for engine in (plain, source, target):
                await engine.stop()

    run(scenario())
