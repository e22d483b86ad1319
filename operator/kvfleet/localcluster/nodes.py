"""The fake GPU nodes the node agent plays: registered with `nvidia.com/gpu` capacity and zone labels,
kept Ready with leases and status heartbeats, as a kubelet would.

Besides its own nodes, the agent serves the nodes a node autoscaler creates (Karpenter's kwok
provider, kvfleet.localcluster.karpenter): those arrive as Node objects with their instance type's
capacity and no kubelet behind them; the agent adopts them (reports them Ready, renews their lease)
until they are deleted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvfleet.localcluster.records import AGENT, as_body, now_rfc3339

log = logging.getLogger(__name__)


class FakeGpuNodes:
    """N nodes named `<prefix>-<i>`, spread over `num_zones` zones, each with `gpus_per_node` GPUs."""

    def __init__(self, api: client.ApiClient, node_names: list[str], gpus_per_node: int, num_zones: int,
                 stopping: threading.Event) -> None:
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.node_names = node_names
        self.gpus_per_node = gpus_per_node
        self.num_zones = max(1, num_zones)
        self.stopping = stopping
        # Nodes created by a node autoscaler that this agent serves: name -> their allocatable
        # resources. Written by the agent's event thread, read by the heartbeat thread.
        self._adopted: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def serves(self, name: str | None) -> bool:
        with self._lock:
            return name in self.node_names or name in self._adopted

    def served(self) -> list[tuple[str, dict[str, Any]]]:
        """Every node this agent plays, with the status it reports."""
        with self._lock:
            adopted = list(self._adopted.items())
        return [(name, self.node_status()) for name in self.node_names] + [
            (name, self.node_status(resources)) for name, resources in adopted]

    def adopt(self, node: dict[str, Any]) -> bool:
        """Serve a node that a node autoscaler created (True if it is new to the agent): report it Ready
        with the resources its creator gave it. Its taints are its creator's: Karpenter lifts its own
        `karpenter.sh/unregistered` taint once the node is registered, as it would for a real kubelet."""
        name = node["metadata"]["name"]
        resources = {k: str(v) for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()}
        with self._lock:
            if name in self._adopted:
                return False
            self._adopted[name] = resources
        self.core.patch_node_status(name, {"status": self.node_status(resources)})
        self.lift_admission_taints(name)
        self.renew_lease(name)
        log.info("serving node %s (%s nvidia.com/gpu), created by %s", name, resources.get("nvidia.com/gpu", "0"),
                 (node["metadata"].get("labels") or {}).get("karpenter.sh/nodepool", "a node autoscaler"))
        return True

    def forget(self, name: str) -> bool:
        with self._lock:
            return self._adopted.pop(name, None) is not None

    def zone_of(self, index: int) -> str:
        return f"zone-{index % self.num_zones}"

    def register_nodes(self) -> None:
        for index, name in enumerate(self.node_names):
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "topology.kubernetes.io/region": "local",
                "topology.kubernetes.io/zone": self.zone_of(index),
                "nvidia.com/gpu.present": "true",
                "kvfleet.dev/node-agent": "true",
            }
            body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
            try:
                self.core.create_node(as_body(body))
            except ApiException as err:
                if err.status != 409:
                    raise
                self.core.patch_node(name, {"metadata": {"labels": labels}})
            self.core.patch_node_status(name, {"status": self.node_status()})
            self.lift_admission_taints(name)
            self.renew_lease(name)
        log.info("registered nodes %s with %d nvidia.com/gpu each", ", ".join(self.node_names), self.gpus_per_node)

    def lift_admission_taints(self, name: str) -> None:
        """Admission taints new nodes not-ready; the node-lifecycle controller that would lift the taint
        once the node reports Ready is off (see controlplane.py), so the agent lifts it. Others' taints
        stay: the write carries the resourceVersion it read, so a taint that Karpenter removed
        meanwhile is not written back (a conflict reads again)."""
        for _ in range(10):
            node: Any = self.core.read_node(name, _preload_content=False)
            body = json.loads(node.data)
            taints = body["spec"].get("taints") or []
            kept = [t for t in taints if not t["key"].startswith("node.kubernetes.io/")]
            if len(kept) == len(taints):
                return
            try:
                self.core.patch_node(name, {"metadata": {"resourceVersion": body["metadata"]["resourceVersion"]},
                                            "spec": {"taints": kept or None}})
                return
            except ApiException as err:
                if err.status != 409:
                    raise
        raise RuntimeError(f"could not lift the admission taints of node {name}: it kept changing")

    def node_status(self, resources: dict[str, str] | None = None) -> dict[str, Any]:
        """A kubelet's status report; `resources` for an adopted node (capacity = allocatable: no daemons
        run beside the pods), else the agent's own node shape."""
        capacity = resources or {"cpu": "16", "memory": "128Gi", "pods": "110", "ephemeral-storage": "100Gi",
                                 "nvidia.com/gpu": str(self.gpus_per_node)}
        stamp = now_rfc3339()
        conditions = [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": f"{AGENT} is posting ready status"},
            {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory", "message": ""},
            {"type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure", "message": ""},
            {"type": "PIDPressure", "status": "False", "reason": "KubeletHasSufficientPID", "message": ""},
        ]
        for cond in conditions:
            cond["lastHeartbeatTime"] = stamp
            cond["lastTransitionTime"] = stamp
        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": socket.gethostname()}],
            "nodeInfo": {
                "machineID": "kvfleet", "systemUUID": "kvfleet", "bootID": "kvfleet", "kernelVersion": os.uname().release,
                "osImage": "kvfleet e2e", "containerRuntimeVersion": "process://1", "kubeletVersion": "v1.36.3",
                "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
            },
        }

    def renew_lease(self, name: str) -> None:
        spec = {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        body = {"metadata": {"name": name, "namespace": "kube-node-lease"}, "spec": spec}
        try:
            self.coordination.patch_namespaced_lease(name, "kube-node-lease", {"spec": spec})
        except ApiException as err:
            if err.status != 404:
                raise
            with contextlib.suppress(ApiException):
                self.coordination.create_namespaced_lease("kube-node-lease", as_body(body))

    def heartbeat_loop(self) -> None:
        last_status = time.monotonic()
        while not self.stopping.wait(10):
            served = self.served()
            for name, _ in served:
                try:
                    self.renew_lease(name)
                except Exception:  # the API may be briefly away; the next beat retries
                    log.exception("heartbeat of %s failed", name)
            if time.monotonic() - last_status > 60:
                for name, status in served:
                    with contextlib.suppress(Exception):  # as above; a deleted node's 404 included
                        self.core.patch_node_status(name, {"status": status})
                last_status = time.monotonic()
