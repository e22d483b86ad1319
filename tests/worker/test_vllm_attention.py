"""kvfleet's DistAttention backend inside vLLM (engines/vllm/attention.py, registered by plugin.py).

The session's vLLM engine with vLLM's own CPU attention and one with kvfleet's (worker_testing
start_engine "vllm-distattention") must give the same greedy tokens on a batch whose steps mix
prefills and decodes and whose contexts span several blocks: the backend's cache writes, block
tables, causal offsets and the kernels' partials all show in the tokens. An engine whose EngineCore
was not given the plugin refuses to start with the reason instead of running vLLM's attention
unasked. Then the pieces alone: the cache writes land where the connector's plain layout reads
them, what the backend refuses, and the plugin's registration.

KV moves between this backend's layout and the others are in test_vllm_kv_migration.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from worker_testing import (
    TEST_KV_CAPACITY_BYTES,
    TEST_MAX_MODEL_LEN,
    EngineLoop,
    StartedEngine,
    greedy,
    skip_without_vllm,
    start_engine,
    tokens_of,
)

skip_without_vllm()

import torch  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from kvfleet.worker.engines.base import EngineConfig, EngineError  # noqa: E402
from kvfleet.worker.engines.vllm import plugin  # noqa: E402
from kvfleet.worker.engines.vllm.attention import KvfleetAttentionImpl  # noqa: E402
from kvfleet.worker.engines.vllm.connector import PlainKVLayout  # noqa: E402
from kvfleet.worker.engines.vllm.engine import VLLMEngine  # noqa: E402
from kvfleet.worker.engines.vllm.options import VLLMOptions  # noqa: E402

# Lengths that start and end inside vLLM's 128-token blocks, one past two blocks, and one token.
PROMPTS = [[1, *((11 * i + 7 * j) % 1900 + 5 for j in range(n))] for i, n in enumerate((0, 5, 40, 127, 128, 300, 17, 90))]


@pytest.fixture(scope="module")
def vllm(tiny_model_dir: Path, engine_loop: EngineLoop, started_engines: dict[str, StartedEngine]) -> StartedEngine:
    return start_engine("vllm", tiny_model_dir, started_engines, engine_loop)


@pytest.fixture(scope="module")
def distattention(tiny_model_dir: Path, engine_loop: EngineLoop, started_engines: dict[str, StartedEngine]) -> StartedEngine:
    return start_engine("vllm-distattention", tiny_model_dir, started_engines, engine_loop)


async def batch(started: StartedEngine, tag: str, max_tokens: int) -> list[list[int]]:
    """Every prompt at once: vLLM schedules them in steps that mix prefills with decodes."""
    return list(await asyncio.gather(*(tokens_of(started.engine.generate(f"{tag}-{i}", p, greedy(max_tokens)))
                                      for i, p in enumerate(PROMPTS))))


def test_greedy_tokens_equal_vllms_own_attention(vllm: StartedEngine, distattention: StartedEngine) -> None:
    ours = distattention.loop.run(batch(distattention, "dist", 48))
    theirs = vllm.loop.run(batch(vllm, "own", 48))
    assert ours == theirs
    assert all(len(tokens) == 48 for tokens in ours)


def test_with_elastic_memory_too(vllm: StartedEngine, tiny_model_dir: Path, engine_loop: EngineLoop) -> None:
    """Elastic memory's cache (an eTensor view, mapped a set at a time) under kvfleet's backend: the
    sets are whole blocks of NHD layers as they are of vLLM's own layout."""
    from kvfleet.worker.elastic.options import MemoryOptions

    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=TEST_MAX_MODEL_LEN, max_num_seqs=16,
                                     dtype="float32"),
                        VLLMOptions(memory=MemoryOptions(budget_bytes=4 * TEST_KV_CAPACITY_BYTES, elastic=True),
                                    attention="distattention"))
    info = engine_loop.run(engine.start(), timeout_s=300)
    try:
        ours = engine_loop.run(batch(StartedEngine("vllm-elastic-distattention", engine, info, engine_loop), "ed", 24))
        assert engine.balloon.get("violations", 0) == 0, engine.balloon
    finally:
        engine_loop.run(engine.stop())
    assert ours == vllm.loop.run(batch(vllm, "own-ed", 24))


def test_the_engine_selects_vllms_custom_backend(distattention: StartedEngine, vllm: StartedEngine) -> None:
    def backend(started: StartedEngine) -> object:
        assert isinstance(started.engine, VLLMEngine) and started.engine._llm is not None
        return started.engine._llm.vllm_config.attention_config.backend

    assert backend(distattention) is AttentionBackendEnum.CUSTOM
    assert backend(vllm) is None


