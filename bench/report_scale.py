"""What KV-load reports cost the API server: pod annotations against KVLoad objects, at 100 to 2,000 workers.

A busy worker rewrites its KV-load report about once an epoch. Written as an annotation of its own
Pod (the `annotation` channel, how workers reported before KVLoad objects existed), every write is a pod update
that the API server fans out to every pod watcher of the cluster (kubelet, scheduler, controller
manager, kopf, routers); written to the worker's own KVLoad (the `kvload` channel) it reaches only
the KVLoad watchers. This bench measures both on the real local control plane (etcd, kube-apiserver,
kube-scheduler, kube-controller-manager from `make controlplane`; no node agent), a fresh one for
every (channel, N):

    python bench/report_scale.py                                   # N = 100, 500, 1000, 2000; 30 s windows
    python bench/report_scale.py --workers 100,500,1000 --window-s 20
    python bench/report_scale.py --quick                           # N = 100, 8 s windows, 2 s epochs (e2e)

Per run: kvfleet's CRDs, fake GPU nodes (8 GPUs each, four zones), an LLMPool of policy mell with
workers.min = workers.max = N, and its N worker pods made here with the operator's own pod body
(kvfleet.operator.resources.worker_pod), bound to a node and marked Running and Ready as a kubelet
would. Then the real operator (`python -m kvfleet.operator`, its own process) and a load generator
(this file with `--load-generator`, its own process, so neither's CPU is the other's): N real
`LoadReporter`s in one asyncio loop writing through the channel's real writer
(`pod_annotation_writer` or `kvload_writer`) over one shared admin ApiClient. Each reporter watches
a synthetic engine of a few requests that arrive, grow and finish, so its report changes several
times an epoch and the reporter writes at its limit, once an epoch: the worst case of a busy pool.
The requests are short chat answers (each ends within two report intervals, so every report marks
it `finishing`), which is also what keeps the operator from ordering KVMigrations that no worker
here would carry out: its writes are then the same steady ones in both channels. A plain watch of
all pods of the namespace (what each kubelet, the scheduler and the controller manager hold) counts
the events and bytes the reports push to pod watchers.

After the generator's first write from every reporter and two more operator passes (the ramp, when
every worker turns from empty to holding, stays out of the window), one window of `--window-s`:
- write latency p50/p99 as the workers see it (the writer's whole call, waiting for a thread and a
  connection of the shared client included) and per HTTP request; writes/s achieved against offered
  (the writes the reporters would make against an instant API server, counted from the engines);
- CPU seconds per second of kube-apiserver, etcd, the operator and the generator (/proc/PID/stat);
- the operator's passes (kvfleet_epoch_duration_seconds sum, count and buckets: `epochs`), their
  mean wall time, an upper bound of the longest, and CPU per pass (all its CPU in the window, watch
  handling included, over its passes); its RSS and RSS / N (the whole process over N: its RSS
  without workers is not measured). A pass runs more often than once an epochSeconds: the pool's
  own status write is a pool event, which wakes its daemon for another pass at once (see
  kvfleet.operator.handlers.pool_changed), a few times over until the status stops changing. So the
  epoch targets (< 1000 ms at 1,000 workers, < 2500 ms at 2,000) are judged on the larger of the mean pass and
  `operator_wall_ms_per_epoch_s`, the wall time of all passes per epochSeconds;
- bytes per report (`report_bytes`: the report's compact JSON, `KVLoadReport.to_annotation()`,
  which is also exactly the `report` a KVLoad holds, so it is the same payload in both channels) and
  per request body (`request_body_bytes`: the PATCH body as the kubernetes client serialises it,
  json.dumps of the writer's merge patch or JSON patch); pod watch events/s and bytes per event.

A channel and N the machine cannot carry (setup fails, or fewer than half the offered writes go
through) is recorded with a note, not an error. First line: the machine. One line per (channel, N),
one per N with the operator-epoch target where there is one (< 1000 ms at 1,000 workers, < 2500 ms at 2,000). The last line is one JSON
object: `workers` keyed by N (a string), each with the figures of both channels and `ratio`
(annotation / kvload) of API server CPU, pod watch events and write p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from _machine import cpu_model  # noqa: E402

from kvfleet.api.incluster import read_through  # noqa: E402
from kvfleet.api.models import LLMPoolSpec  # noqa: E402
from kvfleet.api.reports import ANNOTATION, KVLoadReport, size_class_name  # noqa: E402
from kvfleet.localcluster.controlplane import (  # noqa: E402
    REPO_ROOT,
    ControlPlane,
    Process,
    free_port,
    start_process,
    stop_process,
)
from kvfleet.operator.resources import worker_account_name, worker_pod  # noqa: E402

NAMESPACE = "report-scale"
POOL = "scale"
CHANNELS = ("annotation", "kvload")
GPUS_PER_NODE = 8
NUM_ZONES = 4
# The synthetic model: a Llama-3-8B's KV per token (32 layers x 8 KV heads x 128 dims x K and V x
# 2 bytes), 16-token blocks, 4 GiB of KV per worker, a 30 ms decode step.
KV_BYTES_PER_TOKEN = 131072
BLOCK_TOKENS = 16
CAPACITY_BYTES = 4 << 30
STEP_S = 0.03
# Requests per worker at once, and their prompts: about 40% of the KV capacity in use.
SLOTS_PER_WORKER = 3
PROMPT_TOKENS = (1000, 8000)
# A reporter looks at its engine this often: 2,000 of them at 0.1 s (the worker's default) would
# spend the generator's CPU on ticks, and a report is late by at most a tick either way.
TICK_S = 0.5
# Threads and connections of the generator's one ApiClient (the writers run in threads).
WRITER_THREADS = 32
# The generator stops by itself this long after its planned end, should the bench be gone.
GENERATOR_SLACK_S = 300.0
# The operator-epoch targets by pool size: a pass under 1 s at 1,000 workers, under 2.5 s at 2,000.
TARGET_EPOCH_MS = {1000: 1000.0, 2000: 2500.0}


# ------------------------------------------------------------------------------------ shared helpers


def admin_client(kubeconfig: Path, pool_maxsize: int = 8) -> Any:
    """A kubernetes ApiClient from the admin kubeconfig with `pool_maxsize` connections (the size is
    read when the client is made, so it is set on the configuration first)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_maxsize
    return client.ApiClient(configuration)


