#!/usr/bin/env python3
"""GPU benchmark of the DistAttention kernels (issue 7): is decode micro-attention bandwidth-bound at
the hardware's limit, is the merge cheap, and does it beat torch SDPA?

Decode attention reads every KV byte once per step, so its figure of merit is achieved HBM bandwidth:
bytes moved (KV + Q + O + LSE + split partials + block table) / time, compared with
- the datasheet peak of the GPU and a device-to-device copy measured here (read + write counted);
- a Triton kernel that only streams the same pages through the same block table and split grid:
  the ceiling for this access pattern, so the gap to it is the attention math's own cost;
- torch SDPA (enable_gqa) on a contiguous cache: the speed a non-paged, non-distributed path gets.
The merge share is the ScaleReduce time (split-KV merge plus the merge of 2 DistAttention parts)
over the total of one decode step.

Shapes: heads q/kv/dim 32/8/128 (Llama-3-70B-like GQA), 8/1/128 (MQA-like), 32/32/128 (MHA); batch
1-128; context 1K-128K; bf16; block size 16. Times are medians of CUDA-graph replays (launch
overhead excluded, as in an engine that captures decode in graphs; `--timing events` for CUDA events
with L2 cleared before each run). Rows whose KV cache is below 4x the L2 size are measured but left
out of the headline figures (replays would hit L2, not HBM). Rows whose cache exceeds --max-kv-gib
are skipped (SDPA's contiguous copy is allocated after the paged cache is freed).

    python bench/kernels.py            # full sweep, a few minutes on an H100
    python bench/kernels.py --quick    # 3 contexts x 2 batches per shape, about a minute

Prints the machine, one line per row, and as its last line one JSON object: device,
hbm_fraction_of_peak (by context), merge_share (by context), speedup_vs_sdpa (by context) and more.
Without CUDA it says so and still ends with a JSON line (device null, skipped). --cpu-smoke runs the
whole pipeline on tiny shapes through the Triton interpreter, to test this script without a GPU;
its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# HBM bandwidth from the vendors' datasheets, TB/s, matched against torch.cuda.get_device_name in order.
DATASHEET_TB_S = [
    ("GH200", 4.0),  # before "H200", which it contains
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("H800", 3.35),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB", 1.935),  # PCIe
    ("A100", 1.555),
    ("L40S", 0.864),
    ("L4", 0.3),
]
HEAD_SHAPES = [(32, 8, 128), (8, 1, 128), (32, 32, 128)]
BLOCK_SIZE = 16
LONG_CONTEXT = 16 * 1024  # the targets apply from here on


def sig(x: float, digits: int = 4) -> float:
    """Rounded to significant digits, so that small ratios (the CPU smoke's) do not print as 0."""
    return float(f"{x:.{digits}g}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 contexts x 2 batches per head shape")
    p.add_argument("--max-kv-gib", type=float, default=24.0, help="skip rows whose KV cache is larger (default 24)")
    p.add_argument("--peak-tb-s", type=float, default=None, help="datasheet HBM TB/s if the GPU is not in the table")
    p.add_argument("--timing", choices=("graph", "events"), default="graph",
                   help="graph: CUDA-graph replays, no launch overhead (default); events: do_bench")
    p.add_argument("--sweep", action="store_true", help="also sweep block_n/num_warps/num_stages at 32/8/128, 16K")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes through TRITON_INTERPRET=1 (tests this script)")
    return p.parse_args()


def skipped(reason: str) -> dict[str, Any]:
    return {
        "device": None,
        "skipped": reason,
        "hbm_fraction_of_peak": {},
        "merge_share": {},
        "speedup_vs_sdpa": {},
    }


def main() -> int:
    args = parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    print(f"host: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), python {platform.python_version()}")
    try:
        import torch
    except ImportError as e:
        print(f"bench/kernels.py: torch is not installed ({e}); run `make venv` first")
        print(json.dumps(skipped("torch not installed")))
        return 0
    print(f"torch {torch.__version__}, CUDA runtime {torch.version.cuda}")
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA device here, nothing to measure. Run it on a GPU machine "
              "(`python bench/kernels.py`), or `--cpu-smoke` to check the script itself.")
        print(json.dumps(skipped("no CUDA device")))
        return 0
    # Importable from a checkout without the editable install, too.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))
    return Bench(args, torch).run()


