"""ScaleReduce against its fp64 reference, and the merge rule's edge cases (scale_reduce_kernel.py):
order independence, NaN/+inf LSE read as -inf, empty parts, all parts empty, extreme LSE values."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, to

from kvfleet.kernels.scale_reduce_launcher import scale_reduce, scale_reduce_pair, scale_reduce_varlen
from kvfleet.kernels.scale_reduce_reference import scale_reduce_reference, scale_reduce_varlen_reference

NUM_ROWS, NUM_HEADS, HEAD_DIM = 3, 2, 24  # 24: a head_dim that is not a power of two


def _partials(num_parts: int, seed: int = 0, lse_scale: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(num_parts, NUM_ROWS, NUM_HEADS, HEAD_DIM, generator=g)
    lse = torch.randn(num_parts, NUM_ROWS, NUM_HEADS, generator=g) * lse_scale
    return o, lse


@pytest.mark.parametrize("num_parts", [1, 3, 70])  # 70 > 64 parts per iteration: two chunks
def test_matches_reference(num_parts: int, device: torch.device) -> None:
    o, lse = _partials(num_parts)
    out, out_lse = scale_reduce(*to(device, o, lse))
    ref_out, ref_lse = scale_reduce_reference(o, lse)
    assert_close(out, ref_out, torch.float32)
    assert_close(out_lse, ref_lse, torch.float32)


def test_order_does_not_matter(device: torch.device) -> None:
    o, lse = _partials(9, seed=1)
    out, out_lse = scale_reduce(*to(device, o, lse))
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(2))
    out_p, out_lse_p = scale_reduce(*to(device, o[perm].contiguous(), lse[perm].contiguous()))
    torch.testing.assert_close(out_p, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_lse_p, out_lse, atol=1e-6, rtol=1e-6)


def test_nan_and_inf_lse_count_as_empty(device: torch.device) -> None:
    o, lse = _partials(4, seed=3)
    bad_o, bad_lse = o.clone(), lse.clone()
    bad_lse[1] = float("nan")
    bad_lse[2] = float("inf")
    bad_o[1:3] = float("nan")  # a failed peer's output is garbage too; it must not leak in
    out, out_lse = scale_reduce(*to(device, bad_o, bad_lse))
    ref_out, ref_lse = scale_reduce_reference(o[[0, 3]], lse[[0, 3]])
    assert_close(out, ref_out, torch.float32)
    assert_close(out_lse, ref_lse, torch.float32)


def test_all_empty_is_guarded(device: torch.device) -> None:
    o, lse = _partials(3)
    o[:] = float("nan")
    lse[0], lse[1], lse[2] = float("-inf"), float("nan"), float("inf")
    out, out_lse = scale_reduce(*to(device, o, lse))
    assert torch.all(out == 0)
    assert torch.all(out_lse == float("-inf"))
    # Zero parts behave like all-empty parts.
    out0, lse0 = scale_reduce(*to(device, o[:0], lse[:0]))
    assert torch.all(out0 == 0) and torch.all(lse0 == float("-inf"))


def test_extreme_lse_does_not_overflow(device: torch.device) -> None:
    o, lse = _partials(5, seed=4)
    lse = lse + torch.tensor([1e4, -1e4, 1e4 - 3, 0.0, 1e4 + 1])[:, None, None]
    out, out_lse = scale_reduce(*to(device, o, lse))
    ref_out, ref_lse = scale_reduce_reference(o, lse)
    assert torch.isfinite(out).all() and torch.isfinite(out_lse).all()
    assert_close(out, ref_out, torch.float32)
    torch.testing.assert_close(out_lse.cpu().double(), ref_lse, atol=2e-3, rtol=1e-6)


def test_varlen_with_index_pointer(device: torch.device) -> None:
    g = torch.Generator().manual_seed(5)
    counts = [2, 0, 1, 5, 20]  # a row without parts, a single part, more than one chunk
    total = sum(counts)
    o = torch.randn(total + 2, NUM_HEADS, HEAD_DIM, generator=g)  # 2 trailing rows no row uses
    lse = torch.randn(total + 2, NUM_HEADS, generator=g) * 4
    lse[3, 1] = float("nan")
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    out, out_lse = scale_reduce_varlen(*to(device, o, lse, indptr))
    ref_out, ref_lse = scale_reduce_varlen_reference(o, lse, indptr)
    assert_close(out, ref_out, torch.float32)
    assert_close(out_lse, ref_lse, torch.float32)
    assert torch.all(out[1] == 0) and torch.all(out_lse[1] == float("-inf"))


def test_varlen_rejects_a_bad_index_pointer(device: torch.device) -> None:
    o, lse = to(device, torch.zeros(4, NUM_HEADS, HEAD_DIM), torch.zeros(4, NUM_HEADS))
    for bad in ([1, 2], [0, 3, 2], [0, 5]):
        with pytest.raises(ValueError, match="indptr must start at 0"):
            scale_reduce_varlen(o, lse, torch.tensor(bad, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="indptr must have dtype in \\(int32\\)"):
        scale_reduce_varlen(o, lse, torch.tensor([0, 4], device=device))


def test_pairwise_tree_equals_flat_merge(device: torch.device) -> None:
    o, lse = _partials(4, seed=6)
    o, lse = to(device, o, lse)
    left = scale_reduce_pair(o[0], lse[0], o[1], lse[1])
    right = scale_reduce_pair(o[2], lse[2], o[3], lse[3])
    out, out_lse = scale_reduce_pair(*left, *right)
    flat_out, flat_lse = scale_reduce(o, lse)
    torch.testing.assert_close(out, flat_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_lse, flat_lse, atol=1e-6, rtol=1e-6)


def test_pairwise_edge_cases_and_in_place(device: torch.device) -> None:
    o, lse = _partials(2, seed=7)
    o, lse = to(device, o, lse)
    empty_lse = torch.full_like(lse[1], float("-inf"))
    garbage = torch.full_like(o[1], float("nan"))
    for bad in (empty_lse, torch.full_like(empty_lse, float("nan")), torch.full_like(empty_lse, float("inf"))):
        out, out_lse = scale_reduce_pair(o[0], lse[0], garbage, bad)
        torch.testing.assert_close(out, o[0])
        torch.testing.assert_close(out_lse, lse[0])
    both_out, both_lse = scale_reduce_pair(garbage, empty_lse, garbage, empty_lse)
    assert torch.all(both_out == 0) and torch.all(both_lse == float("-inf"))
    acc_o, acc_lse = o[0].clone(), lse[0].clone()
    got = scale_reduce_pair(acc_o, acc_lse, o[1], lse[1], out=acc_o, out_lse=acc_lse)
    assert got[0] is acc_o and got[1] is acc_lse
    ref_out, ref_lse = scale_reduce_reference(o.cpu(), lse.cpu())
    assert_close(acc_o, ref_out, torch.float32)
    assert_close(acc_lse, ref_lse, torch.float32)


def test_out_is_written_in_place(device: torch.device) -> None:
    o, lse = to(device, *_partials(3))
    out = torch.empty(NUM_ROWS, NUM_HEADS, HEAD_DIM, device=device)
    out_lse = torch.empty(NUM_ROWS, NUM_HEADS, device=device)
    got = scale_reduce(o, lse, out=out, out_lse=out_lse)
    assert got[0] is out and got[1] is out_lse
    assert torch.isfinite(out).all()


def test_validation_errors(device: torch.device) -> None:
    o, lse = to(device, *_partials(3))
    with pytest.raises(TypeError, match="o_parts must have dtype in \\(float32\\)"):
        scale_reduce(o.half(), lse)
    with pytest.raises(ValueError, match="lse_parts must have shape"):
        scale_reduce(o, lse[:2].contiguous())
    with pytest.raises(ValueError, match="o_parts must be contiguous"):
        scale_reduce(o.transpose(0, 1), lse)
    with pytest.raises(ValueError, match="o_parts must have 4 dimensions"):
        scale_reduce(o[0], lse)
    with pytest.raises(ValueError, match="out must have shape"):
        scale_reduce(o, lse, out=torch.empty(1, 2, 3, device=device))
    with pytest.raises(ValueError, match="o_b must have shape"):
        scale_reduce_pair(o[0], lse[0], o[1, :1].contiguous(), lse[1])
    with pytest.raises(ValueError, match="lse_b must have shape"):
        scale_reduce_pair(o[0], lse[0], o[1], lse[1, :1].contiguous())
    with pytest.raises(TypeError, match="lse_a must have dtype"):
        scale_reduce_pair(o[0], lse[0].double(), o[1], lse[1])
