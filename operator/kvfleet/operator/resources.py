"""The Kubernetes objects a pool owns, built as plain dicts from its spec: pure, so they are unit-tested.

Handlers compare these desired objects with what the cluster has and write only the difference.
Names are deterministic (`<pool>-worker-<index>`) so a restarted operator finds what it made instead of
making it twice, and the index records activation order, which MELL's "most recently activated GPU"
rule needs after a restart. A disaggregated pool's prefill workers are `<pool>-prefill-<index>`: worker
pods too (same container, same selector), told apart by their role label and never one of MELL's.
"""

from __future__ import annotations

import re
from typing import Any

from kvfleet.api.models import API_VERSION, POOL_LABEL, ROLE_LABEL, LLMPoolSpec, Role
from kvfleet.api.quantity import quantity_bytes
from kvfleet.serving.credentials import MIGRATION_KEY_ENV, MIGRATION_KEY_KEY, SECRET_ENV, TOKEN_ENV, TOKEN_KEY

INDEX_LABEL = "kvfleet.dev/worker-index"
GPU_LABEL = "kvfleet.dev/gpu-id"
IDLE_SINCE_ANNOTATION = "kvfleet.dev/idle-since"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvfleet-operator", "app.kubernetes.io/part-of": "kvfleet"}
WORKER_PORT = 8000
# Where workers receive migrated KV blocks (docs/migration.md): a raw TCP stream, not HTTP.
MIGRATION_PORT = 8001
_WORKER_NAME = re.compile(r"^(?P<pool>.+)-worker-(?P<index>\d+)$")
_PREFILL_NAME = re.compile(r"^(?P<pool>.+)-prefill-(?P<index>\d+)$")


