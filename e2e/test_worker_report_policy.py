"""A worker may change only its own Pod, on the real API server: the chart's ValidatingAdmissionPolicy
(templates/admissionpolicy.yaml) refuses a pool worker's service account a patch of another pod's
KV-load report, though its Role allows patching pods, and lets it patch its own (issue 18)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kubernetes import client, config

from kvfleet.api.reports import ANNOTATION
from kvfleet.localcluster.cluster import Cluster
from kvfleet_e2e.helm import render_chart

POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def pending_pod(name: str) -> dict[str, Any]:
    # A node selector no node has: the pod exists (a token can be bound to it) and never runs.
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kvfleet.dev/no-such-node": "x"}, "serviceAccountName": "p-worker",
                     "containers": [{"name": "c", "image": "kvfleet/worker:dev"}]}}


def as_token(cluster: Cluster, token: str) -> client.CoreV1Api:
    admin = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=admin)  # type: ignore[no-untyped-call]
    cfg = client.Configuration()
    cfg.host, cfg.ssl_ca_cert, cfg.verify_ssl = admin.host, admin.ssl_ca_cert, admin.verify_ssl
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(cfg))


def report_patch(text: str) -> dict[str, Any]:
    return {"metadata": {"annotations": {ANNOTATION: text}}}


def test_a_worker_patches_its_own_pods_report_and_no_other(cluster: Cluster, namespace: str) -> None:
    objs = render_chart()
    if objs is None:
        pytest.skip("the pinned helm is not built (make controlplane builds it)")
    policy = [o for o in objs if o["kind"] in POLICY_KINDS]
    assert len(policy) == 2, "the chart installs the policy by default"
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": policy}))
    try:
        sa = "p-worker"
        cluster.kubectl("create", "serviceaccount", sa, "-n", namespace)
        cluster.kubectl("create", "role", "p-worker", "--verb=get,patch", "--resource=pods", "-n", namespace)
        cluster.kubectl("create", "rolebinding", "p-worker", "--role=p-worker", f"--serviceaccount={namespace}:{sa}",
                        "-n", namespace)
        for name in ("p-worker-0", "p-worker-1"):
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(pending_pod(name)))
        token = cluster.kubectl("create", "token", sa, "-n", namespace, "--bound-object-kind=Pod",
                                "--bound-object-name=p-worker-0").stdout.strip()
        api = as_token(cluster, token)

        api.patch_namespaced_pod("p-worker-0", namespace, report_patch('{"own": true}'))  # its own: allowed
        # Another pod's report: refused (the policy may take a moment to be in force after its creation).
        deadline = time.monotonic() + 30
        while True:
            try:
                api.patch_namespaced_pod("p-worker-1", namespace, report_patch('{"forged": true}'))
            except client.ApiException as err:
                assert err.status == 403 and "only its own Pod" in str(err.body), err.body
                break
            assert time.monotonic() < deadline, "a worker patched another pod's report"
            time.sleep(0.5)
        api.patch_namespaced_pod("p-worker-0", namespace, report_patch('{"own": 2}'))
        assert cluster.get_json("pod", "p-worker-0", "-n", namespace)["metadata"]["annotations"][ANNOTATION] == '{"own": 2}'
        # A token bound to no pod cannot change pods at all.
        unbound = as_token(cluster, cluster.kubectl("create", "token", sa, "-n", namespace).stdout.strip())
        with pytest.raises(client.ApiException) as refused:
            unbound.patch_namespaced_pod("p-worker-0", namespace, report_patch('{"unbound": true}'))
        assert refused.value.status == 403
    finally:
        for obj in policy:
            cluster.kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found", check=False)
