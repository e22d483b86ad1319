#!/usr/bin/env python3
"""Every GPU measurement kvfleet needs, in one command that fits a short GPU lease.

GPU machines come here rarely, for about a quarter of an hour in all (their start included), with
their own torch, Triton and transformers and no package index. So this script runs everything the
docs quote as a GPU figure, each part in its own process (a fatal CUDA error, such as an illegal
memory access, poisons only that process's context), each under its own time limit, most basic
first, and keeps going when one part fails:

| part | what | figures |
|---|---|---|
| kernel_tests | `KVFLEET_KERNELS_ON_GPU=1 pytest tests/kernels`: compiled kernels, bf16 included | passed / failed |
| crash_hunt | `bench/kernels.py --crash-hunt`: each op of the row that once crashed, alone | which op failed |
| kernels | `bench/kernels.py --quick`: decode micro-attention against HBM peak, merge share, SDPA | fractions |
| engine | `bench/gpu_engine.py`: greedy equal to transformers, decode and prefill tokens/s | tok/s, ratios |
| elastic | `bench/elastic.py --gpu`: CUDA VMM pool against a static split, map/unmap, §5.1 | batch, TPOT |
| distkv | `bench/distkv.py --gpu`: a decode step with borrowed KV against all local | ratio |
| migration | `bench/migration.py --gpu`: two worker processes on the GPU, KV against token moves | downtime |

The parts that serve a model share one (a random-weight Llama 3.2 1B shape, bench/_shapes.py), built
once in the background while the kernel parts run.

    python bench/gpu.py                  # on the GPU machine, from the repository root (about 6 minutes on an H200)
    python bench/gpu.py --dry-run        # here: every part at toy sizes on the CPU (make test runs it)

First line: the device. The log of every part goes to OUT/gpu.log and the summary to OUT/gpu.json
(OUT: $OUT where the device tool sets it, else .cache/gpu). Last line: one JSON object (`device`,
`parts`, each with status, seconds and the part's own JSON line, and `targets`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# The model the serving parts share: one identity (bench/_shapes.py's LLAMA_POSITIONS), so it is built once.
MODEL_SHAPE = "llama-1b"


@dataclass(frozen=True)
class Part:
    name: str
    gpu: list[str]
    dry: list[str]
    gpu_timeout_s: float
    needs_model: bool = False
    env: dict[str, str] = field(default_factory=dict)


def parts(model_dir: Path) -> list[Part]:
    py = sys.executable
    model = ["--model-dir", str(model_dir)]
    return [
        Part("kernel_tests", [py, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider", "-n", "4"],
             [py, "-m", "pytest", "tests/kernels/test_package.py", "-q", "-p", "no:cacheprovider"], 90,
             env={"KVFLEET_KERNELS_ON_GPU": "1"}),
        Part("crash_hunt", [py, "bench/kernels.py", "--crash-hunt"], [py, "bench/kernels.py", "--crash-hunt", "--cpu-smoke"], 90),
        Part("kernels", [py, "bench/kernels.py", "--quick"], [py, "bench/kernels.py", "--cpu-smoke"], 75),
        # The dry run's engine part is bench/gpu_engine.py's quick run, which tests/worker/test_bench_gpu.py
        # checks from this part's output.
        Part("engine", [py, "bench/gpu_engine.py", *model], [py, "bench/gpu_engine.py", "--quick"], 90, needs_model=True),
        # The dry runs leave vLLM out as the GPU machines do (they carry no vLLM): the dry run rehearses
        # what runs there, and the vLLM rows have quick runs of their own (tests/worker/test_bench_*.py).
        # Its dry run is smaller than the quick run that tests/worker/test_bench_elastic.py checks figure by
        # figure: one context, a smaller batch, and no online part (the GPU form has none either).
        Part("elastic", [py, "bench/elastic.py", "--gpu", *model],
             [py, "bench/elastic.py", "--quick", "--skip-vllm", "--contexts", "768", "--max-num-seqs", "16", "--skip-online"],
             80, needs_model=True),
        Part("distkv", [py, "bench/distkv.py", "--gpu", *model],
             [py, "bench/distkv.py", "--quick", "--skip-context", "--skip-vllm"], 50, needs_model=True),
        # The dry run's two-process form with a deadline that cuts its second round and the throughput
        # section, as the GPU form's --deadline-s may: tests/worker/test_bench_gpu.py checks this part's
        # output as that form's test (one ~20 s run of that form in `make test`, not two).
        Part("migration", [py, "bench/migration.py", "--gpu", *model],
             [py, "bench/migration.py", "--quick", "--processes", "--no-vllm", "--repeat", "2", "--deadline-s", "1"], 80,
             needs_model=True),
    ]


def device_line(dry_run: bool) -> str:
    """The machine, without touching CUDA in this process (a part's fatal error must not reach it)."""
    import torch

    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        versions += ", no triton"
    host = f"{platform.node()}, {os.cpu_count()} CPUs, python {platform.python_version()}, {versions}"
    if dry_run or not shutil.which("nvidia-smi"):
        return f"device: cpu (dry run: toy sizes, the numbers mean nothing); host: {host}"
    query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    return f"device: {query.stdout.strip() or 'unknown GPU'}; host: {host}"


def last_json(lines: list[str]) -> dict[str, Any] | None:
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def pytest_counts(lines: list[str]) -> dict[str, int] | None:
    """pytest's closing line ("3 passed, 1 skipped in 2.0s") as counts."""
    for line in reversed(lines):
        if " in " in line and any(word in line for word in ("passed", "failed", "error")):
            counts = {}
            for chunk in line.strip("= ").split(" in ")[0].split(","):
                number, _, word = chunk.strip().partition(" ")
                if number.isdigit():
                    counts[word.rstrip("s") if word.endswith("errors") else word] = int(number)
            return counts
    return None


def run_part(part: Part, argv: list[str], timeout_s: float, env: dict[str, str], log: TextIO) -> dict[str, Any]:
    """Run one part, echoing its output prefixed with its name; its status, time and last JSON line."""
    started = time.monotonic()
    header = f"== {part.name}: {' '.join(argv)} (limit {timeout_s:.0f} s)"
    print(header, flush=True)
    log.write(header + "\n")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            log.write(line + "\n")
            log.flush()
            print(f"[{part.name}] {line[:400]}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        status = "ok" if proc.wait(timeout=timeout_s) == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the part and every process it started
        proc.wait()
        status = f"timed out after {timeout_s:.0f} s"
    reader.join(timeout=10)
    result: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - started, 1), "summary": last_json(lines)}
    if part.name == "kernel_tests":
        result["summary"] = pytest_counts(lines)
    if not status == "ok":
        result["tail"] = lines[-8:]
    print(f"== {part.name}: {status} in {result['seconds']} s", flush=True)
    return result


