"""A loop whose bounds are read at run time, the shape of every kernel's main loop, runs under Triton's
interpreter whatever the Triton and NumPy versions (Triton 3.6's interpreter fails there with NumPy
>= 2.4 unless kvfleet.kernels._interpreter_compat is installed), and compiled on a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels import _interpreter_compat


@triton.jit
def _count_from_program_id_kernel(n_ptr, out_ptr, BLOCK: tl.constexpr):
    """out[i] = number of integers in [i, n[i]): both loop bounds are runtime values."""
    row = tl.program_id(0)
    n = tl.load(n_ptr + row)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(row, n, BLOCK):
        total += ((start + tl.arange(0, BLOCK)) < n).to(tl.int32)
    tl.store(out_ptr + row, tl.sum(total, axis=0))


def test_the_interpreter_converts_scalars_to_indices() -> None:
    from triton.runtime import interpreter

    _interpreter_compat.install()
    _interpreter_compat.install()  # idempotent
    assert _interpreter_compat._index_works(interpreter._patch_lang_tensor)


def test_a_loop_with_runtime_bounds_runs(device: torch.device) -> None:
    import kvfleet.kernels.scale_reduce_kernel  # noqa: F401  (a kernel module installs the fix)

    n = torch.tensor([0, 5, 37, 2], dtype=torch.int32, device=device)
    out = torch.full((4,), -1, dtype=torch.int32, device=device)
    _count_from_program_id_kernel[(4,)](n, out, BLOCK=16)
    assert out.cpu().tolist() == [0, 4, 35, 0]
