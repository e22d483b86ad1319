"""helm for the e2e, and the list of API calls the operator makes, which the chart's RBAC must allow.

helm is the binary the local cluster's build-controlplane.sh builds from its Go module (pinned in its versions.env),
run with a throwaway HELM_*_HOME so no user configuration or chart repository is read and nothing
goes to the network.

OPERATOR_CALLS is the operator's side of the RBAC contract: every request it sends, with the code
that sends it. Those of kvfleet's own code (kube.Kube, leader.LeaderElector) are checked against
the code by tests/unit/test_chart.py, which reads every Kubernetes client call out of the sources;
kopf's own requests are listed from kopf's source (watching, finalizers, events, its CRD and
namespace observers). e2e/test_helm.py checks on the real API server that the chart's ServiceAccount
may make every one of them, that removing any rule of the chart denies at least one, and that the
operator run under that ServiceAccount is never refused.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvfleet.localcluster.controlplane import BUILD_SCRIPT, REPO_ROOT, VERSIONS_FILE, cache_dir

CHART_DIR = REPO_ROOT / "charts" / "kvfleet"

CLUSTER_WIDE = "cluster-wide"
NAMESPACED = "namespaced"
MODES = (CLUSTER_WIDE, NAMESPACED)


def pinned(name: str) -> str:
    """A version pinned in the local cluster's versions.env."""
    for line in VERSIONS_FILE.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == name:
            return value.strip()
    raise KeyError(f"{name} is not pinned in {VERSIONS_FILE}")


def helm_binary() -> Path:
    """The pinned helm, building it (and the control plane, if cold) on first use."""
    path = cache_dir() / "bin" / f"helm-{pinned('HELM_VERSION')}" / "helm"
    if not path.exists():
        subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)
    if not path.exists():
        raise FileNotFoundError(f"{BUILD_SCRIPT} ran but left no helm at {path}")
    return path


@dataclass
class Helm:
    """helm against one cluster (or none: lint and template need no cluster)."""

    home: Path
    kubeconfig: Path | None = None

    def run(self, *args: str, check: bool = True, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        result = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, env=env, timeout=timeout_s)
        if check and result.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def template(self, release: str, namespace: str, *args: str) -> list[dict[str, Any]]:
        """The objects `helm template` renders (CRDs not included unless args say --include-crds)."""
        out = self.run("template", release, str(CHART_DIR), "--namespace", namespace, *args).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]


def render_chart(*args: str) -> list[dict[str, Any]] | None:
    """`helm template` of the chart (release "r", namespace "ns") with the pinned helm, or None where
    it is not built (building it is the control plane's set-up, which a unit test does not do)."""
    if not (cache_dir() / "bin" / f"helm-{pinned('HELM_VERSION')}" / "helm").exists():
        return None
    with tempfile.TemporaryDirectory() as home:
        return Helm(Path(home)).template("r", "ns", *args)


# --------------------------------------------------------------------------------------- the calls


@dataclass(frozen=True)
class Call:
    """One kind of request the operator sends.

    scope says in which namespace: "pool" (a namespace whose pools it serves), "watch" (kopf's list
    and watch: across all namespaces when cluster-wide, each served namespace otherwise), "cluster"
    (a cluster-scoped resource) or "release" (the operator's own namespace, where its Lease lives).
    """

    verb: str
    resource: str  # plural, with "/subresource" when there is one
    group: str
    scope: str
    who: str
    name: str = ""
    modes: tuple[str, ...] = MODES

    def key(self) -> tuple[str, str, str]:
        return (self.verb, self.group, self.resource)

    def __str__(self) -> str:
        what = f"{self.resource}{'/' + self.name if self.name else ''}" + (f" ({self.group})" if self.group else "")
        return f"{self.verb} {what} [{self.who}]"