def targets(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's thresholds, read off the parts' own summaries (None where a part gave none)."""
    def summary(name: str) -> dict[str, Any]:
        value = results.get(name, {}).get("summary")
        return value if isinstance(value, dict) else {}

    tests, hunt, kernels, engine = summary("kernel_tests"), summary("crash_hunt"), summary("kernels"), summary("engine")
    elastic, distkv, migration = summary("elastic"), summary("distkv"), summary("migration")
    kernel_targets = kernels.get("targets") or {}
    return {
        "kernel_tests_pass": (tests.get("passed", 0) > 0 and not tests.get("failed") and not tests.get("error"))
        if tests else None,
        "crash_hunt_failed_ops": hunt.get("failed"),
        "decode_hbm_fraction_ge_0.85_at_16k_plus": (min(v for k, v in kernels["hbm_fraction_of_peak_min"].items()
                                                        if int(k) >= 16384) >= 0.85
                                                    if any(int(k) >= 16384 for k in kernels.get("hbm_fraction_of_peak_min", {}))
                                                    else None),
        "merge_share_le_0.05_at_16k_plus": kernel_targets.get("merge_share_le_0.05_at_16k_plus"),
        "engine": engine.get("targets"),
        "elastic_batch_ratio": elastic.get("batch_ratio"),
        "elastic_low_load_tpot_ratio": elastic.get("low_load_tpot_ratio"),
        "distkv_borrowed_over_local_step": distkv.get("borrowed_over_local_step"),
        "migration_kv_flatness": migration.get("kv_flatness"),
        "migration_kv_below_token": migration.get("kv_below_token"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every part at toy sizes on the CPU")
    parser.add_argument("--out", type=Path, help="where gpu.log and gpu.json go (default $OUT, else .cache/gpu)")
    parser.add_argument("--only", help="comma-separated parts to run (default: all)")
    parser.add_argument("--model-dir", type=Path, help="the shared model (default: under --out's scratch)")
    parser.add_argument("--budget-s", type=float, default=560.0,
                        help="the whole run's limit: a part gets what is left, one with under 20 s is skipped (default 560)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    out = args.out or Path(os.environ.get("OUT") or ROOT / ".cache" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    print(device_line(args.dry_run), flush=True)
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "kvfleet-gpu"
    model_dir = args.model_dir or scratch / MODEL_SHAPE
    selected = [p for p in parts(model_dir) if not args.only or p.name in args.only.split(",")]
    if args.only and len(selected) != len(args.only.split(",")):
        parser.error(f"--only names parts of {', '.join(p.name for p in parts(model_dir))}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / d) for d in ("operator", "worker-image", "kernels")]
                                        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.pop("TRITON_INTERPRET", None)  # the dry run's parts set it where they need it
    builder = None
    if not args.dry_run and any(p.needs_model for p in selected):
        # Writing ~1B parameters takes tens of seconds of CPU: overlap it with the kernel parts.
        code = ("import sys; sys.path.insert(0, 'bench'); from _shapes import shape; "
                "from kvfleet.worker.model.tiny import make_tiny; "
                f"make_tiny({str(model_dir)!r}, seed=0, spec=shape({MODEL_SHAPE!r}, 0))")
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        builder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
        print(f"building the shared {MODEL_SHAPE} model at {model_dir} in the background", flush=True)
    results: dict[str, dict[str, Any]] = {}

    def write_summary() -> dict[str, Any]:
        # After every part, so a run stopped from outside still leaves what it measured.
        summary = {"device": device_line(args.dry_run).removeprefix("device: ").split(";")[0], "dry_run": args.dry_run,
                   "parts": results, "targets": targets(results)}
        (out / "gpu.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary

    with open(out / "gpu.log", "w") as log:
        for part in selected:
            left_s = deadline - time.monotonic()
            if not args.dry_run and left_s < 20:
                results[part.name] = {"status": f"skipped: {left_s:.0f} s left of --budget-s", "seconds": 0.0,
                                      "summary": None}
                print(f"== {part.name}: {results[part.name]['status']}", flush=True)
                continue
            if part.needs_model and builder is not None:
                started = time.monotonic()
                if builder.wait() != 0:
                    print(f"the model build failed (exit {builder.returncode}); the parts build it themselves", flush=True)
                print(f"(waited {time.monotonic() - started:.0f} s for the model)", flush=True)
                builder = None
            argv = part.dry if args.dry_run else part.gpu
            if part.name == "kernels" and not args.dry_run and (results.get("crash_hunt", {}).get("summary") or {}).get(
                    "failed") and any(step in ("decode", "decode_graph", "stream", "stream_graph", "sdpa_sliced",
                                               "sdpa_sliced_graph", "setup")
                                      for step in results["crash_hunt"]["summary"]["failed"]):
                # An op the bench itself runs failed at the big row: keep the rows that can run.
                argv = [*argv, "--max-kv-gib", "4"]
            limit_s = 600 if args.dry_run else min(part.gpu_timeout_s, deadline - time.monotonic())
            results[part.name] = run_part(part, argv, limit_s, env if args.dry_run else env | part.env, log)
            write_summary()
    summary = write_summary()
    print(f"{'part':14s} {'status':28s} {'seconds':>8s}")
    for name, result in results.items():
        print(f"{name:14s} {result['status']:28s} {result['seconds']:8.1f}")
    for name, value in summary["targets"].items():
        print(f"  {name}: {value}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
