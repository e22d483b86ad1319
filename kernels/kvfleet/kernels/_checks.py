"""The ops' contracts: each op's inputs are checked here, by one validator, once per call.

A Triton kernel reading a tensor of the wrong dtype, shape or layout does not fail: it reads the
wrong bytes and returns plausible numbers. So every entry point checks its inputs first and says
which argument is wrong and why, in words a caller can act on. The entry points are three per op
(`dispatch`, the Triton launcher, the torch backend) and their contract is one, so the checks live
here and nowhere else: a validator per op checks by a backend's rules, allocates `out=`/`out_lse=`
when not given, and returns a record the backends compute from without checking again.

The Triton rules add two to the torch backend's: tensors on the device the kernels run on, and
contiguous caches (torch indexes strided views of a cache, elastic memory's block-major storage; the
kernels take one stride per cache dimension but assume a unit-stride head dimension and dense blocks).

This module imports triton only inside `interpreting()`, which only the Triton rules reach: a CPU
worker that checks its inputs here never loads triton.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Concatenate, Literal, ParamSpec, TypeVar

import torch

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_F32 = (torch.float32,)
_I32 = (torch.int32,)

# Whose rules a validator applies: the Triton kernels', the torch backend's, or (dispatch) the
# backend the tensors' device selects: Triton for CUDA tensors, torch otherwise.
Rules = Literal["triton", "torch", "by_device"]
# A DistAttention partial, or a merge of them: (output fp32, natural-log LSE fp32).
Partial = tuple[torch.Tensor, torch.Tensor]


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
    check_tensor(name, out, ndim=len(shape), dtypes=_F32, device=device)
    check_shape(name, out, shape)
    return out


def _check_vector(name: str, t: object, length: int, device: torch.device) -> torch.Tensor:
    """The int32 per-sequence vectors (lengths, offsets, start locations)."""
    checked = check_tensor(name, t, ndim=1, dtypes=_I32, device=device)
    check_shape(name, checked, (length,))
    return checked


def _first(rules: Rules, name: str, t: object, *, ndim: int, dtypes: Sequence[torch.dtype]) -> tuple[torch.Tensor, bool]:
    """Checks an op's first tensor, which the others must match in device, and decides by it whether the
    Triton rules apply. Returns (the tensor, whether the Triton rules apply)."""
    checked = check_tensor(name, t, ndim=ndim, dtypes=dtypes)
    triton = rules == "triton" or (rules == "by_device" and checked.device.type == "cuda")
    if triton:
        check_device(name, checked)
    return checked, triton


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


def check_query_starts(query_start_loc: torch.Tensor, total_q: int) -> None:
    """Host-side check (a device sync) that the sequences tile q's rows."""
    starts = query_start_loc.cpu()
    if int(starts[0]) != 0 or bool((starts[1:] < starts[:-1]).any()) or int(starts[-1]) != total_q:
        raise ValueError(f"query_start_loc must start at 0, never decrease and end at {total_q} (rows of q)")


def check_tile(name: str, value: int) -> None:
    """Tile sizes index tl.arange, which takes powers of two; tl.dot wants 16 rows at least."""
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class PagedAttention:
    """Checked inputs of a micro-attention over a paged KV cache, with its results allocated."""

    triton: bool  # checked by the Triton kernels' rules, so dispatch runs it there
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    lens: torch.Tensor  # decode's seq_lens, prefill's kv_lens: this part's tokens of each sequence
    scale: float  # the caller's, or head_dim ** -0.5
    out: torch.Tensor
    out_lse: torch.Tensor
    num_blocks: int
    block_size: int
    num_kv_heads: int

    @property
    def num_q_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[2])

    @property
    def max_num_tokens(self) -> int:
        """Tokens a row of the block table holds: no sequence is read past its row."""
        return int(self.block_table.shape[1]) * self.block_size

    def kernel_strides(self) -> tuple[int, ...]:
        """The strides both paged kernels take, in their order: q (token, head), each cache (block,
        token, head; the head dimension is unit-stride), the block table's row."""
        q, k, v = self.q, self.k_cache, self.v_cache
        return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                v.stride(2), self.block_table.stride(0))


