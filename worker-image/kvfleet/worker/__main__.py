"""`python -m kvfleet.worker`: the worker pod's entrypoint (the `kvfleet/worker` image).

Configured by the environment the operator puts in the pod (operator/kvfleet/operator/resources.py);
every variable has a flag of the same meaning so the worker also runs by hand:

    python -m kvfleet.worker --engine builtin --model-path /models/tiny --model-name tiny --port 8000

Without POD_NAME (not in a pod) it serves but writes no KV-load report.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfleet.api.reports import ANNOTATION
from kvfleet.worker.disaggregation import CACHINGS, PDConfig
from kvfleet.worker.distkv.creditors import Creditor, Creditors, PoolPlanCreditors, StaticCreditors
from kvfleet.worker.migration.source import LAYOUTS
from kvfleet.worker.migration.transport import split_address

if TYPE_CHECKING:
    from kvfleet.worker.elastic.options import MemoryOptions
    from kvfleet.worker.engines.base import Engine
    from kvfleet.worker.engines.builtin.options import BuiltinOptions
    from kvfleet.worker.engines.vllm.options import VLLMOptions
    from kvfleet.worker.reporter import WriteReport

# Pending connections the listening socket queues (the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 4096


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m kvfleet.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default=env("KVFLEET_ENGINE", "builtin"), choices=("builtin", "vllm"))
    parser.add_argument("--model-path", type=Path, default=env("KVFLEET_MODEL_PATH"),
                        help="HF-format model directory (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--model-name", default=env("KVFLEET_MODEL_NAME"),
                        help="the name clients put in `model` (default: the directory's name)")
    parser.add_argument("--host", default=env("POD_IP", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(env("KVFLEET_PORT", "8000")))
    parser.add_argument("--migration-port", type=int, default=int(env("KVFLEET_MIGRATION_PORT", "8001")),
                        help="where migrations come in (docs/migration.md); 0 picks a free port")
    parser.add_argument("--kv-capacity-bytes", type=int, default=_env_int("KVFLEET_KV_CAPACITY_BYTES"),
                        help="the KV cache's size (vLLM: not with --memory-budget-bytes, which sizes it)")
    parser.add_argument("--max-model-len", type=int, default=_env_int("KVFLEET_MAX_MODEL_LEN"))
    parser.add_argument("--max-num-seqs", type=int, default=int(env("KVFLEET_MAX_NUM_SEQS", "64")))
    parser.add_argument("--dtype", default=env("KVFLEET_DTYPE"),
                        help="float32, bfloat16 or float16 (default: float32 on the CPU, bfloat16 on a GPU)")
    parser.add_argument("--min-step-s", type=float, default=float(env("KVFLEET_MIN_STEP_S", "0")),
                        help="a floor on one engine step's time, emulating a slower accelerator (tests, demos)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                        default=env("KVFLEET_PREFIX_CACHING", "0") == "1",
                        help="keep finished requests' KV by prompt prefix (context caching; vLLM: its own prefix caching)")
    parser.add_argument("--attention", default=env("KVFLEET_ATTENTION", "sdpa"), choices=("sdpa", "distattention"),
                        help="DistAttention partials merged by ScaleReduce (kvfleet.kernels), or the engine's own: torch "
                             "SDPA in the builtin engine, vLLM's backend for the platform with --engine vllm")
    parser.add_argument("--memory-budget-bytes", type=int, default=_env_int("KVFLEET_MEMORY_BUDGET_BYTES"),
                        help="one pool for KV cache and activations (docs/elastic-memory.md); "
                             "static split unless --elastic-memory")
    parser.add_argument("--elastic-memory", action=argparse.BooleanOptionalAction,
                        default=env("KVFLEET_ELASTIC_MEMORY", "0") == "1",
                        help="KV and activations take what each step needs from the budget (eLLM)")
    parser.add_argument("--memory-chunk-bytes", type=int, default=_env_int("KVFLEET_MEMORY_CHUNK_BYTES"),
                        help="the memory pool's unit (default: elastic.options.DEFAULT_CHUNK_BYTES)")
    parser.add_argument("--cpu-buffer-bytes", type=int, default=_env_int("KVFLEET_CPU_BUFFER_BYTES") or 0,
                        help="host memory for the KV of waiting or preempted requests (elastic memory)")
    parser.add_argument("--ttft-slo-ms", type=float, default=_env_float("KVFLEET_TTFT_SLO_MS"),
                        help="a TTFT objective that scales the CPU buffer (elastic memory, eLLM Algorithm 2)")
    parser.add_argument("--tpot-slo-ms", type=float, default=_env_float("KVFLEET_TPOT_SLO_MS"),
                        help="a TPOT objective that scales the CPU buffer (elastic memory, eLLM Algorithm 2)")
    parser.add_argument("--lend-cap-bytes", type=int, default=_env_int("KVFLEET_LEND_CAP_BYTES") or 0,
                        help="lend up to this much free KV to other workers' requests (DistKV, docs/distkv.md; vLLM: with "
                             "--attention distattention)")
    parser.add_argument("--distkv", action=argparse.BooleanOptionalAction, default=env("KVFLEET_DISTKV", "0") == "1",
                        help="builtin engine: borrow KV blocks from other workers for a request larger than this "
                             "worker's cache (needs --attention distattention); creditors from the LLMPool's status")
    parser.add_argument("--distkv-peers", default=env("KVFLEET_DISTKV_PEERS", ""),
                        help="with --distkv outside the operator: creditors as name=host:port,... (best first)")
    parser.add_argument("--role", default=env("KVFLEET_ROLE") or None, choices=("prefill", "decode"),
                        help="this worker's role in a disaggregated pool (docs/disaggregation.md); none: colocated")
    parser.add_argument("--pd-caching", default=env("KVFLEET_PD_CACHING") or "full", choices=CACHINGS,
                        help="disaggregated pools: none, prefill (cache at P), decode (at P and D), full (D sends KV back)")
    parser.add_argument("--pd-layout", default=env("KVFLEET_PD_LAYOUT") or "by-request-aggregated", choices=LAYOUTS,
                        help="disaggregated pools: how a hand-over's KV crosses (one send, or one per layer, K/V, block)")
    parser.add_argument("--report-interval-s", type=float, default=float(env("KVFLEET_REPORT_INTERVAL_S", "5")))
    parser.add_argument("--log-level", default=env("KVFLEET_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    if args.model_path is None:
        parser.error("no model: set KVFLEET_MODEL_PATH or --model-path")
    if not (args.model_path / "config.json").is_file():
        parser.error(f"{args.model_path} holds no config.json: point --model-path at an HF-format model directory")
    for name in ("kv_capacity_bytes", "memory_budget_bytes", "memory_chunk_bytes", "ttft_slo_ms", "tpot_slo_ms"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.cpu_buffer_bytes < 0:
        parser.error("--cpu-buffer-bytes must not be negative")
    if args.lend_cap_bytes < 0:
        parser.error("--lend-cap-bytes must not be negative")
    if args.distkv and args.attention != "distattention":
        parser.error("--distkv needs --attention distattention (KVFLEET_ATTENTION): remote KV is attended where it lives")
    try:
        args.distkv_peers = parse_peers(args.distkv_peers)
    except ValueError as err:
        parser.error(f"--distkv-peers: {err}")
    if args.engine == "vllm":
        # Refused rather than ignored, so a pool never believes it runs what it does not.
        if args.lend_cap_bytes and args.attention != "distattention":
            parser.error("--lend-cap-bytes needs --attention distattention with vLLM: a borrower's queries are "
                         "answered with kvfleet's kernels over the lent blocks")
        if (args.lend_cap_bytes or args.distkv) and args.elastic_memory:
            parser.error("--lend-cap-bytes, --distkv and --elastic-memory: DistKV lending and borrowing need a static "
                         "KV cache")
        if args.distkv and args.prefix_caching:
            parser.error("--distkv and --prefix-caching with vLLM: a borrowing vLLM worker moves a request's own "
                         "blocks to lenders, never shared prefix blocks")
        buffer = [flag for flag, value in (("--cpu-buffer-bytes", args.cpu_buffer_bytes), ("--ttft-slo-ms", args.ttft_slo_ms),
                                           ("--tpot-slo-ms", args.tpot_slo_ms)) if value]
        if buffer and not args.elastic_memory:
            parser.error(f"{', '.join(buffer)} needs --elastic-memory with vLLM: a static split recomputes what vLLM "
                         "preempts, and the objectives scale the CPU buffer")
        if args.kv_capacity_bytes is not None and args.memory_budget_bytes is not None:
            parser.error("--kv-capacity-bytes and --memory-budget-bytes: with vLLM the memory budget sizes the KV "
                         "cache itself; give one")
    if args.elastic_memory and args.memory_budget_bytes is None:
        parser.error("--elastic-memory needs --memory-budget-bytes (KVFLEET_MEMORY_BUDGET_BYTES): the pool to share")
    args.model_name = args.model_name or args.model_path.name
    return args


def memory_options(args: argparse.Namespace) -> MemoryOptions | None:
    """The memory budget's settings, from its flags (either engine); None without a budget."""
    from kvfleet.worker.elastic.options import DEFAULT_CHUNK_BYTES, MemoryOptions

    if args.memory_budget_bytes is None:
        return None
    return MemoryOptions(
        budget_bytes=args.memory_budget_bytes, elastic=args.elastic_memory, cpu_buffer_bytes=args.cpu_buffer_bytes,
        ttft_slo_s=args.ttft_slo_ms / 1000 if args.ttft_slo_ms else None,
        tpot_slo_s=args.tpot_slo_ms / 1000 if args.tpot_slo_ms else None,
        chunk_bytes=args.memory_chunk_bytes or DEFAULT_CHUNK_BYTES)


