"""A worker may write only its own KV-load report, on the real API server: the chart's
ValidatingAdmissionPolicy (templates/admissionpolicy.yaml) refuses a pool worker's service account a
KVLoad of another pod, or one its pod does not own, though its Role allows creating and patching
kvloads, and a patch of another pod (where workers from before KVLoads wrote their report), though
its Role allows patching pods; and lets it write its own."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client, config

from kvfleet.api.models import GROUP, POOL_LABEL, VERSION
from kvfleet.api.reports import ANNOTATION, KVLOAD_PLURAL, KVLoadReport, kvload_object, pool_reports
from kvfleet.localcluster.cluster import Cluster
from kvfleet.worker.reporter import kvload_writer
from kvfleet_e2e.helm import render_chart

POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def pending_pod(name: str) -> dict[str, Any]:
    # A node selector no node has: the pod exists (a token can be bound to it) and never runs.
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kvfleet.dev/no-such-node": "x"}, "serviceAccountName": "p-worker",
                     "containers": [{"name": "c", "image": "kvfleet/worker:dev"}]}}


def token_client(cluster: Cluster, token: str) -> client.ApiClient:
    admin = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=admin)  # type: ignore[no-untyped-call]
    cfg = client.Configuration()
    cfg.host, cfg.ssl_ca_cert, cfg.verify_ssl = admin.host, admin.ssl_ca_cert, admin.verify_ssl
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(cfg)


def as_token(cluster: Cluster, token: str) -> client.CoreV1Api:
    return client.CoreV1Api(token_client(cluster, token))


def report_patch(text: str) -> dict[str, Any]:
    return {"metadata": {"annotations": {ANNOTATION: text}}}


@dataclass(frozen=True)
class Workers:
    """Two pending pods of pool `p` (p-worker-0 and p-worker-1) under the policy, and a token bound to the first."""

    namespace: str
    token: str
    uids: dict[str, str]


@pytest.fixture()
def workers(cluster: Cluster, namespace: str) -> Iterator[Workers]:
    objs = render_chart()
    if objs is None:
        pytest.skip("the pinned helm is not built (make controlplane builds it)")
    policy = [o for o in objs if o["kind"] in POLICY_KINDS]
    assert len(policy) == 2, "the chart installs the policy by default"
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": policy}))
    try:
        sa = "p-worker"
        cluster.kubectl("create", "serviceaccount", sa, "-n", namespace)
        # What resources.worker_rbac grants for reports: patch pods (old workers), create and patch kvloads.
        cluster.kubectl("create", "role", "p-worker", "--verb=get,patch,create", "--resource=pods,kvloads.kvfleet.dev",
                        "-n", namespace)
        cluster.kubectl("create", "rolebinding", "p-worker", "--role=p-worker", f"--serviceaccount={namespace}:{sa}",
                        "-n", namespace)
        for name in ("p-worker-0", "p-worker-1"):
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pending_pod(name)))
        uids = {name: cluster.get_json("pod", name, "-n", namespace)["metadata"]["uid"] for name in ("p-worker-0", "p-worker-1")}
        token = cluster.kubectl("create", "token", sa, "-n", namespace, "--bound-object-kind=Pod",
                                "--bound-object-name=p-worker-0").stdout.strip()
        yield Workers(namespace, token, uids)
    finally:
        for obj in policy:
            cluster.kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found", check=False)


def refused_until_in_force(attempt: Callable[[], object], message: str, undo: Callable[[], object] = lambda: None) -> None:
    """`attempt` is refused by the policy (which may take a moment to be in force after its creation);
    `undo` takes back what an attempt made before it was, so the next attempt meets the policy again
    (a second create would otherwise be refused as a conflict instead)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            attempt()
        except client.ApiException as err:
            assert err.status == 403 and message in str(err.body), err.body
            return
        undo()
        assert time.monotonic() < deadline, f"not refused: {message}"
        time.sleep(0.5)


def report(sequence: int) -> KVLoadReport:
    return KVLoadReport(capacity_bytes=1000, used_bytes=0, sequence=sequence)


