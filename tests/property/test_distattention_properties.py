"""DistAttention is exact (Infinite-LLM section 4.2): a sequence's KV split into any contiguous parts,
micro-attention over each part, merged by ScaleReduce, equals attention over the whole, for the CPU
backend the engine serves with (kvfleet.kernels.torch_backend). Decode and prefill forms, GQA, block
sizes down to one token, empty parts and empty sequences; the reference is fp64 full attention."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvfleet.kernels import torch_backend  # noqa: E402
from kvfleet.kernels.micro_attention_decode_reference import attention_with_lse  # noqa: E402

HEAD_DIM = 16
TOL = 2e-5  # fp32 accumulation over at most ~100 tokens; the reference is fp64


def _paged(tokens: list[torch.Tensor], block_size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence [n, kv_heads, dim] laid out in a cache of shuffled blocks: (cache, table int32, lens int32)."""
    kv_heads = tokens[0].shape[1]
    pages = [-(-t.shape[0] // block_size) for t in tokens]
    num_blocks = sum(pages) + 1
    cache = torch.randn(num_blocks, block_size, kv_heads, HEAD_DIM, generator=g)  # garbage where unused
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(tokens), max([1, *pages])), perm[-1], dtype=torch.int32)
    used = 0
    for s, t in enumerate(tokens):
        for p in range(pages[s]):
            block = perm[used]
            used += 1
            table[s, p] = block
            chunk = t[p * block_size : (p + 1) * block_size]
            cache[block, : chunk.shape[0]] = chunk
    return cache, table, torch.tensor([t.shape[0] for t in tokens], dtype=torch.int32)


def _cuts(draw: st.DrawFn, length: int, num_parts: int) -> list[int]:
    inner = sorted(draw(st.lists(st.integers(0, length), min_size=num_parts - 1, max_size=num_parts - 1)))
    return [0, *inner, length]


shapes = st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]), st.sampled_from([1, 4, 16]))


@st.composite
def decode_cases(draw: st.DrawFn) -> tuple[list[int], list[list[int]], tuple[int, int, int], int]:
    num_parts = draw(st.integers(1, 5))
    lens = draw(st.lists(st.integers(0, 80), min_size=1, max_size=3))
    cuts = [_cuts(draw, n, num_parts) for n in lens]
    return lens, cuts, draw(shapes), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(decode_cases())
def test_decode_parts_merged_equal_full_attention(case: tuple[list[int], list[list[int]], tuple[int, int, int], int]) -> None:
    lens, cuts, (kv_heads, group, block_size), seed = case
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, kv_heads, HEAD_DIM, generator=g) for n in lens]
    values = [torch.randn(n, kv_heads, HEAD_DIM, generator=g) for n in lens]
    q = torch.randn(len(lens), kv_heads * group, HEAD_DIM, generator=g)
    o_parts, lse_parts = [], []
    for p in range(len(cuts[0]) - 1):
        # K and V side by side on the head axis, so they share one block table.
        kv_cache, table, part_lens = _paged([torch.cat((k, v), dim=1)[c[p] : c[p + 1]]
                                             for k, v, c in zip(keys, values, cuts)], block_size, g)
        k_cache = kv_cache[:, :, :kv_heads].contiguous()
        v_cache = kv_cache[:, :, kv_heads:].contiguous()
        o, lse = torch_backend.micro_attention_decode(q, k_cache, v_cache, table, part_lens)
        o_parts.append(o)
        lse_parts.append(lse)
    out, out_lse = torch_backend.scale_reduce(torch.stack(o_parts), torch.stack(lse_parts))
    for s in range(len(lens)):
        ref_out, ref_lse = attention_with_lse(q[s : s + 1].double(), keys[s].double(), values[s].double(), HEAD_DIM**-0.5)
        torch.testing.assert_close(out[s : s + 1].double(), ref_out, atol=TOL, rtol=TOL)
        torch.testing.assert_close(out_lse[s : s + 1].double(), ref_lse, atol=TOL, rtol=TOL)
        if lens[s] == 0:
            assert torch.all(out[s] == 0) and torch.all(out_lse[s] == float("-inf"))


