"""Chaos on the real control plane: real builtin workers, the router, a trace replay, and
kills at the worst moments.

- The operator is SIGKILLed at random (seeded) moments during a replay and restarted as its
  Deployment would restart it; midway the API server and etcd are SIGKILLed and started again on the
  same data. Every replayed stream must come back whole, no two live worker pods may serve one GPU,
  no KVMigration may stay unfinished, and the pool must settle where a run without kills ends: its
  floor of Ready workers, nothing in flight.
- A worker is SIGKILLed while it is the target of a KV move, and another while it is the source. The
  move is held in `Transferring` deterministically by SIGSTOPping the target first (the source then
  waits on its handshake), so the kill lands mid-move on any machine. The KVMigration must end Failed
  with a message, and the client's stream through the router must be whole and equal to the
  unbroken greedy output (it continues on the source, or the router resumes it by re-prefill).
- The leader is frozen (SIGSTOP) past its lease while a stream runs; a standby takes over; the old
  leader, woken, must step down without a single write (its write fence, kvfleet.operator.leader).

The size is one knob: the short version runs in `make test`; KVFLEET_CHAOS_LONG=1 (`make chaos`)
kills the operator 50 times over a longer replay, and writes its counts (the last line one JSON
object) to $KVFLEET_CHAOS_SUMMARY, which the make target prints after pytest's own summary.
"""

from __future__ import annotations

import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.localcluster.cluster import Cluster, start_operator, wait_for
from kvfleet.localcluster.controlplane import stop_process
from kvfleet.sim import bundled
from kvfleet.worker.text import Tokenizer
from kvfleet_e2e.operators import OperatorHandle
from kvfleet_e2e.pools import ready
from kvfleet_e2e.processes import signal_group, worker_pid
from kvfleet_e2e.real_workers import greedy_outputs, seeded_prompt, stream_completion
from kvfleet_e2e.reports import worker_reports

LONG = os.environ.get("KVFLEET_CHAOS_LONG") == "1"
NUM_OPERATOR_KILLS = 50 if LONG else 8
# Trace seconds replayed and every how many requests is sent: the long replay outlasts 50 kills
# (an operator restart with its lease takeover takes ~5 s here).
REPLAY_WINDOW, REPLAY_EVERY = ("0:300", "10") if LONG else ("0:24", "3")
SEED = 18
pytestmark = pytest.mark.timeout(1800 if LONG else 900)
TRACE = bundled.trace_path(bundled.CONV)
WORKER = "app.kubernetes.io/component=worker"
FINISHED = ("Succeeded", "Failed")

TALLY: dict[str, int] = {k: 0 for k in (
    "operator_kills", "operator_exits", "worker_kills", "apiserver_restarts", "lease_losses", "streams",
    "streams_whole", "migrations_failed", "migrations_succeeded", "lost", "duplicate_pods", "non_terminal_migrations")}


def write_summary() -> None:
    """Counts for people, then the same as one JSON object on the last line."""
    figures = {**TALLY, "long": LONG, "machine": platform.node(), "cpus": os.cpu_count()}
    lines = [
        f"chaos ({'long' if LONG else 'short'}) on {figures['machine']} ({figures['cpus']} CPUs):",
        f"  kills: operator {TALLY['operator_kills']} (+{TALLY['operator_exits']} exits on its own), "
        f"workers {TALLY['worker_kills']}, API server+etcd restarts {TALLY['apiserver_restarts']}, "
        f"leases lost {TALLY['lease_losses']}",
        f"  streams: {TALLY['streams']}, whole {TALLY['streams_whole']}, lost {TALLY['lost']}",
        f"  migrations: succeeded {TALLY['migrations_succeeded']}, failed {TALLY['migrations_failed']}, "
        f"left unfinished {TALLY['non_terminal_migrations']}; duplicate worker pods {TALLY['duplicate_pods']}",
        json.dumps(figures, sort_keys=True),
    ]
    text = "\n".join(lines)
    print("\n" + text)
    target = os.environ.get("KVFLEET_CHAOS_SUMMARY")
    if target:
        Path(target).write_text(text + "\n")


@pytest.fixture(scope="module")
def chaos_ns(cluster: Cluster) -> Iterator[str]:
    """One namespace for the module's pools (they share the supervised operator)."""
    name = "t-chaos"
    cluster.kubectl("create", "namespace", name)
    cluster.wait_default_service_account(name)
    yield name
    write_summary()
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, chaos_ns: str) -> Iterator[OperatorHandle]:
    handle = OperatorHandle(cluster, "operator-chaos", restart_exited=True)
    yield handle
    TALLY["operator_exits"] += handle.num_exits
    stop_process(handle.proc)