def test_a_worker_writes_its_own_kvload_and_no_other(cluster: Cluster, workers: Workers) -> None:
    ns, own, other = workers.namespace, "p-worker-0", "p-worker-1"
    api = token_client(cluster, workers.token)
    custom = client.CustomObjectsApi(api)
    # Another pod's report, under that pod's name and owner: refused.
    forged = kvload_object(other, workers.uids[other], "p", report(1))
    refused_until_in_force(lambda: custom.create_namespaced_custom_object(GROUP, VERSION, ns, KVLOAD_PLURAL, forged),
                           "only its own KVLoad", undo=lambda: cluster.kubectl("delete", "kvload", other, "-n", ns))
    # Its own name, owned by another pod: refused too.
    planted = kvload_object(own, workers.uids[other], "p", report(1))
    refused_until_in_force(lambda: custom.create_namespaced_custom_object(GROUP, VERSION, ns, KVLOAD_PLURAL, planted),
                           "owned by its own Pod", undo=lambda: cluster.kubectl("delete", "kvload", own, "-n", ns))

    # The worker's own writer: creates its KVLoad, then patches it.
    write = kvload_writer(own, ns, workers.uids[own], "p", api_client=api)
    asyncio.run(write(report(1)))
    asyncio.run(write(report(2)))
    obj = cluster.get_json("kvload", own, "-n", ns)
    assert KVLoadReport.from_kvload(obj) == report(2)
    assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [workers.uids[own]]
    assert obj["metadata"]["labels"] == {POOL_LABEL: "p"}

    # A KVLoad of its name owned by another pod, as a previous pod's of that name is until the garbage
    # collector removes it (a live pod's here, so the collector cannot win the race): the writer takes
    # it over, so the operator reads it as this pod's and the collector keeps it.
    cluster.kubectl("delete", "kvload", own, "-n", ns)
    stale = kvload_object(own, workers.uids[other], "p", report(7))
    cluster.kubectl("create", "-n", ns, "-f", "-", input_text=json.dumps(stale))
    asyncio.run(write(report(3)))
    obj = cluster.get_json("kvload", own, "-n", ns)
    assert KVLoadReport.from_kvload(obj) == report(3)
    assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [workers.uids[own]]
    assert pool_reports([obj], [cluster.get_json("pod", own, "-n", ns)]) == {own: report(3)}
    assert pool_reports([obj], [cluster.get_json("pod", other, "-n", ns)]) == {}

    # Its own pod's KVLoad written by another pod's worker: refused.
    other_token = cluster.kubectl("create", "token", "p-worker", "-n", ns, "--bound-object-kind=Pod",
                                  f"--bound-object-name={other}").stdout.strip()
    intruder = kvload_writer(own, ns, workers.uids[other], "p", api_client=token_client(cluster, other_token))
    with pytest.raises(client.ApiException) as refused:
        asyncio.run(intruder(report(9)))
    assert refused.value.status == 403
    assert KVLoadReport.from_kvload(cluster.get_json("kvload", own, "-n", ns)) == report(3)


def test_a_worker_patches_its_own_pods_report_and_no_other(cluster: Cluster, workers: Workers) -> None:
    """Workers from before KVLoads (an upgrade's old pods) wrote the report on their pod."""
    namespace = workers.namespace
    api = as_token(cluster, workers.token)
    api.patch_namespaced_pod("p-worker-0", namespace, report_patch('{"own": true}'))  # its own: allowed
    refused_until_in_force(lambda: api.patch_namespaced_pod("p-worker-1", namespace, report_patch('{"forged": true}')),
                           "only its own Pod")
    api.patch_namespaced_pod("p-worker-0", namespace, report_patch('{"own": 2}'))
    assert cluster.get_json("pod", "p-worker-0", "-n", namespace)["metadata"]["annotations"][ANNOTATION] == '{"own": 2}'
    # A token bound to no pod cannot change pods at all.
    unbound = as_token(cluster, cluster.kubectl("create", "token", "p-worker", "-n", namespace).stdout.strip())
    with pytest.raises(client.ApiException) as refused:
        unbound.patch_namespaced_pod("p-worker-0", namespace, report_patch('{"unbound": true}'))
    assert refused.value.status == 403
