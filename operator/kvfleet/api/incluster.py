"""How kvfleet's own pods (workers, router) reach the API server, and the one Secret they read there.

Three parts of the pods talk to the API server (the worker's report writer, its KVMigration watcher,
the router's pool view), and worker and router both re-read the pool's Secret while it rotates
(kvfleet.serving.credentials). The serving contract may not import the Kubernetes client, the router
may not import the worker, so what both sides need of the cluster lives here, once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Mapping
from typing import Any, cast

log = logging.getLogger(__name__)


def load_config() -> None:
    """The pod's in-cluster config; outside a cluster (the e2e node agent hands pods a kubeconfig with
    their bound service-account token) $KUBECONFIG."""
    from kubernetes import config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]


def read_items(answer: object) -> list[dict[str, Any]]:
    """The items of a list asked for unparsed (`_preload_content=False`), as the API serialises them
    (camelCase dicts): building the client's models and turning them back into dicts cost ~1 s an
    epoch over 1,000 pods (docs/scale.md)."""
    return list(json.loads(cast(Any, answer).data)["items"])


def read_through(answer: object) -> None:
    """Reads an answer asked for unparsed (`_preload_content=False`: nothing in it is needed, and a
    pod's costs more to parse than to write) to its end, which hands the connection back for reuse."""
    cast(Any, answer).data  # noqa: B018 (the read is the point)


class SecretReader:
    """Reads one Secret of the pod's namespace with the pod's own credentials (a `get` on that one name
    is all its Role grants: kvfleet.operator.resources)."""

    def __init__(self, namespace: str, name: str) -> None:
        from kubernetes import client

        load_config()
        self._core = client.CoreV1Api()
        self.namespace, self.name = namespace, name

    async def __call__(self) -> Mapping[str, str] | None:
        """The Secret's decoded data; None when it does not exist (deleted, not yet made again)."""
        from kubernetes.client.exceptions import ApiException

        try:
            secret = await asyncio.to_thread(self._core.read_namespaced_secret, self.name, self.namespace,
                                             _request_timeout=10)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return {key: base64.b64decode(value).decode() for key, value in (secret.data or {}).items()}


class PoolStatusReader:
    """Reads one LLMPool's status with the pod's own credentials (its Role grants `get` on that one
    pool: kvfleet.operator.resources). A DistKV worker reads the operator's plan there (docs/distkv.md)."""

    GROUP, VERSION, PLURAL = "kvfleet.dev", "v1alpha1", "llmpools"

    def __init__(self, namespace: str, name: str) -> None:
        from kubernetes import client

        load_config()
        self._custom = client.CustomObjectsApi()
        self.namespace, self.name = namespace, name

    async def __call__(self) -> Mapping[str, object] | None:
        """The pool's status; None when the pool does not exist."""
        from kubernetes.client.exceptions import ApiException

        try:
            pool = await asyncio.to_thread(self._custom.get_namespaced_custom_object, self.GROUP, self.VERSION,
                                           self.namespace, self.PLURAL, self.name, _request_timeout=10)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        status = pool.get("status") if isinstance(pool, dict) else None
        return status if isinstance(status, dict) else {}
