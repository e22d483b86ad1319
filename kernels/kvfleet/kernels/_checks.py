"""Input checks shared by the launchers.

A Triton kernel reading a tensor of the wrong dtype, shape or layout does not fail: it reads the
wrong bytes and returns plausible numbers. So every launcher checks its inputs first and says which
argument is wrong and why, in words a caller can act on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when the kernels run on the CPU in numpy: triton.jit picks the interpreter when a kernel
    is defined (TRITON_INTERPRET=1 at import), so ask a kernel, not the environment of the moment."""
    from triton.runtime.interpreter import InterpretedFunction

    from kvfleet.kernels.scale_reduce_kernel import scale_reduce_pair_kernel

    return isinstance(scale_reduce_pair_kernel, InterpretedFunction)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """contiguous=False asks only for a unit-stride last dimension (views of a larger cache)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).removeprefix('torch.')}")
    if not contiguous:
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit-stride last dimension, got strides {t.stride()}")
    elif not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    return t


def check_device(name: str, t: torch.Tensor) -> None:
    """CUDA tensors on a GPU; CPU tensors only under the interpreter, where kernels run in numpy."""
    if interpreting():
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU when TRITON_INTERPRET=1, got {t.device}")
    elif t.device.type != "cuda":
        raise ValueError(
            f"{name} is on {t.device}: the Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 to run them on the CPU)"
        )


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_out(
    name: str, out: torch.Tensor | None, shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Results are fp32 (the merge rule keeps partials in fp32): an `out=` tensor must be fp32, contiguous, right shape."""
    if out is None:
        return torch.empty(tuple(shape), dtype=torch.float32, device=device)
    check_tensor(name, out, ndim=len(shape), dtypes=(torch.float32,), device=device)
    check_shape(name, out, shape)
    return out


def check_paged_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   attention_dtypes: Sequence[torch.dtype], *, kernel_device: bool = True) -> tuple[int, int, int, int]:
    """The checks every paged-attention launcher makes on q, the caches and the block table.
    kernel_device=False skips the Triton device rule (the torch backend runs on any device) and
    accepts caches that are strided views (elastic memory's block-major storage), as torch indexes any.

    Returns (num_blocks, block_size, num_kv_heads, head_dim).
    """
    check_tensor("q", q, ndim=3, dtypes=attention_dtypes)
    if kernel_device:
        check_device("q", q)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=q.device, contiguous=kernel_device)
    num_blocks, block_size, num_kv_heads, k_head_dim = k_cache.shape
    if k_head_dim != head_dim:
        raise ValueError(f"k_cache head_dim {k_head_dim} differs from q head_dim {head_dim}")
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), device=q.device, contiguous=kernel_device)
    check_shape("v_cache", v_cache, k_cache.shape)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=q.device)
    return num_blocks, block_size, num_kv_heads, head_dim


def check_block_table(block_table: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int) -> None:
    """Host-side bounds check (a device sync): lengths fit the table, used block ids exist."""
    table, lens_host = block_table.cpu().long(), lens.cpu().long()
    if bool((lens_host < 0).any()):
        raise ValueError(f"lengths must be >= 0, got {lens_host.tolist()[:8]}")
    capacity = table.shape[1] * block_size
    if bool((lens_host > capacity).any()):
        raise ValueError(f"a length exceeds the block table's {table.shape[1]} blocks x {block_size} tokens "
                         f"= {capacity}: {lens_host.max().item()}")
    used = torch.arange(table.shape[1])[None, :] < (lens_host[:, None] + block_size - 1) // block_size
    ids = table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block ids must lie in [0, {num_blocks}), got {int(ids.min())}..{int(ids.max())}")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
