"""A whole local cluster: the control plane, the node agent with fake GPU nodes, and kvfleet's CRDs;
on request, Karpenter as the node autoscaler (kvfleet.localcluster.karpenter).

This is what the e2e tests and `make demo` (kvfleet.demo) share, so that what the demo shows is what
the tests check.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvfleet.localcluster import karpenter as karpenter_setup
from kvfleet.localcluster.controlplane import REPO_ROOT, ControlPlane, Process, free_port, start_process, stop_process

CRDS_DIR = REPO_ROOT / "crds"
T = TypeVar("T")


def wait_for(probe: Callable[[], T | None], what: str, timeout_s: float = 60, interval_s: float = 0.2) -> T:
    """Poll until `probe` returns something truthy; fail with `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


@dataclass
class Cluster:
    plane: ControlPlane
    agent: Process
    num_nodes: int
    gpus_per_node: int
    karpenter: Process | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    def kubectl(self, *args: str, check: bool = True, input_text: str | None = None,
                timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        result = self.plane.kubectl_run(*args, check=False, input_text=input_text, timeout_s=timeout_s)
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def get_json(self, *args: str, check: bool = True) -> Any:
        """`kubectl get ARGS -o json` as a dict, or None when it is not found and check is False."""
        result = self.kubectl("get", *args, "-o", "json", check=check)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def pod_dir(self, namespace: str, name: str) -> Path:
        """The node agent's folder for a pod: its kubeconfig and one log file per container."""
        matches = sorted((self.plane.work_dir / "agent" / "pods").glob(f"{namespace}_{name}_*"))
        if not matches:
            raise FileNotFoundError(f"the node agent never started {namespace}/{name}")
        return matches[-1]

    def check_alive(self) -> None:
        self.plane.check_alive()
        code = self.agent.popen.poll()
        if code is not None:
            raise RuntimeError(f"node agent exited with {code}:\n{self.agent.tail()}")
        if self.karpenter is not None and (code := self.karpenter.popen.poll()) is not None:
            raise RuntimeError(f"karpenter exited with {code}:\n{self.karpenter.tail()}")

    def apply_crds(self) -> None:
        self.kubectl("apply", "--server-side", "--field-manager=kvfleet-e2e", "-f", str(CRDS_DIR))
        self.plane.wait_established([crd.stem + ".kvfleet.dev" for crd in sorted(CRDS_DIR.glob("*.yaml"))])

    def wait_nodes(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            out = self.kubectl("get", "nodes", "-l", "kvfleet.dev/node-agent=true", "-o", "name", check=False).stdout
            if len(out.split()) >= self.num_nodes:
                return
            time.sleep(0.3)
        raise TimeoutError(f"node agent did not register {self.num_nodes} nodes:\n{self.agent.tail()}")

    def wait_default_service_account(self, namespace: str, timeout_s: float = 60) -> None:
        """Pods are refused until the controller manager has made the namespace's `default` SA."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise TimeoutError(f"no default ServiceAccount in {namespace}")

    def start_karpenter(self, *, registration_delay_s: float, instance_types: Sequence[str],
                        consolidate_after_s: float) -> None:
        """Karpenter's CRDs, the node class and kvfleet's NodePool, then Karpenter itself."""
        for crd in karpenter_setup.crd_paths():
            self.kubectl("apply", "--server-side", "--field-manager=kvfleet-e2e", "-f", str(crd))
        self.plane.wait_established(["nodepools.karpenter.sh", "nodeclaims.karpenter.sh",
                                     "kwoknodeclasses.karpenter.kwok.sh"])
        self.apply_json(karpenter_setup.node_class(registration_delay_s))
        self.apply_json(karpenter_setup.node_pool(instance_types, consolidate_after_s=consolidate_after_s))
        self.karpenter = karpenter_setup.start_karpenter(self.kubeconfig, self.plane.work_dir)

    def apply_json(self, obj: dict[str, Any], namespace: str | None = None) -> None:
        self.kubectl("apply", *(("-n", namespace) if namespace else ()), "-f", "-", input_text=json.dumps(obj))

    def stop(self) -> None:
        if self.karpenter is not None:
            stop_process(self.karpenter)
        stop_process(self.agent)
        self.plane.stop()


def start_operator(cluster: Cluster, name: str = "operator", metrics_port: int | None = None,
                   lease_duration_s: float = 2.0) -> Process:
    """The operator as a local process with the admin kubeconfig; a short lease so a killed leader is
    replaced within seconds."""
    return start_process(
        name,
        [sys.executable, "-m", "kvfleet.operator", f"--liveness=http://127.0.0.1:{free_port()}/healthz",
         "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port or free_port()}",
         f"--lease-duration={lease_duration_s}"],
        cluster.plane.work_dir / "logs",
        env={"KUBECONFIG": str(cluster.kubeconfig)},
    )


@contextlib.contextmanager
def local_cluster(num_nodes: int = 3, gpus_per_node: int = 2, num_zones: int = 2,
                  work_dir: Path | None = None, extra_python_path: Sequence[Path] = (), *,
                  karpenter: bool = False, node_registration_delay_s: float = 2.0,
                  instance_types: Sequence[str] = ("gpu-1x", "gpu-2x"),
                  consolidate_after_s: float = 5.0) -> Iterator[Cluster]:
    """Start everything, yield the cluster, and tear it all down whatever happens.

    `extra_python_path` goes before the node agent's PYTHONPATH, so images whose module lives outside
    the installed package resolve (the tests' scripted worker, from e2e/). With `karpenter`, Karpenter
    adds GPU nodes of `instance_types` for pods that do not fit (each Ready `node_registration_delay_s`
    after its NodeClaim, the "cloud's" boot time) and consolidates them (`consolidate_after_s`).
    """
    plane = ControlPlane.start(work_dir)
    agent = None
    cluster: Cluster | None = None
    try:
        agent = start_process(
            "node-agent",
            [sys.executable, "-m", "kvfleet.localcluster.nodeagent", f"--kubeconfig={plane.kubeconfig}", f"--nodes={num_nodes}",
             f"--gpus-per-node={gpus_per_node}", f"--zones={num_zones}", f"--work-dir={plane.work_dir / 'agent'}"],
            plane.work_dir / "logs",
            env={"PYTHONPATH": os.pathsep.join(filter(None, [*map(str, extra_python_path), os.environ.get("PYTHONPATH", "")]))},
        )
        cluster = Cluster(plane, agent, num_nodes, gpus_per_node)
        cluster.wait_nodes()
        cluster.apply_crds()
        if karpenter:
            cluster.start_karpenter(registration_delay_s=node_registration_delay_s, instance_types=instance_types,
                                    consolidate_after_s=consolidate_after_s)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        else:
            if agent is not None:
                stop_process(agent)
            plane.stop()
