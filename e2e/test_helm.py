"""The Helm chart on the real control plane: lint, template, install, upgrade, uninstall, and its RBAC.

The operator runs as the chart's Deployment: the node agent runs its pod from the kvfleet/operator
image's entrypoint in operator/kvfleet/localcluster/images.yaml, with a token of the chart's ServiceAccount, so every request the
operator sends is authorized by the chart's RBAC and nothing else. It reconciles examples/llmpool.yaml
with the scripted worker, as e2e/test_operator.py's example test does.

The RBAC is tested three ways: the operator, run under the chart's ServiceAccount, does its work and
is never refused (its log is scanned for refusals); the API server's authorizer says that
ServiceAccount may make every call of kvfleet_e2e.helm.OPERATOR_CALLS (and not the withheld ones,
nor anything outside the watched namespaces); and removing any one rule of the rendered chart from
the live roles denies at least one of those calls, named in the failure.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from kvfleet.localcluster.cluster import CRDS_DIR, Cluster, wait_for
from kvfleet.localcluster.controlplane import REPO_ROOT
from kvfleet.localcluster.images import image_name, load_images
from kvfleet.operator import resources
from kvfleet.operator.leader import LeaderElector
from kvfleet_e2e.helm import CHART_DIR, CLUSTER_WIDE, MODES, NAMESPACED, WITHHELD_CALLS, Call, Helm, all_calls

EXAMPLE = REPO_ROOT / "examples" / "llmpool.yaml"
FULL_VALUES = CHART_DIR / "ci" / "full-values.yaml"
RELEASE, RELEASE_NS, POOLS_NS = "kvfleet", "kvfleet-system", "llm-pools"
FULLNAME = "kvfleet"  # the release name already says kvfleet (templates/_helpers.tpl)
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
# A Lease this short makes the replacement pod of an upgrade lead within seconds.
INSTALL_ARGS = ("--set", "leaderElection.leaseDurationSeconds=3", "--wait", "--timeout", "120s")
# What an operator log line says when the API server refused it (kopf's and the Kube adapter's wording).
# "403" as a status code, not the milliseconds of a log line's timestamp ("18:07:40,403").
REFUSALS = re.compile(r"(?<![,.])\b403\b|Forbidden|forbidden|Not enough permissions|Failed to post an event")


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, rendered {[o['metadata']['name'] for o in by_kind(objs, kind)]}"
    return matches[0]


@pytest.fixture(scope="module")
def offline_helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm-home"))


# ------------------------------------------------------------------------------ lint and template


def test_helm_lint_is_clean_with_default_and_full_values(offline_helm: Helm) -> None:
    for extra in ((), ("--values", str(FULL_VALUES))):
        result = offline_helm.run("lint", str(CHART_DIR), "--strict", *extra)
        # [INFO] "icon is recommended" is the one remark left: the project has no logo.
        remarks = [line for line in result.stdout.splitlines() if line.startswith("[") and "icon is recommended" not in line]
        assert not remarks, result.stdout
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_template_with_default_values(offline_helm: Helm) -> None:
    objs = offline_helm.template(RELEASE, RELEASE_NS)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(["PriorityClass", "ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding",
                            "ClusterRoleBinding", "Role", "RoleBinding", "Service", "Deployment",
                            # a worker may change only its own Pod (e2e/test_worker_report_policy.py)
                            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"])

    deploy = one(objs, "Deployment")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    pod = deploy["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == FULLNAME
    (container,) = pod["containers"]
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert container["image"] == f"kvfleet/operator:{chart['appVersion']}"
    # No command: the image's entrypoint runs, the one operator/kvfleet/localcluster/images.yaml names (and the node agent runs).
    assert "command" not in container
    assert image_name(container["image"]) == "kvfleet/operator"
    assert load_images()["kvfleet/operator"]["entrypoint"] == ["python", "-m", "kvfleet.operator"]
    # Every flag the chart passes is one the operator has.
    help_text = subprocess.run([sys.executable, "-m", "kvfleet.operator", "--help"], capture_output=True, text=True,
                               check=True).stdout
    for arg in container["args"]:
        assert arg.split("=", 1)[0] in help_text, f"{arg} is not a flag of python -m kvfleet.operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert not by_kind(objs, "ServiceMonitor")

    # The names and the PriorityClass the operator's code fixes.
    lease_rules = one(objs, "Role")["rules"]
    assert [r.get("resourceNames") for r in lease_rules] == [None, [inspect.signature(LeaderElector).parameters["name"].default]]
    priority_class = one(objs, "PriorityClass")
    wanted = resources.headroom_priority_class()
    for field_name in ("value", "globalDefault", "preemptionPolicy", "description"):
        assert priority_class[field_name] == wanted[field_name], field_name
    assert priority_class["metadata"]["name"] == wanted["metadata"]["name"]
    cluster_rules = one(objs, "ClusterRole", f"{FULLNAME}-cluster")["rules"]
    assert {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"], "verbs": ["get"],
            "resourceNames": [resources.HEADROOM_PRIORITY_CLASS]} in cluster_rules

    # The CRDs Helm installs are the generated ones.
    with_crds = offline_helm.template(RELEASE, RELEASE_NS, "--include-crds")
    rendered = {o["metadata"]["name"]: o for o in by_kind(with_crds, "CustomResourceDefinition")}
    generated = {(d := yaml.safe_load(p.read_text()))["metadata"]["name"]: d for p in CRDS_DIR.glob("*.yaml")}
    assert rendered == generated


def test_template_with_every_value_set(offline_helm: Helm) -> None:
    objs = offline_helm.template("x", "ops", "--values", str(FULL_VALUES))
    values = yaml.safe_load(FULL_VALUES.read_text())
    deploy = one(objs, "Deployment", "llm-fleet")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"{values['image']['repository']}@{values['image']['digest']}"
    assert container["args"] == ["--liveness=http://0.0.0.0:8081/healthz", "--metrics-address=0.0.0.0", "--metrics-port=9091",
                                 "--namespace=team-a", "--namespace=team-b", "--no-leader-election", "--verbose"]
    assert pod["serviceAccountName"] == "llm-fleet-operator"
    assert pod["affinity"] == values["affinity"] and pod["tolerations"] == values["tolerations"]
    assert pod["priorityClassName"] == "platform-critical" and pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert deploy["spec"]["template"]["metadata"]["labels"]["team"] == "ml-platform"
    # Namespaced: the namespaced rules are bound only in the two namespaces; kopf may watch namespaces.
    bindings = by_kind(objs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "llm-fleet"} for b in bindings)
    assert [b["roleRef"]["name"] for b in by_kind(objs, "ClusterRoleBinding")] == ["llm-fleet-cluster"]
    assert {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]} in \
        one(objs, "ClusterRole", "llm-fleet-cluster")["rules"]
    assert not by_kind(objs, "Role") and not by_kind(objs, "PriorityClass")  # no Lease; PriorityClass made elsewhere
    monitor = one(objs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s"}]
    assert one(objs, "Service")["spec"]["type"] == "NodePort"


# --------------------------------------------------------------------------------- on the cluster


@dataclass
class Installed:
    cluster: Cluster
    helm: Helm
    pool_name: str
    operator_pods: list[str]  # every operator pod this module has seen, oldest first


def operator_pod(cluster: Cluster) -> dict[str, Any] | None:
    """The release's one live operator pod, once it is Ready."""
    pods = [p for p in cluster.get_json("pods", "-n", RELEASE_NS, "-l", OPERATOR_SELECTOR)["items"]
            if not p["metadata"].get("deletionTimestamp")]
    if len(pods) != 1:
        return None
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pods[0].get("status", {}).get("conditions", []))
    return pods[0] if ready else None


