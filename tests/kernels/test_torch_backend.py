"""The torch backend (kvfleet.kernels.torch_backend, what the engine runs on the CPU) against the same
fp64 references as the Triton kernels, on the kernel tests' shapes: paged caches with random block
tables, GQA, a head_dim that is not a power of two, empty sequences, tokens past a table's row,
strided caches, and the merge's edge cases. The dispatch sends CPU tensors here, never to Triton, but
for decodes the C kernel takes where it is built (test_cpu_native.py)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kernel_testing import ATOL, RTOL, assert_close, make_paged

from kvfleet.kernels import dispatch, torch_backend
from kvfleet.kernels.micro_attention_decode_reference import micro_attention_decode_reference
from kvfleet.kernels.micro_attention_prefill_reference import micro_attention_prefill_reference
from kvfleet.kernels.scale_reduce_reference import scale_reduce_reference, scale_reduce_varlen_reference

HEAD_DIM = 24


def _seqs(lens: list[int], kv_heads: int, dtype: torch.dtype, g: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    keys = [torch.randn(n, kv_heads, HEAD_DIM, generator=g).to(dtype) for n in lens]
    values = [torch.randn(n, kv_heads, HEAD_DIM, generator=g).to(dtype) for n in lens]
    return keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_matches_reference(dtype: torch.dtype, q_heads: int, kv_heads: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(q_heads * 7 + block_size)
    lens = [0, 1, 17, 130, 33]
    keys, values = _seqs(lens, kv_heads, dtype, g)
    k_cache, v_cache, table, seq_lens = make_paged(keys, values, block_size=block_size, num_spare_blocks=3, generator=g)
    q = torch.randn(len(lens), q_heads, HEAD_DIM, generator=g).to(dtype)
    out, lse = torch_backend.micro_attention_decode(q, k_cache, v_cache, table, seq_lens)
    ref_out, ref_lse = micro_attention_decode_reference(q, k_cache, v_cache, table, seq_lens)
    assert out.dtype == lse.dtype == torch.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))


@pytest.mark.parametrize("decode", [torch_backend.micro_attention_decode, dispatch.micro_attention_decode],
                         ids=["torch_backend", "dispatch"])   # dispatch: the C kernel where it is built
def test_decode_writes_out_and_ignores_tokens_past_the_table(decode: Callable[..., Any]) -> None:
    g = torch.Generator().manual_seed(1)
    keys, values = _seqs([20, 9], 2, torch.float32, g)
    k_cache, v_cache, table, seq_lens = make_paged(keys, values, block_size=8, num_spare_blocks=2, generator=g)
    q = torch.randn(2, 4, HEAD_DIM, generator=g)
    too_long = torch.tensor([20 + 100, 9], dtype=torch.int32)  # more than the table's 3 blocks
    out, out_lse = torch.empty(2, 4, HEAD_DIM), torch.empty(2, 4)
    result = decode(q, k_cache, v_cache, table, too_long, out=out, out_lse=out_lse)
    assert result[0] is out and result[1] is out_lse
    ref_out, ref_lse = micro_attention_decode_reference(q, k_cache, v_cache, table, torch.tensor([24, 9], dtype=torch.int32))
    assert_close(out, ref_out, torch.float32)
    assert_close(out_lse, ref_lse, torch.float32)


def test_decode_reads_strided_caches() -> None:
    """Elastic memory's cache is a view of a block-major tensor; the backend reads it as it is."""
    g = torch.Generator().manual_seed(2)
    keys, values = _seqs([30, 5], 2, torch.float32, g)
    k_cache, v_cache, table, seq_lens = make_paged(keys, values, block_size=8, num_spare_blocks=1, generator=g)
    both = torch.stack((k_cache, v_cache), dim=1)  # [blocks, 2, ...]: k_cache[i] is both[i, 0]
    q = torch.randn(2, 4, HEAD_DIM, generator=g)
    out, lse = torch_backend.micro_attention_decode(q, both[:, 0], both[:, 1], table, seq_lens)
    ref_out, ref_lse = micro_attention_decode_reference(q, k_cache, v_cache, table, seq_lens)
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("max_logits_bytes", [None, 1])  # 1: one query row per tile
def test_prefill_matches_reference(dtype: torch.dtype, q_heads: int, kv_heads: int, max_logits_bytes: int | None) -> None:
    g = torch.Generator().manual_seed(q_heads)
    kv_lens = [37, 0, 16, 70]
    q_lens = [5, 0, 16, 1]
    keys, values = _seqs(kv_lens, kv_heads, dtype, g)
    k_cache, v_cache, table, lens = make_paged(keys, values, block_size=16, num_spare_blocks=2, generator=g)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), q_heads, HEAD_DIM, generator=g).to(dtype)
    for offsets in (None, torch.tensor([40, 0, -3, 69], dtype=torch.int32)):
        out, lse = torch_backend.micro_attention_prefill(q, k_cache, v_cache, table, lens, starts,
                                                         causal_offsets=offsets, max_logits_bytes=max_logits_bytes)
        ref_out, ref_lse = micro_attention_prefill_reference(q, k_cache, v_cache, table, lens, starts,
                                                             causal_offsets=offsets)
        assert_close(out, ref_out, dtype)
        assert_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("num_parts", [0, 1, 3, 70])