# ------------------------------------------------------------------------------------------ helpers


def get_json(cluster: Cluster, *args: str) -> Any:
    """`kubectl get -o json`, or None while the API server is away (its restart is part of the test)."""
    result = cluster.kubectl("get", *args, "-o", "json", check=False, timeout_s=30)
    return json.loads(result.stdout) if result.returncode == 0 else None


def live_workers(cluster: Cluster, namespace: str, pool: str) -> list[dict[str, Any]] | None:
    listing = get_json(cluster, "pods", "-n", namespace, "-l", f"kvfleet.dev/pool={pool},{WORKER}")
    if listing is None:
        return None
    return sorted((p for p in listing["items"] if not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: p["metadata"]["name"])


def duplicates(pods: list[dict[str, Any]], max_workers: int) -> list[str]:
    """What is wrong with a set of live worker pods: two serving one GPU, or more than the pool's max."""
    by_gpu: dict[str, list[str]] = {}
    for pod in pods:
        gpu = (pod["metadata"].get("labels") or {}).get("kvfleet.dev/gpu-id")
        if gpu:
            by_gpu.setdefault(gpu, []).append(pod["metadata"]["name"])
    wrong = [f"{gpu} served by {names}" for gpu, names in by_gpu.items() if len(names) > 1]
    if len(pods) > max_workers:
        wrong.append(f"{len(pods)} live workers > max {max_workers}: {[p['metadata']['name'] for p in pods]}")
    return wrong


def pool_body(name: str, model_dir: Path, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "tiny", "path": str(model_dir)}, "engine": "builtin",
        "scheduling": {"policy": "mell-paper", "epochSeconds": 1},
        "migration": {"mode": "kv", "timeoutSeconds": 60},
        "autoscaling": {"scaleDownDelaySeconds": 3},
        "workerTemplate": {"image": "kvfleet/worker:dev", "env": [{"name": "OMP_NUM_THREADS", "value": "1"},
                                                                  {"name": "KVFLEET_MIN_STEP_S", "value": "0.03"}]},
    }
    body.update(spec)
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "LLMPool", "metadata": {"name": name}, "spec": body}


def wait_pool_up(cluster: Cluster, operator: OperatorHandle, namespace: str, pool: str, num_workers: int) -> str:
    """Wait for the router and `num_workers` Ready workers; the router's IP."""

    def router() -> str | None:
        operator.check()
        listing = get_json(cluster, "pods", "-n", namespace, "-l", f"kvfleet.dev/router={pool}")
        pods = [p for p in (listing or {"items": []})["items"] if ready(p)]
        return str(pods[0]["status"]["podIP"]) if pods else None

    ip = wait_for(router, f"the router of {pool}", timeout_s=180, interval_s=0.5)
    wait_for(lambda: operator.check() or len([p for p in live_workers(cluster, namespace, pool) or [] if ready(p)]) >= num_workers,
             f"{num_workers} Ready workers of {pool}", timeout_s=180, interval_s=0.5)
    return ip


def migrations_of(cluster: Cluster, namespace: str, pool: str) -> list[dict[str, Any]]:
    listing = get_json(cluster, "kvmigrations", "-n", namespace, "-l", f"kvfleet.dev/pool={pool}")
    return list((listing or {"items": []})["items"])


def phase(mig: dict[str, Any]) -> str:
    return str((mig.get("status") or {}).get("phase") or "Pending")


def tally_migrations(migs: list[dict[str, Any]]) -> None:
    TALLY["migrations_succeeded"] += sum(phase(m) == "Succeeded" for m in migs)
    TALLY["migrations_failed"] += sum(phase(m) == "Failed" for m in migs)
    TALLY["non_terminal_migrations"] += sum(phase(m) not in FINISHED for m in migs)


