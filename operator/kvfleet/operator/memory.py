"""`MemoryKube`: the cluster as dicts behind the `KubeApi` contract, for unit tests and benchmarks.

It lets the operator's real pass (kvfleet.operator.reconcile.reconcile_pool) run without an API server,
in tests/unit and in bench/operator_epochs.py, counting writes the way `Kube` does. It lives beside
`Kube` and is checked against the same Protocol by `mypy --strict -p kvfleet.operator`, so a call
the reconcile starts making is a type error here, not a crash found later in a benchmark.

A scripted kubelet: a pod it creates is scheduled (on `node-<n>`, `pods_per_node` to a node,
`nodes_per_zone` nodes to a zone) and Ready at once. A Deployment has as many Ready replicas as
`ready_replicas` says (none until set). Callers script everything else (reports, migrations'
progress) by editing `pool`, `pods` and `migrations` directly.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any


class MemoryKube:
    """An in-memory `kvfleet.operator.kube.KubeApi` holding one pool and what it owns."""

    def __init__(self, pool: dict[str, Any], *, pods_per_node: int = 8, nodes_per_zone: int = 4) -> None:
        self.pool = pool
        self.pods: dict[str, dict[str, Any]] = {}
        self.kvloads: dict[str, dict[str, Any]] = {}  # pod name -> its KVLoad
        self.created_pods = 0
        self.migrations: dict[str, dict[str, Any]] = {}
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}  # everything else, by (kind, name)
        self.ready_replicas: dict[str, int] = {}  # Deployment name -> its Ready replicas
        self.events: list[tuple[str, str, bool]] = []  # (reason, message, warning)
        self.pods_per_node = pods_per_node
        self.nodes_per_zone = nodes_per_zone
        self._writes: dict[str, int] = {}

    def _record_write(self, kind: str) -> None:
        self._writes[kind] = self._writes.get(kind, 0) + 1

    def writes(self) -> dict[str, int]:
        counts, self._writes = self._writes, {}
        return counts

    # Reads hand out copies, as the API server does: the reconcile must not see its own edits early.

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.pool) if self.pool["metadata"]["name"] == name else None

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._record_write("patch_llmpool_status")
        self.pool["status"] = copy.deepcopy(status)

    def exists(self, namespace: str, kind: str, name: str) -> bool:
        return (kind, name) in self.objects

    def role_rules(self, namespace: str, name: str) -> list[dict[str, Any]] | None:
        role = self.objects.get(("Role", name))
        return copy.deepcopy(role["rules"]) if role is not None else None

    def patch_role_rules(self, namespace: str, name: str, rules: list[dict[str, Any]]) -> None:
        self._record_write("patch_role")
        self.objects[("Role", name)]["rules"] = copy.deepcopy(rules)

    def create(self, namespace: str, obj: dict[str, Any]) -> bool:
        self._record_write(f"create_{obj['kind'].lower()}")
        name = obj["metadata"]["name"]
        if obj["kind"] != "Pod":
            if (obj["kind"], name) in self.objects:
                return False
            self.objects[(obj["kind"], name)] = copy.deepcopy(obj)
            return True
        if name in self.pods:
            return False
        pod = copy.deepcopy(obj)
        pod["metadata"].setdefault("annotations", {})
        self.created_pods += 1
        pod["metadata"].setdefault("uid", f"uid-{self.created_pods}")  # the API server gives each pod a new one
        pod["spec"]["nodeName"] = f"node-{len(self.pods) // self.pods_per_node}"
        pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"},
                                                           {"type": "PodScheduled", "status": "True"}]}
        self.pods[name] = pod
        return True

    def deployment_replicas(self, namespace: str, name: str) -> int | None:
        deployment = self.objects.get(("Deployment", name))
        return None if deployment is None else int(deployment["spec"].get("replicas") or 0)

    def deployment_image_and_ready(self, namespace: str, name: str) -> tuple[str, int] | None:
        deployment = self.objects.get(("Deployment", name))
        if deployment is None:
            return None
        return str(deployment["spec"]["template"]["spec"]["containers"][0]["image"]), self.ready_replicas.get(name, 0)

    def replace_deployment_template(self, namespace: str, body: dict[str, Any]) -> None:
        self._record_write("patch_deployment")
        self.objects[("Deployment", body["metadata"]["name"])]["spec"]["template"] = copy.deepcopy(body["spec"]["template"])

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        self._record_write("patch_deployment")
        self.objects[("Deployment", name)]["spec"]["replicas"] = replicas

    def delete_deployment(self, namespace: str, name: str) -> None:
        self._record_write("delete_deployment")
        self.objects.pop(("Deployment", name), None)

    def worker_pods(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(p) for p in self.pods.values()]

    def list_worker_pods(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        return self.worker_pods(namespace, pool_name)

    def list_kvloads(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(k) for k in self.kvloads.values()]

    def delete_pod(self, namespace: str, name: str) -> None:
        self._record_write("delete_pod")
        self.pods.pop(name, None)
        self.kvloads.pop(name, None)  # the garbage collector's part: it is owned by the pod

    def patch_pods_metadata(self, namespace: str, changes: Mapping[str, MetadataChanges]) -> None:
        for name, (label_changes, annotation_changes) in changes.items():
            self._record_write("patch_pod")
            if name not in self.pods:
                continue
            meta = self.pods[name]["metadata"]
            for target, diff in ((meta.setdefault("labels", {}), label_changes),
                                 (meta.setdefault("annotations", {}), annotation_changes)):
                for key, value in diff.items():
                    if value is None:
                        target.pop(key, None)
                    else:
                        target[key] = value

    def node_zones(self, nodes: Collection[str]) -> dict[str, str]:
        held = {p["spec"]["nodeName"] for p in self.pods.values()}
        return {node: f"zone-{int(node.removeprefix('node-')) // self.nodes_per_zone}" for node in held}

    def list_migrations(self, namespace: str, pool_name: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(m) for m in self.migrations.values()]

    def create_migration(self, namespace: str, body: dict[str, Any]) -> bool:
        self._record_write("create_kvmigration")
        name = body["metadata"]["name"]
        if name in self.migrations:
            return False
        obj = copy.deepcopy(body)
        obj["metadata"]["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.migrations[name] = obj
        return True

    def patch_migration_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._record_write("patch_kvmigration_status")
        self.migrations[name].setdefault("status", {}).update(status)

    def delete_migration(self, namespace: str, name: str) -> None:
        self._record_write("delete_kvmigration")
        self.migrations.pop(name, None)

    def post_event(self, pool: dict[str, Any], reason: str, message: str, warning: bool = False) -> None:
        self._record_write("event")
        self.events.append((reason, message, warning))


if TYPE_CHECKING:
    from kvfleet.operator.kube import KubeApi, MetadataChanges

    def _implements_kube_api(api: MemoryKube) -> KubeApi:  # mypy fails here when MemoryKube falls behind KubeApi
        return api