def pool_status(cluster: Cluster, name: str) -> dict[str, Any]:
    return dict((cluster.get_json("llmpool", name, "-n", POOLS_NS, check=False) or {}).get("status") or {})


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


@pytest.fixture(scope="module")
def installed(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    helm = Helm(tmp_path_factory.mktemp("helm-home"), cluster.kubeconfig)
    cluster.kubectl("create", "namespace", POOLS_NS)
    cluster.wait_default_service_account(POOLS_NS)
    # An operator run by another test module (with admin rights) may have created the headroom
    # PriorityClass; Helm adopts only objects it labelled, and deleting a PriorityClass leaves its pods be.
    existing = cluster.get_json("priorityclass", resources.HEADROOM_PRIORITY_CLASS, check=False)
    if existing and "meta.helm.sh/release-name" not in existing["metadata"].get("annotations", {}):
        cluster.kubectl("delete", "priorityclass", resources.HEADROOM_PRIORITY_CLASS)
    state = Installed(cluster, helm, "", [])
    try:
        yield state
    finally:
        helm.run("uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", check=False)
        # The pools outlive the operator by design; their finalizer would keep the namespace from going.
        for pool in (cluster.get_json("llmpools", "-n", POOLS_NS, check=False) or {}).get("items", []):
            cluster.kubectl("patch", "llmpool", pool["metadata"]["name"], "-n", POOLS_NS, "--type=merge",
                            "-p", '{"metadata":{"finalizers":null}}', check=False)
        for ns in (POOLS_NS, RELEASE_NS):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_install_refuses_a_wrong_type_and_an_unknown_key(installed: Installed, tmp_path: Path) -> None:
    cases = {
        "metrics:\n  port: \"9090\"\n": ["at '/metrics/port'", "got string, want integer"],
        "leaderElection:\n  enabled: true\n  leaseSeconds: 5\n": ["at '/leaderElection'", "additional properties 'leaseSeconds' not allowed"],
        "replicaCount: 2\n": ["additional properties 'replicaCount' not allowed"],
    }
    for index, (text, wanted) in enumerate(cases.items()):
        values = tmp_path / f"bad-{index}.yaml"
        values.write_text(text)
        result = installed.helm.run("install", f"bad-{index}", str(CHART_DIR), "--namespace", RELEASE_NS, "--create-namespace",
                                    "--values", str(values), check=False)
        assert result.returncode != 0, f"helm install accepted {text!r}"
        for fragment in wanted:
            assert fragment in result.stderr, f"{fragment!r} not in: {result.stderr}"
        assert installed.helm.run("status", f"bad-{index}", "--namespace", RELEASE_NS, check=False).returncode != 0


def test_install_runs_the_operator_under_the_charts_service_account_and_reconciles_the_example(installed: Installed) -> None:
    cluster, helm = installed.cluster, installed.helm
    helm.run("install", RELEASE, str(CHART_DIR), "--namespace", RELEASE_NS, "--create-namespace", *INSTALL_ARGS)
    pod = wait_for(lambda: operator_pod(cluster), "the operator pod to be Ready", timeout_s=60)
    installed.operator_pods.append(pod["metadata"]["name"])
    assert pod["spec"]["serviceAccountName"] == FULLNAME
    assert pod["spec"]["containers"][0]["image"].startswith("kvfleet/operator:")
    # The process's credentials are a token of the chart's ServiceAccount, handed over by the node agent.
    pod_kubeconfig = cluster.pod_dir(RELEASE_NS, pod["metadata"]["name"]) / "kubeconfig"
    whoami = subprocess.run([str(cluster.plane.kubectl), f"--kubeconfig={pod_kubeconfig}", "auth", "whoami", "-o", "json"],
                            capture_output=True, text=True, check=True, timeout=30)
    assert json.loads(whoami.stdout)["status"]["userInfo"]["username"] == f"system:serviceaccount:{RELEASE_NS}:{FULLNAME}"

    example = yaml.safe_load(EXAMPLE.read_text())
    spec = example["spec"]
    spec["model"].pop("volume")  # no volume provisioner here; the scripted worker reads no weights
    spec["workerTemplate"]["image"] = "kvfleet/scripted-worker:dev"
    spec["scheduling"]["epochSeconds"] = 1
    # One headroom pod: the headroom Deployment and the chart's PriorityClass are used too.
    spec["autoscaling"]["headroomWorkers"] = 1
    installed.pool_name = name = example["metadata"]["name"]
    cluster.kubectl("apply", "-n", POOLS_NS, "-f", "-", input_text=json.dumps(example))
    st = wait_for(lambda: (s := pool_status(cluster, name)) and s.get("readyWorkers") == 1
                  and condition(s, "Ready").get("status") == "True" and s, "the example pool's ready worker", timeout_s=90)
    assert st["desiredWorkers"] == 1 and st["observedGeneration"] == 1
    workers = cluster.get_json("pods", "-n", POOLS_NS, "-l", resources.worker_selector(name))["items"]
    assert [w["metadata"]["name"] for w in workers] == [f"{name}-worker-0"]
    assert workers[0]["spec"]["serviceAccountName"] == resources.worker_account_name(name)
    # Its pod got the chart's PriorityClass's value from the API server's Priority admission.
    wait_for(lambda: [p for p in cluster.get_json("pods", "-n", POOLS_NS, "-l", "app.kubernetes.io/component=headroom")["items"]
                      if p["spec"].get("priority") == resources.HEADROOM_PRIORITY], "a headroom pod", timeout_s=30)

    # The metrics endpoint the chart's Service points at serves the pool's figures.
    def metrics() -> str:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:9090/metrics", timeout=5) as resp:
            return resp.read().decode()

    sample = f'kvfleet_pool_workers_ready{{namespace="{POOLS_NS}",pool="{name}"}} 1.0'
    wait_for(lambda: sample in metrics(), f"{sample} on the operator's /metrics", timeout_s=15)
    service = cluster.get_json("service", f"{FULLNAME}-metrics", "-n", RELEASE_NS)
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_upgrade_with_a_changed_value_rolls_the_operator(installed: Installed) -> None:
    cluster, helm = installed.cluster, installed.helm
    assert installed.operator_pods, "the install test did not run"
    old = installed.operator_pods[-1]
    # From every namespace to llm-pools only: new flags (a new pod) and RoleBindings instead of a
    # ClusterRoleBinding for the namespaced rules.
    helm.run("upgrade", RELEASE, str(CHART_DIR), "--namespace", RELEASE_NS, "--reuse-values",
             "--set", f"watchNamespaces={{{POOLS_NS}}}", "--wait", "--timeout", "120s")
    pod = wait_for(lambda: (p := operator_pod(cluster)) and p["metadata"]["name"] != old and p, "a new operator pod", timeout_s=60)
    installed.operator_pods.append(pod["metadata"]["name"])
    assert f"--namespace={POOLS_NS}" in pod["spec"]["containers"][0]["args"]
    wait_for(lambda: cluster.get_json("pod", old, "-n", RELEASE_NS, check=False) is None, "the old operator pod to go", timeout_s=60)
    assert cluster.get_json("clusterrolebinding", FULLNAME, check=False) is None
    assert cluster.get_json("rolebinding", FULLNAME, "-n", POOLS_NS)["roleRef"]["name"] == FULLNAME
    assert helm.run("history", RELEASE, "--namespace", RELEASE_NS, "-o", "json").stdout.count('"revision"') == 2

    # The new operator, with namespaced rights only, carries on with the pool.
    name = installed.pool_name
    cluster.kubectl("scale", "llmpool", name, "-n", POOLS_NS, "--replicas=2")
    wait_for(lambda: pool_status(cluster, name).get("readyWorkers") == 2, "a second worker from the new operator", timeout_s=90)


def namespace_is_going(cluster: Cluster, namespace: str) -> bool:
    ns = cluster.get_json("namespace", namespace, check=False)
    return ns is None or ns.get("status", {}).get("phase") == "Terminating"


def refusals(cluster: Cluster, log: str) -> list[str]:
    """Log lines where the API server refused the operator, less those that are not about its RBAC
    on our pool: a namespace being deleted refuses new objects with 403 too (NamespaceLifecycle
    admission). While cluster-wide, the operator also serves other test modules' pools, whose
    namespaces are going, and the upgrade to namespaced rights takes its cluster-wide binding away
    while the old pod still finishes their deletion (kopf retries a refused finalizer PATCH until the
    pod stops). Its RBAC is the same in every namespace before that, so a real denial would show on
    our pool as well. The namespace comes from our reconcile line or from kopf's request URL."""
    found = []
    for line in log.splitlines():
        if not REFUSALS.search(line) or "because it is being terminated" in line:
            continue
        named = re.search(r"reconcile of ([a-z0-9-]+)/\S+ failed|/namespaces/([a-z0-9-]+)/", line)
        namespace = named and (named[1] or named[2])
        if namespace and namespace != POOLS_NS and namespace_is_going(cluster, namespace):
            continue
        found.append(line)
    return found


def test_the_operator_was_never_refused(installed: Installed) -> None:
    assert len(installed.operator_pods) == 2, "the install and upgrade tests did not run"
    for name in installed.operator_pods:
        log = (installed.cluster.pod_dir(RELEASE_NS, name) / "operator.log").read_text(errors="replace")
        assert "became the leader" in log, log[-3000:]
        refused = refusals(installed.cluster, log)
        assert not refused, f"{name} was refused by the API server:\n" + "\n".join(refused[:20])
        assert "Traceback" not in log, log[-3000:]


def test_uninstall_keeps_the_crds_and_the_pools(installed: Installed) -> None:
    cluster, helm = installed.cluster, installed.helm
    name = installed.pool_name
    assert name, "the install test did not run"
    helm.run("uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", "--timeout", "120s")
    wait_for(lambda: not cluster.get_json("pods", "-n", RELEASE_NS, "-l", OPERATOR_SELECTOR)["items"],
             "the operator pod to go", timeout_s=60)
    for kind, obj_name in (("deployment", FULLNAME), ("clusterrole", FULLNAME), ("clusterrole", f"{FULLNAME}-cluster"),
                           ("serviceaccount", FULLNAME), ("priorityclass", resources.HEADROOM_PRIORITY_CLASS)):
        namespace = ["-n", RELEASE_NS] if kind in ("deployment", "serviceaccount") else []
        assert cluster.get_json(kind, obj_name, *namespace, check=False) is None, f"{kind} {obj_name} survived the uninstall"
    for crd in CRDS_DIR.glob("*.yaml"):
        got = cluster.get_json("crd", f"{crd.stem}.kvfleet.dev")
        assert any(c["type"] == "Established" and c["status"] == "True" for c in got["status"]["conditions"])
    pool = cluster.get_json("llmpool", name, "-n", POOLS_NS)
    assert pool["spec"]["workerTemplate"]["image"] == "kvfleet/scripted-worker:dev"
    # The workers keep serving, unmanaged, until an operator is back.
    workers = cluster.get_json("pods", "-n", POOLS_NS, "-l", resources.worker_selector(name))["items"]
    assert len(workers) == 2 and not any(w["metadata"].get("deletionTimestamp") for w in workers)


# ------------------------------------------------------------------------------------------- RBAC

PROBE_NS, PROBE_POOLS_NS, ELSEWHERE_NS = "rbac-probe", "rbac-probe-pools", "rbac-probe-elsewhere"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


@dataclass
class Probe:
    """The chart's RBAC, rendered for one mode and applied under a release name of its own, asked
    about the operator's calls through SubjectAccessReviews (the API server's authorizer)."""

    mode: str
    objs: list[dict[str, Any]]
    authz: client.AuthorizationV1Api
    rbac: client.RbacAuthorizationV1Api

    @property
    def user(self) -> str:
        account = one(self.objs, "ServiceAccount")["metadata"]["name"]
        return f"system:serviceaccount:{PROBE_NS}:{account}"

    def namespace(self, call: Call) -> str:
        if call.scope == "cluster" or (call.scope == "watch" and self.mode == CLUSTER_WIDE):
            return ""
        return PROBE_NS if call.scope == "release" else PROBE_POOLS_NS

    def allowed(self, call: Call, namespace: str | None = None) -> bool:
        resource, _, subresource = call.resource.partition("/")
        attrs = {"verb": call.verb, "group": call.group, "resource": resource, "subresource": subresource,
                 "name": call.name, "namespace": self.namespace(call) if namespace is None else namespace}
        body = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
            user=self.user, groups=["system:serviceaccounts", f"system:serviceaccounts:{PROBE_NS}", "system:authenticated"],
            resource_attributes=client.V1ResourceAttributes(**{k: v for k, v in attrs.items() if v})))
        return bool(self.authz.create_subject_access_review(body).status.allowed)

    def set_rules(self, role: dict[str, Any], rules: list[dict[str, Any]]) -> None:
        meta = role["metadata"]
        if role["kind"] == "ClusterRole":
            self.rbac.patch_cluster_role(meta["name"], {"rules": rules})
        else:
            self.rbac.patch_namespaced_role(meta["name"], meta["namespace"], {"rules": rules})


