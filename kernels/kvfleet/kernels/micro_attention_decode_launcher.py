"""Launcher for the decode micro-attention: picks the split-KV count and tile sizes, runs the kernel
and, when the context was split, merges the splits with ScaleReduce. The inputs are checked by the
op's one validator (_checks.py), here or in dispatch, before `launch_decode` sees them.

The result is one DistAttention partial (Infinite-LLM section 4.2): the normalised output of this
part's tokens in fp32 and their natural-log LSE in fp32, ready to be merged with the partials of the
other parts by `scale_reduce*` wherever the query was shipped from (section 4.6).
"""

from __future__ import annotations

import torch

from kvfleet.kernels._checks import (
    PagedAttention,
    Partial,
    check_block_table,
    check_tile,
    interpreting,
    micro_attention_decode_inputs,
    next_power_of_2,
)
from kvfleet.kernels.micro_attention_decode_kernel import micro_attention_decode_kernel
from kvfleet.kernels.scale_reduce_launcher import launch_scale_reduce

# Tokens per loop iteration: 64 bf16 tokens x 128 dims is 16 KB of K and 16 KB of V per step, enough
# in flight per program to keep HBM busy without spilling registers.
DEFAULT_BLOCK_N = 64
# Below this many tokens per split the merge's extra traffic outweighs the added parallelism.
MIN_TOKENS_PER_SPLIT = 256
MAX_NUM_SPLITS = 64


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_num_tokens: int, num_sms: int, block_n: int = DEFAULT_BLOCK_N
) -> int:
    """Split the context until there are about two programs per SM (one is too few to hide the
    latency of the page gathers), but never below MIN_TOKENS_PER_SPLIT tokens per split."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    by_length = max(1, max_num_tokens // max(MIN_TOKENS_PER_SPLIT, block_n))
    return max(1, min(wanted, by_length, MAX_NUM_SPLITS))


def plan_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_num_tokens: int,
    num_splits: int | None,
    block_n: int,
    device: torch.device,
) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a launch; tokens_per_split is a multiple of block_n.

    Split sizes come from the block table's width (max_num_tokens), an upper bound on every seq_len,
    so a launch needs no device-to-host sync; splits past a short sequence's end return empty partials.
    """
    if num_splits is None:
        num_sms = 4 if interpreting() else torch.cuda.get_device_properties(device).multi_processor_count
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_num_tokens, num_sms, block_n)
    tokens_per_split = -(-max(1, max_num_tokens) // num_splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n
    return max(1, -(-max_num_tokens // tokens_per_split)), tokens_per_split


def micro_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    check_bounds: bool = False,
) -> Partial:
    """Decode attention on the Triton kernel. The contract (shapes, dtypes, the (out, lse) partial,
    tokens past a row of the block table ignored rather than read out of bounds) is
    `_checks.micro_attention_decode_inputs`'s, which checks the inputs.

    num_splits: split-KV count, None to choose from the shapes and the GPU. block_n, num_warps,
    num_stages: tile size and Triton launch options (None: Triton's defaults), exposed for
    bench/kernels.py to sweep. check_bounds=True also checks seq_lens and the block ids on the host
    (a device sync: for tests and debugging, not for the decode loop).
    """
    inputs = micro_attention_decode_inputs(
        "triton", q, k_cache, v_cache, block_table, seq_lens, scale=scale, out=out, out_lse=out_lse
    )
    if check_bounds:
        check_block_table(inputs.block_table, inputs.lens, inputs.block_size, inputs.num_blocks)
    return launch_decode(inputs, num_splits=num_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def launch_decode(
    inputs: PagedAttention,
    *,
    num_splits: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Partial:
    """Runs the kernel on inputs checked by the Triton rules (dispatch's, or the function above's)."""
    check_tile("block_n", block_n)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    q, out, out_lse = inputs.q, inputs.out, inputs.out_lse
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = inputs.num_kv_heads
    if num_seqs == 0 or num_q_heads == 0:
        return out, out_lse

    num_splits, tokens_per_split = plan_splits(
        num_seqs, num_kv_heads, inputs.max_num_tokens, num_splits, block_n, q.device
    )

    if num_splits == 1:
        o_dst, lse_dst = out, out_lse
        o_split_stride, lse_split_stride = 0, 0
    else:
        # fp32 partials, never 16-bit (vLLM's paged_attention_v2 keeps them in fp16/bf16 and loses precision there).
        o_dst = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse_dst = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        o_split_stride, lse_split_stride = o_dst.stride(2), lse_dst.stride(2)

    upcast = interpreting() or q.dtype == torch.float32
    group_size = num_q_heads // num_kv_heads
    launch_options = {}
    if num_warps is not None:
        launch_options["num_warps"] = num_warps
    if num_stages is not None:
        launch_options["num_stages"] = num_stages
    micro_attention_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        inputs.k_cache,
        inputs.v_cache,
        inputs.block_table,
        inputs.lens,
        o_dst,
        lse_dst,
        float(inputs.scale) * 1.4426950408889634,  # log2(e)
        *inputs.kernel_strides(),
        o_dst.stride(0),
        o_dst.stride(1),
        o_split_stride,
        lse_dst.stride(0),
        lse_dst.stride(1),
        lse_split_stride,
        tokens_per_split,
        inputs.max_num_tokens,
        HEAD_DIM=head_dim,
        GROUP_SIZE=group_size,
        BLOCK_SIZE=inputs.block_size,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        GROUP_PAD=max(16, next_power_of_2(group_size)),
        BLOCK_N=block_n,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
        **launch_options,
    )
    if num_splits > 1:
        launch_scale_reduce(o_dst, lse_dst, out, out_lse)
    return out, out_lse