class Client(threading.Thread):
    """A streaming client in the background; `result()` re-raises what went wrong."""

    def __init__(self, ip: str, request_id: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.ip, self.request_id, self.body = ip, request_id, body
        self.outcome: tuple[str, int, str | None] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.outcome = stream_completion(self.ip, self.request_id, self.body)
        except BaseException as err:  # reported on the main thread
            self.error = err

    def result(self, timeout_s: float = 300) -> tuple[str, int, str | None]:
        self.join(timeout_s)
        assert not self.is_alive(), f"the stream of {self.request_id} did not end in {timeout_s}s"
        if self.error is not None:
            raise AssertionError(f"the stream of {self.request_id} failed: {self.error!r}") from self.error
        assert self.outcome is not None
        return self.outcome


def holder(cluster: Cluster, namespace: str, pool: str, request_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the worker whose KV-load report lists the request, another live worker), once reported."""
    pods = live_workers(cluster, namespace, pool) or []
    reports = worker_reports(cluster, namespace, pool)
    for pod in pods:
        report = reports.get(pod["metadata"]["name"])
        if report is not None and any(r.id == request_id for r in report.requests):
            others = [p for p in pods if p["metadata"]["name"] != pod["metadata"]["name"] and ready(p)]
            return (pod, others[0]) if others else None
    return None


# -------------------------------------------------------------------------------------------- tests


def test_operator_killed_and_api_server_restarted_during_a_replay(cluster: Cluster, chaos_ns: str, operator: OperatorHandle,
                                                                  model_dir: Path, tmp_path: Path) -> None:
    pool, min_workers, max_workers = "churn", 1, 3
    cluster.kubectl("apply", "-n", chaos_ns, "-f", "-", input_text=json.dumps(pool_body(
        pool, model_dir, capacity={"kvCapacityPerWorker": "1536Ki"}, workers={"min": min_workers, "max": max_workers})))
    wait_pool_up(cluster, operator, chaos_ns, pool, min_workers)

    out = tmp_path / "record"
    replay_log = tmp_path / "replay.log"
    with replay_log.open("w") as log_file:
        replay = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.cli", "replay", "--pool", pool, "-n", chaos_ns,
             "--kubeconfig", str(cluster.kubeconfig), "--trace", str(TRACE), "--window", REPLAY_WINDOW,
             "--every", REPLAY_EVERY, "--prompt-scale", "0.25", "--output-scale", "0.5", "--max-request-tokens", "752",
             "--drain-timeout-s", "90", "--out", str(out), "--json", "--no-progress"],
            stdout=log_file, stderr=subprocess.STDOUT)
    rng = random.Random(SEED)
    kills = 0
    restarted_api = False
    next_kill_s = time.monotonic() + rng.uniform(0.5, 5.0)
    next_look_s = 0.0
    wrong: list[str] = []
    deadline_s = time.monotonic() + (1500 if LONG else 400)
    try:
        # The operator's children must be started from this thread (PR_SET_PDEATHSIG is per thread),
        # so the kills, the restarts and the API server's restart all happen in this loop.
        while replay.poll() is None or kills < NUM_OPERATOR_KILLS:
            assert time.monotonic() < deadline_s, f"the replay or the kills did not finish: {kills} kills, replay rc {replay.poll()}"
            operator.check()
            cluster.check_alive()  # the scheduler, the controller manager and the node agent survive it all
            now_s = time.monotonic()
            if kills < NUM_OPERATOR_KILLS and now_s >= next_kill_s:
                operator.kill()
                kills += 1
                TALLY["operator_kills"] += 1
                operator.check()
                next_kill_s = time.monotonic() + rng.uniform(0.5, 5.0)
            if not restarted_api and kills >= NUM_OPERATOR_KILLS // 2:
                away_s = cluster.plane.restart_apiserver_and_etcd()
                restarted_api = True
                TALLY["apiserver_restarts"] += 1
                print(f"API server and etcd restarted: away {away_s:.1f}s")
            if now_s >= next_look_s:
                pods = live_workers(cluster, chaos_ns, pool)
                found = duplicates(pods, max_workers) if pods is not None else []
                wrong += found
                TALLY["duplicate_pods"] += len(found)
                next_look_s = now_s + 1.0
            time.sleep(0.2)
    finally:
        if replay.poll() is None:
            replay.kill()
    output = replay_log.read_text()
    assert replay.returncode == 0, f"replay failed ({replay.returncode}):\n{output[-4000:]}"
    record = json.loads((out / "record.json").read_text())
    TALLY["streams"] += record["streams"]
    TALLY["streams_whole"] += record["streamsWhole"]
    TALLY["lost"] += record["streams"] - record["streamsWhole"]
    assert record["streams"] > 5, output[-2000:]
    assert record["streamsWhole"] == record["streams"], f"streams not whole: {record['notWhole']}"
    assert not wrong, f"duplicate worker pods seen during the run: {wrong}"

    # Settled where a run without kills ends: the floor of Ready workers, nothing moving or held.
    def settled() -> dict[str, Any] | None:
        operator.check()
        pods = live_workers(cluster, chaos_ns, pool)
        status = (get_json(cluster, "llmpool", pool, "-n", chaos_ns) or {}).get("status") or {}
        migs = migrations_of(cluster, chaos_ns, pool)
        if (pods is not None and len(pods) == min_workers and all(ready(p) for p in pods)
                and status.get("readyWorkers") == min_workers and status.get("migrationsInFlight") == 0
                and all(phase(m) in FINISHED for m in migs)):
            return status
        return None

    try:
        wait_for(settled, f"the pool to settle at {min_workers} Ready worker(s), nothing in flight", timeout_s=180, interval_s=1)
    finally:
        migs = migrations_of(cluster, chaos_ns, pool)
        tally_migrations(migs)
    unfinished = [(m["metadata"]["name"], phase(m)) for m in migs if phase(m) not in FINISHED]
    assert not unfinished, f"KVMigrations left unfinished: {unfinished}"
    for mig in migs:
        assert phase(mig) == "Succeeded" or (mig.get("status") or {}).get("message"), f"a Failed move without a reason: {mig}"
    cluster.kubectl("delete", "llmpool", pool, "-n", chaos_ns, "--wait=false")


def test_a_worker_killed_as_the_target_then_as_the_source_of_a_move(cluster: Cluster, chaos_ns: str, operator: OperatorHandle,
                                                                     model_dir: Path) -> None:
    pool = "moves"
    # best-fit plans no moves of its own: the only KVMigrations are the ones this test makes.
    cluster.kubectl("apply", "-n", chaos_ns, "-f", "-", input_text=json.dumps(pool_body(
        pool, model_dir, capacity={"kvCapacityPerWorker": "4Mi"}, workers={"min": 2, "max": 2},
        scheduling={"policy": "best-fit", "epochSeconds": 1})))
    # The unmigrated greedy output, from a plain engine in this process while the pool starts.
    reference: list[str] = []
    computing = threading.Thread(target=lambda: reference.append(Tokenizer(model_dir).decode(
        greedy_outputs(model_dir, [("r", 200, 400)], 8 * 2**20)["r"])), daemon=True)
    computing.start()
    router_ip = wait_pool_up(cluster, operator, chaos_ns, pool, 2)
    body = {"model": "tiny", "prompt": seeded_prompt(200, 0), "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    def move_and_kill(request_id: str, victim: str) -> dict[str, Any]:
        client = Client(router_ip, request_id, body)
        source, target = wait_for(lambda: operator.check() or holder(cluster, chaos_ns, pool, request_id),
                                  f"a worker to report {request_id}", timeout_s=60, interval_s=0.3)
        source_pid, target_pid = worker_pid(source), worker_pid(target)
        # A stopped target accepts the connection (the kernel does) but never answers the handshake:
        # the move stays Transferring until the kill.
        signal_group(target_pid, signal.SIGSTOP)
        try:
            mig = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "KVMigration",
                   "metadata": {"name": request_id, "labels": {"kvfleet.dev/pool": pool}},
                   "spec": {"pool": pool, "requestId": request_id, "sourcePod": source["metadata"]["name"],
                            "targetPod": target["metadata"]["name"], "mode": "kv", "reason": "Rebalance"}}
            cluster.kubectl("create", "-n", chaos_ns, "-f", "-", input_text=json.dumps(mig))
            wait_for(lambda: phase(get_json(cluster, "kvmigration", request_id, "-n", chaos_ns) or {}) in ("Transferring", *FINISHED),
                     f"{request_id} to start", timeout_s=20, interval_s=0.1)
            seen = phase(get_json(cluster, "kvmigration", request_id, "-n", chaos_ns))
            assert seen == "Transferring", f"{request_id} was {seen} before the kill: {get_json(cluster, 'kvmigration', request_id, '-n', chaos_ns)}"
            signal_group(target_pid if victim == "target" else source_pid, signal.SIGKILL)
            TALLY["worker_kills"] += 1
        finally:
            signal_group(target_pid, signal.SIGCONT)
        ended = wait_for(lambda: operator.check() or ((m := get_json(cluster, "kvmigration", request_id, "-n", chaos_ns))
                                                        and phase(m) in FINISHED and m),
                         f"{request_id} to end", timeout_s=90, interval_s=0.5)
        text, tokens, finish = client.result()
        TALLY["streams"] += 1
        whole = tokens == body["max_tokens"] and finish == "length"
        TALLY["streams_whole"] += whole
        TALLY["lost"] += not whole
        assert whole, f"{request_id}: {tokens} tokens, finish {finish}"
        return {"migration": ended, "text": text}

    as_target = move_and_kill("chaos-target-kill", "target")
    # The source was told nothing but a broken connection: it fails the move and keeps the request.
    wait_pool_up(cluster, operator, chaos_ns, pool, 2)
    as_source = move_and_kill("chaos-source-kill", "source")
    computing.join(120)
    assert reference, "the greedy reference was not computed"
    unbroken = reference[0]
    tally_migrations([as_target["migration"], as_source["migration"]])
    for case in (as_target, as_source):
        mig = case["migration"]
        assert phase(mig) == "Failed" and mig["status"].get("message"), f"{mig['metadata']['name']}: {mig.get('status')}"
        assert case["text"] == unbroken, f"{mig['metadata']['name']}: the client's text differs from the unbroken run"
    print(f"target killed: {as_target['migration']['status']['message']!r}; "
          f"source killed: {as_source['migration']['status']['message']!r}")


def test_a_leader_frozen_past_its_lease_steps_down_without_acting(cluster: Cluster, chaos_ns: str, operator: OperatorHandle) -> None:
    pool = "moves"
    router_ip = wait_pool_up(cluster, operator, chaos_ns, pool, 2)
    wait_for(lambda: operator.check() or "became the leader" in operator.proc.log_path.read_text(errors="replace"),
             "the operator to lead", timeout_s=60)
    standby = start_operator(cluster, "operator-chaos-standby")
    try:
        wait_for(lambda: "waiting to lead" in standby.log_path.read_text(), "the standby to wait", timeout_s=60)
        body = {"model": "tiny", "prompt": seeded_prompt(120, 1), "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        client = Client(router_ip, "chaos-lease", body)
        wait_for(lambda: holder(cluster, chaos_ns, pool, "chaos-lease"), "the stream to be reported", timeout_s=60, interval_s=0.3)
        with operator.lock:
            leader = operator.proc
        signal_group(leader.popen.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: "became the leader" in standby.log_path.read_text(), "the standby to take over", timeout_s=60)
            # The new leader acts (an epoch or two) while the old one is still frozen.
            time.sleep(2.0)
            before = len(leader.log_path.read_bytes())
        finally:
            signal_group(leader.popen.pid, signal.SIGCONT)
        TALLY["lease_losses"] += 1
        code = wait_for(lambda: leader.popen.poll() is not None and str(leader.popen.returncode), "the old leader to exit", timeout_s=30)
        after = leader.log_path.read_bytes()[before:].decode(errors="replace")
        assert code == "1", f"the old leader exited with {code}:\n{after[-3000:]}"
        assert "stepping down" in after, f"the old leader did not say it stepped down:\n{after[-3000:]}"
        acted = [line for line in after.splitlines()
                 if any(mark in line for mark in ("created worker", "deleted worker", "MigrationPlanned", "waking ", "MigrationTimedOut",
                                                  "MigrationSourceLost"))]
        assert not acted, f"the old leader acted after it woke: {acted}"
        operator.check()  # restarted as its Deployment would: a follower now
        text, tokens, finish = client.result()
        TALLY["streams"] += 1
        TALLY["streams_whole"] += tokens == body["max_tokens"] and finish == "length"
        TALLY["lost"] += not (tokens == body["max_tokens"] and finish == "length")
        assert tokens == body["max_tokens"] and finish == "length", (tokens, finish)
        pods = live_workers(cluster, chaos_ns, pool) or []
        wrong = duplicates(pods, 2)
        TALLY["duplicate_pods"] += len(wrong)
        assert not wrong, wrong
        migs = migrations_of(cluster, chaos_ns, pool)
        live_moves = [(m["spec"]["requestId"]) for m in migs if phase(m) not in FINISHED]
        assert len(live_moves) == len(set(live_moves)), f"two moves of one request in flight: {live_moves}"
    finally:
        stop_process(standby)
    # The first replica leads again once the standby is gone.
    wait_for(lambda: operator.check() or "became the leader" in operator.proc.log_path.read_text(errors="replace"),
             "the restarted operator to lead", timeout_s=60)
