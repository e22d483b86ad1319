"""A pod's container environment as a kubelet builds it: the pod's env and envFrom (secrets,
config maps, downward API fields), the API server's address, and a bound service-account token
handed over as a kubeconfig in $KUBECONFIG (the process's in-cluster config)."""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvfleet.localcluster.controlplane import kubeconfig_text
from kvfleet.localcluster.images import expand_env_refs
from kvfleet.localcluster.records import PodRuntime, as_body


class PodEnvironment:
    """Builds containers' environments from the API server at `server` (trusted through `ca_file`)."""

    def __init__(self, api: client.ApiClient, server: str, ca_file: str) -> None:
        self.core = client.CoreV1Api(api)
        self.server = server
        self.ca_file = ca_file

    def pod_env(self, runtime: PodRuntime, container: dict[str, Any]) -> dict[str, str]:
        """The environment of one container: the agent's PATH, the API server, the pod's env vars."""
        pod = runtime.body
        meta = pod["metadata"]
        server_host, _, server_port = self.server.removeprefix("https://").partition(":")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(runtime.directory),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "HOSTNAME": meta["name"],
            "KUBERNETES_SERVICE_HOST": server_host,
            "KUBERNETES_SERVICE_PORT": server_port,
            "KVFLEET_POD_DIR": str(runtime.directory),
            "KVFLEET_POD_IP": runtime.ip,
        }
        for name in ("KVFLEET_CACHE", "VIRTUAL_ENV", "PYTHONPATH", "TRITON_INTERPRET"):
            if name in os.environ:
                env[name] = os.environ[name]
        if runtime.env.get("KUBECONFIG"):
            env["KUBECONFIG"] = runtime.env["KUBECONFIG"]
        for item in container.get("envFrom") or []:
            prefix = item.get("prefix", "")
            if "secretRef" in item:
                data = self.read_secret(meta["namespace"], item["secretRef"]["name"], optional=item["secretRef"].get("optional", False))
            else:
                data = self.read_configmap(meta["namespace"], item["configMapRef"]["name"], optional=item["configMapRef"].get("optional", False))
            env.update({prefix + k: v for k, v in data.items()})
        for var in container.get("env") or []:
            env[var["name"]] = self.env_value(runtime, var, env)
        return env

    def env_value(self, runtime: PodRuntime, var: dict[str, Any], env: dict[str, str]) -> str:
        if "valueFrom" not in var:
            return expand_env_refs(var.get("value", ""), env)
        source = var["valueFrom"]
        pod = runtime.body
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            simple = {
                "metadata.name": pod["metadata"]["name"],
                "metadata.namespace": pod["metadata"]["namespace"],
                "metadata.uid": pod["metadata"]["uid"],
                "spec.nodeName": pod["spec"].get("nodeName", ""),
                "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
                "status.podIP": runtime.ip,
                "status.hostIP": "127.0.0.1",
            }
            if path in simple:
                return str(simple[path])
            match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            if match:
                return str((pod["metadata"].get(match.group(1)) or {}).get(match.group(2), ""))
            raise ValueError(f"fieldRef {path} is not supported by the e2e node agent")
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return self.read_secret(pod["metadata"]["namespace"], ref["name"], ref.get("optional", False)).get(ref["key"], "")
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.read_configmap(pod["metadata"]["namespace"], ref["name"], ref.get("optional", False)).get(ref["key"], "")
        raise ValueError(f"env source {sorted(source)} is not supported by the e2e node agent")

    def read_secret(self, namespace: str, name: str, optional: bool) -> dict[str, str]:
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as err:
            if err.status == 404 and optional:
                return {}
            raise
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    def read_configmap(self, namespace: str, name: str, optional: bool) -> dict[str, str]:
        try:
            return dict(self.core.read_namespaced_config_map(name, namespace).data or {})
        except ApiException as err:
            if err.status == 404 and optional:
                return {}
            raise

    def service_account_kubeconfig(self, runtime: PodRuntime) -> None:
        """A bound token from the TokenRequest API, handed over as a kubeconfig (the process's in-cluster config)."""
        spec = runtime.body["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return
        sa = spec.get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 86400,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": runtime.name, "uid": runtime.uid},
            },
        }
        status = self.core.create_namespaced_service_account_token(sa, runtime.namespace, as_body(request)).status
        token = status.token if status is not None else None
        if not token:
            raise RuntimeError(f"the TokenRequest for service account {runtime.namespace}/{sa} returned no token")

        path = runtime.directory / "kubeconfig"
        path.write_text(kubeconfig_text(self.server, Path(self.ca_file), token=token, user=f"system:serviceaccount:{runtime.namespace}:{sa}",
                                        namespace=runtime.namespace))
        path.chmod(0o600)
        (runtime.directory / "token").write_text(token)
        (runtime.directory / "namespace").write_text(runtime.namespace)
        runtime.env["KUBECONFIG"] = str(path)
