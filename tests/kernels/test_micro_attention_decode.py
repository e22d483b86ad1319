"""Decode micro-attention against its fp64 reference, and DistAttention's promise: the parts of a
sequence, computed separately on paged caches of their own and merged by ScaleReduce, equal attention
over the whole sequence (Infinite-LLM section 4.2)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, make_paged, to

from kvfleet.kernels.micro_attention_decode_launcher import choose_num_splits, micro_attention_decode
from kvfleet.kernels.micro_attention_decode_reference import attention_with_lse, micro_attention_decode_reference
from kvfleet.kernels.scale_reduce_launcher import scale_reduce, scale_reduce_pair, scale_reduce_varlen

BLOCK_SIZE = 16
HEAD_DIM = 32
NUM_KV_HEADS = 2
# 0 (empty part), 1, block_size - 1, block_size + 1, and a long one: 6 blocks, split 3 ways below.
SEQ_LENS = [0, 1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, 5 * BLOCK_SIZE + 3]


def _inputs(dtype: torch.dtype, group: int, seq_lens: list[int], seed: int = 0, kv_heads: int = NUM_KV_HEADS):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, kv_heads, HEAD_DIM, generator=g).to(dtype) for n in seq_lens]
    values = [torch.randn(n, kv_heads, HEAD_DIM, generator=g).to(dtype) for n in seq_lens]
    k_cache, v_cache, block_table, lens = make_paged(
        keys, values, block_size=BLOCK_SIZE, num_spare_blocks=3, generator=g
    )
    q = torch.randn(len(seq_lens), kv_heads * group, HEAD_DIM, generator=g).to(dtype)
    return q, k_cache, v_cache, block_table, lens


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(dtype: torch.dtype, group: int, num_splits: int, device: torch.device) -> None:
    inputs = _inputs(dtype, group, SEQ_LENS)
    out, lse = micro_attention_decode(*to(device, *inputs), num_splits=num_splits, block_n=16)
    ref_out, ref_lse = micro_attention_decode_reference(*inputs)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)
    # The empty sequence: zeros and -inf, never NaN.
    assert torch.all(out[0].cpu() == 0) and torch.all(lse[0].cpu() == float("-inf"))


def test_split_count_does_not_change_the_result(device: torch.device) -> None:
    inputs = to(device, *_inputs(torch.float32, 4, [7 * BLOCK_SIZE + 5, 3, 40]))
    base_out, base_lse = micro_attention_decode(*inputs, num_splits=1, block_n=16)
    for num_splits in (2, 5, 8):
        out, lse = micro_attention_decode(*inputs, num_splits=num_splits, block_n=16)
        torch.testing.assert_close(out, base_out, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, base_lse, atol=1e-6, rtol=1e-6)


def test_automatic_split_count() -> None:
    # Batch 1 on a large GPU: split until ~2 programs per SM, capped by the context length.
    assert choose_num_splits(1, 8, 128 * 1024, num_sms=132) == 33
    assert choose_num_splits(1, 8, 1024, num_sms=132) == 4
    # A full batch already fills the GPU: no split.
    assert choose_num_splits(128, 8, 128 * 1024, num_sms=132) == 1
    assert choose_num_splits(1, 1, 100, num_sms=132) == 1


def test_automatic_split_runs_and_matches(device: torch.device) -> None:
    inputs = _inputs(torch.float32, 4, [40 * BLOCK_SIZE - 7], kv_heads=1)
    out, lse = micro_attention_decode(*to(device, *inputs))  # 640 tokens: 2 splits under the interpreter
    ref_out, ref_lse = micro_attention_decode_reference(*inputs)
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


def test_logits_of_1e4_do_not_overflow(device: torch.device) -> None:
    q, k_cache, v_cache, block_table, seq_lens = _inputs(torch.float32, 4, [BLOCK_SIZE + 1, 2 * BLOCK_SIZE, 5])
    # q = 1/sqrt(d) and k ~ 1e4 in every dim: logits q.k / sqrt(d) are 1e4 (kv head 1) and -1e4 (kv
    # head 0), spread by a few units so the softmax is not uniform. A kernel exponentiating raw logits
    # overflows (exp(1e4) = inf) or underflows to 0/0.
    q = torch.full_like(q, HEAD_DIM**-0.5)
    g = torch.Generator().manual_seed(3)
    k_cache = 1e4 * (1 + 1e-3 * torch.randn(k_cache.shape, generator=g))
    k_cache[..., 0, :] *= -1
    inputs = (q, k_cache, v_cache, block_table, seq_lens)
    out, lse = micro_attention_decode(*to(device, *inputs), num_splits=2, block_n=16)
    ref_out, ref_lse = micro_attention_decode_reference(*inputs)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse.abs().min() > 0.99e4
    # fp32 logits of magnitude 1e4 carry ~1e-3 absolute rounding error, which the softmax turns into
    # ~1e-3 relative error of the weights: the problem's conditioning, not the kernel's.
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-6, atol=1e-2)


def test_empty_part_gives_zeros_and_minus_inf(device: torch.device) -> None:
    inputs = _inputs(torch.float16, 4, [0, 0, 0])
    out, lse = micro_attention_decode(*to(device, *inputs), num_splits=2)
    assert torch.all(out == 0)
    assert torch.all(lse == float("-inf"))


def _split_points(num_tokens: int, num_parts: int, g: torch.Generator) -> list[int]:
    cuts = sorted(torch.randint(0, num_tokens + 1, (num_parts - 1,), generator=g).tolist())
    return [0, *cuts, num_tokens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_parts_merge_to_full_attention(dtype: torch.dtype, device: torch.device) -> None:
    """Each part lives in its own paged cache (another worker), cut at arbitrary token positions,
    empty parts included; all three merge forms must give attention over the whole sequence."""
    g = torch.Generator().manual_seed(7)
    group, num_parts = 4, 4
    seq_lens = [3 * BLOCK_SIZE + 5, 2 * BLOCK_SIZE, 9]
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for n in seq_lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for n in seq_lens]
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, HEAD_DIM, generator=g).to(dtype)
    cuts = [_split_points(n, num_parts, g) for n in seq_lens]

    part_outs, part_lses = [], []
    for part in range(num_parts):
        part_keys = [k[c[part] : c[part + 1]] for k, c in zip(keys, cuts)]
        part_values = [v[c[part] : c[part + 1]] for v, c in zip(values, cuts)]
        paged = make_paged(part_keys, part_values, block_size=BLOCK_SIZE, num_spare_blocks=2, generator=g)
        o, lse = micro_attention_decode(*to(device, q, *paged), num_splits=2, block_n=16)
        part_outs.append(o)
        part_lses.append(lse)

    expected = [attention_with_lse(q[i : i + 1].double(), keys[i].double(), values[i].double(), HEAD_DIM**-0.5)
                for i in range(len(seq_lens))]
    ref_out = torch.cat([e[0] for e in expected])
    ref_lse = torch.cat([e[1] for e in expected])

    # Dense: [parts, seqs, heads, dim].
    out, lse = scale_reduce(torch.stack(part_outs), torch.stack(part_lses))
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)

    # Varlen: sequence i keeps only its non-empty parts, packed with an index pointer.
    rows_o, rows_lse, indptr = [], [], [0]
    for i in range(len(seq_lens)):
        kept = [p for p in range(num_parts) if cuts[i][p + 1] > cuts[i][p]]
        rows_o += [part_outs[p][i] for p in kept]
        rows_lse += [part_lses[p][i] for p in kept]
        indptr.append(indptr[-1] + len(kept))
    out_v, lse_v = scale_reduce_varlen(
        torch.stack(rows_o), torch.stack(rows_lse), torch.tensor(indptr, dtype=torch.int32, device=device)
    )
    assert_close(out_v, ref_out, dtype)
    assert_close(lse_v, ref_lse, dtype)

    # Pairwise, folding the parts in a random order into the first one, in place.
    order = torch.randperm(num_parts, generator=g).tolist()
    acc_o, acc_lse = part_outs[order[0]].clone(), part_lses[order[0]].clone()
    for p in order[1:]:
        scale_reduce_pair(acc_o, acc_lse, part_outs[p], part_lses[p], out=acc_o, out_lse=acc_lse)
    assert_close(acc_o, ref_out, dtype)
    assert_close(acc_lse, ref_lse, dtype)


def test_out_is_written_in_place(device: torch.device) -> None:
    inputs = to(device, *_inputs(torch.float32, 1, [5, 20]))
    out = torch.full((2, NUM_KV_HEADS, HEAD_DIM), float("nan"), device=device)
    out_lse = torch.full((2, NUM_KV_HEADS), float("nan"), device=device)
    for num_splits in (1, 2):
        got_out, got_lse = micro_attention_decode(*inputs, num_splits=num_splits, out=out, out_lse=out_lse)
        assert got_out is out and got_lse is out_lse
        assert torch.isfinite(out).all() and torch.isfinite(out_lse).all()


def test_validation_errors(device: torch.device) -> None:
    q, k, v, bt, lens = to(device, *_inputs(torch.float16, 4, [5, 20]))
    with pytest.raises(TypeError, match="k_cache must have dtype in \\(float16\\)"):
        micro_attention_decode(q, k.float(), v, bt, lens)
    with pytest.raises(TypeError, match="q must have dtype"):
        micro_attention_decode(q.to(torch.int32), k, v, bt, lens)
    with pytest.raises(TypeError, match="block_table must have dtype in \\(int32\\)"):
        micro_attention_decode(q, k, v, bt.long(), lens)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        micro_attention_decode(q[None], k, v, bt, lens)
    with pytest.raises(ValueError, match="v_cache must have shape"):
        micro_attention_decode(q, k, v[:-1].contiguous(), bt, lens)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        micro_attention_decode(q[:, :7].contiguous(), k, v, bt, lens)
    with pytest.raises(ValueError, match="k_cache head_dim"):
        micro_attention_decode(q[..., :16].contiguous(), k, v, bt, lens)
    with pytest.raises(ValueError, match="q must be contiguous"):
        micro_attention_decode(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, bt, lens)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        micro_attention_decode(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, bt, lens)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        micro_attention_decode(q, k, v, bt, lens[:1].contiguous())
    with pytest.raises(ValueError, match="block_table has 1 rows for 2 sequences"):
        micro_attention_decode(q, k, v, bt[:1].contiguous(), lens)
    with pytest.raises(TypeError, match="out must have dtype in \\(float32\\)"):
        micro_attention_decode(q, k, v, bt, lens, out=torch.empty(q.shape, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="out_lse must have shape"):
        micro_attention_decode(q, k, v, bt, lens, out_lse=torch.empty(2, 3, device=device))
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        micro_attention_decode(q, k, v, bt, lens, num_splits=0)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        micro_attention_decode(q, k, v, bt, lens, block_n=24)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        micro_attention_decode(q.tolist(), k, v, bt, lens)  # type: ignore[arg-type]


def test_lengths_past_the_block_table(device: torch.device) -> None:
    q, k, v, bt, lens = _inputs(torch.float32, 4, [20, 3])  # block table: 2 blocks = 32 tokens a row
    too_long = torch.tensor([40, 3], dtype=torch.int32)
    # Unchecked, the tokens past the table are ignored, never read out of bounds.
    out, lse = micro_attention_decode(*to(device, q, k, v, bt, too_long), num_splits=2, block_n=16)
    ref_out, ref_lse = micro_attention_decode_reference(q, k, v, bt, torch.tensor([32, 3], dtype=torch.int32))
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)
    with pytest.raises(ValueError, match="exceeds the block table's 2 blocks x 16 tokens = 32: 40"):
        micro_attention_decode(*to(device, q, k, v, bt, too_long), check_bounds=True)
    bad_table = bt.clone()
    bad_table[1, 0] = k.shape[0]
    with pytest.raises(ValueError, match="block ids must lie in"):
        micro_attention_decode(*to(device, q, k, v, bad_table, lens), check_bounds=True)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        micro_attention_decode(*to(device, q, k, v, bt, torch.tensor([-1, 3], dtype=torch.int32)), check_bounds=True)
    micro_attention_decode(*to(device, q, k, v, bt, lens), check_bounds=True)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvfleet.kernels._checks.interpreting", lambda: False)
    q, k, v, bt, lens = _inputs(torch.float32, 1, [3])
    with pytest.raises(ValueError, match="need CUDA tensors"):
        micro_attention_decode(q, k, v, bt, lens)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4, 8])
def test_bf16_on_gpu(group: int) -> None:
    """bf16 only here: the interpreter stores bf16 as uint16 and computes it wrongly."""
    inputs = _inputs(torch.bfloat16, group, [*SEQ_LENS, 300 * BLOCK_SIZE + 7], kv_heads=8)
    out, lse = micro_attention_decode(*to(torch.device("cuda"), *inputs))
    ref_out, ref_lse = micro_attention_decode_reference(*inputs)
    assert_close(out, ref_out, torch.bfloat16)
    assert_close(lse, ref_lse, torch.bfloat16)
