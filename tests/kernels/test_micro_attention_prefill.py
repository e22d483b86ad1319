"""Prefill micro-attention against its fp64 reference, and a long prompt spread over parts (each with
its own paged cache and causal offset) merging to full causal attention."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, make_paged, to

from kvfleet.kernels.micro_attention_decode_reference import attention_with_lse
from kvfleet.kernels.micro_attention_prefill_launcher import micro_attention_prefill
from kvfleet.kernels.micro_attention_prefill_reference import micro_attention_prefill_reference
from kvfleet.kernels.scale_reduce_launcher import scale_reduce

BLOCK_SIZE = 16
HEAD_DIM = 32
NUM_KV_HEADS = 2
# (new tokens, KV tokens incl. the new ones): empty prompt, 1, block_size +- 1, a long one with context.
Q_LENS = [0, 1, BLOCK_SIZE - 1, 3, 2 * BLOCK_SIZE + 3]
KV_LENS = [4, 1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, 4 * BLOCK_SIZE + 5]


def _inputs(dtype: torch.dtype, group: int, q_lens: list[int], kv_lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for n in kv_lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for n in kv_lens]
    k_cache, v_cache, block_table, lens = make_paged(keys, values, block_size=BLOCK_SIZE, num_spare_blocks=3, generator=g)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, HEAD_DIM, generator=g).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, block_table, lens, query_start_loc


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(dtype: torch.dtype, group: int, device: torch.device) -> None:
    inputs = _inputs(dtype, group, Q_LENS, KV_LENS)
    out, lse = micro_attention_prefill(*to(device, *inputs))
    ref_out, ref_lse = micro_attention_prefill_reference(*inputs)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)


def test_rows_that_see_nothing_are_empty(device: torch.device) -> None:
    # Offset -2: query rows 0 and 1 see no KV token of this part.
    inputs = _inputs(torch.float32, 1, [5], [5])
    offsets = torch.tensor([-2], dtype=torch.int32)
    out, lse = micro_attention_prefill(*to(device, *inputs), causal_offsets=offsets.to(device))
    ref_out, ref_lse = micro_attention_prefill_reference(*inputs, causal_offsets=offsets)
    assert torch.all(out[:2] == 0) and torch.all(lse[:2] == float("-inf"))
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prompt_spread_over_parts_merges_to_causal_attention(dtype: torch.dtype, device: torch.device) -> None:
    """Sequence positions [0, total) are cut at random token positions into parts, each on its own
    paged cache; the part starting at position a gets causal offset (total - q_len) - a."""
    g = torch.Generator().manual_seed(11)
    group, num_parts = 4, 3
    q_lens = [BLOCK_SIZE + 3, 1, 6]
    totals = [3 * BLOCK_SIZE + 2, 20, 6]
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for n in totals]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for n in totals]
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, HEAD_DIM, generator=g).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cuts = [[0, *sorted(torch.randint(0, n + 1, (num_parts - 1,), generator=g).tolist()), n] for n in totals]

    part_outs, part_lses = [], []
    for part in range(num_parts):
        starts = [c[part] for c in cuts]
        part_keys = [k[c[part] : c[part + 1]] for k, c in zip(keys, cuts)]
        part_values = [v[c[part] : c[part + 1]] for v, c in zip(values, cuts)]
        k_cache, v_cache, block_table, kv_lens = make_paged(
            part_keys, part_values, block_size=BLOCK_SIZE, num_spare_blocks=1, generator=g
        )
        offsets = torch.tensor([t - ql - a for t, ql, a in zip(totals, q_lens, starts)], dtype=torch.int32)
        o, lse = micro_attention_prefill(
            *to(device, q, k_cache, v_cache, block_table, kv_lens, query_start_loc), causal_offsets=offsets.to(device)
        )
        part_outs.append(o)
        part_lses.append(lse)
    out, lse = scale_reduce(torch.stack(part_outs), torch.stack(part_lses))

    ref_out, ref_lse = [], []
    for i, (total, q_len) in enumerate(zip(totals, q_lens)):
        rows = slice(int(query_start_loc[i]), int(query_start_loc[i + 1]))
        visible = torch.arange(total)[None, :] <= torch.arange(q_len)[:, None] + (total - q_len)
        o, seq_lse = attention_with_lse(q[rows].double(), keys[i].double(), values[i].double(), HEAD_DIM**-0.5, visible)
        ref_out.append(o)
        ref_lse.append(seq_lse)
    assert_close(out, torch.cat(ref_out), dtype)
    assert_close(lse, torch.cat(ref_lse), dtype)


def test_out_is_written_in_place(device: torch.device) -> None:
    inputs = to(device, *_inputs(torch.float32, 1, [3, 4], [3, 9]))
    out = torch.empty(7, NUM_KV_HEADS, HEAD_DIM, device=device)
    out_lse = torch.empty(7, NUM_KV_HEADS, device=device)
    got = micro_attention_prefill(*inputs, out=out, out_lse=out_lse)
    assert got[0] is out and got[1] is out_lse
    assert torch.isfinite(out).all() and torch.isfinite(out_lse).all()


def test_validation_errors(device: torch.device) -> None:
    q, k, v, bt, kv_lens, qsl = to(device, *_inputs(torch.float16, 4, [3, 4], [3, 9]))
    with pytest.raises(TypeError, match="v_cache must have dtype in \\(float16\\)"):
        micro_attention_prefill(q, k, v.float(), bt, kv_lens, qsl)
    with pytest.raises(ValueError, match="query_start_loc must have shape \\(3,\\)"):
        micro_attention_prefill(q, k, v, bt, kv_lens, qsl[:2].contiguous())
    with pytest.raises(TypeError, match="kv_lens must have dtype in \\(int32\\)"):
        micro_attention_prefill(q, k, v, bt, kv_lens.long(), qsl)
    with pytest.raises(ValueError, match="causal_offsets must have shape"):
        micro_attention_prefill(q, k, v, bt, kv_lens, qsl, causal_offsets=kv_lens[:1].contiguous())
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        micro_attention_prefill(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, bt, kv_lens, qsl)
    with pytest.raises(ValueError, match="out must have shape"):
        micro_attention_prefill(q, k, v, bt, kv_lens, qsl, out=torch.empty(1, 1, 1, device=device))
    with pytest.raises(ValueError, match="query_start_loc must start at 0"):
        micro_attention_prefill(q, k, v, bt, kv_lens, qsl + 1, check_bounds=True)
    with pytest.raises(ValueError, match="exceeds the block table"):
        micro_attention_prefill(q, k, v, bt, kv_lens * 10, qsl, check_bounds=True)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        micro_attention_prefill(q, k, v, bt, kv_lens, qsl, block_m=8)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4, 8])
def test_bf16_on_gpu(group: int) -> None:
    inputs = _inputs(torch.bfloat16, group, [*Q_LENS, 300], [*KV_LENS, 1000])
    out, lse = micro_attention_prefill(*to(torch.device("cuda"), *inputs))
    ref_out, ref_lse = micro_attention_prefill_reference(*inputs)
    assert_close(out, ref_out, torch.bfloat16)
    assert_close(lse, ref_lse, torch.bfloat16)
