"""Compiles every kernel ahead of time for an H100 (sm_90) without a GPU, as far as the cubin.

The interpreter runs a kernel's Python, not Triton's compiler: code that runs there can still be
rejected on a GPU (a non-constexpr global, a dot shape the tensor cores do not take, a type that
changes across a loop). Triton compiles to PTX and assembles with its bundled ptxas without a device,
so this catches those errors on the CPU. Run in a process without TRITON_INTERPRET; prints one JSON
line per kernel configuration.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import time
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("compile_for_gpu.py must run without TRITON_INTERPRET=1")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvfleet.kernels.micro_attention_decode_kernel import micro_attention_decode_kernel
from kvfleet.kernels.micro_attention_prefill_kernel import micro_attention_prefill_kernel
from kvfleet.kernels.scale_reduce_kernel import scale_reduce_kernel, scale_reduce_pair_kernel

TRITON_DTYPE = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def compile_kernel(kernel: Any, pointers: dict[str, str], constexprs: dict[str, Any], *, arch: int) -> dict[str, Any]:
    names = list(inspect.signature(kernel.fn).parameters)
    signature: dict[str, str] = {}
    for name in names:
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()}
    )
    start_s = time.perf_counter()
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "num_stages": 2})
    return {
        "kernel": kernel.fn.__name__,
        "constexprs": {k: v for k, v in constexprs.items() if k in ("GROUP_SIZE", "UPCAST", "VARLEN")},
        "dtype": pointers.get("q_ptr", "*fp32"),
        "compile_s": round(time.perf_counter() - start_s, 2),
        "shared_bytes": compiled.metadata.shared,
        "cubin_bytes": len(compiled.asm["cubin"]),
    }


def main(arch: int = 90) -> None:
    # bf16 (the serving dtype) at every GQA ratio; fp16 and fp32 (upcast path) at one, to keep the
    # CPU test short: the group size changes no code path, only a constexpr.
    for dtype in ("bf16", "fp16", "fp32"):
        upcast = dtype == "fp32"
        for group in (1, 4, 8) if dtype == "bf16" else (4,):
            ptrs = {n: TRITON_DTYPE[dtype] for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr")}
            ptrs |= {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32"}
            print(json.dumps(compile_kernel(
                micro_attention_decode_kernel,
                ptrs,
                dict(HEAD_DIM=128, GROUP_SIZE=group, BLOCK_SIZE=16, HEAD_DIM_PAD=128, GROUP_PAD=16,
                     BLOCK_N=64, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32"),
                arch=arch,
            )), flush=True)
        if dtype == "fp16":
            continue
        ptrs = {n: TRITON_DTYPE[dtype] for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr")}
        ptrs |= {"block_table_ptr": "*i32", "kv_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                 "causal_offsets_ptr": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32"}
        print(json.dumps(compile_kernel(
            micro_attention_prefill_kernel,
            ptrs,
            dict(HEAD_DIM=128, GROUP_SIZE=4, BLOCK_SIZE=16, HEAD_DIM_PAD=128, BLOCK_M=32 if upcast else 64, BLOCK_N=64,
                 UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32"),
            arch=arch,
        )), flush=True)
    f32 = {n: "*fp32" for n in ("o_ptr", "lse_ptr", "out_ptr", "out_lse_ptr")}
    for varlen in (False, True):
        print(json.dumps(compile_kernel(
            scale_reduce_kernel, f32 | {"indptr_ptr": "*i32" if varlen else "*fp32"},
            dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_P=64, VARLEN=varlen), arch=arch,
        )), flush=True)
    # The benchmark's page-streaming ceiling kernel runs only on a GPU: check it compiles too.
    bench_path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "kernels.py")
    spec = importlib.util.spec_from_file_location("kvfleet_bench_kernels", bench_path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stream = {"k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
              "sink_ptr": "*fp32"}
    print(json.dumps(compile_kernel(bench._make_stream_kernel(triton), stream,
                                    dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=64), arch=arch)), flush=True)
    pair = {n: "*fp32" for n in ("o_a_ptr", "lse_a_ptr", "o_b_ptr", "lse_b_ptr", "out_ptr", "out_lse_ptr")}
    print(json.dumps(compile_kernel(scale_reduce_pair_kernel, pair, dict(HEAD_DIM=128, HEAD_DIM_PAD=128), arch=arch)),
          flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