@dataclass(frozen=True)
class PagedPrefill(PagedAttention):
    query_start_loc: torch.Tensor
    causal_offsets: torch.Tensor | None  # None: kv_lens - q_lens, this part ends with the new tokens
    max_q_len: int | None  # the caller's bound, which spares the Triton launch a device sync
    max_logits_bytes: int | None  # the torch backend's bound on a query tile's fp32 logits


def _paged(
    rules: Rules, q: object, k_cache: object, v_cache: object, block_table: object
) -> tuple[torch.Tensor, bool, int, int, int]:
    """The checks every paged micro-attention makes on q, the caches and the block table.

    Returns (q, whether the Triton rules apply, num_blocks, block_size, num_kv_heads)."""
    q, triton = _first(rules, "q", q, ndim=3, dtypes=ATTENTION_DTYPES)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=q.device, contiguous=triton)
    num_blocks, block_size, num_kv_heads, k_head_dim = k.shape
    if k_head_dim != head_dim:
        raise ValueError(f"k_cache head_dim {k_head_dim} differs from q head_dim {head_dim}")
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), device=q.device, contiguous=triton)
    check_shape("v_cache", v, k.shape)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_tensor("block_table", block_table, ndim=2, dtypes=_I32, device=q.device)
    return q, triton, num_blocks, block_size, num_kv_heads