def test_scale_reduce_matches_reference(num_parts: int) -> None:
    g = torch.Generator().manual_seed(num_parts)
    o = torch.randn(num_parts, 3, 2, HEAD_DIM, generator=g)
    lse = torch.randn(num_parts, 3, 2, generator=g) * 5
    out, out_lse = dispatch.scale_reduce(o, lse)
    ref_out, ref_lse = scale_reduce_reference(o, lse)
    assert_close(out, ref_out, torch.float32)
    assert_close(out_lse, ref_lse, torch.float32)


def test_nan_inf_lse_count_as_empty_in_every_form() -> None:
    g = torch.Generator().manual_seed(5)
    o = torch.randn(4, 3, 2, HEAD_DIM, generator=g)
    lse = torch.randn(4, 3, 2, generator=g) * 3
    bad_o, bad_lse = o.clone(), lse.clone()
    bad_lse[1], bad_lse[2] = float("nan"), float("inf")
    bad_o[1:3] = float("nan")
    ref_out, ref_lse = scale_reduce_reference(o[[0, 3]], lse[[0, 3]])
    out, out_lse = torch_backend.scale_reduce(bad_o, bad_lse)
    assert_close(out, ref_out, torch.float32)
    assert_close(out_lse, ref_lse, torch.float32)
    # Pairwise fold, in place into the first operand.
    acc_o, acc_lse = bad_o[0].clone(), bad_lse[0].clone()
    for p in (1, 2, 3):
        torch_backend.scale_reduce_pair(acc_o, acc_lse, bad_o[p].contiguous(), bad_lse[p].contiguous(), out=acc_o,
                                        out_lse=acc_lse)
    torch.testing.assert_close(acc_o.double(), ref_out, atol=ATOL[torch.float32], rtol=RTOL[torch.float32])
    torch.testing.assert_close(acc_lse.double(), ref_lse, atol=ATOL[torch.float32], rtol=RTOL[torch.float32])
    # All empty: 0 and -inf.
    out, out_lse = torch_backend.scale_reduce_pair(bad_o[1], bad_lse[1], bad_o[2], bad_lse[2])
    assert torch.all(out == 0) and torch.all(out_lse == float("-inf"))


def test_scale_reduce_varlen_matches_reference() -> None:
    g = torch.Generator().manual_seed(6)
    indptr = torch.tensor([0, 2, 2, 7, 8], dtype=torch.int32)  # a row with no parts
    o = torch.randn(9, 2, HEAD_DIM, generator=g)  # one trailing part no row uses
    lse = torch.randn(9, 2, generator=g) * 4
    lse[3] = float("-inf")
    out, out_lse = dispatch.scale_reduce_varlen(o, lse, indptr)
    ref_out, ref_lse = scale_reduce_varlen_reference(o, lse, indptr)
    assert_close(out, ref_out, torch.float32)
    assert_close(out_lse, ref_lse, torch.float32)
    with pytest.raises(ValueError, match="indptr"):
        torch_backend.scale_reduce_varlen(o, lse, torch.tensor([0, 3, 2], dtype=torch.int32))


def test_bad_inputs_are_named() -> None:
    q = torch.randn(2, 4, HEAD_DIM)
    cache = torch.randn(3, 8, 2, HEAD_DIM)
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="seq_lens"):
        torch_backend.micro_attention_decode(q, cache, cache, table, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_q_heads"):
        torch_backend.micro_attention_decode(torch.randn(2, 3, HEAD_DIM), cache, cache, table,
                                             torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("op", [dispatch.micro_attention_decode, torch_backend.micro_attention_decode])
def test_dispatch_and_backend_check_by_the_one_validator(op: Callable[..., Any]) -> None:
    """Both take the contract's signature and docstring from its validator and name a bad input as the
    launchers do; CPU tensors are checked by the torch rules, which take strided caches."""
    assert op.__name__ == "micro_attention_decode" and "Decode attention" in (op.__doc__ or "")
    assert list(inspect.signature(op).parameters) == ["q", "k_cache", "v_cache", "block_table", "seq_lens", "scale",
                                                      "out", "out_lse"]
    q = torch.randn(2, 4, HEAD_DIM)
    cache = torch.randn(3, 8, 2, HEAD_DIM)
    table = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    with pytest.raises(TypeError, match="seq_lens must have dtype in \\(int32\\)"):
        op(q, cache, cache, table, lens.long())
    with pytest.raises(ValueError, match="block_table has 1 rows for 2 sequences"):
        op(q, cache, cache, table[:1], lens)
    with pytest.raises(ValueError, match="out_lse must have shape"):
        op(q, cache, cache, table, lens, out_lse=torch.empty(2, 3))
    strided = torch.randn(3, 2, 8, HEAD_DIM).transpose(1, 2)
    out, lse = op(q, strided, strided, table, lens)
    ref_out, ref_lse = micro_attention_decode_reference(q, strided, strided, table, lens)
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)
