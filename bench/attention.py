"""Decode step time of DistAttention against each engine's own attention: the builtin engine's and vLLM's.

Builtin engine: its default attention (BuiltinOptions.attention) is chosen on these figures:
DistAttention (micro-attention partials merged by ScaleReduce, kvfleet.kernels: the C decode kernel
and the torch backend's prefill on the CPU) against torch's fused SDPA, one decode step of the tiny
model (float32) at batch 1 and 16 and contexts of 256 and 2048 tokens.

vLLM (`vllm` rows, skipped where vLLM is not installed): the tiny model served by two vLLM engines,
one with vLLM's own CPU attention and one with kvfleet's DistAttention backend
(VLLMOptions(attention="distattention"), engines/vllm/attention.py), a batch of requests decoding
together at the case's context; a step is the time between two tokens of one request (median over
the requests and steps). Target: DistAttention's step within 1.3x vLLM's at batch 16 and 2048 tokens.
Beside them (`cpu_decode_op`), the decode attention op alone at that size: vLLM's CPU kernel,
kvfleet's C kernel (kvfleet.kernels.cpu_native) and the torch backend's gather-and-matmul, which
is where DistAttention's time went before the C kernel.

Paths are loaded side by side and measured in alternating rounds (median of the rounds), so load
from elsewhere on a shared machine slows both alike. Last line: one JSON object, ms per step of each
path and their ratio per case.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402

PATHS = ("sdpa", "distattention")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small cases, few steps (the test suite's run)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-vllm", action="store_true", help="the builtin engine's rows only")
    parser.add_argument("--vllm-only", action="store_true", help="the vLLM rows only")
    args = parser.parse_args()
    cases = [(1, 256), (16, 256), (1, 2048), (16, 2048)]
    if args.quick:
        cases, args.steps, args.rounds = [(1, 64), (4, 64)], 2, 1

    import torch  # after argparse, so --help is instant

    from kvfleet.worker.model.tiny import make_tiny

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"host: {platform.node()} ({cpu_model()}, {torch.get_num_threads()} torch threads), device: {device}, "
          f"torch {torch.__version__}", flush=True)
    results: dict[str, dict[str, float]] = {}
    summary: dict[str, Any] = {"cases": results}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(Path(tmp) / "tiny")
        if not args.vllm_only:
            builtin_rows(args, cases, model_dir, device, results)
        if not args.skip_vllm:
            if importlib.util.find_spec("vllm") is None:
                print("vllm: not installed (bash scripts/install-vllm.sh .venv), rows skipped", flush=True)
            else:
                vllm_cases = [(4, 128)] if args.quick else [(1, 256), (16, 256), (16, 2048)]
                summary["vllm"] = asyncio.run(vllm_rows(model_dir, vllm_cases, 8 if args.quick else 24,
                                                        1 if args.quick else 3))
                summary["cpu_decode_op"] = decode_op(*((4, 128) if args.quick else (16, 2048)), 3 if args.quick else 20)
    print(json.dumps(summary))


def builtin_rows(args: argparse.Namespace, cases: list[tuple[int, int]], model_dir: Path, device: Any,
                 results: dict[str, dict[str, float]]) -> None:
    """The builtin engine's two paths, one forward at a time (the module docstring)."""
    import torch

    from kvfleet.worker.engines.builtin.model import LlamaForward, PagedKVCache, SeqBatchEntry, read_architecture

    arch = read_architecture(model_dir)
    models = {p: LlamaForward.load(model_dir, torch.float32, device, 4096, p) for p in PATHS}  # type: ignore[arg-type]
    for batch, context in cases:
        blocks_each = -(-(context + 1) // 16)
        cache = PagedKVCache(arch, blocks_each * batch, 16, torch.float32, device)
        entries = [SeqBatchEntry([3], context, tuple(range(i * blocks_each, (i + 1) * blocks_each)))
                   for i in range(batch)]
        samples: dict[str, list[float]] = {p: [] for p in PATHS}
        for path in PATHS:
            models[path].forward(entries, cache)  # warm-up
        for _ in range(args.rounds):
            for path in PATHS:
                started_s = time.perf_counter()
                for _ in range(args.steps):
                    models[path].forward(entries, cache)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                samples[path].append((time.perf_counter() - started_s) / args.steps * 1000)
        ms = {p: statistics.median(samples[p]) for p in PATHS}
        name = f"batch{batch}_context{context}"
        results[name] = {"sdpa_ms": round(ms["sdpa"], 3), "distattention_ms": round(ms["distattention"], 3),
                         "ratio": round(ms["distattention"] / ms["sdpa"], 3)}
        print(f"{name:24s} sdpa {ms['sdpa']:8.3f} ms/step   distattention {ms['distattention']:8.3f} ms/step   "
              f"ratio {results[name]['ratio']:.2f}", flush=True)


VLLM_TARGET_RATIO = 1.3   # DistAttention's decode step against vLLM's own at batch 16 and 2048 tokens


async def batch_step_ms(engine: Any, prompts: list[list[int]], params: Any, tag: str) -> float:
    """The prompts decoding together: the median time between two tokens of a request, past its first."""

    async def gaps(request_id: str, prompt: list[int]) -> list[float]:
        stamps = [time.perf_counter() async for _ in engine.generate(request_id, prompt, params)]
        return [b - a for a, b in zip(stamps[1:], stamps[2:])]

    every = await asyncio.gather(*(gaps(f"{tag}-{i}", p) for i, p in enumerate(prompts)))
    return statistics.median(g for request in every for g in request) * 1000


async def vllm_rows(model_dir: Path, cases: list[tuple[int, int]], decode_tokens: int, rounds: int) -> dict[str, Any]:
    """Both vLLM engines per case, started side by side, measured in alternating rounds after a
    warm-up round (which also fills each engine's prefix cache, so later rounds prefill nothing)."""
    from kvfleet.worker.engines import load_engine
    from kvfleet.worker.engines.base import EngineConfig, SamplingParams
    from kvfleet.worker.engines.vllm.options import VLLMOptions

    rows: dict[str, Any] = {}
    for batch, context in cases:
        config = EngineConfig(model_path=model_dir, kv_capacity_bytes=2 * batch * context * 2048, max_model_len=context,
                              max_num_seqs=batch, dtype="float32", prefix_caching=True)
        engines = {name: load_engine("vllm", config, VLLMOptions(attention=name)) for name in ("vllm", "distattention")}
        for engine in engines.values():
            await engine.start()
        prompts = [[1, *((13 * i + 7 * j) % 1900 + 5 for j in range(context - decode_tokens - 1))] for i in range(batch)]
        params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
        samples: dict[str, list[float]] = {name: [] for name in engines}
        try:
            for round_ in range(rounds + 1):
                for name in engines:
                    ms = await batch_step_ms(engines[name], prompts, params, f"{name}-{round_}")
                    if round_:   # round 0 warms up and caches the prompts
                        samples[name].append(ms)
        finally:
            for engine in engines.values():
                await engine.stop()
        own, ours = statistics.median(samples["vllm"]), statistics.median(samples["distattention"])
        name = f"batch{batch}_context{context}"
        rows[name] = {"vllm_ms": round(own, 3), "distattention_ms": round(ours, 3), "ratio": round(ours / own, 3)}
        verdict = ""
        if (batch, context) == (16, 2048):
            rows[name]["target_ratio"] = VLLM_TARGET_RATIO
            rows[name]["met"] = ours / own <= VLLM_TARGET_RATIO
            verdict = f"   target <= {VLLM_TARGET_RATIO}: {'met' if rows[name]['met'] else 'MISSED'}"
        print(f"vllm {name:19s} vLLM's attention {own:8.3f} ms/step   distattention {ours:8.3f} ms/step   "
              f"ratio {ours / own:.2f}{verdict}", flush=True)
    return rows


def decode_op(batch: int, context: int, repeats: int) -> dict[str, Any]:
    """The decode attention op alone at the tiny model's shapes (4 query heads, 2 KV heads, head_dim 64,
    float32, vLLM's CPU block of 128): vLLM's CPU kernel over its own layout against kvfleet's C kernel
    and the torch backend over vLLM's NHD layout (engines/vllm/attention.py), each the median of
    alternating rounds."""
    import torch
    from vllm import _custom_ops as ops

    from kvfleet.kernels import cpu_native, torch_backend
    from kvfleet.kernels._checks import micro_attention_decode_inputs
    from kvfleet.worker.engines.vllm.internals import cpu_attention_isa

    heads, kv_heads, dim, block = 4, 2, 64, 128
    per_seq = -(-context // block)
    blocks = batch * per_seq + 1
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, dim, generator=generator)
    table = (torch.randperm(blocks - 1, generator=generator)[: batch * per_seq] + 1).int().view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    own_cache = torch.randn(blocks, kv_heads, block, 2 * dim, generator=generator)
    key_cache, value_cache = own_cache.view(blocks, kv_heads, 2 * block, dim).chunk(2, dim=2)
    isa = cpu_attention_isa(torch.float32, block, dim, "auto")
    starts = torch.arange(batch + 1, dtype=torch.int32)
    plan = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lens, dtype=torch.float32,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")
    out = torch.empty(batch, heads, dim)
    rows = torch.randn(blocks, block, kv_heads, 2 * dim, generator=generator)
    keys, values = rows[..., :dim], rows[..., dim:]

    def vllm_kernel() -> None:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lens,
            scale=dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
            scheduler_metadata=plan, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    def kvfleet_c() -> None:
        cpu_native.decode(micro_attention_decode_inputs("torch", q, keys, values, table, lens))

    def torch_gather() -> None:
        torch_backend.decode(micro_attention_decode_inputs("torch", q, keys, values, table, lens))

    paths = {"vllm_kernel": vllm_kernel, "torch_backend": torch_gather}
    if cpu_native.status() == "native":
        paths["kvfleet_c"] = kvfleet_c
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()
    for _ in range(5):
        for name, fn in paths.items():
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            samples[name].append((time.perf_counter() - started) / repeats * 1000)
    ms = {name: round(statistics.median(v), 3) for name, v in samples.items()}
    result: dict[str, Any] = {"case": f"batch{batch}_context{context}", "cpu_native": cpu_native.status(),
                              **{f"{name}_ms": value for name, value in ms.items()}}
    print(f"decode op batch{batch}_context{context}: " + "   ".join(f"{name} {value:.3f} ms" for name, value in ms.items())
          + f"   (kvfleet's C kernel: {cpu_native.status()})", flush=True)
    return result


if __name__ == "__main__":
    main()
