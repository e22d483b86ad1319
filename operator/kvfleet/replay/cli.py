"""`kvfleet replay`: send a trace slice through a pool's router and record what the pool did.

The simulator predicts how many GPUs a trace needs; this runs the trace on a real pool (the local
control plane or any cluster a kubeconfig reaches) so the prediction can be checked: each request
becomes a streamed completion sent at its (scaled) arrival time, while the pool's status, worker
pods and KVMigrations are watched through the API server. The record (kvfleet.replay.record) holds
the billed GPU-seconds, GPUs in use against the fluid bound, migrations by mode and phase, latency
percentiles and whether every stream came back whole; `make demo` is this plus a live table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from kvfleet.api.models import SchedulingSpec
from kvfleet.replay.observe import PoolObserver
from kvfleet.replay.record import Record, build_record, write_record
from kvfleet.replay.streams import Clock, Stream, run_stream
from kvfleet.sim import bundled
from kvfleet.sim.traces import TraceError, TraceRequest, read_trace, slice_trace

DEFAULT_TRACE = bundled.CONV
POOL_POLICIES = tuple(get_args(SchedulingSpec.model_fields["policy"].annotation))


@dataclass(frozen=True)
class Shape:
    """How trace requests are fitted to the pool: thinned, their lengths scaled and capped."""

    every: int = 1
    prompt_scale: float = 1.0
    output_scale: float = 1.0
    max_request_tokens: int | None = None  # prompt + output; a prompt gets at most half of it

    def apply(self, requests: list[TraceRequest]) -> list[TraceRequest]:
        out = []
        for r in requests[::self.every]:
            prompt = max(1, round(r.prompt_tokens * self.prompt_scale))
            output = max(1, round(r.output_tokens * self.output_scale))
            if self.max_request_tokens is not None:
                prompt = min(prompt, self.max_request_tokens // 2)
                output = min(output, self.max_request_tokens - prompt)
            out.append(TraceRequest(r.request_id, r.arrival_s, prompt, output))
        return out


@dataclass
class Progress:
    """What an `on_tick` callback (the demo's live table) sees while the replay runs."""

    streams: list[Stream]
    total: int
    observer: PoolObserver
    clock: Clock
    draining: bool = False


class UsageError(ValueError):
    """Something about the arguments or the pool that makes the replay impossible; exit 2."""


def default_trace() -> Path:
    """The Azure conversation trace: from $KVFLEET_TRACES if set, else the copy kvfleet ships."""
    return bundled.trace_path(DEFAULT_TRACE)


def parse_window(text: str) -> tuple[float, float]:
    try:
        start, duration = (float(x) for x in text.split(":"))
    except ValueError:
        raise UsageError(f"--window {text!r}: expected START:DURATION in seconds") from None
    if start < 0 or duration <= 0:
        raise UsageError(f"--window {text!r}: START must be >= 0 and DURATION > 0")
    return start, duration


def replay(observer: PoolObserver, router_url: str, model: str, requests: list[TraceRequest], time_scale: float,
           *, drain_timeout_s: float, min_workers: int, on_tick: Callable[[Progress], None] | None = None,
           tick_s: float = 4.0) -> tuple[list[Stream], float]:
    """Send `requests` at arrival_s / time_scale, wait for every stream, then for the pool to drain
    to its floor (or `drain_timeout_s`); returns the streams and the end of the record's window."""
    clock = observer.clock
    streams: list[Stream] = []
    observer.in_flight = lambda: sum(1 for s in list(streams) if not s.done.is_set())
    progress = Progress(streams, len(requests), observer, clock)
    last_tick = clock.now_s()

    def tick() -> None:
        nonlocal last_tick
        if on_tick is not None and clock.now_s() - last_tick >= tick_s:
            last_tick = clock.now_s()
            on_tick(progress)

    for request in requests:
        while (wait_s := request.arrival_s / time_scale - clock.now_s()) > 0:
            time.sleep(min(wait_s, 0.2))
            tick()
        stream = Stream(request, max_tokens=request.output_tokens)
        streams.append(stream)
        threading.Thread(target=run_stream, args=(router_url, model, stream, clock), daemon=True).start()
    while not all(s.done.is_set() for s in streams):
        time.sleep(0.2)
        tick()
    progress.draining = True
    drain_until = clock.now_s() + drain_timeout_s
    while clock.now_s() < drain_until:
        samples = observer.samples
        live_pods = [p for p in observer.pod_lives() if p.gone_s is None]
        if samples and samples[-1].gpus_in_use == 0 and len(live_pods) <= min_workers:
            break
        time.sleep(0.5)
        tick()
    return streams, clock.now_s()


class _Bar:
    """A tqdm bar over streams finished (or a line every 10 s where tqdm is missing); nothing if not enabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        self.enabled = enabled
        self.last_line_s = 0.0
        if enabled:
            with contextlib.suppress(ImportError):
                import importlib

                self.bar = importlib.import_module("tqdm").tqdm(total=total, unit="stream", file=sys.stderr,
                                                                 dynamic_ncols=True, leave=False)

    def __call__(self, p: Progress) -> None:
        done = sum(1 for s in p.streams if s.done.is_set())
        sample = p.observer.samples[-1] if p.observer.samples else None
        state = (f"sent {len(p.streams)}/{p.total}, GPUs in use {sample.gpus_in_use if sample else '?'}, "
                 f"workers {sample.workers if sample else '?'}, moves {len(p.observer.migrations)}"
                 + (", draining" if p.draining else ""))
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(state, refresh=True)
        elif self.enabled and p.clock.now_s() - self.last_line_s >= 10:
            self.last_line_s = p.clock.now_s()
            print(f"[{p.clock.now_s():5.0f}s] finished {done}/{p.total}; {state}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", required=True, help="the LLMPool to replay through")
    parser.add_argument("--namespace", "-n", default="default", help="the pool's namespace (default)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--router-url", default=None,
                        help="the pool's router, e.g. http://127.0.0.1:8000 after `kubectl port-forward "
                             "svc/POOL-router 8000` (default: the router pod's IP, reachable on the local cluster)")
    parser.add_argument("--trace", type=Path, default=None,
                        help=f"a trace file (default: {DEFAULT_TRACE} from $KVFLEET_TRACES, else the copy kvfleet ships)")
    parser.add_argument("--window", default="0:60", metavar="START:DURATION",
                        help="the slice of the trace replayed, in trace seconds (0:60)")
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                        help="replay X times as fast as the trace's clock (1)")
    parser.add_argument("--every", type=int, default=1, metavar="N", help="send every N-th request of the slice (1)")
    parser.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt lengths by this (1)")
    parser.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths by this (1)")
    parser.add_argument("--max-request-tokens", type=int, default=None, metavar="N",
                        help="cap prompt + output at N tokens, a prompt at N/2 (for a model of small context)")
    parser.add_argument("--policy", default=None,
                        help="schedule the pool with this policy during the replay (restored afterwards)")
    parser.add_argument("--model", default=None, help="model name sent to the router (default: the pool's)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for record.json, sent.csv, speed-profile.json (default: replay-POOL-TIME/)")
    parser.add_argument("--drain-timeout-s", type=float, default=None,
                        help="after the last stream, wait this long at most for the pool to scale back to its "
                             "floor (default: the pool's scale-down delay + 60 s)")
    parser.add_argument("--json", action="store_true", help="print the record's figures as one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def prepare(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    """The requests to send and the window's label, or UsageError."""
    trace = args.trace or default_trace()
    if not args.time_scale > 0:  # written so that NaN is refused too
        raise UsageError("--time-scale must be positive")
    if args.policy is not None and args.policy not in POOL_POLICIES:
        raise UsageError(f"--policy {args.policy!r}: an LLMPool's policy is one of {', '.join(POOL_POLICIES)}")
    if args.every < 1:
        raise UsageError("--every must be at least 1")
    if args.prompt_scale <= 0 or args.output_scale <= 0:
        raise UsageError("--prompt-scale and --output-scale must be positive")
    if args.max_request_tokens is not None and args.max_request_tokens < 2:
        raise UsageError("--max-request-tokens must be at least 2")
    start, duration = parse_window(args.window)
    try:
        requests = slice_trace(read_trace(trace), start, duration)
    except TraceError as err:
        raise UsageError(str(err)) from None
    shaped = Shape(args.every, args.prompt_scale, args.output_scale, args.max_request_tokens).apply(requests)
    if not shaped:
        raise UsageError(f"{trace}: no requests in window {args.window}")
    return shaped, str(trace)


def run(args: argparse.Namespace) -> int:
    try:
        requests, trace = prepare(args)
        observer = PoolObserver(args.pool, args.namespace, Clock(), kubeconfig=args.kubeconfig)
        pool = observer.get_pool()
        if pool is None:
            raise UsageError(f"no LLMPool {args.namespace}/{args.pool}")
        router_url = args.router_url or observer.find_router_url()
        if router_url is None:
            raise UsageError(f"LLMPool {args.namespace}/{args.pool} has no ready router pod; pass --router-url")
        check_router(router_url)
    except UsageError as err:
        print(f"kvfleet replay: error: {err}", file=sys.stderr)
        return 2
    except (ConfigException, ApiException) as err:  # no kubeconfig, no access, no CRD
        print(f"kvfleet replay: error: cannot read LLMPool {args.namespace}/{args.pool}: {_api_error(err)}",
              file=sys.stderr)
        return 2
    record, streams = run_replay(observer, pool, router_url, requests, trace, args)
    out = args.out or Path(f"replay-{args.pool}-{time.strftime('%Y%m%d-%H%M%S')}")
    written = write_record(out, record, [(s.sent_s, s.request) for s in streams], observer.profiles)
    if args.json:
        figures = record.to_json()
        del figures["pods"], figures["samples"], figures["migrations"]["moves"]
        print(json.dumps(figures))
    else:
        print(summary(record))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0 if record.streams_whole == record.streams else 1


def run_replay(observer: PoolObserver, pool: dict[str, Any], router_url: str, requests: list[TraceRequest],
               trace: str, args: argparse.Namespace,
               on_tick: Callable[[Progress], None] | None = None) -> tuple[Record, list[Stream]]:
    """The replay with its observer running, the policy switched for it if asked, and the record built."""
    spec = pool.get("spec") or {}
    previous_policy = (spec.get("scheduling") or {}).get("policy", "mell")
    policy = args.policy or previous_policy
    epoch_s = float((spec.get("scheduling") or {}).get("epochSeconds", 1))
    delay_s = float((spec.get("autoscaling") or {}).get("scaleDownDelaySeconds", 60))
    drain_timeout_s = args.drain_timeout_s if args.drain_timeout_s is not None else delay_s + 60
    model = args.model or (spec.get("model") or {}).get("name", "model")
    observer.router_url = router_url
    switched = bool(args.policy and args.policy != previous_policy)
    bar = _Bar(len(requests), not args.no_progress)

    def tick(p: Progress) -> None:
        bar(p)
        if on_tick is not None:
            on_tick(p)

    try:
        if switched:
            observer.set_policy(args.policy)
            time.sleep(2 * epoch_s)  # the operator and the router read the new policy at their next epoch
            observer.clock = Clock()  # the trace's clock starts once the pool runs the policy
        observer.start()
        streams, end_s = replay(observer, router_url, model, requests, args.time_scale,
                                drain_timeout_s=drain_timeout_s, min_workers=int((spec.get("workers") or {}).get("min", 1)),
                                on_tick=tick, tick_s=1.0 if on_tick is None else 4.0)
    finally:
        try:
            observer.stop()
        finally:
            bar.close()
            if switched:
                observer.set_policy(previous_policy)
    record = build_record(pool=args.pool, policy=policy, trace=trace, window=args.window, time_scale=args.time_scale,
                          started_wall_s=observer.clock.started_wall_s, end_s=end_s, streams=streams,
                          pods=observer.pod_lives(), samples=list(observer.samples),
                          migrations=list(observer.migrations.values()), profiles=dict(observer.profiles))
    return record, streams


def check_router(router_url: str) -> None:
    """The router answers (GET /v1/models) within a few seconds, or UsageError with what to do."""
    try:
        with urllib.request.urlopen(f"{router_url}/v1/models", timeout=5):
            pass
    except (OSError, ValueError) as err:
        raise UsageError(f"the router at {router_url} does not answer ({err}); from outside the cluster run "
                         "`kubectl port-forward svc/POOL-router 8000` and pass --router-url http://127.0.0.1:8000") from None


def _api_error(err: Exception) -> str:
    if isinstance(err, ApiException):
        return f"HTTP {err.status} {err.reason}"
    return str(err)


def summary(record: Record) -> str:
    m = record.migrations
    lines = [
        f"streams completed whole: {record.streams_whole} of {record.streams}",
        *(f"  {line}" for line in record.not_whole[:10]),
        f"billed GPU-seconds (worker pod lifetimes): {record.billed_gpu_seconds:.1f} over {record.duration_s:.0f} s; "
        f"GPUs in use: peak {record.peak_gpus_in_use}, {record.gpu_seconds_in_use:.1f} GPU-seconds; "
        f"fluid lower bound: mean {record.mean_lower_bound_gpus:.2f} GPUs",
        f"migrations: {m.total} ({', '.join(f'{k}: {n}' for k, n in m.by_mode_phase.items()) or 'none'}); "
        f"failed {m.failed} ({m.failed / m.total:.0%} of moves)" if m.total else "migrations: none",
        *(f"  failed x{n}: {cause}" for cause, n in list(m.failure_causes.items())[:3]),
        f"  moved again within 30 s (not draining): {m.quick_removes}",
        f"TTFT ms p50/p90/p99: {_ms(record.ttft_ms)}; per output token ms: {_ms(record.per_token_ms)}",
    ]
    return "\n".join(lines)


def _ms(p: dict[str, float | None]) -> str:
    return "/".join("-" if v is None else f"{v:.0f}" for v in p.values())