def builtin_options(args: argparse.Namespace) -> BuiltinOptions:
    """The builtin engine's own settings, from its flags."""
    from kvfleet.worker.distkv.options import DistKVOptions
    from kvfleet.worker.engines.builtin.options import BuiltinOptions

    return BuiltinOptions(attention=args.attention, memory=memory_options(args),
                          distkv=DistKVOptions(lend_cap_bytes=args.lend_cap_bytes, borrow=args.distkv))


def vllm_options(args: argparse.Namespace) -> VLLMOptions:
    """The vLLM engine's own settings, from its flags (parse_args has refused those it does not run)."""
    from kvfleet.worker.distkv.options import DistKVOptions
    from kvfleet.worker.engines.vllm.options import VLLMOptions

    return VLLMOptions(memory=memory_options(args), attention="distattention" if args.attention == "distattention" else "vllm",
                       distkv=DistKVOptions(lend_cap_bytes=args.lend_cap_bytes, borrow=args.distkv))


def parse_peers(text: str) -> list[tuple[str, str]]:
    """`name=host:port,...` -> [(name, address)], in order."""
    peers = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, address = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{item!r} is not name=host:port")
        split_address(address)  # the transport's own parse: a peer it could not dial is refused here
        peers.append((name, address))
    return peers


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported here so `--help` and argument errors are instant (torch and transformers are not).
    import torch
    from aiohttp import web

    from kvfleet.api.incluster import SecretReader
    from kvfleet.serving.credentials import PoolCredentials
    from kvfleet.worker.agent import Agent, AgentConfig
    from kvfleet.worker.engines import EngineConfig, load_engine
    from kvfleet.worker.text import Tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    engine = load_engine(args.engine, EngineConfig(
        model_path=args.model_path, kv_capacity_bytes=args.kv_capacity_bytes, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, dtype=dtype, device=device, min_step_s=args.min_step_s,
        prefix_caching=args.prefix_caching), builtin_options(args) if args.engine == "builtin" else vllm_options(args))
    pod_name, namespace = os.environ.get("POD_NAME"), os.environ.get("POD_NAMESPACE")
    pod_uid, pool = os.environ.get("POD_UID"), os.environ.get("KVFLEET_POOL")
    writer = report_writer(pod_name, namespace, pod_uid, pool)
    credentials = PoolCredentials.from_env(os.environ, SecretReader)
    creditors = _creditors(args, pod_name, namespace, pool) if args.distkv else None
    agent = Agent(AgentConfig(model_name=args.model_name, credentials=credentials, report_interval_s=args.report_interval_s,
                              migration_host=args.host, migration_port=args.migration_port, creditors=creditors,
                              disaggregation=PDConfig(args.role, args.pd_caching, args.pd_layout)),
                  engine, Tokenizer(args.model_path), writer)
    if isinstance(creditors, PoolPlanCreditors):
        agent.run_when_ready(follow_pool_plan(creditors, engine))
    if pod_name and namespace and pool and credentials is not None:
        from kvfleet.worker.migration.watcher import KubernetesMigrationAPI, MigrationWatcher, WatcherConfig

        watcher = MigrationWatcher(WatcherConfig(pod_name, namespace, pool, http_port=args.port,
                                                 migration_port=args.migration_port or 8001),
                                   KubernetesMigrationAPI(namespace, pool), agent.migrate)
        agent.run_when_ready(watcher.run)
    else:
        logging.getLogger("kvfleet.worker").info("no pod, pool or pool token: this worker executes no KVMigrations")
    web.run_app(agent.app(), host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=30,
                # A burst of clients (bench/load.py: 1,000 at once) overflows aiohttp's default backlog of 128:
                # each dropped SYN costs its client a second or more.
                backlog=LISTEN_BACKLOG)
    return 0