def owner_reference(pool: dict[str, Any]) -> dict[str, Any]:
    meta = pool["metadata"]
    return {"apiVersion": API_VERSION, "kind": "LLMPool", "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def worker_selector(pool_name: str) -> str:
    """The pool's worker pods, of both roles in a disaggregated pool."""
    return f"{POOL_LABEL}={pool_name},{COMPONENT_LABEL}=worker"


def scaled_selector(pool_name: str, spec: LLMPoolSpec) -> str:
    """The pods `status.workers` counts (the scale subresource's selector): the worker pods, less a
    disaggregated pool's prefill workers. `!=` keeps decode pods made before the pool was disaggregated,
    which have no role label, as status.workers counts them."""
    if not spec.disaggregation.enabled:
        return worker_selector(pool_name)
    return f"{worker_selector(pool_name)},{ROLE_LABEL}!=prefill"


def is_prefill_pod(pod: dict[str, Any]) -> bool:
    """A disaggregated pool's prefill worker: its role label says so (never one of MELL's workers)."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL) == "prefill"


def worker_name(pool_name: str, index: int) -> str:
    return f"{pool_name}-worker-{index}"


def worker_index(pod_name: str) -> int | None:
    match = _WORKER_NAME.match(pod_name)
    return int(match.group("index")) if match else None


def prefill_name(pool_name: str, index: int) -> str:
    # One character longer than a worker's name: with a 40-character pool name and a 5-digit index it
    # is 54 characters, inside the 63 of a pod's hostname like the workers' (MAX_POOL_NAME_LENGTH).
    return f"{pool_name}-prefill-{index}"


def prefill_index(pod_name: str) -> int | None:
    match = _PREFILL_NAME.match(pod_name)
    return int(match.group("index")) if match else None


def token_secret_name(pool_name: str) -> str:
    return f"{pool_name}-token"


def worker_account_name(pool_name: str) -> str:
    return f"{pool_name}-worker"


def _labels(pool_name: str, component: str) -> dict[str, str]:
    return {**MANAGED_BY, POOL_LABEL: pool_name, COMPONENT_LABEL: component, "app.kubernetes.io/instance": pool_name}


def token_secret(pool: dict[str, Any], token: str, migration_key: str) -> dict[str, Any]:
    """The pool's Secret: the token that guards the workers' internal endpoints and the key of the
    migration port's handshake. Deleting it rotates both: the operator makes a new one, and the pods
    pick it up while they run (kvfleet.serving.credentials)."""
    name = pool["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": token_secret_name(name), "labels": _labels(name, "token"), "ownerReferences": [owner_reference(pool)]},
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token, MIGRATION_KEY_KEY: migration_key},
    }


def _secret_env(pool_name: str, *, migration_key: bool) -> list[dict[str, Any]]:
    """What a pod starts with of the pool's Secret, and the Secret's name, to re-read it when it rotates."""
    secret = token_secret_name(pool_name)
    env: list[dict[str, Any]] = [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}}]
    if migration_key:
        # optional: a Secret made by an older release has no migration key; the token keys the handshake then.
        env.append({"name": MIGRATION_KEY_ENV,
                    "valueFrom": {"secretKeyRef": {"name": secret, "key": MIGRATION_KEY_KEY, "optional": True}}})
    return [*env, {"name": SECRET_ENV, "value": secret}]


def _secret_rule(pool_name: str) -> dict[str, Any]:
    """Read the pool's Secret, that one only, to follow its rotation."""
    return {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [token_secret_name(pool_name)], "verbs": ["get"]}


def worker_rbac(pool: dict[str, Any]) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding of the workers: what they need in their namespace, no more.

    Workers write their own KV-load report (a KVLoad named after their pod: create it, patch it; the
    admission policy keeps each to its own) and read pods; workers from before KVLoads patched the
    report onto their pod, so patching pods stays allowed (again only their own) for an upgrade's
    old workers under the new Role. They execute KVMigrations
    (read them, write their status) and read their own LLMPool, by name: under DistKV a borrower finds
    its creditor candidates in the pool's status (status.distkv.candidates). The pool rule is there
    whether or not DistKV is on, so that turning it on needs no change of the Role while workers run
    (and this function stays a function of the pool alone). They create only their KVLoad, and delete nothing.
    """
    name = pool["metadata"]["name"]
    account = worker_account_name(name)
    meta = {"name": account, "labels": _labels(name, "worker"), "ownerReferences": [owner_reference(pool)]}
    return account_with_role(pool, meta, [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": ["kvfleet.dev"], "resources": ["kvloads"], "verbs": ["create", "patch"]},
        {"apiGroups": ["kvfleet.dev"], "resources": ["kvmigrations"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["kvfleet.dev"], "resources": ["kvmigrations/status"], "verbs": ["get", "patch", "update"]},
        _secret_rule(name),
        {"apiGroups": ["kvfleet.dev"], "resources": ["llmpools"], "resourceNames": [name], "verbs": ["get"]},
    ])


def account_with_role(pool: dict[str, Any], meta: dict[str, Any], rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ServiceAccount, a Role of these rules and the RoleBinding between them, all named meta["name"]."""
    account = meta["name"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": pool["metadata"]["namespace"]}],
        },
    ]


def _field_env(env_name: str, path: str) -> dict[str, Any]:
    """An environment variable from the pod's own fields (the downward API)."""
    return {"name": env_name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _worker_resources(spec: LLMPoolSpec) -> dict[str, dict[str, str]]:
    """The worker container's requests and limits: the template's, with the pool's GPUs."""
    template = spec.worker_template
    resources: dict[str, dict[str, str]] = {"requests": {}, "limits": {}}
    if template.resources is not None:
        resources["requests"].update(template.resources.requests)
        resources["limits"].update(template.resources.limits)
    # Extended resources must have request == limit; the pool's gpusPerWorker wins over any override.
    resources["limits"]["nvidia.com/gpu"] = str(spec.gpus_per_worker)
    resources["requests"]["nvidia.com/gpu"] = str(spec.gpus_per_worker)
    return resources


# The Pod Security Standard "restricted" (non-root, no privilege escalation, no capabilities,
# seccomp RuntimeDefault) for the pods the operator makes; the images run as uid 65532
# (worker-image/Dockerfile). The root filesystem is read-only; what the processes must write (Python,
# torch, Triton and vLLM caches under $HOME/.cache, scratch in /tmp) goes to emptyDirs.
POD_SECURITY_CONTEXT: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                        "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                              "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
SCRATCH_VOLUMES: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
SCRATCH_MOUNTS: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"},
                                        {"name": "cache", "mountPath": "/home/kvfleet/.cache"}]