def micro_attention_decode_inputs(
    rules: Rules, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, *, scale: float | None = None, out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> PagedAttention:
    """Decode attention of one query token per sequence over the KV blocks this part holds.

    q [num_seqs, num_q_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads,
    head_dim] (same dtype as q: fp16, bf16 or fp32); block_table int32 [num_seqs, max_num_blocks]
    (physical block ids, in token order); seq_lens int32 [num_seqs] (tokens of each sequence in this
    part, 0 allowed). num_q_heads must be a multiple of num_kv_heads (GQA). scale defaults to
    head_dim ** -0.5.

    Returns (out fp32 [num_seqs, num_q_heads, head_dim], lse fp32 [num_seqs, num_q_heads], natural
    log); a sequence with no tokens here gets out 0 and lse -inf. `out=`/`out_lse=` are written in
    place. Tokens past a row of the block table (seq_len > max_num_blocks * block_size) are ignored.
    """
    q, triton, num_blocks, block_size, num_kv_heads = _paged(rules, q, k_cache, v_cache, block_table)
    num_seqs, num_q_heads, head_dim = q.shape
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences in q")
    return PagedAttention(
        triton, q, k_cache, v_cache, block_table, _check_vector("seq_lens", seq_lens, num_seqs, q.device),
        head_dim**-0.5 if scale is None else scale,
        check_out("out", out, (num_seqs, num_q_heads, head_dim), q.device),
        check_out("out_lse", out_lse, (num_seqs, num_q_heads), q.device),
        num_blocks, block_size, num_kv_heads,
    )


def micro_attention_prefill_inputs(
    rules: Rules, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    kv_lens: torch.Tensor, query_start_loc: torch.Tensor, *, causal_offsets: torch.Tensor | None = None,
    max_q_len: int | None = None, scale: float | None = None, max_logits_bytes: int | None = None,
    out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
) -> PagedPrefill:
    """Causal attention of new tokens over the KV blocks this part holds.

    q [total_q_tokens, num_q_heads, head_dim] (sequences packed; sequence s owns rows
    query_start_loc[s] .. query_start_loc[s+1]-1, int32 [num_seqs + 1]); k_cache, v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] already holding the new tokens' K/V where this
    part holds them; block_table int32 [num_seqs, max_num_blocks]; kv_lens int32 [num_seqs].
    causal_offsets int32 [num_seqs]: query i sees KV j iff j <= i + offset; default kv_lens - q_lens
    (this part ends with the new tokens). max_q_len: the longest q_len, which spares the Triton launch
    a device sync (it reads query_start_loc when not given). max_logits_bytes bounds the torch
    backend's query tiles (default torch_backend.DEFAULT_MAX_LOGITS_BYTES); the Triton kernel tiles on
    chip and needs no bound.

    Returns (out fp32 [total_q_tokens, num_q_heads, head_dim], lse fp32 [total_q_tokens, num_q_heads]);
    a query row that sees nothing here gets out 0 and lse -inf. KV tokens past a row of the block
    table are ignored.
    """
    q, triton, num_blocks, block_size, num_kv_heads = _paged(rules, q, k_cache, v_cache, block_table)
    total_q, num_q_heads, head_dim = q.shape
    num_seqs = block_table.shape[0]
    kv_lens = _check_vector("kv_lens", kv_lens, num_seqs, q.device)
    query_start_loc = _check_vector("query_start_loc", query_start_loc, num_seqs + 1, q.device)
    if causal_offsets is not None:
        causal_offsets = _check_vector("causal_offsets", causal_offsets, num_seqs, q.device)
    return PagedPrefill(
        triton, q, k_cache, v_cache, block_table, kv_lens, head_dim**-0.5 if scale is None else scale,
        check_out("out", out, (total_q, num_q_heads, head_dim), q.device),
        check_out("out_lse", out_lse, (total_q, num_q_heads), q.device),
        num_blocks, block_size, num_kv_heads, query_start_loc, causal_offsets, max_q_len, max_logits_bytes,
    )


@dataclass(frozen=True)
class Merge:
    """Checked inputs of a ScaleReduce with its results allocated. Dense: o_parts [parts, rows, heads,
    dim], lse_parts [parts, rows, heads]; varlen: o_parts [total_parts, heads, dim], lse_parts
    [total_parts, heads] and an index pointer checked on the host."""

    triton: bool
    o_parts: torch.Tensor
    lse_parts: torch.Tensor
    out: torch.Tensor
    out_lse: torch.Tensor
    indptr: torch.Tensor | None = None


@dataclass(frozen=True)
class PairMerge:
    """Checked inputs of a pairwise ScaleReduce; out may alias o_a or o_b."""

    triton: bool
    o_a: torch.Tensor
    lse_a: torch.Tensor
    o_b: torch.Tensor
    lse_b: torch.Tensor
    out: torch.Tensor
    out_lse: torch.Tensor


def scale_reduce_inputs(
    rules: Rules, o_parts: torch.Tensor, lse_parts: torch.Tensor, *, out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> Merge:
    """Merge o_parts [num_parts, num_rows, num_heads, head_dim] and lse_parts [num_parts, num_rows,
    num_heads] (fp32) into (out [num_rows, num_heads, head_dim], out_lse [num_rows, num_heads])."""
    o_parts, triton = _first(rules, "o_parts", o_parts, ndim=4, dtypes=_F32)
    num_parts, num_rows, num_heads, head_dim = o_parts.shape
    check_tensor("lse_parts", lse_parts, ndim=3, dtypes=_F32, device=o_parts.device)
    check_shape("lse_parts", lse_parts, (num_parts, num_rows, num_heads))
    return Merge(triton, o_parts, lse_parts, check_out("out", out, (num_rows, num_heads, head_dim), o_parts.device),
                 check_out("out_lse", out_lse, (num_rows, num_heads), o_parts.device))


def scale_reduce_varlen_inputs(
    rules: Rules, o_parts: torch.Tensor, lse_parts: torch.Tensor, indptr: torch.Tensor, *,
    out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
) -> Merge:
    """Merge packed partials o_parts [total_parts, num_heads, head_dim], lse_parts [total_parts,
    num_heads]: row r merges parts indptr[r] .. indptr[r+1]-1 (int32 indptr [num_rows + 1],
    non-decreasing, indptr[0] == 0, indptr[-1] <= total_parts). A row without parts gets 0 and -inf."""
    o_parts, triton = _first(rules, "o_parts", o_parts, ndim=3, dtypes=_F32)
    total_parts, num_heads, head_dim = o_parts.shape
    check_tensor("lse_parts", lse_parts, ndim=2, dtypes=_F32, device=o_parts.device)
    check_shape("lse_parts", lse_parts, (total_parts, num_heads))
    check_tensor("indptr", indptr, ndim=1, dtypes=_I32, device=o_parts.device)
    if indptr.numel() < 1:
        raise ValueError("indptr must have num_rows + 1 >= 1 entries, got an empty tensor")
    num_rows = indptr.numel() - 1
    out = check_out("out", out, (num_rows, num_heads, head_dim), o_parts.device)
    out_lse = check_out("out_lse", out_lse, (num_rows, num_heads), o_parts.device)
    # On the host: a bad index pointer would have a row read other rows' memory. This costs a device
    # sync, accepted because merges happen once per step, not per layer tile.
    ptr = indptr.cpu()
    if int(ptr[0]) != 0 or bool((ptr[1:] < ptr[:-1]).any()) or int(ptr[-1]) > total_parts:
        raise ValueError(
            f"indptr must start at 0, never decrease and end at most at total_parts={total_parts}, "
            f"got {ptr.tolist()[:8]}{'...' if ptr.numel() > 8 else ''}"
        )
    return Merge(triton, o_parts, lse_parts, out, out_lse, indptr)


def scale_reduce_pair_inputs(
    rules: Rules, o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor, *,
    out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None,
) -> PairMerge:
    """Merge two partials o [..., head_dim], lse [...] of equal shapes (fp32). `out=o_a, out_lse=lse_a`
    merges in place (each element is read before it is written)."""
    if not isinstance(o_a, torch.Tensor) or o_a.dim() < 1:
        raise ValueError("o_a must be a tensor [..., head_dim] with at least one dimension")
    o_a, triton = _first(rules, "o_a", o_a, ndim=o_a.dim(), dtypes=_F32)
    check_tensor("o_b", o_b, ndim=o_a.dim(), dtypes=_F32, device=o_a.device)
    check_shape("o_b", o_b, o_a.shape)
    lse_shape = o_a.shape[:-1]
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, lse, ndim=len(lse_shape), dtypes=_F32, device=o_a.device)
        check_shape(name, lse, lse_shape)
    return PairMerge(triton, o_a, lse_a, o_b, lse_b, check_out("out", out, o_a.shape, o_a.device),
                     check_out("out_lse", out_lse, lse_shape, o_a.device))


P = ParamSpec("P")
Inputs = TypeVar("Inputs")


def entry_point(
    validate: Callable[Concatenate[Rules, P], Inputs], rules: Rules, run: Callable[[Inputs], Partial]
) -> Callable[P, Partial]:
    """One op's public function for one backend (or for dispatch): the signature and docstring are
    the op's validator's, so the contract is written once; the inputs are checked there by `rules`,
    once, and `run` computes on the checked record. Named after the validator, less `_inputs`."""

    def op(*args: P.args, **kwargs: P.kwargs) -> Partial:
        return run(validate(rules, *args, **kwargs))

    op.__name__ = op.__qualname__ = validate.__name__.removesuffix("_inputs")
    op.__doc__ = validate.__doc__
    op.__module__ = run.__module__
    # What help() and inspect show: the validator's parameters less the rules, which this binds.
    signature = inspect.signature(validate)
    op.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=list(signature.parameters.values())[1:], return_annotation=inspect.signature(run).return_annotation
    )
    return op
