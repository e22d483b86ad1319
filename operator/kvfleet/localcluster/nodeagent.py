"""A "process kubelet": fake GPU nodes whose pods run as local processes.

There is no container runtime on these machines, yet the operator's behaviour only counts when real
pods are scheduled, become ready, exit, get deleted and garbage-collected. This agent plays N nodes
with `nvidia.com/gpu` capacity and zone labels (nodes.py) and runs every pod the real scheduler binds
to them whose image is one of the project's (images.py) as a process: the container's command, args
and env, with a service-account token from the TokenRequest API handed over as a kubeconfig in
$KUBECONFIG (podenv.py), and a loopback address of its own as the pod IP (127.B.x.y, so every pod can
listen on its declared ports; B is claimed per agent, by binding 127.B.0.1, which no pod gets, so that
clusters running side by side on one machine, as parallel test runs do, never hand out one address). Readiness and liveness probes
(probes.py), restart policy, exit codes and graceful deletion (SIGTERM, SIGKILL after the grace
period, then the final delete a kubelet makes) are reflected in the pod status. Pods with other
images stay Pending with a Warning event that says why.

It also serves the nodes Karpenter's kwok provider creates (kvfleet.localcluster.karpenter): it watches
for them, reports them Ready and runs the pods bound to them; when such a node is deleted, its
machine is gone, so its remaining pods' processes are killed and the pods deleted, as the pod garbage
collector deletes a vanished node's pods (without its wait).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from kvfleet.localcluster.controlplane import die_with_parent
from kvfleet.localcluster.images import container_argv, image_name, load_images
from kvfleet.localcluster.karpenter import NODE_LABEL, PROVIDER_PREFIX
from kvfleet.localcluster.nodes import FakeGpuNodes
from kvfleet.localcluster.podenv import PodEnvironment
from kvfleet.localcluster.probes import Prober
from kvfleet.localcluster.records import AGENT, ContainerRuntime, PodRuntime, Probe, as_body, now_rfc3339

log = logging.getLogger(__name__)

TICK_S = 0.25
MAX_BACKOFF_S = 20.0


# The port each agent binds on 127.B.0.1 to hold its octet B while it lives (pods never get x.y.0.z).
OCTET_CLAIM_PORT = 47_999


def claim_ip_octet() -> tuple[int, socket.socket]:
    """An octet no other live agent on this machine holds, and the socket that holds it until closed
    (the process's exit closes it). Drawn in random order so that a fresh agent rarely probes twice."""
    octets = list(range(1, 255))
    random.SystemRandom().shuffle(octets)
    for octet in octets:
        claim = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            claim.bind((f"127.{octet}.0.1", OCTET_CLAIM_PORT))
        except OSError:
            claim.close()
            continue
        return octet, claim
    raise RuntimeError("every pod-IP octet 127.1-254 is held by another node agent on this machine")


class NodeAgent:
    def __init__(
        self,
        api: client.ApiClient,
        *,
        num_nodes: int,
        gpus_per_node: int,
        num_zones: int,
        node_prefix: str,
        work_dir: Path,
        server: str,
        ca_file: str,
    ) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.stopping = threading.Event()
        self.node_names = [f"{node_prefix}-{i}" for i in range(num_nodes)]
        self.nodes = FakeGpuNodes(api, self.node_names, gpus_per_node, num_zones, self.stopping)
        self.env = PodEnvironment(api, server, ca_file)
        self.prober = Prober(self.env)
        self.work_dir = work_dir
        self.images = load_images()
        self.pods: dict[str, PodRuntime] = {}
        self.refused: dict[str, str] = {}  # pod uid -> why it cannot run here (event already sent)
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._free_ips: list[int] = []
        self._next_ip = 0
        # The second octet of this agent's pod IPs: 1..254, never 0 (127.0.0.1 is the host).
        self._ip_octet, self._octet_claim = claim_ip_octet()

    # ------------------------------------------------------------------------------------- watch

    def watch_loop(self) -> None:
        """List then watch all pods; push (type, pod dict) for every pod (on_event keeps ours)."""
        self._watch(self.core.list_pod_for_all_namespaces, "")

    def node_watch_loop(self) -> None:
        """List then watch the nodes Karpenter's kwok provider creates; push ("NODE_<type>", node)."""
        self._watch(self.core.list_node, "NODE_", label_selector=NODE_LABEL)

    def _watch(self, lister: Any, prefix: str, **selectors: str) -> None:
        resource_version = ""
        while not self.stopping.is_set():
            try:
                if not resource_version:
                    # Raw JSON, not the client's models: the agent works on the API's own dicts.
                    listing: Any = lister(_preload_content=False, **selectors)
                    data = yaml.safe_load(listing.data)
                    resource_version = data["metadata"]["resourceVersion"]
                    for item in data["items"]:
                        self.events.put((prefix + "SYNC", item))
                stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
                    lister,
                    resource_version=resource_version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                    _preload_content=False,
                    **selectors,
                )
                for event in stream:
                    obj = event["raw_object"]
                    resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.events.put((prefix + event["type"], obj))
                    if self.stopping.is_set():
                        break
            except ApiException as err:
                if err.status == 410:
                    resource_version = ""
                else:
                    log.warning("%s watch failed: %s", prefix.lower() or "pod_", err)
                    time.sleep(1)
            except Exception as err:  # connection reset, API server restart
                if self.stopping.is_set():
                    return
                log.warning("%s watch interrupted: %s", prefix.lower() or "pod_", err)
                resource_version = ""
                time.sleep(1)

    # ------------------------------------------------------------------------------------ pods

    def allocate_ip(self) -> str:
        index = self._free_ips.pop() if self._free_ips else self._next_ip
        if index == self._next_ip:
            self._next_ip += 1
        return f"127.{self._ip_octet}.{1 + index // 250}.{index % 250 + 2}"

    def release_ip(self, ip: str) -> None:
        _, _, third, fourth = (int(p) for p in ip.split("."))
        self._free_ips.append((third - 1) * 250 + fourth - 2)

    def on_node_event(self, kind: str, node: dict[str, Any]) -> None:
        """Adopt a node Karpenter created; when it is deleted, stop what still runs there."""
        if not (node.get("spec") or {}).get("providerID", "").startswith(PROVIDER_PREFIX):
            return
        name = node["metadata"]["name"]
        if kind == "NODE_DELETED":
            if self.nodes.forget(name):
                self.node_gone(name)
            return
        # A node being deleted is still served: Karpenter drains it first, and its pods stop gracefully.
        if self.nodes.adopt(node):
            # Pods the scheduler bound to it before the agent adopted it were ignored: take them now.
            listing: Any = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={name}", _preload_content=False)
            for pod in yaml.safe_load(listing.data)["items"]:
                self.on_event("SYNC", pod)

    def node_gone(self, name: str) -> None:
        """The node's machine is gone: its processes die with it, and its pod objects are deleted."""
        for uid, runtime in list(self.pods.items()):
            if runtime.node == name:
                log.info("node %s deleted under pod %s/%s", name, runtime.namespace, runtime.name)
                self.kill_all(runtime, signal.SIGKILL)
                self.release_ip(runtime.ip)
                del self.pods[uid]
                self.final_delete(runtime.body["metadata"])

    def on_event(self, kind: str, pod: dict[str, Any]) -> None:
        if kind.startswith("NODE_"):
            self.on_node_event(kind, pod)
            return
        meta = pod["metadata"]
        uid = meta["uid"]
        node = pod.get("spec", {}).get("nodeName")
        if not self.nodes.serves(node):
            return
        if kind == "DELETED":
            runtime = self.pods.pop(uid, None)
            self.refused.pop(uid, None)
            if runtime:
                self.kill_all(runtime, signal.SIGKILL)
                self.release_ip(runtime.ip)
            return
        runtime = self.pods.get(uid)
        if runtime is not None:
            runtime.body = pod
        if meta.get("deletionTimestamp"):
            self.begin_delete(pod, runtime)
            return
        if runtime is not None or uid in self.refused:
            return
        phase = pod.get("status", {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            return
        why = self.why_not_runnable(pod)
        if why:
            self.refuse(pod, why)
            return
        self.start_pod(pod)

    def why_not_runnable(self, pod: dict[str, Any]) -> str:
        spec = pod["spec"]
        if spec.get("initContainers"):
            return "init containers are not supported by the e2e node agent"
        for container in spec["containers"]:
            if image_name(container["image"]) not in self.images:
                known = ", ".join(sorted(self.images))
                return (f"image {container['image']!r} of container {container['name']!r} is not one of kvfleet's images "
                        f"({known}); the e2e node agent runs only those, as local processes")
        return ""

    def refuse(self, pod: dict[str, Any], why: str) -> None:
        meta = pod["metadata"]
        self.refused[meta["uid"]] = why
        log.info("pod %s/%s cannot run here: %s", meta["namespace"], meta["name"], why)
        self.emit_event(pod, "Warning", "ImageNotRunnable", why)
        statuses = [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "restartCount": 0, "started": False,
             "state": {"waiting": {"reason": "ImageNotRunnable", "message": why}}}
            for c in pod["spec"]["containers"]
        ]
        self.patch_status(meta["namespace"], meta["name"], {
            "phase": "Pending",
            "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "False", "reason": "ContainersNotReady", "message": why,
                            "lastTransitionTime": now_rfc3339()}],
            "containerStatuses": statuses,
        })

    def start_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        directory = self.work_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        directory.mkdir(parents=True, exist_ok=True)
        runtime = PodRuntime(meta["uid"], meta["namespace"], meta["name"], pod["spec"]["nodeName"], self.allocate_ip(), directory, pod)
        runtime.start_time = now_rfc3339()
        self.pods[runtime.uid] = runtime
        try:
            self.env.service_account_kubeconfig(runtime)
            for spec in pod["spec"]["containers"]:
                cont = ContainerRuntime(spec["name"], spec)
                if spec.get("readinessProbe"):
                    cont.readiness = Probe(spec["readinessProbe"])
                if spec.get("livenessProbe"):
                    cont.liveness = Probe(spec["livenessProbe"])
                runtime.containers[cont.name] = cont
                self.start_container(runtime, cont)
        except Exception as err:
            log.exception("pod %s/%s failed to start", runtime.namespace, runtime.name)
            self.emit_event(pod, "Warning", "Failed", f"could not start: {err}")
        self.sync_status(runtime)

    def start_container(self, runtime: PodRuntime, cont: ContainerRuntime) -> None:
        env = self.env.pod_env(runtime, cont.spec)
        argv = container_argv(cont.spec, self.images, env)
        workdir = cont.spec.get("workingDir") or str(runtime.directory)
        log_file = open(runtime.directory / f"{cont.name}.log", "ab")  # noqa: SIM115 - owned by the child
        log_file.write(f"--- {now_rfc3339()} start {shlex.join(argv)}\n".encode())
        log_file.flush()
        try:
            cont.popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=workdir, preexec_fn=die_with_parent)
        finally:
            log_file.close()
        cont.started_at = now_rfc3339()
        cont.started_monotonic = time.monotonic()
        cont.terminated = None
        cont.restart_at = None
        cont.ready = cont.readiness is None
        for probe in (cont.readiness, cont.liveness):
            if probe:
                probe.successes = probe.failures = 0
                probe.next_at = time.monotonic() + float(probe.spec.get("initialDelaySeconds", 0))
        self.emit_event(runtime.body, "Normal", "Started", f"Started container {cont.name} as process {cont.popen.pid}")
        log.info("pod %s/%s container %s started: pid %d ip %s", runtime.namespace, runtime.name, cont.name, cont.popen.pid, runtime.ip)

    # ------------------------------------------------------------------------------ lifecycle

    def tick(self) -> None:
        for runtime in list(self.pods.values()):
            if runtime.kill_deadline is not None:
                self.step_delete(runtime)
                continue
            if runtime.finished:
                continue
            policy = runtime.body["spec"].get("restartPolicy", "Always")
            for cont in runtime.containers.values():
                self.step_container(runtime, cont, policy)
            if all(c.terminated is not None and c.restart_at is None for c in runtime.containers.values()) and runtime.containers:
                runtime.finished = True
            self.sync_status(runtime)

    def step_container(self, runtime: PodRuntime, cont: ContainerRuntime, policy: str) -> None:
        if cont.popen is None:
            if cont.restart_at is not None and time.monotonic() >= cont.restart_at:
                cont.restart_count += 1
                self.start_container(runtime, cont)
            return
        code = cont.popen.poll()
        if code is None:
            if cont.readiness:
                verdict = self.prober.step_probe(runtime, cont, cont.readiness)
                if verdict is not None and verdict != cont.ready:
                    cont.ready = verdict
                    if not verdict:
                        self.emit_event(runtime.body, "Warning", "Unhealthy", f"Readiness probe of {cont.name} failed")
            if cont.liveness and self.prober.step_probe(runtime, cont, cont.liveness) is False:
                self.emit_event(runtime.body, "Warning", "Unhealthy", f"Liveness probe of {cont.name} failed; restarting it")
                self.kill_container(cont, signal.SIGTERM)
            return
        # The process exited: record it, then restart it or leave it terminated per restartPolicy.
        reason = "Completed" if code == 0 else ("Error" if code > 0 else "Killed")
        state = {"exitCode": code if code >= 0 else 128 - code, "reason": reason, "startedAt": cont.started_at,
                 "finishedAt": now_rfc3339()}
        if code < 0:
            state["signal"] = -code
        cont.popen = None
        cont.ready = False
        cont.last_terminated = state
        restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if restart:
            ran_s = time.monotonic() - cont.started_monotonic
            backoff_s = 0.0 if ran_s > 60 else min(MAX_BACKOFF_S, 0.5 * 2 ** min(cont.restart_count, 6))
            cont.restart_at = time.monotonic() + backoff_s
            cont.terminated = None
            self.emit_event(runtime.body, "Warning" if code else "Normal", "BackOff" if code else "Restarting",
                            f"container {cont.name} exited with {state['exitCode']}; restarting in {backoff_s:.1f}s")
        else:
            cont.terminated = state
        log.info("pod %s/%s container %s exited %s", runtime.namespace, runtime.name, cont.name, code)

    def kill_container(self, cont: ContainerRuntime, sig: int) -> None:
        if cont.popen is not None and cont.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cont.popen.pid, sig)

    def kill_all(self, runtime: PodRuntime, sig: int) -> None:
        for cont in runtime.containers.values():
            self.kill_container(cont, sig)
            if sig == signal.SIGKILL and cont.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    cont.popen.wait(5)

    def begin_delete(self, pod: dict[str, Any], runtime: PodRuntime | None) -> None:
        if runtime is None:
            # Never started here (refused, finished before we saw it, or left over): nothing to stop.
            self.final_delete(pod["metadata"])
            return
        if runtime.kill_deadline is not None:
            return
        grace_s = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace_s is None:
            grace_s = pod["spec"].get("terminationGracePeriodSeconds", 30)
        runtime.kill_deadline = time.monotonic() + float(grace_s)
        for cont in runtime.containers.values():
            if cont.popen is not None:
                self.emit_event(pod, "Normal", "Killing", f"Stopping container {cont.name} (grace period {grace_s}s)")
        self.kill_all(runtime, signal.SIGTERM)
        self.step_delete(runtime)

    def step_delete(self, runtime: PodRuntime) -> None:
        alive = [c for c in runtime.containers.values() if c.popen is not None and c.popen.poll() is None]
        if alive and runtime.kill_deadline is not None and time.monotonic() < runtime.kill_deadline:
            return
        self.kill_all(runtime, signal.SIGKILL)
        self.final_delete(runtime.body["metadata"])

    def final_delete(self, meta: dict[str, Any]) -> None:
        """The kubelet's last word: delete with grace 0, guarded by the UID."""
        try:
            self.core.delete_namespaced_pod(
                meta["name"], meta["namespace"],
                body=client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta["uid"])),
            )
        except ApiException as err:
            if err.status not in (404, 409):
                log.warning("final delete of %s/%s failed: %s", meta["namespace"], meta["name"], err)

    # -------------------------------------------------------------------------------- status

    def sync_status(self, runtime: PodRuntime) -> None:
        statuses = []
        for cont in runtime.containers.values():
            if cont.popen is not None:
                state: dict[str, Any] = {"running": {"startedAt": cont.started_at}}
            elif cont.terminated is not None:
                state = {"terminated": cont.terminated}
            else:
                state = {"waiting": {"reason": "CrashLoopBackOff" if cont.restart_count or cont.last_terminated else "ContainerCreating"}}
            entry: dict[str, Any] = {
                "name": cont.name, "image": cont.spec["image"], "imageID": f"kvfleet://{image_name(cont.spec['image'])}",
                "containerID": f"process://{cont.popen.pid}" if cont.popen else "", "ready": cont.ready and cont.popen is not None,
                "restartCount": cont.restart_count, "started": cont.popen is not None, "state": state,
            }
            if cont.last_terminated:
                entry["lastState"] = {"terminated": cont.last_terminated}
            statuses.append(entry)
        all_ready = bool(statuses) and all(s["ready"] for s in statuses)
        terminated = [c.terminated for c in runtime.containers.values()]
        if runtime.finished:
            phase = "Succeeded" if all(t and t["exitCode"] == 0 for t in terminated) else "Failed"
        else:
            phase = "Running" if any(c.popen is not None for c in runtime.containers.values()) else "Pending"
        ready = "True" if all_ready and phase == "Running" else "False"
        status: dict[str, Any] = {
            "phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "podIP": runtime.ip,
            "podIPs": [{"ip": runtime.ip}], "startTime": runtime.start_time, "containerStatuses": statuses,
            "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": ready},
            ],
        }
        # Write only on change; transition timestamps are added to what is sent, not compared.
        if status == runtime.last_status:
            return
        previous = {c["type"]: c["status"] for c in (runtime.last_status or {}).get("conditions", [])}
        stamp = now_rfc3339()
        conditions: list[dict[str, Any]] = status["conditions"]
        sent = status | {"conditions": [
            c | {"lastTransitionTime": stamp} if previous.get(c["type"]) != c["status"] else c for c in conditions
        ]}
        if self.patch_status(runtime.namespace, runtime.name, sent):
            runtime.last_status = status

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> bool:
        try:
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status})
            return True
        except ApiException as err:
            if err.status != 404:
                log.warning("status of %s/%s not written: %s", namespace, name, err.reason)
            return False

    def emit_event(self, pod: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        stamp = now_rfc3339()
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta["uid"]},
            "reason": reason, "message": message[:1000], "type": type_, "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": AGENT, "host": pod["spec"].get("nodeName", "")},
            "reportingComponent": AGENT, "reportingInstance": pod["spec"].get("nodeName", ""),
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], as_body(body))
        except ApiException as err:
            log.debug("event not written: %s", err)

    # ---------------------------------------------------------------------------------- main

    def run(self) -> None:
        self.nodes.register_nodes()
        threads = [threading.Thread(target=t, daemon=True, name=t.__name__) for t in (self.watch_loop, self.node_watch_loop, self.nodes.heartbeat_loop)]
        for thread in threads:
            thread.start()
        print("node agent ready", flush=True)
        while not self.stopping.is_set():
            try:
                kind, pod = self.events.get(timeout=TICK_S)
                self.on_event(kind, pod)
                while True:
                    kind, pod = self.events.get_nowait()
                    self.on_event(kind, pod)
            except queue.Empty:
                pass
            except Exception:
                log.exception("event handling failed")
            try:
                self.tick()
            except Exception:
                log.exception("tick failed")
        self.shutdown()

    def shutdown(self) -> None:
        for runtime in self.pods.values():
            self.kill_all(runtime, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for runtime in self.pods.values():
            for cont in runtime.containers.values():
                if cont.popen is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        cont.popen.wait(max(0.1, deadline - time.monotonic()))
            self.kill_all(runtime, signal.SIGKILL)
        self.prober.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--gpus-per-node", type=int, default=2)
    parser.add_argument("--zones", type=int, default=2)
    parser.add_argument("--node-prefix", default="gpu-node")
    parser.add_argument("--work-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config.load_kube_config(args.kubeconfig)  # type: ignore[no-untyped-call]
    api = client.ApiClient()
    cfg = api.configuration
    agent = NodeAgent(api, num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, num_zones=args.zones,
                      node_prefix=args.node_prefix, work_dir=args.work_dir, server=cfg.host, ca_file=cfg.ssl_ca_cert)

    def stop(_signum: int, _frame: Any) -> None:
        agent.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