def _locked_down(pod_spec: dict[str, Any], container: dict[str, Any]) -> None:
    """Make a pod spec meet the "restricted" Pod Security Standard, with writable scratch space."""
    pod_spec["securityContext"] = dict(POD_SECURITY_CONTEXT)
    container["securityContext"] = dict(CONTAINER_SECURITY_CONTEXT)
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), *SCRATCH_VOLUMES]
    container["volumeMounts"] = [*container.get("volumeMounts", []), *SCRATCH_MOUNTS]


def _worker_env(name: str, spec: LLMPoolSpec, role: Role | None) -> list[dict[str, Any]]:
    """The worker's configuration (kvfleet.worker reads it from its environment), then the template's
    variables. `role`: the pod's half of a disaggregated pool, None in a colocated one."""
    elastic = spec.elastic_memory
    # A vLLM worker's memory budget sizes its KV cache itself (it refuses a KV capacity beside one); the
    # builtin engine's budget holds the KV capacity it is given.
    kv_capacity = [] if elastic.enabled and spec.engine == "vllm" else [
        {"name": "KVFLEET_KV_CAPACITY_BYTES", "value": str(spec.kv_capacity_per_worker_bytes())}]
    env: list[dict[str, Any]] = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_UID", "metadata.uid"),  # the owner of its KVLoad
        _field_env("POD_IP", "status.podIP"),
        {"name": "KVFLEET_POOL", "value": name},
        {"name": "KVFLEET_ENGINE", "value": spec.engine},
        {"name": "KVFLEET_MODEL_NAME", "value": spec.model.name},
        {"name": "KVFLEET_MODEL_PATH", "value": spec.model.path},
        *kv_capacity,
        {"name": "KVFLEET_PORT", "value": str(WORKER_PORT)},
        {"name": "KVFLEET_MIGRATION_PORT", "value": str(MIGRATION_PORT)},
        # Workers coalesce their KV-load reports to at most one write per scheduling epoch.
        {"name": "KVFLEET_REPORT_INTERVAL_S", "value": str(spec.scheduling.epoch_seconds)},
        *_secret_env(name, migration_key=True),
    ]
    if elastic.enabled:
        env += [{"name": "KVFLEET_ELASTIC_MEMORY", "value": "1"},
                {"name": "KVFLEET_MEMORY_BUDGET_BYTES", "value": str(spec.memory_budget_bytes())}]
        env.append({"name": "KVFLEET_CPU_BUFFER_BYTES",
                    "value": str(quantity_bytes(elastic.cpu_buffer) if elastic.cpu_buffer is not None else 0)})
        env += [{"name": name, "value": str(value)} for name, value in
                (("KVFLEET_TTFT_SLO_MS", elastic.ttft_milliseconds), ("KVFLEET_TPOT_SLO_MS", elastic.tpot_milliseconds))
                if value is not None]
    if spec.prefix_cache_on(role):
        # Per role in a disaggregated pool: disaggregation.caching says which half keeps prompts' KV.
        env.append({"name": "KVFLEET_PREFIX_CACHING", "value": "1"})
    if role is not None:
        disaggregation = spec.disaggregation
        env += [{"name": "KVFLEET_ROLE", "value": role},
                {"name": "KVFLEET_PD_CACHING", "value": disaggregation.caching},
                {"name": "KVFLEET_PD_LAYOUT", "value": disaggregation.layout}]
    if spec.distattention():
        env.append({"name": "KVFLEET_ATTENTION", "value": "distattention"})
    if spec.distkv.enabled:
        # DistKV (docs/operator.md): attention over KV spread across workers (above), borrowing on, and
        # the §4.3 cap on what this worker lends. Borrowers read their creditors from the pool's status.
        env += [{"name": "KVFLEET_DISTKV", "value": "1"},
                {"name": "KVFLEET_LEND_CAP_BYTES", "value": str(spec.lend_cap_bytes())}]
    return env + [{"name": var.name, "value": var.value} for var in spec.worker_template.env]


def worker_pod(pool: dict[str, Any], spec: LLMPoolSpec, index: int, gpu_id: str | None = None) -> dict[str, Any]:
    """One GPU worker: the engine plus the agent, configured through its environment (a decode worker
    in a disaggregated pool).

    `gpu_id` binds it to the scheduler GPU it is created for; a floor pod starts unbound.
    """
    name = pool["metadata"]["name"]
    labels = {INDEX_LABEL: str(index)}
    if gpu_id is not None:
        labels[GPU_LABEL] = gpu_id
    role: Role | None = "decode" if spec.disaggregation.enabled else None
    return _worker_pod(pool, spec, worker_name(name, index), labels, role)