class Bench:
    def __init__(self, args: argparse.Namespace, torch: Any) -> None:
        import triton

        from kvfleet.kernels.micro_attention_decode_launcher import micro_attention_decode, plan_splits
        from kvfleet.kernels.scale_reduce_launcher import launch_scale_reduce, scale_reduce

        self.args, self.torch, self.triton = args, torch, triton
        self.decode, self.plan_splits = micro_attention_decode, plan_splits
        self.launch_scale_reduce, self.scale_reduce = launch_scale_reduce, scale_reduce
        self.cpu = args.cpu_smoke
        self.device = torch.device("cpu" if self.cpu else "cuda")
        self.dtype = torch.float32 if self.cpu else torch.bfloat16  # the interpreter computes bf16 wrongly
        self.stream_kernel = _make_stream_kernel(triton)
        print(f"triton {triton.__version__}")

    # -- timing ------------------------------------------------------------------------------------
    def time_s(self, fn: Callable[[], Any]) -> float:
        """Median seconds per call. On a GPU, by default from CUDA-graph replays (do_bench_cudagraph):
        launch overhead is left out, as in a serving engine that captures its decode step in graphs,
        so a small kernel such as the merge is measured by its GPU time. --timing events uses
        do_bench instead (CUDA events around each call, L2 cleared before each)."""
        if self.cpu:  # the interpreter compiles nothing: one call is the measurement
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        rep_ms = 50 if self.args.quick else 100
        if self.args.timing == "graph":
            try:
                return float(self.triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")) / 1e3
            except Exception as e:  # noqa: BLE001  (any capture failure: fall back, say so)
                print(f"CUDA-graph timing failed ({type(e).__name__}: {e}); timing with events from here on")
                self.args.timing = "events"
        return float(self.triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")) / 1e3

    # -- the machine ---------------------------------------------------------------------------------
    def describe(self) -> tuple[str, float | None, float, int]:
        torch = self.torch
        if self.cpu:
            print("device: CPU through the Triton interpreter (--cpu-smoke): the numbers mean nothing")
            # A tiny "L2" so the smoke rows reach the headline figures and exercise that code too.
            return "cpu-smoke", 0.01, self.measure_copy_tb_s(64 << 20), 1024
        props = torch.cuda.get_device_properties(self.device)
        name = torch.cuda.get_device_name(self.device)
        l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20))
        driver = "?"
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
        peak_tb_s = self.args.peak_tb_s or next((tb for key, tb in DATASHEET_TB_S if key in name), None)
        print(f"device: {name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
              f"L2 {l2_bytes / 2**20:.0f} MiB, capability {props.major}.{props.minor}, driver {driver}")
        copy_tb_s = self.measure_copy_tb_s(2 << 30 if not self.args.quick else 1 << 30)
        print(f"HBM: datasheet {peak_tb_s if peak_tb_s else '?'} TB/s, device-to-device copy {copy_tb_s:.2f} TB/s (read+write); "
              f"timing: {'CUDA-graph replays' if self.args.timing == 'graph' else 'CUDA events, L2 cleared'}")
        return name, peak_tb_s, copy_tb_s, l2_bytes

    def measure_copy_tb_s(self, num_bytes: int) -> float:
        src = self.torch.empty(num_bytes, dtype=self.torch.uint8, device=self.device).fill_(1)
        dst = self.torch.empty_like(src)
        t = self.time_s(lambda: dst.copy_(src))
        return 2 * num_bytes / t / 1e12

    # -- one row -------------------------------------------------------------------------------------
    def row(self, heads: tuple[int, int, int], context: int, batch: int, peak_tb_s: float | None, copy_tb_s: float,
            l2_bytes: int, **launch: Any) -> dict[str, Any] | None:
        torch = self.torch
        num_q_heads, num_kv_heads, head_dim = heads
        elem = torch.finfo(self.dtype).bits // 8
        kv_bytes = batch * context * num_kv_heads * head_dim * 2 * elem
        if kv_bytes > self.args.max_kv_gib * 2**30:
            return None
        blocks_per_seq = -(-context // BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        k_cache = torch.empty(shape, dtype=self.dtype, device=self.device).normal_()
        v_cache = torch.empty(shape, dtype=self.dtype, device=self.device).normal_()
        block_table = torch.randperm(num_blocks, device=self.device).to(torch.int32).view(batch, blocks_per_seq)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=self.device)
        q = torch.randn(batch, num_q_heads, head_dim, dtype=self.dtype, device=self.device)
        out = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float32, device=self.device)
        out_lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=self.device)
        # The decode call, the split plan and the streaming kernel must use the same tile size.
        launch = {"block_n": 16 if self.cpu else 64, **launch}
        block_n = launch["block_n"]
        num_splits, tokens_per_split = self.plan_splits(
            batch, num_kv_heads, blocks_per_seq * BLOCK_SIZE, None, block_n, self.device
        )

        decode_s = self.time_s(lambda: self.decode(q, k_cache, v_cache, block_table, seq_lens, out=out,
                                                   out_lse=out_lse, **launch))
        # The merges on their own: the split-KV merge inside the call, and merging 2 parts' partials.
        split_merge_s = 0.0
        if num_splits > 1:
            o_split = torch.randn(batch, num_q_heads, num_splits, head_dim, device=self.device)
            lse_split = torch.randn(batch, num_q_heads, num_splits, device=self.device)
            split_merge_s = self.time_s(lambda: self.launch_scale_reduce(o_split, lse_split, out, out_lse))
        o_parts = torch.randn(2, batch, num_q_heads, head_dim, device=self.device)
        lse_parts = torch.randn(2, batch, num_q_heads, device=self.device)
        part_merge_s = self.time_s(lambda: self.scale_reduce(o_parts, lse_parts, out=out, out_lse=out_lse))

        sink = torch.empty(batch * num_kv_heads * num_splits * head_dim, dtype=torch.float32, device=self.device)
        grid = (batch, num_kv_heads, num_splits)
        stream_s = self.time_s(lambda: self.stream_kernel[grid](
            k_cache, v_cache, block_table, seq_lens, sink, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_table.stride(0), tokens_per_split, num_kv_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=block_n))
        k_cache = v_cache = None  # free the paged cache before the contiguous one is allocated

        # SDPA on a contiguous [batch, kv_heads, context, dim] cache, one query token per sequence.
        k_contig = torch.empty(batch, num_kv_heads, context, head_dim, dtype=self.dtype, device=self.device).normal_()
        v_contig = torch.empty_like(k_contig).normal_()
        q4 = q.view(batch, num_q_heads, 1, head_dim)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        sdpa_s = self.time_s(lambda: sdpa(q4, k_contig, v_contig, enable_gqa=num_q_heads != num_kv_heads))
        k_contig = v_contig = None
        if not self.cpu:
            torch.cuda.empty_cache()

        table_bytes = batch * blocks_per_seq * 4
        partial_bytes = 2 * batch * num_q_heads * num_splits * (head_dim + 1) * 4 if num_splits > 1 else 0
        io_bytes = batch * num_q_heads * (head_dim * elem + (head_dim + 1) * 4)
        total_bytes = kv_bytes + table_bytes + partial_bytes + io_bytes
        achieved_tb_s = total_bytes / decode_s / 1e12
        return {
            "heads": f"{num_q_heads}/{num_kv_heads}/{head_dim}",
            "context": context,
            "batch": batch,
            "num_splits": num_splits,
            "kv_mib": sig(kv_bytes / 2**20),
            "l2_resident": kv_bytes < 4 * l2_bytes,
            "decode_us": sig(decode_s * 1e6),
            "achieved_tb_s": sig(achieved_tb_s),
            "fraction_of_peak": sig(achieved_tb_s / peak_tb_s) if peak_tb_s else None,
            "fraction_of_copy": sig(achieved_tb_s / copy_tb_s),
            "stream_fraction_of_peak": sig((kv_bytes + table_bytes) / stream_s / 1e12 / peak_tb_s) if peak_tb_s else None,
            "decode_over_stream": sig(stream_s / decode_s),
            "merge_share": sig((split_merge_s + part_merge_s) / (decode_s + part_merge_s)),
            "sdpa_us": sig(sdpa_s * 1e6),
            "speedup_vs_sdpa": sig(sdpa_s / decode_s),
        }

    # -- the whole run -------------------------------------------------------------------------------
    def run(self) -> int:
        name, peak_tb_s, copy_tb_s, l2_bytes = self.describe()
        if self.cpu:
            # 600 tokens: two splits (see plan_splits), so the split merge runs too.
            shapes, contexts, batches = [(4, 2, 32), (4, 1, 32)], [64, 600], [2]
        elif self.args.quick:
            shapes, contexts, batches = HEAD_SHAPES, [4096, 16384, 65536], [1, 32]
        else:
            shapes = HEAD_SHAPES
            contexts = [1024, 4096, 16384, 32768, 65536, 131072]
            batches = [1, 8, 32, 128]
        rows = []
        header = ("heads", "context", "batch", "num_splits", "kv_mib", "decode_us", "achieved_tb_s",
                  "fraction_of_peak", "fraction_of_copy", "stream_fraction_of_peak", "merge_share", "speedup_vs_sdpa")
        print(" ".join(f"{h:>14}" for h in header))
        for heads in shapes:
            for context in contexts:
                for batch in batches:
                    r = self.row(heads, context, batch, peak_tb_s, copy_tb_s, l2_bytes)
                    if r is None:
                        print(f"{heads} context {context} batch {batch}: skipped, KV > {self.args.max_kv_gib} GiB")
                        continue
                    rows.append(r)
                    note = "  (L2-resident: not in the headline)" if r["l2_resident"] else ""
                    print(" ".join(f"{str(r[h]):>14}" for h in header) + note, flush=True)
        if self.args.sweep and not self.cpu:
            self.sweep(peak_tb_s, copy_tb_s, l2_bytes)

        def by_context(key: str, agg: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
            result = {}
            for context in contexts:
                values = [r[key] for r in rows if r["context"] == context and not r["l2_resident"] and r[key] is not None]
                if values:
                    result[str(context)] = sig(agg(values))
            return result

        summary: dict[str, Any] = {
            "device": name,
            "datasheet_peak_tb_s": peak_tb_s,
            "copy_tb_s": sig(copy_tb_s),
            "hbm_fraction_of_peak": by_context("fraction_of_peak"),
            "hbm_fraction_of_peak_min": by_context("fraction_of_peak", min),
            "hbm_fraction_of_copy": by_context("fraction_of_copy"),
            "stream_ceiling_fraction_of_peak": by_context("stream_fraction_of_peak"),
            "merge_share": by_context("merge_share"),
            "merge_share_max": by_context("merge_share", max),
            "speedup_vs_sdpa": by_context("speedup_vs_sdpa"),
            "speedup_vs_sdpa_min": by_context("speedup_vs_sdpa", min),
            "num_rows": len(rows),
            "dtype": str(self.dtype).removeprefix("torch."),
            "quick": self.args.quick,
            "timing": "cpu" if self.cpu else self.args.timing,
            "torch": self.torch.__version__,
            "triton": self.triton.__version__,
        }
        long_rows = [r for r in rows if r["context"] >= LONG_CONTEXT and not r["l2_resident"]]
        if long_rows and peak_tb_s:
            summary["targets"] = {
                "hbm_fraction_ge_0.8_at_16k_plus": min(r["fraction_of_peak"] for r in long_rows) >= 0.8,
                "merge_share_le_0.05_at_16k_plus": max(r["merge_share"] for r in long_rows) <= 0.05,
                "faster_than_sdpa_at_16k_plus": min(r["speedup_vs_sdpa"] for r in long_rows) > 1.0,
            }
        print(json.dumps(summary))
        return 0

    def sweep(self, peak_tb_s: float | None, copy_tb_s: float, l2_bytes: int) -> None:
        print("sweep at 32/8/128, context 16K, batch 8 (block_n, num_warps, num_stages):")
        for block_n in (32, 64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3, 4):
                    r = self.row((32, 8, 128), 16384, 8, peak_tb_s, copy_tb_s, l2_bytes,
                                 block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                    if r:
                        print(f"  {block_n:4d} {num_warps} {num_stages}: {r['achieved_tb_s']} TB/s, "
                              f"{r['fraction_of_peak']} of peak, {r['decode_us']} us", flush=True)


def _make_stream_kernel(triton: Any) -> Any:
    """A kernel that reads exactly the pages the decode kernel reads, through the same block table and
    split grid, and does nothing with them but a sum: the bandwidth ceiling of this access pattern."""
    import triton.language as tl

    @triton.jit
    def stream_pages_kernel(
        k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, sink_ptr,
        stride_block, stride_tok, stride_head, stride_bt_seq, num_tokens_per_split, num_kv_heads, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        seq_id = tl.program_id(0)
        kv_head_id = tl.program_id(1)
        split_id = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq_id)
        tok_start = split_id * num_tokens_per_split
        tok_end = tl.minimum(tok_start + num_tokens_per_split, seq_len)
        dim_offs = tl.arange(0, HEAD_DIM)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for tok0 in range(tok_start, tok_end, BLOCK_N):
            tok = tok0 + tl.arange(0, BLOCK_N)
            tok_mask = tok < tok_end
            block_ids = tl.load(block_table_ptr + seq_id * stride_bt_seq + tok // BLOCK_SIZE, mask=tok_mask, other=0)
            rows = block_ids.to(tl.int64) * stride_block + (tok % BLOCK_SIZE) * stride_tok + kv_head_id * stride_head
            k = tl.load(k_cache_ptr + rows[:, None] + dim_offs[None, :], mask=tok_mask[:, None], other=0.0)
            v = tl.load(v_cache_ptr + rows[:, None] + dim_offs[None, :], mask=tok_mask[:, None], other=0.0)
            acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
        program = (seq_id * num_kv_heads + kv_head_id) * num_splits + split_id
        tl.store(sink_ptr + program * HEAD_DIM + dim_offs, acc)

    return stream_pages_kernel


if __name__ == "__main__":
    sys.exit(main())
