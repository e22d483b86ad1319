"""Decode step time of the builtin engine's two attention paths, DistAttention against SDPA.

The engine's default attention (BuiltinOptions.attention) is chosen on these figures: DistAttention
(micro-attention partials merged by ScaleReduce, kvfleet.kernels; the torch backend on the CPU)
against torch's fused SDPA, one decode step of the tiny model (float32) at batch 1 and 16 and
contexts of 256 and 2048 tokens. Both paths are loaded side by side and measured in alternating
rounds (median of the rounds), so load from elsewhere on a shared machine slows both alike. Last
line: one JSON object, ms per step of each path and their ratio (distattention / sdpa) per case.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402

PATHS = ("sdpa", "distattention")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small cases, few steps (the test suite's run)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cases = [(1, 256), (16, 256), (1, 2048), (16, 2048)]
    if args.quick:
        cases, args.steps, args.rounds = [(1, 64), (4, 64)], 2, 1

    import torch  # after argparse, so --help is instant

    from kvfleet.worker.engines.builtin.model import LlamaForward, PagedKVCache, SeqBatchEntry, read_architecture
    from kvfleet.worker.model.tiny import make_tiny

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"host: {platform.node()} ({cpu_model()}, {torch.get_num_threads()} torch threads), device: {device}, "
          f"torch {torch.__version__}", flush=True)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(Path(tmp) / "tiny")
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
    print(json.dumps({"cases": results}))


if __name__ == "__main__":
    main()
