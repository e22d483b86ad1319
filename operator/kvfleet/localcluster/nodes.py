"""The fake GPU nodes the node agent plays: registered with `nvidia.com/gpu` capacity and zone labels,
kept Ready with leases and status heartbeats, as a kubelet would."""

from __future__ import annotations

import contextlib
import datetime as dt
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
            # Admission taints new nodes not-ready; the node-lifecycle controller that would lift the
            # taint once the node reports Ready is off (see controlplane.py), so the agent lifts it.
            spec = self.core.read_node(name).spec
            taints = (spec.taints if spec is not None else None) or []
            kept = [t.to_dict() for t in taints if not t.key.startswith("node.kubernetes.io/")]
            if len(kept) != len(taints):
                self.core.patch_node(name, {"spec": {"taints": kept or None}})
            self.renew_lease(name)
        log.info("registered nodes %s with %d nvidia.com/gpu each", ", ".join(self.node_names), self.gpus_per_node)

    def node_status(self) -> dict[str, Any]:
        capacity = {"cpu": "16", "memory": "128Gi", "pods": "110", "ephemeral-storage": "100Gi", "nvidia.com/gpu": str(self.gpus_per_node)}
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
            try:
                for name in self.node_names:
                    self.renew_lease(name)
                if time.monotonic() - last_status > 60:
                    for name in self.node_names:
                        self.core.patch_node_status(name, {"status": self.node_status()})
                    last_status = time.monotonic()
            except Exception:  # the API may be briefly away; the next beat retries
                log.exception("heartbeat failed")