KV = "kvfleet.dev"
OPERATOR_CALLS: tuple[Call, ...] = (
    # kvfleet's own code (operator/kvfleet/operator/kube.py Kube, leader.py LeaderElector)
    Call("get", "llmpools", KV, "pool", "Kube.get_pool"),
    Call("patch", "llmpools/status", KV, "pool", "Kube.patch_status"),
    Call("list", "kvmigrations", KV, "pool", "Kube.list_migrations"),
    Call("create", "kvmigrations", KV, "pool", "Kube.create_migration"),
    Call("delete", "kvmigrations", KV, "pool", "Kube.delete_migration"),
    Call("patch", "kvmigrations/status", KV, "pool", "Kube.patch_migration_status"),
    Call("list", "pods", "", "pool", "Kube.worker_pods"),
    Call("list", "kvloads", KV, "pool", "Kube.list_kvloads"),
    Call("create", "pods", "", "pool", "Kube.create (worker pods)"),
    Call("delete", "pods", "", "pool", "Kube.delete_pod"),
    Call("patch", "pods", "", "pool", "Kube.patch_pods_metadata"),
    Call("get", "secrets", "", "pool", "Kube.exists (pool token)"),
    Call("create", "secrets", "", "pool", "Kube.create (pool token)"),
    Call("get", "serviceaccounts", "", "pool", "Kube.exists (workers' ServiceAccount)"),
    Call("create", "serviceaccounts", "", "pool", "Kube.create (workers' ServiceAccount)"),
    Call("get", "roles", "rbac.authorization.k8s.io", "pool", "Kube.role_rules (workers' and router's Roles)"),
    Call("create", "roles", "rbac.authorization.k8s.io", "pool", "Kube.create (workers' Role)"),
    Call("patch", "roles", "rbac.authorization.k8s.io", "pool", "Kube.patch_role_rules (a release's new rules)"),
    Call("get", "rolebindings", "rbac.authorization.k8s.io", "pool", "Kube.exists (workers' RoleBinding)"),
    Call("create", "rolebindings", "rbac.authorization.k8s.io", "pool", "Kube.create (workers' RoleBinding)"),
    Call("get", "services", "", "pool", "Kube.exists (router Service)"),
    Call("create", "services", "", "pool", "Kube.create (router Service)"),
    Call("get", "deployments", "apps", "pool", "Kube.deployment_replicas (headroom), deployment_image_and_ready (router)"),
    Call("create", "deployments", "apps", "pool", "Kube.create (headroom and router Deployments)"),
    Call("patch", "deployments", "apps", "pool", "Kube.scale_deployment (headroom), replace_deployment_template (router)"),
    Call("delete", "deployments", "apps", "pool", "Kube.delete_deployment (headroom)"),
    Call("list", "nodes", "", "cluster", "Kube.node_zones"),
    Call("get", "priorityclasses", "scheduling.k8s.io", "cluster", "Kube.exists (headroom PriorityClass)",
         name="kvfleet-headroom"),
    Call("get", "leases", "coordination.k8s.io", "release", "LeaderElector", name="kvfleet-operator"),
    Call("create", "leases", "coordination.k8s.io", "release", "LeaderElector (first replica ever)"),
    Call("update", "leases", "coordination.k8s.io", "release", "LeaderElector (renew, take over)", name="kvfleet-operator"),
    # kopf (its watcher, finalizers, event poster, resource and namespace observers)
    Call("list", "llmpools", KV, "watch", "kopf: watching pools (daemons, pool_changed)"),
    Call("watch", "llmpools", KV, "watch", "kopf: watching pools (daemons, pool_changed)"),
    Call("patch", "llmpools", KV, "pool", "kopf: finalizer kvfleet.dev/operator (daemons)"),
    Call("list", "pods", "", "watch", "kopf: watching worker pods (worker_changed)"),
    Call("watch", "pods", "", "watch", "kopf: watching worker pods (worker_changed)"),
    Call("create", "events", "", "pool", "kopf: events on pools (Kube.post_event, logged messages)"),
    Call("list", "customresourcedefinitions", "apiextensions.k8s.io", "cluster", "kopf: resource observer"),
    Call("watch", "customresourcedefinitions", "apiextensions.k8s.io", "cluster", "kopf: resource observer"),
    Call("list", "namespaces", "", "cluster", "kopf: namespace observer (--namespace)", modes=(NAMESPACED,)),
    Call("watch", "namespaces", "", "cluster", "kopf: namespace observer (--namespace)", modes=(NAMESPACED,)),
    # The API server's admission: owned objects carry blockOwnerDeletion (resources.owner_reference),
    # which OwnerReferencesPermissionEnforcement (OpenShift, hardened clusters) checks as this.
    Call("update", "llmpools/finalizers", KV, "pool", "admission: blockOwnerDeletion on owned objects"),
)

# What the operator's code can send but the chart withholds on purpose: the chart creates the
# headroom PriorityClass itself (headroom.createPriorityClass), so the operator never needs to, and
# the right to create PriorityClasses would let it mint any priority, even a cluster-wide default.
WITHHELD_CALLS: tuple[Call, ...] = (
    Call("create", "priorityclasses", "scheduling.k8s.io", "cluster", "Kube.create (headroom PriorityClass, when missing)"),
)


def escalation_calls() -> tuple[Call, ...]:
    """The rights of the workers' and the router's Roles, which the operator must hold itself to create
    those Roles (RBAC escalation prevention), derived from resources.worker_rbac and router_objects."""
    from kvfleet.api.models import LLMPoolSpec
    from kvfleet.operator.resources import router_objects, worker_rbac

    pool = {"metadata": {"name": "p", "namespace": "n", "uid": "u"}}
    spec = LLMPoolSpec.model_validate({"model": {"name": "m", "path": "/models/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"}})
    roles = [("the workers' Role (resources.worker_rbac)", next(o for o in worker_rbac(pool) if o["kind"] == "Role")),
             ("the router's Role (resources.router_objects)", next(o for o in router_objects(pool, spec) if o["kind"] == "Role"))]
    calls: dict[tuple[str, str, str], Call] = {}
    for who, role in roles:
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        calls.setdefault((verb, group, resource), Call(verb, resource, group, "pool", f"escalation: {who}"))
    return tuple(calls.values())


def all_calls(mode: str) -> list[Call]:
    """Every call the chart must allow in one mode (cluster-wide or namespaced)."""
    return [c for c in (*OPERATOR_CALLS, *escalation_calls()) if mode in c.modes]