@st.composite
def prefill_cases(draw: st.DrawFn) -> tuple[int, int, list[int], tuple[int, int, int], int]:
    stored = draw(st.integers(0, 60))
    new = draw(st.integers(1, 20))
    return stored, new, _cuts(draw, stored, draw(st.integers(1, 4))), draw(shapes), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(prefill_cases())
def test_prefill_stored_parts_and_causal_in_hand_part_merged_equal_causal_attention(
        case: tuple[int, int, list[int], tuple[int, int, int], int]) -> None:
    """The engine's form: the context before this step in contiguous parts, seen whole (causal offset
    = the part's length), and the new tokens causal among themselves (a cache of one-token blocks),
    merged densely, pairwise and varlen: all equal causal attention over the whole sequence."""
    stored, new, cuts, (kv_heads, group, block_size), seed = case
    g = torch.Generator().manual_seed(seed)
    total = stored + new
    k = torch.randn(total, kv_heads, HEAD_DIM, generator=g)
    v = torch.randn(total, kv_heads, HEAD_DIM, generator=g)
    q = torch.randn(new, kv_heads * group, HEAD_DIM, generator=g)
    starts = torch.tensor([0, new], dtype=torch.int32)
    o_parts, lse_parts = [], []
    for p in range(len(cuts) - 1):
        kv_cache, table, part_lens = _paged([torch.cat((k, v), dim=1)[cuts[p] : cuts[p + 1]]],
                                            block_size, g)
        k_cache = kv_cache[:, :, :kv_heads].contiguous()
        v_cache = kv_cache[:, :, kv_heads:].contiguous()
        o, lse = torch_backend.micro_attention_prefill(q, k_cache, v_cache, table, part_lens, starts,
                                                       causal_offsets=part_lens, max_logits_bytes=seed % 3 * 2000)
        o_parts.append(o)
        lse_parts.append(lse)
    hand_table = torch.arange(new, dtype=torch.int32)[None]
    o, lse = torch_backend.micro_attention_prefill(q, k[stored:, None].contiguous(), v[stored:, None].contiguous(),
                                                   hand_table, torch.tensor([new], dtype=torch.int32), starts)
    o_parts.append(o)
    lse_parts.append(lse)
    mask = torch.arange(total)[None, :] <= torch.arange(stored, total)[:, None]
    ref_out, ref_lse = attention_with_lse(q.double(), k.double(), v.double(), HEAD_DIM**-0.5, mask=mask)

    out, out_lse = torch_backend.scale_reduce(torch.stack(o_parts), torch.stack(lse_parts))
    torch.testing.assert_close(out.double(), ref_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(out_lse.double(), ref_lse, atol=TOL, rtol=TOL)

    acc_o, acc_lse = o_parts[-1].clone(), lse_parts[-1].clone()  # any fold order
    for o, lse in zip(o_parts[:-1], lse_parts[:-1]):
        torch_backend.scale_reduce_pair(acc_o, acc_lse, o, lse, out=acc_o, out_lse=acc_lse)
    torch.testing.assert_close(acc_o.double(), ref_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(acc_lse.double(), ref_lse, atol=TOL, rtol=TOL)

    num_parts = len(o_parts)
    packed_o = torch.stack(o_parts, dim=1).flatten(0, 1)  # row-major: each query's parts together
    packed_lse = torch.stack(lse_parts, dim=1).flatten(0, 1)
    indptr = torch.arange(0, (new + 1) * num_parts, num_parts, dtype=torch.int32)
    out, out_lse = torch_backend.scale_reduce_varlen(packed_o, packed_lse, indptr)
    torch.testing.assert_close(out.double(), ref_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(out_lse.double(), ref_lse, atol=TOL, rtol=TOL)