def prefill_pod(pool: dict[str, Any], spec: LLMPoolSpec, index: int) -> dict[str, Any]:
    """One prefill worker of a disaggregated pool: a worker's pod with the prefill role. No GPU label
    and no worker index: MELL never places requests on it; it still requests its GPUs like any worker."""
    return _worker_pod(pool, spec, prefill_name(pool["metadata"]["name"], index), {}, "prefill")


def _worker_pod(pool: dict[str, Any], spec: LLMPoolSpec, pod_name: str, extra_labels: dict[str, str],
                role: Role | None) -> dict[str, Any]:
    """A worker pod of either role (or of a colocated pool, `role` None) named `pod_name`."""
    name = pool["metadata"]["name"]
    template = spec.worker_template
    resources = _worker_resources(spec)
    container: dict[str, Any] = {
        "name": "worker",
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "env": _worker_env(name, spec, role),
        "ports": [{"name": "http", "containerPort": WORKER_PORT},
                  {"name": "migration", "containerPort": MIGRATION_PORT}],
        "resources": {k: v for k, v in resources.items() if v},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6,
                          "initialDelaySeconds": 30},
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "serviceAccountName": worker_account_name(name),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
    }
    if spec.model.volume is not None:
        volume = spec.model.volume
        source: dict[str, Any]
        if volume.persistent_volume_claim is not None:
            source = {"persistentVolumeClaim": {"claimName": volume.persistent_volume_claim.claim_name, "readOnly": True}}
        else:
            assert volume.host_path is not None  # the model validator guarantees exactly one source
            source = {"hostPath": {"path": volume.host_path.path, "type": "Directory"}}
        pod_spec["volumes"] = [{"name": "model", **source}]
        container["volumeMounts"] = [{"name": "model", "mountPath": spec.model.path, "readOnly": True}]
    _locked_down(pod_spec, container)
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in template.tolerations]
    if template.priority_class_name:
        pod_spec["priorityClassName"] = template.priority_class_name
    labels = _labels(name, "worker") | extra_labels
    if role is not None:
        labels[ROLE_LABEL] = role
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "labels": labels,
            # A new worker is empty and may be evicted; the operator flips these while it holds KV cache.
            "annotations": {
                "cluster-autoscaler.kubernetes.io/safe-to-evict": "true",
                "karpenter.sh/do-not-disrupt": "false",
            },
            "ownerReferences": [owner_reference(pool)],
        },
        "spec": pod_spec,
    }


HEADROOM_PRIORITY_CLASS = "kvfleet-headroom"
# Below the default priority (0) of worker pods, so the scheduler preempts a headroom pod for a worker.
HEADROOM_PRIORITY = -10
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"


def headroom_priority_class() -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": HEADROOM_PRIORITY_CLASS, "labels": dict(MANAGED_BY)},
        "value": HEADROOM_PRIORITY,
        "globalDefault": False,
        "preemptionPolicy": "Never",
        "description": "kvfleet GPU headroom pods: preempted by any worker, never preempt anything",
    }


def headroom_name(pool_name: str) -> str:
    return f"{pool_name}-headroom"