def percentile(values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


# ------------------------------------------------------------------------------------ load generator


class SyntheticEngines:
    """The requests of every worker, advanced together once a tick: each worker keeps
    SLOTS_PER_WORKER slots busy; a request decodes a token per STEP_S and ends after its output, and
    its slot takes a new request after a short pause. `versions[i]` moves whenever worker i's report
    key would (a request arrived, finished or changed size class), which is how the writes an instant
    API server would take are counted (`offered`)."""

    def __init__(self, num_workers: int, epoch_s: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.epoch_s = epoch_s
        # Every request ends within two report intervals, so its report says `finishing` from the start.
        self.max_output_tokens = int(2 * epoch_s / STEP_S)
        self.next_id = 0
        # Per worker, per slot: None (pausing until self.resume_s) or [id, prompt, written, output, class].
        self.slots: list[list[list[Any] | None]] = []
        self.resume_s: list[list[float]] = []
        self.versions = [0] * num_workers
        now_s = time.monotonic()
        for _ in range(num_workers):
            slots: list[list[Any] | None] = []
            for _ in range(SLOTS_PER_WORKER):
                request = self.new_request()
                request[2] = self.rng.randrange(request[3])  # mid-answer already: a pool in steady state
                slots.append(request)
            self.slots.append(slots)
            self.resume_s.append([now_s] * SLOTS_PER_WORKER)

    def new_request(self) -> list[Any]:
        self.next_id += 1
        prompt = self.rng.randint(*PROMPT_TOKENS)
        output = self.rng.randint(max(1, self.max_output_tokens // 3), self.max_output_tokens)
        return [f"r{self.next_id}", prompt, 0, output, size_class_name(self.kv_bytes(prompt), CAPACITY_BYTES)]

    @staticmethod
    def kv_bytes(tokens: int) -> int:
        return -(-tokens // BLOCK_TOKENS) * BLOCK_TOKENS * KV_BYTES_PER_TOKEN

    def advance(self, dt_s: float, now_s: float) -> None:
        tokens = max(1, round(dt_s / STEP_S))
        for worker, slots in enumerate(self.slots):
            resume = self.resume_s[worker]
            for slot, request in enumerate(slots):
                if request is None:
                    if now_s >= resume[slot]:
                        slots[slot] = self.new_request()
                        self.versions[worker] += 1
                    continue
                request[2] += tokens
                if request[2] >= request[3]:
                    slots[slot] = None
                    resume[slot] = now_s + self.rng.uniform(0.05, 0.3) * self.epoch_s
                    self.versions[worker] += 1
                    continue
                cls = size_class_name(self.kv_bytes(request[1] + request[2]), CAPACITY_BYTES)
                if cls != request[4]:
                    request[4] = cls
                    self.versions[worker] += 1

    def usage(self, worker: int) -> list[Any]:
        from kvfleet.worker.engines.base import RequestKV

        return [RequestKV(r[0], r[1] + r[2], self.kv_bytes(r[1] + r[2]), remaining_tokens=r[3] - r[2])
                for r in self.slots[worker] if r is not None]


def request_body_bytes(channel: str, report: KVLoadReport, pod_uid: str) -> int:
    """The PATCH body the channel's writer sends, as the kubernetes client serialises it (json.dumps)."""
    if channel == "annotation":
        return len(json.dumps({"metadata": {"annotations": {ANNOTATION: report.to_annotation()}}}))
    return len(json.dumps([{"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": pod_uid},
                           {"op": "replace", "path": "/report", "value": report.to_json()}]))


async def generate(plan: dict[str, Any]) -> None:
    from kvfleet.worker.reporter import LoadReporter, kvload_writer, pod_annotation_writer

    loop = asyncio.get_running_loop()
    # The writers block in threads (asyncio.to_thread); the default pool (cores + 4) would queue them.
    loop.set_default_executor(ThreadPoolExecutor(WRITER_THREADS))
    api = admin_client(Path(plan["kubeconfig"]), WRITER_THREADS)
    channel, epoch_s = plan["channel"], float(plan["epoch_s"])
    pods: list[tuple[str, str]] = [tuple(p) for p in plan["pods"]]
    writes: list[tuple[float, float, bool, int, int]] = []  # (start, seconds, ok, report bytes, body bytes)
    http: list[tuple[float, float]] = []  # (start, seconds) of every HTTP request of the client
    offered: list[float] = []

    # Per HTTP request timing: its REST client's request is what every call of the client ends in.
    raw_request = api.rest_client.request

    def timed_request(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return raw_request(*args, **kwargs)
        finally:
            http.append((started, time.monotonic() - started))

    api.rest_client.request = timed_request

    def timed(write: Callable[[KVLoadReport], Any], pod_uid: str) -> Callable[[KVLoadReport], Any]:
        async def wrapped(report: KVLoadReport) -> None:
            started, ok = time.monotonic(), False
            try:
                await write(report)
                ok = True
            finally:
                writes.append((started, time.monotonic() - started, ok, len(report.to_annotation()),
                               request_body_bytes(channel, report, pod_uid)))
        return wrapped

    engines = SyntheticEngines(len(pods), epoch_s, seed=int(plan.get("seed", 1)))
    rng = random.Random(2)
    reporters = []
    start_at_s: list[float] = []
    now_s = time.monotonic()
    for index, (name, uid) in enumerate(pods):
        writer = (pod_annotation_writer(name, NAMESPACE, api_client=api) if channel == "annotation"
                  else kvload_writer(name, NAMESPACE, uid, POOL, api_client=api))
        reporters.append(LoadReporter(lambda i=index: engines.usage(i), CAPACITY_BYTES, timed(writer, uid),
                                      interval_s=epoch_s, tick_s=TICK_S, step_s=lambda: STEP_S,
                                      block_size_tokens=BLOCK_TOKENS))
        # Workers of a real pool started at different times: their writes are spread over the epoch.
        start_at_s.append(now_s + rng.uniform(0, epoch_s))

    async def run_from(reporter: LoadReporter, at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - time.monotonic()))
        await reporter.run()

    async def drive_engines() -> None:
        # What the reporters would write against an instant API server: a write when the key moved
        # and the last (offered) write is an interval old, checked at the reporters' tick.
        shadow_version = [-1] * len(pods)
        shadow_last_s = [float("-inf")] * len(pods)
        last_s = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now_s = time.monotonic()
            engines.advance(now_s - last_s, now_s)
            last_s = now_s
            for i, version in enumerate(engines.versions):
                if now_s >= start_at_s[i] and version != shadow_version[i] and now_s - shadow_last_s[i] >= epoch_s:
                    offered.append(now_s)
                    shadow_version[i], shadow_last_s[i] = version, now_s

    async def note_ready() -> None:
        while any(r.writes == 0 for r in reporters):
            await asyncio.sleep(0.5)
        Path(plan["ready"]).write_text(json.dumps({"at_s": time.monotonic()}))

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(run_from(r, at)) for r, at in zip(reporters, start_at_s, strict=True)]
    tasks += [asyncio.create_task(drive_engines()), asyncio.create_task(note_ready())]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), float(plan["max_s"]))
    result = {"writes": writes, "http": http, "offered": offered,
              "failures": sum(r.failures for r in reporters), "reporters": len(reporters)}
    out = Path(plan["out"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


def load_generator_main(plan_path: Path) -> int:
    plan = json.loads(plan_path.read_text())
    asyncio.run(generate(plan))
    # Writer threads may still wait on the API server; they hold nothing worth waiting for.
    os._exit(0)


# ------------------------------------------------------------------------------------ measurements


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def scrape(port: int) -> dict[str, float]:
    """The operator's metrics of interest: the epoch duration's sum and count, and API writes."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    wanted = ("kvfleet_epoch_duration_seconds_sum", "kvfleet_epoch_duration_seconds_count",
              "kvfleet_epoch_duration_seconds_bucket", "kvfleet_api_writes_total")
    figures: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            value = float(line.rsplit(" ", 1)[1])
            figures[name] = figures.get(name, 0.0) + value
            if name == "kvfleet_epoch_duration_seconds_bucket":
                upper = line.split('le="', 1)[1].split('"', 1)[0]
                figures[f"le:{upper}"] = figures.get(f"le:{upper}", 0.0) + float(line.rsplit(" ", 1)[1])
            if name == "kvfleet_api_writes_total" and 'kind="' in line:
                kind = line.split('kind="', 1)[1].split('"', 1)[0]
                figures[f"writes:{kind}"] = figures.get(f"writes:{kind}", 0.0) + value
    return figures


class PodWatch(threading.Thread):
    """A plain watch of every pod of the namespace, counting events (one JSON line each) and bytes, not parsing them."""

    def __init__(self, kubeconfig: Path) -> None:
        super().__init__(daemon=True, name="pod-watch")
        self.api = admin_client(kubeconfig, 2)
        self.events = 0
        self.bytes = 0
        self.stopping = threading.Event()
        self.response: Any = None
        self.error = ""

    def run(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.api)
        while not self.stopping.is_set():
            try:
                listing = json.loads(core.list_namespaced_pod(NAMESPACE, limit=1, _preload_content=False).data)
                self.response = core.list_namespaced_pod(
                    NAMESPACE, watch=True, resource_version=listing["metadata"]["resourceVersion"],
                    timeout_seconds=3600, _preload_content=False, _request_timeout=(10, 3700))
                for chunk in self.response.stream(65536):
                    self.bytes += len(chunk)
                    self.events += chunk.count(b"\n")
            except Exception as err:  # closed by stop(), or the API server dropped it: watch again
                self.error = str(err)
                if not self.stopping.is_set():
                    time.sleep(0.5)

    def stop(self) -> None:
        self.stopping.set()
        with contextlib.suppress(Exception):
            self.response.shutdown()
        with contextlib.suppress(Exception):
            self.response.release_conn()


def sample(pids: dict[str, int], watch: PodWatch, metrics_port: int) -> dict[str, Any]:
    return {"at_s": time.monotonic(), "cpu_s": {name: cpu_s(pid) for name, pid in pids.items()},
            "watch_events": watch.events, "watch_bytes": watch.bytes, "metrics": scrape(metrics_port)}


# ------------------------------------------------------------------------------------ one run


class Run:
    """One (channel, N) on a fresh control plane, torn down whatever happens."""

    def __init__(self, channel: str, num_workers: int, args: argparse.Namespace) -> None:
        self.channel, self.num_workers, self.args = channel, num_workers, args
        self.work_dir: Path = args.out / f"{channel}-{num_workers}"
        self.plane: ControlPlane | None = None
        self.operator: Process | None = None
        self.generator: Process | None = None
        self.watch: PodWatch | None = None
        self.api: Any = None

    def log(self, message: str) -> None:
        print(f"# [{self.channel} N={self.num_workers}] {message}", file=sys.stderr, flush=True)

    def kubectl(self, *args: str) -> str:
        assert self.plane is not None
        result = self.plane.kubectl_run(*args, check=False, timeout_s=120)
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def measure(self) -> dict[str, Any]:
        shutil.rmtree(self.work_dir, ignore_errors=True)
        try:
            return self._measure()
        finally:
            self.teardown()

    def teardown(self) -> None:
        for proc in (self.generator, self.operator):
            if proc is not None:
                stop_process(proc, grace_s=15)
        if self.watch is not None:
            self.watch.stop()
        if self.plane is not None:
            self.plane.stop()
        # The logs stay for a post-mortem; etcd's data is only bulk.
        shutil.rmtree(self.work_dir / "etcd", ignore_errors=True)

    def _measure(self) -> dict[str, Any]:
        args, n = self.args, self.num_workers
        started_s = time.monotonic()
        self.plane = plane = ControlPlane.start(self.work_dir)
        self.kubectl("apply", "--server-side", "--field-manager=report-scale", "-f", str(REPO_ROOT / "crds"))
        plane.wait_established([f"{crd.stem}.kvfleet.dev" for crd in sorted((REPO_ROOT / "crds").glob("*.yaml"))])
        self.kubectl("create", "namespace", NAMESPACE)
        deadline = time.monotonic() + 60
        while plane.kubectl_run("get", "serviceaccount", "default", "-n", NAMESPACE, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no default ServiceAccount in {NAMESPACE}")
            time.sleep(0.2)
        self.api = admin_client(plane.kubeconfig, 16)
        nodes = self.make_nodes(max(1, -(-n // GPUS_PER_NODE)))
        pool = self.make_pool()
        uids = self.make_workers(pool, nodes)
        self.log(f"{len(nodes)} nodes, {n} Ready worker pods in {time.monotonic() - started_s:.0f} s")

        self.watch = PodWatch(plane.kubeconfig)
        self.watch.start()
        metrics_port = free_port()
        logs = self.work_dir / "logs"
        # No leader election: one replica, and a renewal starved on a saturated 2-core machine would
        # end the operator (kvfleet.operator.__main__), which is not what this bench measures.
        self.operator = start_process("operator", [
            sys.executable, "-m", "kvfleet.operator", f"--liveness=http://127.0.0.1:{free_port()}/healthz",
            "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}", "--no-leader-election"],
            logs, env={"KUBECONFIG": str(plane.kubeconfig)})
        self.wait(lambda: (self.pool_status().get("readyWorkers") == n), "the operator's first epoch over every worker",
                  120 + n * 0.05)
        self.log(f"operator's first epoch done at {time.monotonic() - started_s:.0f} s")

        plan_path, result_path, ready_path = (self.work_dir / f for f in ("plan.json", "writes.json", "ready.json"))
        planned_s = 2 * args.epoch_s + args.window_s + 120 + n * 0.1
        plan_path.write_text(json.dumps({
            "kubeconfig": str(plane.kubeconfig), "channel": self.channel, "epoch_s": args.epoch_s,
            "pods": [[name, uid] for name, uid in uids.items()], "out": str(result_path), "ready": str(ready_path),
            "max_s": planned_s + GENERATOR_SLACK_S}))
        self.generator = start_process("load-generator", [sys.executable, str(Path(__file__).resolve()),
                                                          "--load-generator", str(plan_path)], logs)
        notes: list[str] = []
        first_writes_s = 60 + n * 0.1
        try:
            self.wait(lambda: ready_path.exists(), "a first write from every reporter", first_writes_s)
        except TimeoutError:
            notes.append(f"not every reporter had written once after {first_writes_s:.0f} s")
        # Warm-up: two whole passes after every reporter has written. The first passes after the load
        # starts are the ramp (every worker turns from empty to holding: hundreds of pod writes, 6-14 s
        # at 1,000 workers); a fixed two epochs of sleep let them into the window, whose mean pass then
        # said more about the ramp than about the steady state it is meant to measure.
        passes_before = scrape(metrics_port).get("kvfleet_epoch_duration_seconds_count", 0.0)
        self.log("generator writing; warming up: two operator passes")
        time.sleep(args.epoch_s)
        try:
            self.wait(lambda: scrape(metrics_port).get("kvfleet_epoch_duration_seconds_count", 0.0) >= passes_before + 2,
                      "two operator passes under the load", 120 + n * 0.05)
        except TimeoutError:
            notes.append("the operator did not finish two passes under the load before the window")

        pids = {"apiserver": self.pid("kube-apiserver"), "etcd": self.pid("etcd"),
                "operator": self.operator.popen.pid, "generator": self.generator.popen.pid}
        before = sample(pids, self.watch, metrics_port)
        time.sleep(args.window_s)
        after = sample(pids, self.watch, metrics_port)
        operator_rss_kib = rss_kib(pids["operator"])
        plane.check_alive()
        for proc in (self.operator, self.generator):
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")

        os.kill(self.generator.popen.pid, signal.SIGTERM)
        self.wait(lambda: result_path.exists() or self.generator_gone(), "the generator's figures", 60,
                  generator_may_end=True)
        if not result_path.exists():
            raise RuntimeError(f"the load generator left no figures:\n{self.generator.tail()}")
        figures = self.figures(json.loads(result_path.read_text()), before, after, operator_rss_kib, notes)
        figures["notes"] = notes + self.operator_trouble()
        self.log(f"done in {time.monotonic() - started_s:.0f} s")
        return figures

    def figures(self, gen: dict[str, Any], before: dict[str, Any], after: dict[str, Any], operator_rss_kib: int,
                notes: list[str]) -> dict[str, Any]:
        n = self.num_workers
        t0, t1 = before["at_s"], after["at_s"]
        window_s = t1 - t0
        # A write belongs to the window it ended in.
        done = [w for w in gen["writes"] if t0 <= w[0] + w[1] < t1]
        ok = [w for w in done if w[2]]
        http = [h[1] for h in gen["http"] if t0 <= h[0] + h[1] < t1]
        offered = sum(1 for t in gen["offered"] if t0 <= t < t1)
        cpu = {name: (after["cpu_s"][name] - before["cpu_s"][name]) / window_s for name in before["cpu_s"]}
        epochs = after["metrics"].get("kvfleet_epoch_duration_seconds_count", 0) - before["metrics"].get(
            "kvfleet_epoch_duration_seconds_count", 0)
        epoch_sum_s = after["metrics"].get("kvfleet_epoch_duration_seconds_sum", 0) - before["metrics"].get(
            "kvfleet_epoch_duration_seconds_sum", 0)
        operator_writes = after["metrics"].get("kvfleet_api_writes_total", 0) - before["metrics"].get(
            "kvfleet_api_writes_total", 0)
        # What the operator wrote, by kind (its writes are the same in both channels, and they are pod
        # writes too: the pod-deletion-cost annotation follows each worker's reported KV).
        writes_by_kind = {key.split(":", 1)[1]: round((after["metrics"][key] - before["metrics"].get(key, 0)) / window_s, 2)
                          for key in after["metrics"] if key.startswith("writes:")}
        # The longest pass, as the histogram can tell it: the smallest bucket bound holding every pass of the window.
        bounds = sorted((float(key[3:]), after["metrics"][key] - before["metrics"].get(key, 0))
                        for key in after["metrics"] if key.startswith("le:"))
        longest_le_s = next((upper for upper, count in bounds if epochs and count >= epochs), None)
        if not epochs:
            notes.append(f"the operator finished no pass in the {window_s:.0f} s window (a pass takes longer)")
        elif longest_le_s is not None and math.isinf(longest_le_s):
            notes.append("a pass took longer than the histogram's last bound (10 s)")
        events = after["watch_events"] - before["watch_events"]
        event_bytes = after["watch_bytes"] - before["watch_bytes"]
        writes_per_s = len(ok) / window_s
        offered_per_s = offered / window_s
        if offered_per_s and writes_per_s < 0.5 * offered_per_s:
            notes.append(f"saturated: {writes_per_s:.1f} writes/s went through of {offered_per_s:.1f} offered")
        if len(done) > len(ok):
            notes.append(f"{len(done) - len(ok)} writes failed in the window")
        return {
            "workers": n,
            "window_s": round(window_s, 2),
            "write_p50_ms": rounded(percentile([w[1] * 1000 for w in ok], 0.50)),
            "write_p99_ms": rounded(percentile([w[1] * 1000 for w in ok], 0.99)),
            "http_p50_ms": rounded(percentile([s * 1000 for s in http], 0.50)),
            "http_p99_ms": rounded(percentile([s * 1000 for s in http], 0.99)),
            "writes_per_s": round(writes_per_s, 2),
            "offered_writes_per_s": round(offered_per_s, 2),
            "failed_writes": len(done) - len(ok),
            "apiserver_cpu_s_per_s": round(cpu["apiserver"], 3),
            "etcd_cpu_s_per_s": round(cpu["etcd"], 3),
            "operator_cpu_s_per_s": round(cpu["operator"], 3),
            "generator_cpu_s_per_s": round(cpu["generator"], 3),
            "report_bytes": round(sum(w[3] for w in ok) / len(ok)) if ok else None,
            "request_body_bytes": round(sum(w[4] for w in ok) / len(ok)) if ok else None,
            "pod_watch_events_per_s": round(events / window_s, 2),
            "pod_watch_bytes_per_s": round(event_bytes / window_s),
            "pod_watch_bytes_per_event": round(event_bytes / events) if events else None,
            "epochs": int(epochs),
            "operator_epoch_wall_ms": round(epoch_sum_s / epochs * 1000, 1) if epochs else None,
            "operator_cpu_ms_per_epoch": round(cpu["operator"] * window_s / epochs * 1000, 1) if epochs else None,
            # Passes run more often than once an epochSeconds (the pool's own status write wakes its
            # daemon again): the wall time of all passes per epochSeconds is what one epoch costs.
            "operator_wall_ms_per_epoch_s": round(epoch_sum_s * self.args.epoch_s / window_s * 1000, 1) if epochs else None,
            "operator_longest_pass_le_ms": None if longest_le_s is None or math.isinf(longest_le_s)
            else round(longest_le_s * 1000),
            "operator_writes_per_s": round(operator_writes / window_s, 2),
            "operator_writes_per_s_by_kind": {k: v for k, v in sorted(writes_by_kind.items()) if v},
            # Anything else on the machine (another test run) shows here: the window's CPU was shared.
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
            "operator_rss_mib": round(operator_rss_kib / 1024, 1),
            "operator_rss_kib_per_worker": round(operator_rss_kib / n, 1),
        }

    # -- setup

    def make_nodes(self, count: int) -> list[str]:
        """Fake GPU nodes as FakeGpuNodes registers them (labels, capacity); nothing keeps them alive,
        and nothing needs to: the node-lifecycle controller is off and the pods are bound by name."""
        from kubernetes import client

        core = client.CoreV1Api(self.api)
        names = [f"gpu-node-{i}" for i in range(count)]
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(GPUS_PER_NODE)}

        def make(index: int) -> None:
            name = names[index]
            labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                      "topology.kubernetes.io/zone": f"zone-{index % NUM_ZONES}", "nvidia.com/gpu.present": "true"}
            read_through(core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}},
                                          _preload_content=False))
            read_through(core.patch_node_status(name, {"status": {"capacity": capacity, "allocatable": capacity, "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "report-scale bench"}]}},
                _preload_content=False))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(make, range(count)))
        return names

    def make_pool(self) -> dict[str, Any]:
        from kubernetes import client

        manifest = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": POOL}, "spec": {
            "model": {"name": "bench", "path": "/models/bench"},
            "engine": "builtin",
            "capacity": {"kvCapacityPerWorker": f"{CAPACITY_BYTES >> 30}Gi"},
            "workers": {"min": self.num_workers, "max": self.num_workers},
            "scheduling": {"policy": "mell", "epochSeconds": self.args.epoch_s},
            "workerTemplate": {"image": "kvfleet/worker:dev"},
        }}
        pool: dict[str, Any] = client.CustomObjectsApi(self.api).create_namespaced_custom_object(
            "kvfleet.dev", "v1alpha1", NAMESPACE, "llmpools", manifest)
        # Pods name the workers' ServiceAccount, which admission requires to exist; the operator finds it made.
        client.CoreV1Api(self.api).create_namespaced_service_account(
            NAMESPACE, {"metadata": {"name": worker_account_name(POOL)}})
        return pool

    def make_workers(self, pool: dict[str, Any], nodes: list[str]) -> dict[str, str]:
        """The pool's N worker pods as the operator would make them, each bound to a node and then
        Running and Ready as its kubelet would say. Returns pod name -> uid."""
        from kubernetes import client

        core = client.CoreV1Api(self.api)
        spec = LLMPoolSpec.model_validate(pool["spec"])

        def make(index: int) -> tuple[str, str]:
            body = worker_pod(pool, spec, index, None)
            body["spec"]["nodeName"] = nodes[index // GPUS_PER_NODE]
            name = body["metadata"]["name"]
            created = json.loads(core.create_namespaced_pod(NAMESPACE, body, _preload_content=False).data)
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            ip = f"10.{1 + index // 65536}.{index // 256 % 256}.{index % 256}"
            status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": now,
                      "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                                     for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                      "containerStatuses": [{"name": "worker", "image": body["spec"]["containers"][0]["image"],
                                             "imageID": "", "ready": True, "started": True, "restartCount": 0,
                                             "state": {"running": {"startedAt": now}}}]}
            read_through(core.patch_namespaced_pod_status(name, NAMESPACE, {"status": status}, _preload_content=False))
            return name, str(created["metadata"]["uid"])

        with ThreadPoolExecutor(8) as pool_threads:
            return dict(pool_threads.map(make, range(self.num_workers)))

    # -- small helpers

    def pool_status(self) -> dict[str, Any]:
        from kubernetes import client

        pool = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            "kvfleet.dev", "v1alpha1", NAMESPACE, "llmpools", POOL)
        return dict(pool.get("status") or {})

    def wait(self, probe: Callable[[], bool], what: str, timeout_s: float, generator_may_end: bool = False) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.plane is not None
            self.plane.check_alive()
            for proc in (self.operator, None if generator_may_end else self.generator):
                if proc is not None and proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            if probe():
                return
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def generator_gone(self) -> bool:
        return self.generator is not None and self.generator.popen.poll() is not None

    def pid(self, name: str) -> int:
        assert self.plane is not None
        return next(p.popen.pid for p in self.plane.processes if p.name == name)

    def operator_trouble(self) -> list[str]:
        """Tracebacks and errors in the operator's log, said rather than hidden."""
        if self.operator is None:
            return []
        try:
            text = self.operator.log_path.read_text(errors="replace")
        except OSError:
            return []
        errors = [line for line in text.splitlines() if " ERROR " in line or line.startswith("Traceback")]
        if not errors:
            return []
        return [f"operator log has {len(errors)} error lines (first: {errors[0][:300]}); see {self.operator.log_path}"]


# ------------------------------------------------------------------------------------ report


def summary_line(channel: str, n: int, f: dict[str, Any]) -> str:
    if "error" in f:
        return f"{channel:<10} N={n:<5} not measured: {f['error']}"
    notes = f"; {'; '.join(f['notes'])}" if f.get("notes") else ""
    return (f"{channel:<10} N={n:<5} writes {f['writes_per_s']:.1f}/s of {f['offered_writes_per_s']:.1f} offered, "
            f"p50 {f['write_p50_ms']} ms p99 {f['write_p99_ms']} ms; apiserver {f['apiserver_cpu_s_per_s']:.2f} "
            f"CPU-s/s, etcd {f['etcd_cpu_s_per_s']:.2f}; pod watch {f['pod_watch_events_per_s']:.1f} events/s "
            f"{f['pod_watch_bytes_per_s'] / 1024:.0f} KiB/s; report {f['report_bytes']} B; operator "
            f"{f['epochs']} passes of {f['operator_epoch_wall_ms']} ms ({f['operator_wall_ms_per_epoch_s']} ms per epoch), "
            f"{f['operator_cpu_ms_per_epoch']} CPU-ms each, {f['operator_cpu_s_per_s']:.2f} CPU-s/s, "
            f"RSS {f['operator_rss_mib']} MiB ({f['operator_rss_kib_per_worker']} KiB/worker){notes}")


def target_line(n: int, channels: list[str], per_n: dict[str, Any], epoch_s: float) -> str:
    """The operator-epoch target, judged on the larger of the mean pass and the wall time of all passes
    per epochSeconds (one epoch's work however many passes it took), the new channel's first."""
    parts = []
    judged: float | None = None
    for channel in sorted(channels, key=lambda c: c != "kvload"):
        f = per_n.get(channel, {})
        wall_ms = f.get("operator_wall_ms_per_epoch_s")
        if wall_ms is None:
            parts.append(f"{channel}: not measured")
            continue
        # The mean pass hides a long one among the short passes a status write wakes; the wall per
        # epochSeconds spreads a long one over the window: the larger of the two.
        wall_ms = max(wall_ms, f.get("operator_epoch_wall_ms") or 0.0)
        judged = wall_ms if judged is None else judged
        parts.append(f"{channel}: {f['operator_wall_ms_per_epoch_s']:.0f} ms of passes per {epoch_s:g} s epoch ({f['epochs']} passes of "
                     f"{f['operator_epoch_wall_ms']} ms mean, longest <= {f['operator_longest_pass_le_ms']} ms)")
    shown = "?" if judged is None else f"{judged:.0f}"
    target_ms = TARGET_EPOCH_MS.get(n)
    if target_ms is None:
        judgement = f"no target at {n} workers"
    else:
        verdict = "not measured" if judged is None else ("met" if judged < target_ms else "missed")
        judgement = f"target < {target_ms:.0f} ms at {n} workers: {verdict}"
    return f"epoch over {n} workers: {shown} ms ({judgement}); " + "; ".join(parts)


def ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 2) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def machine_line() -> str:
    mem_gib = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / (1 << 20)
    return (f"{platform.node()} ({cpu_model()}, {os.cpu_count()} cores, {mem_gib:.0f} GiB memory, "
            f"{platform.machine()}, Python {platform.python_version()})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", default="100,500,1000,2000", help="worker counts, comma-separated")
    parser.add_argument("--channels", default=",".join(CHANNELS), help="annotation, kvload or both")
    parser.add_argument("--window-s", type=float, default=30.0, help="seconds measured per (channel, N)")
    parser.add_argument("--epoch-s", type=float, default=5.0, help="the pool's epoch, and the reporters' interval")
    parser.add_argument("--quick", action="store_true", help="N = 100, 8 s windows, 2 s epochs, both channels")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "bench" / "report_scale",
                        help="work folders (control-plane and operator logs) per run")
    parser.add_argument("--load-generator", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load_generator is not None:
        return load_generator_main(args.load_generator)
    if args.quick:
        args.workers, args.channels, args.window_s, args.epoch_s = "100", ",".join(CHANNELS), 8.0, 2.0
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    channels = [c.strip() for c in args.channels.split(",") if c.strip()]
    unknown = set(channels) - set(CHANNELS)
    if unknown:
        parser.error(f"unknown channels {sorted(unknown)}; known: {', '.join(CHANNELS)}")
    machine = machine_line()
    print(f"machine: {machine}; local control plane (no node agent), operator and load generator as processes",
          flush=True)
    started_s = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for n in counts:
        per_n: dict[str, Any] = {}
        for channel in channels:
            try:
                per_n[channel] = Run(channel, n, args).measure()
            except Exception as err:  # the machine may not carry this N: say so and go on
                # The end of the message: a process's log tail ends with what went wrong.
                per_n[channel] = {"workers": n, "error": f"{type(err).__name__}: {str(err)[-800:]}"}
            print(summary_line(channel, n, per_n[channel]), flush=True)
        if set(CHANNELS) <= set(per_n):
            a, k = per_n["annotation"], per_n["kvload"]
            per_n["ratio"] = {"apiserver_cpu": ratio(a.get("apiserver_cpu_s_per_s"), k.get("apiserver_cpu_s_per_s")),
                              "watcher_events": ratio(a.get("pod_watch_events_per_s"), k.get("pod_watch_events_per_s")),
                              "write_p99": ratio(a.get("write_p99_ms"), k.get("write_p99_ms"))}
        results[str(n)] = per_n
    for n in counts:
        print(target_line(n, channels, results[str(n)], args.epoch_s))
    print(f"(work folders under {args.out}; {time.monotonic() - started_s:.0f} s)")
    print(json.dumps({"bench": "report_scale", "machine": machine, "epoch_s": args.epoch_s, "window_s": args.window_s,
                      "workers": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