def follow_pool_plan(creditors: PoolPlanCreditors, engine: Engine) -> Callable[[], Coroutine[Any, Any, None]]:
    """What keeps a borrowing worker on its pool's DistKV plan once it is ready: its creditor candidates
    read every few seconds, and DGFM's recalls in the same status carried out by its engine (docs/distkv.md)."""
    borrowing = engine.capabilities.borrowing
    if borrowing is not None:
        creditors.on_recall, creditors.owed = borrowing.recall, borrowing.borrowed_bytes
    return creditors.run


def report_writer(pod_name: str | None, namespace: str | None, pod_uid: str | None, pool: str | None,
                  ) -> WriteReport | None:
    """Where this worker's KV-load reports go: its KVLoad in a pod the operator made; its pod's annotation
    in a pod made without the uid and pool (docs/worker.md); nowhere outside a pod."""
    from kvfleet.worker.reporter import kvload_writer, pod_annotation_writer

    log = logging.getLogger("kvfleet.worker")
    if not (pod_name and namespace):
        log.info("not in a pod (no POD_NAME/POD_NAMESPACE): no KV-load reports")
        return None
    if pod_uid and pool:
        return kvload_writer(pod_name, namespace, pod_uid, pool)
    log.warning("no POD_UID or KVFLEET_POOL: the KV-load report goes in the pod's annotation %s", ANNOTATION)
    return pod_annotation_writer(pod_name, namespace)


def _creditors(args: argparse.Namespace, pod_name: str | None, namespace: str | None, pool: str | None) -> Creditors:
    """Whom a borrowing worker asks: the peers given, or the operator's plan in its pool's status."""
    if args.distkv_peers:
        # No room figure without the operator: each is asked, and a refusal says there is none.
        return StaticCreditors([Creditor(name, address, 1 << 62) for name, address in args.distkv_peers])
    if not (pod_name and namespace and pool):
        raise SystemExit("--distkv needs the pool's plan (POD_NAME, POD_NAMESPACE, KVFLEET_POOL) or --distkv-peers")
    from kvfleet.api.incluster import PoolStatusReader

    return PoolPlanCreditors(PoolStatusReader(namespace, pool), pod_name)


# vLLM's engine starts processes that import this module again: only the real entrypoint may run it.
if __name__ == "__main__":
    sys.exit(main())