def test_an_enginecore_without_the_plugin_refuses_to_start(tiny_model_dir: Path, engine_loop: EngineLoop,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_PLUGINS names the plugins vLLM loads; naming none leaves vLLM's CPU attention in the
    EngineCore, which the connector sees and refuses."""
    monkeypatch.setenv("VLLM_PLUGINS", "")
    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                                     max_model_len=TEST_MAX_MODEL_LEN, max_num_seqs=4),
                        VLLMOptions(attention="distattention"))
    with pytest.raises(EngineError, match="DistAttention was asked, but vLLM built its layers with"):
        engine_loop.run(engine.start(), timeout_s=300)
    engine_loop.run(engine.stop())


def nhd_layer(blocks: int, block_size: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """A layer as vLLM views it under the LBNHC layout: logically [blocks, kv_heads, block_size, 2 x
    head_dim], laid out [blocks, block_size, kv_heads, 2 x head_dim]."""
    return torch.zeros(blocks, block_size, kv_heads, 2 * head_dim).permute(0, 2, 1, 3)


def impl(**overrides: object) -> KvfleetAttentionImpl:
    args: dict[str, object] = {"num_heads": 4, "head_size": 8, "scale": 8**-0.5, "num_kv_heads": 2, "alibi_slopes": None,
                               "sliding_window": None, "kv_cache_dtype": "auto"}
    args.update(overrides)
    return KvfleetAttentionImpl(**args)  # type: ignore[arg-type]


def test_cache_writes_land_where_the_connectors_plain_layout_reads_them() -> None:
    layer = nhd_layer(4, 8, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, 17, -1, 8, 31])   # block 0 offset 3, block 2 offset 1, padding, ...
    impl().do_kv_cache_update(torch.nn.Module(), key, value, layer, slots)
    layout = PlainKVLayout(8, 2, 8)
    kv = layout.read(layer, [0, 1, 2, 3])   # [2, blocks, block_size, kv_heads, head_dim]
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kv[0, slot // 8, slot % 8], key[row])
            assert torch.equal(kv[1, slot // 8, slot % 8], value[row])
    assert int((kv != 0).any(dim=-1).sum()) == 2 * 4 * 2, "only the four real slots were written, K and V, both heads"
    other = nhd_layer(4, 8, 2, 8)
    layout.write(other, [2, 0], kv[:, [0, 2]])
    assert torch.equal(layout.read(other, [2, 0]), kv[:, [0, 2]])


@pytest.mark.parametrize(("override", "named"), [({"sliding_window": 128}, "a sliding window"),
                                                 ({"alibi_slopes": [0.5] * 4}, "ALiBi"),
                                                 ({"logits_soft_cap": 30.0}, "a logit soft cap"),
                                                 ({"kv_cache_dtype": "fp8"}, "a fp8 KV cache"),
                                                 ({"attn_type": "encoder_only"}, "encoder_only attention")])
def test_the_backend_refuses_what_it_does_not_compute(override: dict[str, object], named: str) -> None:
    with pytest.raises(NotImplementedError, match=named):
        impl(**override)


def test_the_plugin_registers_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    members = (AttentionBackendEnum.CUSTOM, AttentionBackendEnum.CPU_ATTN)
    before = {m: m.get_path() if m.is_overridden() else None for m in members}
    try:
        for m in members:
            m.clear_override()
        monkeypatch.delenv(plugin.ENV, raising=False)
        plugin.register()
        assert not any(m.is_overridden() for m in members)
        with plugin.asked("distattention"):
            assert os.environ[plugin.ENV] == "distattention"
            plugin.register()
        assert plugin.ENV not in os.environ
        assert all(m.get_path() == plugin.BACKEND_PATH for m in members)
    finally:
        for m, path in before.items():
            m.clear_override()
            if path is not None:
                from vllm.v1.attention.backends.registry import register_backend

                register_backend(m, path)
    assert plugin.entry_point_installed()


def test_this_vllm_has_what_the_backend_relies_on() -> None:
    from kvfleet.worker.engines.vllm import internals

    assert internals.attention_problems() == []


def test_a_vllm_whose_attention_interface_differs_is_refused_at_start(tiny_model_dir: Path, engine_loop: EngineLoop,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from kvfleet.worker.engines.vllm import internals

    fields = dict(CommonAttentionMetadata.__dataclass_fields__)
    del fields["block_table_tensor"]
    monkeypatch.setattr(CommonAttentionMetadata, "__dataclass_fields__", fields)
    assert internals.attention_problems() == ["CommonAttentionMetadata has no block_table_tensor"]
    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                                     max_model_len=TEST_MAX_MODEL_LEN), VLLMOptions(attention="distattention"))
    with pytest.raises(EngineError, match="cannot run on this vLLM.*block_table_tensor"):
        engine_loop.run(engine.start(), timeout_s=60)
    engine_loop.run(engine.stop())


def test_distattention_inside_vllm_is_refused_on_a_gpu_until_its_kernels_read_vllms_layout() -> None:
    with pytest.raises(EngineError, match="runs on the CPU only for now"):
        VLLMEngine(EngineConfig(model_path=Path("/nonexistent"), device="cuda"), VLLMOptions(attention="distattention"))
