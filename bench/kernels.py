#!/usr/bin/env python3
"""GPU benchmark of the DistAttention kernels: is decode micro-attention bandwidth-bound at
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


# Torch's own kernels (its normal_ fill, SDPA's backends) are not all safe on tensors of 2**31 or more
# elements: an H100 run died with an illegal memory access at context 65,536 x batch 32, the first row
# whose caches hold 2**31 elements each (`--crash-hunt` finds which op; docs/gpu.md has the answer).
# kvfleet's kernels index with int64 and are meant to take such caches whole; the bench's fills and its
# SDPA baseline stay below the limit, in slices along the first dimension.
MAX_TORCH_ELEMENTS = 2**31 - 1
SMOKE_LIMIT = 40_000


def rows_per_slice(shape: tuple[int, ...], limit: int = MAX_TORCH_ELEMENTS) -> int:
    """How many entries of the first dimension one slice may hold so it has at most `limit` elements."""
    per_row = 1
    for size in shape[1:]:
        per_row *= size
    if per_row > limit:
        raise ValueError(f"one row of {shape} has {per_row} elements, over {limit}")
    return max(1, min(shape[0], limit // max(1, per_row)))


def filled_normal(torch: Any, shape: tuple[int, ...], dtype: Any, device: Any, limit: int = MAX_TORCH_ELEMENTS) -> Any:
    """A tensor of N(0, 1) values, filled a slice at a time (see MAX_TORCH_ELEMENTS)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    step = rows_per_slice(shape, limit)
    for start in range(0, shape[0], step):
        tensor[start:start + step].normal_()
    return tensor


