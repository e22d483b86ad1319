"""Karpenter in the local cluster: a real node autoscaler that provisions and consolidates GPU nodes.

Users run kvfleet beside Karpenter or the cluster autoscaler; the annotations and conditions kvfleet
sets for them (kvfleet.operator.pods) only count if a node autoscaler actually reads them. Karpenter's
`kwok` cloud provider (built from its Go module by build-controlplane.sh) creates Node objects instead
of cloud machines; the node agent (nodeagent.py) serves those nodes as it serves its own: Ready, the
GPU capacity of their instance type, pods run as processes, and their pods stop when Karpenter deletes
them.

This module writes the instance types (GPU nodes with prices, so consolidation has something to
weigh), applies Karpenter's CRDs, a KWOKNodeClass and a NodePool for kvfleet's workers, and runs the
Karpenter process against the local API server.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.localcluster.controlplane import BUILD_SCRIPT, Process, cache_dir, free_port, start_process

# Karpenter's kwok nodes carry this provider ID prefix (kwok/cloudprovider/const.go in its module).
PROVIDER_PREFIX = "kwok://"
# ... and this label (kwok/apis/v1alpha1/labels.go), which the node agent watches them by.
NODE_LABEL = "kwok.x-k8s.io/node=fake"
NODE_POOL = "kvfleet-gpu"
NODE_CLASS = "kvfleet"
# The zones of the node agent's own nodes (nodes.py: zone-<i>), so a pool's spread covers both kinds.
ZONES = ("zone-0", "zone-1")


@dataclass(frozen=True)
class InstanceType:
    """A GPU node Karpenter may launch; `price_per_hour` is on-demand dollars, one GPU priced alike on every type."""

    name: str
    gpus: int
    cpus: int
    memory_gib: int
    price_per_hour: float

    def resources(self) -> dict[str, str]:
        return {"cpu": str(self.cpus), "memory": f"{self.memory_gib}Gi", "pods": "110",
                "ephemeral-storage": "100Gi", "nvidia.com/gpu": str(self.gpus)}


# A 1-GPU and a 2-GPU type for the e2e tests and the demo, and the paper setups' 8-GPU node for the
# scale bench. The price per GPU-hour is the same on each ($4.10, an A100-40GB's share of an 8-GPU
# cloud node), so the cheapest fit is the smallest node that holds the pending workers: consolidation
# replaces a half-empty 2-GPU node with a 1-GPU one, and deletes a node whose workers fit elsewhere.
GPU_PRICE_PER_HOUR = 4.10
INSTANCE_TYPES = (
    InstanceType("gpu-1x", 1, 8, 64, 1 * GPU_PRICE_PER_HOUR),
    InstanceType("gpu-2x", 2, 16, 128, 2 * GPU_PRICE_PER_HOUR),
    InstanceType("gpu-8x", 8, 64, 512, 8 * GPU_PRICE_PER_HOUR),
)


def instance_type(name: str) -> InstanceType | None:
    return next((t for t in INSTANCE_TYPES if t.name == name), None)


def instance_types_json(types: Sequence[InstanceType] = INSTANCE_TYPES) -> list[dict[str, Any]]:
    """The kwok provider's instance-types file (`--instance-types-file-path`): one on-demand offering per zone."""
    return [{
        "name": t.name,
        "architecture": "amd64",
        "operatingSystems": ["linux"],
        "resources": t.resources(),
        "offerings": [{"Price": t.price_per_hour, "Available": True, "Requirements": [
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [zone]},
        ]} for zone in ZONES],
    } for t in types]


def node_class(registration_delay_s: float) -> dict[str, Any]:
    """The KWOKNodeClass: `nodeRegistrationDelay` is how long a "cloud" takes to boot a node."""
    return {"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass", "metadata": {"name": NODE_CLASS},
            "spec": {"nodeRegistrationDelay": f"{registration_delay_s:g}s"}}


def node_pool(instance_types: Sequence[str] = ("gpu-1x", "gpu-2x"), *, consolidate_after_s: float = 5,
              gpu_limit: int = 16) -> dict[str, Any]:
    """A NodePool for kvfleet's GPU workers (docs/autoscaling.md explains each field).

    Consolidation `WhenEmptyOrUnderutilized`: Karpenter may move pods that do not say
    `karpenter.sh/do-not-disrupt: "true"`, which kvfleet sets on every worker holding KV cache or in a
    move, so it only ever moves empty workers; MELL's own draining empties the rest.
    """
    return {"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": NODE_POOL}, "spec": {
        "template": {
            "metadata": {"labels": {"nvidia.com/gpu.present": "true"}},
            "spec": {
                "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": NODE_CLASS},
                "requirements": [
                    {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": list(instance_types)},
                    {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                ],
                "expireAfter": "Never",
            },
        },
        "disruption": {"consolidationPolicy": "WhenEmptyOrUnderutilized", "consolidateAfter": f"{consolidate_after_s:g}s",
                       "budgets": [{"nodes": "100%"}]},
        "limits": {"nvidia.com/gpu": str(gpu_limit)},
    }}


def karpenter_dir() -> Path:
    """The cached Karpenter binary and its CRDs, building them first if the cache is cold."""
    current = cache_dir() / "bin" / "karpenter-current"
    if not (current / "karpenter").exists() or not list((current / "crds").glob("*.yaml")):
        subprocess.run(["bash", str(BUILD_SCRIPT), "--without-helm"], check=True)
    return current.resolve()


def start_karpenter(kubeconfig: Path, work_dir: Path) -> Process:
    """Karpenter as a local process: one replica (no leader election), its ports free ones, the
    instance types above. Its CRDs must be applied first (`crd_paths`)."""
    types_file = work_dir / "karpenter-instance-types.json"
    types_file.write_text(json.dumps(instance_types_json(), indent=1))
    return start_process("karpenter", [
        str(karpenter_dir() / "karpenter"), "--disable-leader-election",
        f"--metrics-port={free_port()}", f"--health-probe-port={free_port()}",
        f"--instance-types-file-path={types_file}",
        # Pods pending for 1 s with no new ones end a provisioning batch (10 s at most): the defaults.
        "--batch-idle-duration=1s", "--batch-max-duration=10s",
    ], work_dir / "logs", env={"KUBECONFIG": str(kubeconfig), "LOG_LEVEL": os.environ.get("KVFLEET_KARPENTER_LOG_LEVEL", "info")})


def crd_paths() -> list[Path]:
    return sorted((karpenter_dir() / "crds").glob("*.yaml"))
