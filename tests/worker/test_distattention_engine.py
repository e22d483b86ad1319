"""The builtin engine's DistAttention path (builtin/model.py, attention="distattention"): greedy outputs
equal the SDPA path's (single requests, prefills batched with decodes, prompts of several blocks,
elastic memory with the prefix cache and offloaded prefills), KV held outside the cache merges in
through the extra-part seam (KVParts) to the all-local logits, and a step's memory stays within what
elastic memory charges it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from worker_testing import TEST_KV_CAPACITY_BYTES, activation_slack, greedy, run, tokens_of  # noqa: E402

from kvfleet.kernels.micro_attention_decode_reference import attention_with_lse  # noqa: E402
from kvfleet.worker.elastic.options import MemoryOptions  # noqa: E402
from kvfleet.worker.engines.base import EngineConfig  # noqa: E402
from kvfleet.worker.engines.builtin.engine import BuiltinEngine  # noqa: E402
from kvfleet.worker.engines.builtin.model import (  # noqa: E402
    ACTIVATION_BASE_BYTES,
    LlamaForward,
    PagedKVCache,
    SeqBatchEntry,
    activation_bytes,
    read_architecture,
)
from kvfleet.worker.engines.builtin.options import Attention, BuiltinOptions  # noqa: E402

KIB = 1024
PROMPTS = [[1, 5, 9, 13], [1, *range(200, 300)], [1, 42], [1, *range(600, 637)], [1, 7, 7, 7, 7, 7, 7]]


def _engine(model_dir: Path, attention: Attention, memory: MemoryOptions | None = None, **kw: Any) -> BuiltinEngine:
    settings: dict[str, Any] = {"kv_capacity_bytes": TEST_KV_CAPACITY_BYTES, **kw}
    return BuiltinEngine(EngineConfig(model_path=model_dir, max_model_len=512, max_num_seqs=16, **settings),
                         BuiltinOptions(attention=attention, memory=memory))


async def _serve(engine: BuiltinEngine, prompts: list[list[int]], max_tokens: int, stagger_s: float) -> list[list[int]]:
    """Requests started `stagger_s` apart: later prompts prefill in steps where earlier ones decode."""
    await engine.start()
    try:
        async def one(i: int, prompt: list[int]) -> list[int]:
            await asyncio.sleep(i * stagger_s)
            return await tokens_of(engine.generate(f"r{i}", prompt, greedy(max_tokens)))

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await engine.stop()


def _both(model_dir: Path, prompts: list[list[int]], max_tokens: int, stagger_s: float, **kw: Any) -> tuple[list[list[int]], list[list[int]]]:
    sdpa = run(_serve(_engine(model_dir, "sdpa", **kw), prompts, max_tokens, stagger_s))
    dist = run(_serve(_engine(model_dir, "distattention", **kw), prompts, max_tokens, stagger_s))
    return sdpa, dist


@pytest.mark.parametrize(("prompts", "stagger_s"), [
    ([PROMPTS[0]], 0.0),  # one short request
    ([PROMPTS[1]], 0.0),  # a prompt of several blocks (101 tokens, 7 blocks of 16)
    (PROMPTS, 0.01),  # prefills arriving while others decode: mixed steps
    (PROMPTS * 3, 0.0),  # 15 at once: one batch
], ids=["single", "long-prompt", "mixed-prefill-decode", "batch"])
def test_greedy_outputs_equal_the_sdpa_path(tiny_model_dir: Path, prompts: list[list[int]], stagger_s: float) -> None:
    sdpa, dist = _both(tiny_model_dir, prompts, 24, stagger_s)
    assert all(len(t) == 24 for t in dist)
    assert dist == sdpa


def test_greedy_outputs_equal_with_elastic_memory_and_the_prefix_cache(tiny_model_dir: Path) -> None:
    """Shared system prompt (prefix-cache hits: prefills over a stored context), a pool small enough
    for offloaded prefills and parked decodes, the CPU buffer on."""
    system = [1, *range(100, 180)]
    prompts = [system + [300 + i, 301 + i] for i in range(6)] + [PROMPTS[1]]
    memory = MemoryOptions(budget_bytes=20 * 256 * KIB, chunk_bytes=256 * KIB, elastic=True, cpu_buffer_bytes=4 * 1024 * KIB)
    kw: dict[str, Any] = dict(kv_capacity_bytes=None, memory=memory, prefix_caching=True)
    sdpa, dist = _both(tiny_model_dir, prompts, 16, 0.02, **kw)
    assert all(len(t) == 16 for t in dist)
    assert dist == sdpa


class HeldElsewhere:
    """A KVParts provider holding a copy of some of a sequence's K and V (as a peer's rBlocks would),
    attending to shipped queries where the KV is (Infinite-LLM section 4.6)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values  # per layer [tokens, kv_heads, head_dim]
        self.calls = 0

    def submit(self, layer_index: int, q: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        self.calls += 1
        out, lse = attention_with_lse(q.float(), self.keys[layer_index].float(), self.values[layer_index].float(),
                                      q.shape[-1] ** -0.5)
        return lambda: (out.contiguous(), lse.contiguous())


@pytest.mark.parametrize("new_tokens", [1, 5])
def test_kv_held_outside_the_cache_merges_to_the_all_local_logits(tiny_model_dir: Path, new_tokens: int) -> None:
    """The first blocks of a sequence move out of the cache into two providers; the step's logits with
    the cache holding only the rest equal those with everything local."""
    arch = read_architecture(tiny_model_dir)
    model = LlamaForward.load(tiny_model_dir, torch.float32, torch.device("cpu"), 512, "distattention")
    bs, context = 16, 70  # 4 full blocks and 6 tokens stored, then the new tokens
    prompt = [(37 * i) % 2000 + 1 for i in range(context)]
    new = [(11 * i) % 2000 + 3 for i in range(new_tokens)]
    local = PagedKVCache(arch, 8, bs, torch.float32, torch.device("cpu"))
    table = tuple(range(8))
    model.forward([SeqBatchEntry(prompt, 0, table)], local)
    expected = model.forward([SeqBatchEntry(new, context, table), SeqBatchEntry([9], 3, (7,))], local, all_logits=True)

    remote_blocks = 3  # 48 tokens: two providers of 32 and 16, order irrelevant
    remote_tokens = remote_blocks * bs
    kv = local.read_blocks(range(remote_blocks))  # [layers, 2, blocks, bs, kv_heads, dim]
    flat = kv.flatten(2, 3)
    first = HeldElsewhere([flat[layer, 0, 32:48] for layer in range(arch.num_layers)],
                          [flat[layer, 1, 32:48] for layer in range(arch.num_layers)])
    second = HeldElsewhere([flat[layer, 0, :32] for layer in range(arch.num_layers)],
                           [flat[layer, 1, :32] for layer in range(arch.num_layers)])
    # The local cache keeps only blocks 3.. (moved to the front of a fresh cache) and the other sequence.
    split = PagedKVCache(arch, 8, bs, torch.float32, torch.device("cpu"))
    split.write_blocks([0, 1, 7], local.read_blocks([3, 4, 7]))
    entry = SeqBatchEntry(new, context, (0, 1, 2), extra_parts=(first, second), remote_tokens=remote_tokens)
    got = model.forward([entry, SeqBatchEntry([9], 3, (7,))], split, all_logits=True)
    assert first.calls == second.calls == arch.num_layers
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # The new tokens' K and V went to the local cache at slot position - remote_tokens.
    written = split.read_blocks([0, 1, 2]).flatten(2, 3)[:, :, context - remote_tokens:][:, :, :new_tokens]
    torch.testing.assert_close(written, local.read_blocks(table).flatten(2, 3)[:, :, context : context + new_tokens])


def test_the_sdpa_path_refuses_kv_held_elsewhere(tiny_model_dir: Path) -> None:
    arch = read_architecture(tiny_model_dir)
    model = LlamaForward.load(tiny_model_dir, torch.float32, torch.device("cpu"), 512, "sdpa")
    cache = PagedKVCache(arch, 2, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="distattention"):
        model.forward([SeqBatchEntry([1], 16, (0,), remote_tokens=16)], cache)
    with pytest.raises(ValueError, match="attention"):
        LlamaForward.load(tiny_model_dir, torch.float32, torch.device("cpu"), 512, "flash")  # type: ignore[arg-type]


@pytest.mark.parametrize(("new_tokens", "context_tokens", "batch"),
                         [(512, 512, 1), (2048, 2048, 1), (1, 1024, 8), (1, 2000, 32), (40, 40, 1)])
def test_activation_charge_bounds_what_the_distattention_path_allocates(
        tiny_model_dir: Path, new_tokens: int, context_tokens: int, batch: int) -> None:
    """As test_elastic_engine.py's check of the SDPA path: the charge is never below the forward's
    measured peak (elastic memory's bound holds), and at most 1.6x it besides the fixed part."""
    from torch.profiler import ProfilerActivity, profile

    arch = read_architecture(tiny_model_dir)
    model = LlamaForward.load(tiny_model_dir, torch.float32, torch.device("cpu"), 2048, "distattention")
    blocks_each = -(-context_tokens // 16)
    cache = PagedKVCache(arch, blocks_each * batch, 16, torch.float32, torch.device("cpu"))
    entries = [SeqBatchEntry(tuple((7 * i + j) % 2000 + 1 for j in range(new_tokens)), context_tokens - new_tokens,
                             tuple(range(i * blocks_each, (i + 1) * blocks_each))) for i in range(batch)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model.forward(entries, cache)
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    fixed = ACTIVATION_BASE_BYTES + model.decode_workspace_bytes
    charged = fixed + batch * activation_bytes(arch, torch.float32, new_tokens, context_tokens, 16)
    assert peak <= charged <= activation_slack(new_tokens, "distattention") * peak + fixed