def chunked_sdpa(torch: Any, q: Any, k: Any, v: Any, limit: int = MAX_TORCH_ELEMENTS) -> Any:
    """SDPA (GQA when the head counts differ) over batch slices whose K and V stay under the limit."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = q.shape[1] != k.shape[1]
    step = rows_per_slice(tuple(k.shape), limit)
    if step >= k.shape[0]:
        return sdpa(q, k, v, enable_gqa=gqa)
    return torch.cat([sdpa(q[i:i + step], k[i:i + step], v[i:i + step], enable_gqa=gqa)
                      for i in range(0, k.shape[0], step)])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 contexts x 2 batches per head shape")
    p.add_argument("--max-kv-gib", type=float, default=24.0, help="skip rows whose KV cache is larger (default 24)")
    p.add_argument("--peak-tb-s", type=float, default=None, help="datasheet HBM TB/s if the GPU is not in the table")
    p.add_argument("--timing", choices=("graph", "events"), default="graph",
                   help="graph: CUDA-graph replays, no launch overhead (default); events: do_bench")
    p.add_argument("--sweep", action="store_true", help="also sweep block_n/num_warps/num_stages at 32/8/128, 16K")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes through TRITON_INTERPRET=1 (tests this script)")
    p.add_argument("--crash-hunt", action="store_true",
                   help="run each op of one row alone (CUDA_LAUNCH_BLOCKING=1), a fresh process after a fatal error")
    p.add_argument("--hunt-shape", default=None,
                   help="q_heads,kv_heads,head_dim,context,batch of the hunt (default 32,8,128,65536,32)")
    p.add_argument("--hunt-child", default=None, help=argparse.SUPPRESS)  # the steps one hunt process runs
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
    if args.crash_hunt:
        return crash_hunt(args)  # the parent never touches CUDA: a fatal error kills only a child
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
    if args.hunt_child is not None:
        return Hunt(Bench(args, torch), args.hunt_shape or default_hunt_shape(args)).run(args.hunt_child.split(","))
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
        # The smoke's tensors are tiny: a tiny limit makes its fills and SDPA take the sliced paths too.
        self.limit = SMOKE_LIMIT if self.cpu else MAX_TORCH_ELEMENTS
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
        # do_bench_cudagraph runs `fn` on a stream of its own, which does not wait for the work queued on
        # the default stream: the row's inputs (a multi-GiB fill, then the block table) may still be
        # being written when its first call reads them. A block table read before it is written is
        # recycled memory, whose block ids point anywhere: the illegal memory access at context 65,536
        # x batch 32, the first row whose fill takes longer than the Python between it and the timing
        # (docs/gpu.md). Everything queued so far finishes first.
        self.torch.cuda.synchronize()
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
        k_cache = filled_normal(torch, shape, self.dtype, self.device, self.limit)
        v_cache = filled_normal(torch, shape, self.dtype, self.device, self.limit)
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
        contig_shape = (batch, num_kv_heads, context, head_dim)
        k_contig = filled_normal(torch, contig_shape, self.dtype, self.device, self.limit)
        v_contig = filled_normal(torch, contig_shape, self.dtype, self.device, self.limit)
        q4 = q.view(batch, num_q_heads, 1, head_dim)
        sdpa_s = self.time_s(lambda: chunked_sdpa(torch, q4, k_contig, v_contig, self.limit))
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


# -- the crash hunt --------------------------------------------------------------------------------
# Each op of one row, alone and in the row's order, eager then under CUDA-graph capture as the bench
# times it; CUDA_LAUNCH_BLOCKING=1 makes a bad access fail in the op that made it. "fill_whole" and the
# "sdpa_*" steps are torch's own ops on whole 2**31-element tensors; the rest are what the bench runs.
HUNT_STEPS = ("setup", "fill_whole", "decode", "decode_graph", "split_merge", "part_merge", "stream", "stream_graph",
              "sdpa_setup", "sdpa_default", "sdpa_default_graph", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn",
              "sdpa_sliced", "sdpa_sliced_graph")
# The bench's own order, each in a fresh process without CUDA_LAUNCH_BLOCKING (which would serialise the
# streams and hide it): inputs made on the default stream, read at once by do_bench_cudagraph's own
# stream, with the block table's memory recycled from random data as in a bench that ran rows before;
# then the same after a synchronize, as time_s now does.
RACE_STEPS = ("race_unsynced", "race_synced")


def default_hunt_shape(args: argparse.Namespace) -> str:
    return "4,1,32,600,3" if args.cpu_smoke else "32,8,128,65536,32"


def crash_hunt(args: argparse.Namespace) -> int:
    """Run the hunt's steps in child processes until each has an answer: a child that dies (or whose
    CUDA context a failed op left unusable) is followed by a fresh one from the next step on."""
    shape = args.hunt_shape or default_hunt_shape(args)
    verdicts: dict[str, str] = {}
    for _ in range(len(HUNT_STEPS)):
        remaining = [step for step in HUNT_STEPS if step not in verdicts]
        if not remaining:
            break
        died = run_hunt_child(args, shape, remaining, verdicts, launch_blocking=True)
        if died == "setup":
            break
    for step in RACE_STEPS:
        run_hunt_child(args, shape, [step], verdicts, launch_blocking=False)
    failed = [step for step, verdict in verdicts.items() if verdict.startswith("FAILED") and step not in RACE_STEPS]
    sanitizer = sanitize(args, shape, failed[0]) if failed and not args.cpu_smoke else None
    print(json.dumps({"hunt_shape": shape, "steps": verdicts, "failed": failed, "sanitizer": sanitizer}))
    return 0


def run_hunt_child(args: argparse.Namespace, shape: str, steps: list[str], verdicts: dict[str, str],
                   launch_blocking: bool) -> str | None:
    """One child process running `steps` in order, its output echoed and its verdicts added to
    `verdicts`; the step it died in (recorded as FAILED) if it died, else None."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hunt-child", ",".join(steps), "--hunt-shape", shape]
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_LAUNCH_BLOCKING"}
    if launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    running = None
    for line in proc.stdout.splitlines():
        print(line, flush=True)
        if line.startswith("hunt-start "):
            running = line.split()[1]
        elif line.startswith("hunt ") and ": " in line:
            name, verdict = line.removeprefix("hunt ").split(": ", 1)
            verdicts[name] = verdict
    if running is not None and running not in verdicts:
        died = running  # it died inside this step
    elif running is None and proc.returncode != 0:
        died = steps[0]  # it died before its first step
    else:
        return None  # every step it started has its verdict (after a FAILED one it may stop, exit 3)
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])[-600:]
    verdicts[died] = f"FAILED (the process died, exit {proc.returncode}): {tail}"
    print(f"hunt {died}: {verdicts[died]}", flush=True)
    return died


def sanitize(args: argparse.Namespace, shape: str, step: str) -> list[str] | None:
    """The first failed step again under compute-sanitizer's memcheck, which names the kernel and the
    bad address; its report's first lines (None where the tool is missing)."""
    import shutil

    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if Path(p).exists()), None)
    if tool is None:
        print("hunt: no compute-sanitizer here", flush=True)
        return None
    steps = ",".join(dict.fromkeys(["setup", "sdpa_setup" if step.startswith("sdpa") else "setup", step]))
    cmd = [tool, "--tool", "memcheck", "--print-limit", "4", sys.executable, str(Path(__file__).resolve()),
           "--hunt-child", steps, "--hunt-shape", shape]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        output = f"{e.stdout or ''}{e.stderr or ''}\n(compute-sanitizer stopped after 90 s)"
        output = output if isinstance(output, str) else str(output)
    report = [line for line in output.splitlines() if line.startswith("=========") or line.startswith("hunt ")][:40]
    for line in report:
        print(f"sanitizer: {line}", flush=True)
    return report