def poll(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """RBAC changes reach the authorizer through its informers: within milliseconds, not at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.fixture(scope="module")
def probes(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Probe]]:
    helm = Helm(tmp_path_factory.mktemp("helm-home"))
    for ns in (PROBE_NS, PROBE_POOLS_NS):
        cluster.kubectl("create", "namespace", ns)
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    out: dict[str, Probe] = {}
    for mode in MODES:
        watch = ["--set", f"watchNamespaces={{{PROBE_POOLS_NS}}}"] if mode == NAMESPACED else []
        objs = [o for o in helm.template(f"probe-{mode}", PROBE_NS, *watch) if o["kind"] in RBAC_KINDS]
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
        out[mode] = Probe(mode, objs, client.AuthorizationV1Api(api), client.RbacAuthorizationV1Api(api))
    try:
        yield out
    finally:
        for probe in out.values():
            cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", check=False,
                            input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": probe.objs}))
        for ns in (PROBE_NS, PROBE_POOLS_NS):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        api.close()


@pytest.mark.parametrize("mode", MODES)
def test_the_charts_service_account_may_make_every_operator_call_and_no_more(probes: dict[str, Probe], mode: str) -> None:
    probe = probes[mode]
    calls = all_calls(mode)
    assert poll(lambda: probe.allowed(calls[0]))  # the bindings just applied are live
    denied = [str(c) for c in calls if not probe.allowed(c)]
    assert not denied, f"{mode}: the chart's RBAC refuses calls the operator makes:\n" + "\n".join(denied)
    granted = [str(c) for c in WITHHELD_CALLS if probe.allowed(c)]
    assert not granted, f"{mode}: the chart grants what it should withhold: {granted}"
    if mode == NAMESPACED:
        # Nothing in a namespace the operator does not serve, and no cross-namespace list or watch.
        leaks = [f"{c} in {ELSEWHERE_NS}" for c in calls if c.scope in ("pool", "watch") and probe.allowed(c, ELSEWHERE_NS)]
        leaks += [f"{c} across all namespaces" for c in calls if c.scope == "watch" and probe.allowed(c, "")]
        assert not leaks, "namespaced install has rights outside its namespaces:\n" + "\n".join(leaks)


@pytest.mark.parametrize("mode", MODES)
def test_removing_any_one_rule_denies_an_operator_call(probes: dict[str, Probe], mode: str) -> None:
    probe = probes[mode]
    calls = all_calls(mode)
    roles = [o for o in probe.objs if o["kind"] in ("ClusterRole", "Role")]
    # Exactly the verbs: each verb of each rule is one some call uses (resourceNames included).
    unused = [f"{v} {g or 'core'}/{r}{' ' + str(rule['resourceNames']) if 'resourceNames' in rule else ''} ({role['metadata']['name']})"
              for role in roles for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
              if not any(c.key() == (v, g, r) and (not rule.get("resourceNames") or c.name in rule["resourceNames"]) for c in calls)]
    assert not unused, f"{mode}: the chart grants verbs no call uses:\n" + "\n".join(unused)
    unneeded = []
    for role in roles:
        rules = role["rules"]
        for index, rule in enumerate(rules):
            served = [c for c in calls if c.group in rule["apiGroups"] and c.resource in rule["resources"]]
            label = f"{role['kind']} {role['metadata']['name']} rule {index} {rule}"
            probe.set_rules(role, rules[:index] + rules[index + 1:])
            try:
                if not served or not poll(lambda served=served: any(not probe.allowed(c) for c in served)):
                    unneeded.append(label)
            finally:
                probe.set_rules(role, copy.deepcopy(rules))
            assert poll(lambda served=served: all(probe.allowed(c) for c in served)), f"restoring {label} did not take"
    assert not unneeded, (f"{mode}: removing these rules denies none of the operator's calls (kvfleet_e2e.helm.OPERATOR_CALLS); "
                          "drop them or list the call that needs them:\n" + "\n".join(unneeded))
