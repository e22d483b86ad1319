"""The CRDs against the real API server: installed, printer columns, defaults, and bad input refused.

Each malformed manifest must be refused by `kubectl apply` itself with a message naming the field,
because that is the only error a user of a real cluster sees before the operator ever runs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.localcluster.cluster import Cluster
from kvfleet.localcluster.controlplane import VERSIONS_FILE

EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "llmpool.yaml").read_text())
DISAGGREGATED_EXAMPLE = yaml.safe_load(
    (Path(__file__).resolve().parents[1] / "examples" / "llmpool-disaggregated.yaml").read_text())


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> tuple[int, str]:
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(obj), check=False)
    return result.returncode, result.stdout + result.stderr


def minimal_pool(name: str = "pool") -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "LLMPool",
        "metadata": {"name": name},
        "spec": {"model": {"name": "tiny", "path": "/models/tiny"}, "capacity": {"kvCapacityPerWorker": "10Gi"}},
    }


def test_api_server_reports_pinned_version(cluster: Cluster) -> None:
    versions = dict(
        line.split("=", 1)
        for line in VERSIONS_FILE.read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert json.loads(cluster.plane.get("/version"))["gitVersion"] == versions["KUBERNETES_VERSION"]


def test_example_pool_is_accepted_with_defaults(cluster: Cluster, namespace: str) -> None:
    code, out = apply(cluster, namespace, EXAMPLE)
    assert code == 0, out
    pool = cluster.get_json("llmpool", "llama-13b", "-n", namespace)
    assert pool["spec"]["model"]["path"] == "/models/llama-2-13b"
    # Server-side defaults fill what the user left out.
    assert pool["spec"]["workerTemplate"]["imagePullPolicy"] == "IfNotPresent"
    assert pool["spec"]["migration"]["timeoutSeconds"] == 120

    code, out = apply(cluster, namespace, minimal_pool("bare"))
    assert code == 0, out
    bare = cluster.get_json("llmp", "bare", "-n", namespace)["spec"]
    assert bare["engine"] == "vllm"
    assert bare["scheduling"] == {"policy": "mell", "epochSeconds": 5.0, "workloadWeight": 1.0, "distanceWeight": 1.0}
    assert bare["workers"] == {"min": 1, "max": 8}


def test_printer_columns(cluster: Cluster, namespace: str) -> None:
    assert apply(cluster, namespace, minimal_pool("cols"))[0] == 0
    header = cluster.kubectl("get", "llmpools", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "MODEL", "ENGINE", "POLICY", "DESIRED", "READY", "PREFILL", "GPUS", "KV-UTIL%", "MIGRATING",
                      "STATUS", "AGE"]
    wide = cluster.kubectl("get", "llmpools", "-n", namespace, "-o", "wide").stdout.splitlines()[0].split()
    assert "TRANSFERS" in wide and "LOWER-BOUND" in wide
    migration = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "KVMigration",
        "metadata": {"name": "m1"},
        "spec": {"pool": "cols", "requestId": "req-1", "sourcePod": "cols-worker-0", "targetPod": "cols-worker-1",
                 "mode": "kv", "reason": "Depart"},
    }
    code, out = apply(cluster, namespace, migration)
    assert code == 0, out
    lines = cluster.kubectl("get", "kvmigrations", "-n", namespace).stdout.splitlines()
    assert lines[0].split() == ["NAME", "POOL", "REQUEST", "FROM", "TO", "MODE", "PHASE", "DOWNTIME", "AGE"]
    assert lines[1].split()[:6] == ["m1", "cols", "req-1", "cols-worker-0", "cols-worker-1", "kv"]
    # An empty table says so, the way users will first see it.
    empty = cluster.kubectl("get", "kvmigrations", "-n", "default")
    assert "No resources found" in empty.stderr


def test_kvmigration_spec_is_immutable(cluster: Cluster, namespace: str) -> None:
    migration = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "KVMigration",
        "metadata": {"name": "m2"},
        "spec": {"pool": "p", "requestId": "r", "sourcePod": "a", "targetPod": "b", "mode": "token", "reason": "Update"},
    }
    assert apply(cluster, namespace, migration)[0] == 0
    changed = copy.deepcopy(migration)
    changed["spec"]["targetPod"] = "c"
    code, out = apply(cluster, namespace, changed)
    assert code != 0 and "spec is immutable" in out


def test_scale_subresource_sets_the_floor(cluster: Cluster, namespace: str) -> None:
    assert apply(cluster, namespace, minimal_pool("scaled"))[0] == 0
    cluster.kubectl("scale", "llmpool", "scaled", "-n", namespace, "--replicas=3")
    assert cluster.get_json("llmpool", "scaled", "-n", namespace)["spec"]["replicas"] == 3
    refused = cluster.kubectl("scale", "llmpool", "scaled", "-n", namespace, "--replicas=9", check=False)
    assert refused.returncode != 0 and "replicas must not exceed workers.max" in refused.stderr


def test_disaggregated_pools_are_accepted_with_defaults(cluster: Cluster, namespace: str) -> None:
    code, out = apply(cluster, namespace, DISAGGREGATED_EXAMPLE)
    assert code == 0, out
    code, out = apply(cluster, namespace, _disaggregated("pd-bare"))
    assert code == 0, out
    bare = cluster.get_json("llmp", "pd-bare", "-n", namespace)["spec"]
    assert bare["disaggregation"] == {"enabled": True, "prefillWorkers": {"min": 1, "max": 4}, "caching": "full",
                                      "layout": "by-request-aggregated", "choice": "per-request"}
    # PD-Basic caches nothing, so it needs no prefix cache.
    pd_basic = _disaggregated("pd-basic", disaggregation={"enabled": True, "caching": "none"}, prefixCaching=None)
    code, out = apply(cluster, namespace, pd_basic)
    assert code == 0, out
    assert cluster.get_json("llmp", "pd-basic", "-n", namespace)["spec"]["prefixCaching"]["enabled"] is False


def _disaggregated(name: str = "bad", **spec: Any) -> dict[str, Any]:
    """A valid disaggregated pool (builtin engine, prefix caching on), with `spec` fields on top (None deletes one)."""
    pool = minimal_pool(name)
    pool["spec"].update({"engine": "builtin", "prefixCaching": {"enabled": True}, "disaggregation": {"enabled": True}})
    pool["spec"].update(spec)
    pool["spec"] = {k: v for k, v in pool["spec"].items() if v is not None}
    return pool


def _pool_with(path: str, value: Any, name: str = "bad") -> dict[str, Any]:
    """The minimal pool with one dotted path set (value None deletes it)."""
    pool = minimal_pool(name)
    node: Any = pool
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return pool


# (id, manifest, text the API server's message must contain: the field's path)
MALFORMED_POOLS = [
    ("missing-model", _pool_with("spec.model", None), "spec.model: Required value"),
    ("missing-model-path", _pool_with("spec.model.path", None), "spec.model.path: Required value"),
    ("relative-model-path", _pool_with("spec.model.path", "models/tiny"), "spec.model.path"),
    ("unknown-engine", _pool_with("spec.engine", "tensorrt"), 'spec.engine: Unsupported value: "tensorrt"'),
    ("gpus-wrong-type", _pool_with("spec.gpusPerWorker", "two"), "spec.gpusPerWorker: Invalid value"),
    ("gpus-zero", _pool_with("spec.gpusPerWorker", 0), "spec.gpusPerWorker"),
    ("negative-min-workers", _pool_with("spec.workers", {"min": -1, "max": 4}), "spec.workers.min"),
    ("min-above-max", _pool_with("spec.workers", {"min": 5, "max": 2}), "spec.workers.min: Invalid value"),
    ("unknown-policy", _pool_with("spec.scheduling.policy", "random"), "spec.scheduling.policy: Unsupported value"),
    ("zero-epoch", _pool_with("spec.scheduling.epochSeconds", 0), "spec.scheduling.epochSeconds"),
    ("bad-migration-mode", _pool_with("spec.migration.mode", "rdma"), "spec.migration.mode: Unsupported value"),
    ("non-positive-computation-boundary", _pool_with("spec.migration.computationBoundaryTokensPerSecond", 0),
     "spec.migration.computationBoundaryTokensPerSecond"),
    ("bad-communication-boundary", _pool_with("spec.migration.communicationBoundaryBytesPerSecond", "fast"),
     "spec.migration.communicationBoundaryBytesPerSecond"),
    ("negative-capacity", _pool_with("spec.capacity.kvCapacityPerWorker", "-10Gi"), "spec.capacity.kvCapacityPerWorker"),
    ("capacity-above-gpu-memory", _pool_with("spec.capacity", {"gpuMemory": "24Gi", "kvCapacityPerWorker": "30Gi"}),
     "spec.capacity.kvCapacityPerWorker"),
    ("no-capacity-source", _pool_with("spec.capacity", {"gpuMemory": "24Gi"}), "spec.capacity"),
    ("weights-fill-gpu", _pool_with("spec.capacity", {"gpuMemory": "24Gi", "modelWeights": "23Gi"}),
     "spec.capacity.modelWeights"),
    ("reserve-fraction-one", _pool_with("spec.capacity.activationReserveFraction", 1.0),
     "spec.capacity.activationReserveFraction"),
    ("replicas-above-max", _pool_with("spec.replicas", 20), "spec.replicas"),
    ("oversize-name", _pool_with("metadata.name", "a" * 45), "metadata.name must be at most 40 characters"),
    ("name-starting-with-digit", _pool_with("metadata.name", "7pool"), "metadata.name must be a DNS-1035 label"),
    ("two-volume-sources", _pool_with("spec.model.volume", {"hostPath": {"path": "/m"},
                                                             "persistentVolumeClaim": {"claimName": "w"}}),
     "spec.model.volume"),
    ("bad-pull-policy", _pool_with("spec.workerTemplate", {"imagePullPolicy": "Sometimes"}),
     "spec.workerTemplate.imagePullPolicy"),
    ("bad-toleration-effect", _pool_with("spec.workerTemplate", {"tolerations": [{"key": "k", "effect": "Never"}]}),
     "spec.workerTemplate.tolerations[0].effect"),
    ("negative-scale-down-delay", _pool_with("spec.autoscaling", {"scaleDownDelaySeconds": -5}),
     "spec.autoscaling.scaleDownDelaySeconds"),
    # spec.disaggregation: each CEL rule with the message the models raise (tests/unit/test_disaggregation_api.py).
    ("disaggregated-without-prefix-cache", _disaggregated(prefixCaching=None),
     "spec.disaggregation.caching: Invalid value"),
    ("disaggregated-caching-at-p-without-prefix-cache",
     _disaggregated(prefixCaching={"enabled": False}, disaggregation={"enabled": True, "caching": "prefill"}),
     "disaggregation.caching other than none needs prefixCaching.enabled: true"),
    ("disaggregated-with-distkv", _disaggregated(distkv={"enabled": True}),
     "spec.disaggregation.enabled: Invalid value"),
    ("disaggregated-with-distkv-says-why", _disaggregated(distkv={"enabled": True}),
     "a request whose KV spans workers cannot be handed over"),
    ("distkv-on-vllm-with-prefix-caching", _pool_with("spec", {**minimal_pool("bad")["spec"], "distkv": {"enabled": True},
                                                               "prefixCaching": {"enabled": True}}),
     "distkv.enabled on a vllm pool needs prefixCaching.enabled: false"),
    ("disaggregated-on-vllm", _disaggregated(engine="vllm"), "spec.disaggregation.caching: Invalid value"),
    ("disaggregated-on-the-default-engine", _disaggregated(engine=None), "a vllm pool serves only caching: none"),
    ("disaggregated-zero-decode-workers", _disaggregated(workers={"max": 0}), "spec.workers.max"),
    ("prefill-min-above-max", _disaggregated(disaggregation={"enabled": True, "prefillWorkers": {"min": 3, "max": 2}}),
     "spec.disaggregation.prefillWorkers.min: Invalid value"),
    ("prefill-max-zero", _disaggregated(disaggregation={"enabled": True, "prefillWorkers": {"min": 0, "max": 0}}),
     "spec.disaggregation.prefillWorkers.max"),
    ("unknown-caching", _disaggregated(disaggregation={"enabled": True, "caching": "everything"}),
     "spec.disaggregation.caching: Unsupported value"),
    ("unknown-layout", _disaggregated(disaggregation={"enabled": True, "layout": "by-block"}),
     "spec.disaggregation.layout: Unsupported value"),
    ("unknown-choice", _disaggregated(disaggregation={"enabled": True, "choice": "never"}),
     "spec.disaggregation.choice: Unsupported value"),
]


@pytest.mark.parametrize(("manifest", "expected"), [pytest.param(m, e, id=i) for i, m, e in MALFORMED_POOLS])
def test_malformed_pool_is_refused_naming_the_field(cluster: Cluster, namespace: str, manifest: dict[str, Any],
                                                    expected: str) -> None:
    code, out = apply(cluster, namespace, manifest)
    assert code != 0, f"accepted: {manifest}"
    assert expected in out, out


def _migration_with(**spec: Any) -> dict[str, Any]:
    base = {"pool": "p", "requestId": "r", "sourcePod": "a", "targetPod": "b", "mode": "kv", "reason": "Depart"}
    base.update(spec)
    return {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "KVMigration", "metadata": {"name": "bad-mig"},
            "spec": {k: v for k, v in base.items() if v is not None}}


MALFORMED_MIGRATIONS = [
    ("same-source-and-target", _migration_with(targetPod="a"), "spec.targetPod: Invalid value"),
    ("bad-mode", _migration_with(mode="teleport"), "spec.mode: Unsupported value"),
    ("missing-request", _migration_with(requestId=None), "spec.requestId: Required value"),
    ("negative-bytes", _migration_with(expectedBytes=-1), "spec.expectedBytes"),
    ("unknown-reason", _migration_with(reason="Whim"), "spec.reason: Unsupported value"),
    ("bad-pod-name", _migration_with(sourcePod="Not_A_Pod"), "spec.sourcePod"),
]


@pytest.mark.parametrize(("manifest", "expected"), [pytest.param(m, e, id=i) for i, m, e in MALFORMED_MIGRATIONS])
def test_malformed_migration_is_refused_naming_the_field(cluster: Cluster, namespace: str, manifest: dict[str, Any],
                                                         expected: str) -> None:
    code, out = apply(cluster, namespace, manifest)
    assert code != 0, f"accepted: {manifest}"
    assert expected in out, out