def headroom_deployment(pool: dict[str, Any], spec: LLMPoolSpec) -> dict[str, Any]:
    """Headroom pods that hold `headroomWorkers` workers' worth of GPUs (the overprovisioning pattern).

    When a worker needs their GPUs the scheduler preempts them; the Deployment recreates them, they
    stay Pending, and the cluster autoscaler or Karpenter adds a GPU node before MELL needs the next one.
    """
    name = pool["metadata"]["name"]
    labels = _labels(name, "headroom")
    template = spec.worker_template
    gpus = str(spec.gpus_per_worker)
    pod_spec: dict[str, Any] = {
        "priorityClassName": HEADROOM_PRIORITY_CLASS,
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "containers": [{"name": "headroom", "image": PAUSE_IMAGE,
                        "resources": {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}}],
    }
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in template.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": headroom_name(name), "labels": labels, "ownerReferences": [owner_reference(pool)]},
        "spec": {
            "replicas": spec.autoscaling.headroom_workers,
            "selector": {"matchLabels": {POOL_LABEL: name, COMPONENT_LABEL: "headroom"}},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


ROUTER_PORT = 8000
ROUTER_LABEL = "kvfleet.dev/router"
ROUTER_SERVICE_PORT = 80


def router_name(pool_name: str) -> str:
    return f"{pool_name}-router"


def router_image(worker_image: str) -> tuple[str, list[str] | None]:
    """The router's image and command, derived from the pool's worker image.

    The router is the worker's venv with another entrypoint (worker-image/Dockerfile, target
    `router`), published beside it: `<registry>/kvfleet/worker:<tag>` -> `<registry>/kvfleet/router:<tag>`,
    so one tag names a matching pair. A worker image not named `.../worker` is a custom build of the
    worker image, which holds the router too: the router then runs from it with its own command.
    """
    name, at, digest = worker_image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    repo, tag = (name[:colon], name[colon:]) if colon > slash else (name, "")
    head, _, last = repo.rpartition("/")
    if last == "worker" and not at:
        return f"{head + '/' if head else ''}router{tag}", None
    return worker_image, ["python", "-m", "kvfleet.router"]


def _router_container(name: str, spec: LLMPoolSpec) -> dict[str, Any]:
    """The router's container: its image and command derived from the worker template's (router_image)."""
    template = spec.worker_template
    image, command = router_image(template.image)
    container: dict[str, Any] = {
        "name": "router",
        "image": image,
        "imagePullPolicy": template.image_pull_policy,
        "env": [
            _field_env("POD_NAMESPACE", "metadata.namespace"),
            _field_env("POD_IP", "status.podIP"),
            {"name": "KVFLEET_POOL", "value": name},
            {"name": "KVFLEET_PORT", "value": str(ROUTER_PORT)},
            # Read workers' /internal/requests (KV bytes per token, capacity) and migrated streams.
            *_secret_env(name, migration_key=False),
        ],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
    }
    if command is not None:
        container["command"] = command
    return container


def router_objects(pool: dict[str, Any], spec: LLMPoolSpec) -> list[dict[str, Any]]:
    """The pool's router: ServiceAccount, Role and RoleBinding, Deployment, and the Service `<pool>-router`.

    The router watches its own LLMPool (the routing table), the pool's worker pods (readiness,
    addresses) and their KVLoads (KV-load reports), and writes nothing: its Role is get/list/watch on those, the pool by
    name. One replica: placement counts the requests the router itself has in flight against each
    worker's capacity, which a second replica would not see (docs/router.md).
    """
    name = pool["metadata"]["name"]
    account = router_name(name)
    labels = _labels(name, "router")
    meta = {"name": account, "labels": labels, "ownerReferences": [owner_reference(pool)]}
    # The router's pods carry ROUTER_LABEL instead of POOL_LABEL, so that selecting a pool's pods
    # (`-l kvfleet.dev/pool=<pool>`: its workers and GPU placeholders) never catches the router.
    selector = {ROUTER_LABEL: name, COMPONENT_LABEL: "router"}
    pod_labels = {**{k: v for k, v in labels.items() if k != POOL_LABEL}, ROUTER_LABEL: name}
    container = _router_container(name, spec)
    pod_spec: dict[str, Any] = {"containers": [container], "serviceAccountName": account,
                                # Streams in flight get the worker's drain time to finish.
                                "terminationGracePeriodSeconds": 30}
    _locked_down(pod_spec, container)
    return [
        *account_with_role(pool, meta, [
            # list and watch a single object need the name as a field selector; RBAC allows that
            # with resourceNames, so the router reads its own pool and no other.
            # patch: the held-requests annotation that wakes a pool scaled to zero (docs/router.md).
            {"apiGroups": ["kvfleet.dev"], "resources": ["llmpools"], "resourceNames": [name],
             "verbs": ["get", "list", "watch", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["kvfleet.dev"], "resources": ["kvloads"], "verbs": ["list", "watch"]},
            _secret_rule(name),
        ]),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": selector},
                # A new router is Ready before the old one stops taking requests.
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {"type": "ClusterIP", "selector": selector,
                     "ports": [{"name": "http", "port": ROUTER_SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}]},
        },
    ]