class Hunt:
    """One child of the crash hunt: the state of one row and a function per step."""

    def __init__(self, bench: Bench, shape: str) -> None:
        self.bench, self.torch = bench, bench.torch
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.context, self.batch = map(int, shape.split(","))
        self.state: dict[str, Any] = {}

    def graph(self, fn: Callable[[], Any]) -> None:
        if self.bench.cpu:
            raise _Skip("no CUDA graphs on the CPU")
        self.bench.triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")

    def run(self, steps: list[str]) -> int:
        torch = self.torch
        die_at = os.environ.get("KVFLEET_HUNT_DIE_AT")  # a test's stand-in for a fatal CUDA error
        for step in steps:
            print(f"hunt-start {step}", flush=True)
            if step == die_at:
                os._exit(9)
            started = time.perf_counter()
            try:
                getattr(self, f"step_{step}")()
                if not self.bench.cpu:
                    torch.cuda.synchronize()
                verdict = f"ok ({time.perf_counter() - started:.2f} s)"
            except _Skip as skip:
                verdict = f"skipped: {skip}"
            except Exception as e:  # noqa: BLE001  (the point is to see any error, then go on if we can)
                verdict = f"FAILED {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            print(f"hunt {step}: {verdict}", flush=True)
            if verdict.startswith("FAILED") and not self.alive():
                return 3  # the parent starts a fresh process at the next step
            if verdict.startswith("FAILED") and step == "setup":
                return 3
        return 0

    def alive(self) -> bool:
        if self.bench.cpu:
            return True
        try:
            return float(self.torch.ones(1, device="cuda").add_(1).item()) == 2.0
        except Exception:  # noqa: BLE001
            return False

    # The steps, in HUNT_STEPS' order; each may assume the ones before it ran in this process or,
    # for those that build state, rebuilds it (a fresh process after a failure starts from scratch).
    def paged(self) -> dict[str, Any]:
        if "k" not in self.state:
            self.step_setup()
        return self.state

    def step_setup(self) -> None:
        torch, b = self.torch, self.bench
        blocks_per_seq = -(-self.context // BLOCK_SIZE)
        num_blocks = self.batch * blocks_per_seq
        shape = (num_blocks, BLOCK_SIZE, self.num_kv_heads, self.head_dim)
        s = self.state
        s["k"] = filled_normal(torch, shape, b.dtype, b.device, b.limit)
        s["v"] = filled_normal(torch, shape, b.dtype, b.device, b.limit)
        s["table"] = torch.randperm(num_blocks, device=b.device).to(torch.int32).view(self.batch, blocks_per_seq)
        s["lens"] = torch.full((self.batch,), self.context, dtype=torch.int32, device=b.device)
        s["q"] = torch.randn(self.batch, self.num_q_heads, self.head_dim, dtype=b.dtype, device=b.device)
        s["out"] = torch.empty(self.batch, self.num_q_heads, self.head_dim, dtype=torch.float32, device=b.device)
        s["lse"] = torch.empty(self.batch, self.num_q_heads, dtype=torch.float32, device=b.device)
        s["block_n"] = 16 if b.cpu else 64
        s["splits"], s["per_split"] = b.plan_splits(self.batch, self.num_kv_heads, blocks_per_seq * BLOCK_SIZE, None,
                                                    s["block_n"], b.device)
        elements = num_blocks * BLOCK_SIZE * self.num_kv_heads * self.head_dim
        print(f"hunt: caches of {elements} elements each ({elements / 2**31:.3f} x 2**31), {s['splits']} splits",
              flush=True)

    def step_fill_whole(self) -> None:
        """torch's normal_ on the whole cache at once, as the bench filled it before; checks the values
        too, since a 32-bit element count can leave part of a tensor unwritten rather than crash."""
        torch, b, s = self.torch, self.bench, self.paged()
        t = torch.empty(tuple(s["k"].shape), dtype=b.dtype, device=b.device).fill_(float("nan")).normal_()
        tail = t[-max(1, t.shape[0] // 64):].float()
        std, nans = float(tail.std()), int(torch.isnan(tail).sum())
        del t, tail
        if nans or not 0.9 < std < 1.1:
            raise RuntimeError(f"normal_ left the tensor's tail wrong: std {std:.3f}, {nans} NaN")

    def decode_call(self) -> Callable[[], Any]:
        s = self.paged()
        return lambda: self.bench.decode(s["q"], s["k"], s["v"], s["table"], s["lens"], out=s["out"], out_lse=s["lse"],
                                         block_n=s["block_n"])

    def step_decode(self) -> None:
        self.decode_call()()

    def step_decode_graph(self) -> None:
        self.graph(self.decode_call())

    def step_split_merge(self) -> None:
        torch, b, s = self.torch, self.bench, self.paged()
        if s["splits"] < 2:
            raise _Skip("one split at this shape")
        o = torch.randn(self.batch, self.num_q_heads, s["splits"], self.head_dim, device=b.device)
        lse = torch.randn(self.batch, self.num_q_heads, s["splits"], device=b.device)
        b.launch_scale_reduce(o, lse, s["out"], s["lse"])

    def step_part_merge(self) -> None:
        torch, b, s = self.torch, self.bench, self.paged()
        o = torch.randn(2, self.batch, self.num_q_heads, self.head_dim, device=b.device)
        lse = torch.randn(2, self.batch, self.num_q_heads, device=b.device)
        b.scale_reduce(o, lse, out=s["out"], out_lse=s["lse"])

    def stream_call(self) -> Callable[[], Any]:
        torch, b, s = self.torch, self.bench, self.paged()
        k = s["k"]
        sink = torch.empty(self.batch * self.num_kv_heads * s["splits"] * self.head_dim, dtype=torch.float32,
                           device=b.device)
        grid = (self.batch, self.num_kv_heads, s["splits"])
        return lambda: b.stream_kernel[grid](
            k, s["v"], s["table"], s["lens"], sink, k.stride(0), k.stride(1), k.stride(2), s["table"].stride(0),
            s["per_split"], self.num_kv_heads, s["splits"], HEAD_DIM=self.head_dim, BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_N=s["block_n"])

    def step_stream(self) -> None:
        self.stream_call()()

    def step_stream_graph(self) -> None:
        self.graph(self.stream_call())

    def step_sdpa_setup(self) -> None:
        """The contiguous caches of SDPA's baseline (the paged ones are freed first, as in the bench)."""
        torch, b, s = self.torch, self.bench, self.state
        for key in ("k", "v"):
            s.pop(key, None)
        if not b.cpu:
            torch.cuda.empty_cache()
        shape = (self.batch, self.num_kv_heads, self.context, self.head_dim)
        s["kc"] = filled_normal(torch, shape, b.dtype, b.device, b.limit)
        s["vc"] = filled_normal(torch, shape, b.dtype, b.device, b.limit)
        s["q4"] = torch.randn(self.batch, self.num_q_heads, 1, self.head_dim, dtype=b.dtype, device=b.device)

    def contiguous(self) -> dict[str, Any]:
        if "kc" not in self.state:
            self.step_sdpa_setup()
        return self.state

    def sdpa_call(self) -> Callable[[], Any]:
        s = self.contiguous()
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        return lambda: sdpa(s["q4"], s["kc"], s["vc"], enable_gqa=self.num_q_heads != self.num_kv_heads)

    def step_sdpa_default(self) -> None:
        self.sdpa_call()()

    def step_sdpa_default_graph(self) -> None:
        self.graph(self.sdpa_call())

    def with_backend(self, name: str) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if self.bench.cpu:
            raise _Skip("a CUDA backend")
        with sdpa_kernel(getattr(SDPBackend, name)):
            self.sdpa_call()()

    def step_sdpa_flash(self) -> None:
        self.with_backend("FLASH_ATTENTION")

    def step_sdpa_efficient(self) -> None:
        self.with_backend("EFFICIENT_ATTENTION")

    def step_sdpa_cudnn(self) -> None:
        self.with_backend("CUDNN_ATTENTION")

    def sliced_call(self) -> Callable[[], Any]:
        s = self.contiguous()
        return lambda: chunked_sdpa(self.torch, s["q4"], s["kc"], s["vc"], self.bench.limit)

    def step_sdpa_sliced(self) -> None:
        self.sliced_call()()

    def step_sdpa_sliced_graph(self) -> None:
        self.graph(self.sliced_call())

    def race(self, synchronize: bool) -> None:
        torch, b = self.torch, self.bench
        if b.cpu:
            raise _Skip("one stream on the CPU")
        # Random data freed into the allocator's cache: the block table's memory is recycled from it.
        junk = [torch.randn(self.batch * (-(-self.context // BLOCK_SIZE)), device=b.device) * 1e9 for _ in range(8)]
        del junk
        self.step_setup()  # the multi-GiB fill, then the block table, all queued on the default stream
        if synchronize:
            torch.cuda.synchronize()
        self.graph(self.decode_call())

    def step_race_unsynced(self) -> None:
        self.race(synchronize=False)

    def step_race_synced(self) -> None:
        self.race(synchronize=True)


class _Skip(Exception):
    """A hunt step that does not apply here."""


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
