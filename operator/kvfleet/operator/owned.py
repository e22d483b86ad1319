"""The objects a pool owns besides its worker pods, kept in place at the start of an epoch.

The pool's token Secret and the workers' RBAC (which every worker needs before it starts), the
headroom placeholders and the router. Each is built by kvfleet.operator.resources and written only
when it is missing or, for the two Deployments, when the pool's spec says otherwise, and for the
Roles when a release changed their rules; what a person tunes on the rest is left alone.

The objects are independent, so each is checked in a thread of its own: a check is a read, and on an
API server loaded by a large pool's reports one read waits about 100 ms (docs/scale.md), so a dozen
in turn held the epoch a second.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvfleet.api.models import LLMPoolSpec
from kvfleet.operator import resources
from kvfleet.operator.kube import KubeApi

# Shared by every pool's pass (each waits for its own checks only).
_CHECKS = ThreadPoolExecutor(16, thread_name_prefix="owned")


def reconcile_owned(api: KubeApi, namespace: str, pool: dict[str, Any], spec: LLMPoolSpec) -> bool:
    """Create what is missing of the pool's owned objects, all checked at once; True when a router
    replica is Ready."""
    checks: list[Callable[[], bool | None]] = [
        *worker_prerequisite_checks(api, namespace, pool),
        lambda: reconcile_headroom(api, namespace, pool, spec),
        *router_checks(api, namespace, pool, spec),
    ]
    results = list(_CHECKS.map(lambda check: check(), checks))  # waits for all; raises the first failure
    return any(result is True for result in results)


def worker_prerequisite_checks(api: KubeApi, namespace: str, pool: dict[str, Any]) -> list[Callable[[], None]]:
    """The checks of the pool's Secret (fresh random token and migration key whenever it is missing) and
    of the workers' ServiceAccount, Role and RoleBinding."""

    def secret() -> None:
        secret_name = resources.token_secret_name(pool["metadata"]["name"])
        if not api.exists(namespace, "Secret", secret_name):
            # Deleted, it is made again with fresh values: that is how a person rotates them.
            api.create(namespace, resources.token_secret(pool, secrets.token_hex(32), secrets.token_hex(32)))

    return [secret, *(_keeper(api, namespace, obj) for obj in resources.worker_rbac(pool))]


def _keeper(api: KubeApi, namespace: str, obj: dict[str, Any]) -> Callable[[], None]:
    return lambda: _keep(api, namespace, obj)


def _keep(api: KubeApi, namespace: str, obj: dict[str, Any]) -> None:
    """Create `obj` when it is missing; a Role whose rules this release changed gets the new rules
    (a router made before scale from zero could not patch its pool, and would never wake it)."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    if kind == "Role":
        rules = api.role_rules(namespace, name)
        if rules is None:
            api.create(namespace, obj)
        elif rules != obj["rules"]:
            api.patch_role_rules(namespace, name, obj["rules"])
    elif not api.exists(namespace, kind, name):
        api.create(namespace, obj)


def reconcile_headroom(api: KubeApi, namespace: str, pool: dict[str, Any], spec: LLMPoolSpec) -> None:
    """Keep `autoscaling.headroomWorkers` headroom pods (see resources.headroom_deployment)."""
    name = resources.headroom_name(pool["metadata"]["name"])
    want = spec.autoscaling.headroom_workers
    have = api.deployment_replicas(namespace, name)
    if want and have is None:
        if not api.exists(namespace, "PriorityClass", resources.HEADROOM_PRIORITY_CLASS):
            api.create(namespace, resources.headroom_priority_class())
        api.create(namespace, resources.headroom_deployment(pool, spec))
    elif want and have != want:
        api.scale_deployment(namespace, name, want)
    elif not want and have is not None:
        api.delete_deployment(namespace, name)


def reconcile_router(api: KubeApi, namespace: str, pool: dict[str, Any], spec: LLMPoolSpec) -> bool:
    """Keep the pool's router (resources.router_objects), one object after another; True when a router
    replica is Ready."""
    return any([check() is True for check in router_checks(api, namespace, pool, spec)])


def router_checks(api: KubeApi, namespace: str, pool: dict[str, Any], spec: LLMPoolSpec) -> list[Callable[[], bool | None]]:
    """The checks of the router's objects; the Deployment's says whether a router replica is Ready."""
    return [_deployment_keeper(api, namespace, obj) if obj["kind"] == "Deployment" else _keeper(api, namespace, obj)
            for obj in resources.router_objects(pool, spec)]


def _deployment_keeper(api: KubeApi, namespace: str, obj: dict[str, Any]) -> Callable[[], bool]:
    """Created when missing; rolled when the image derived from the worker template changes (a new
    release), and otherwise left alone, so a person may tune it. True when a replica is Ready."""

    def keep() -> bool:
        observed = api.deployment_image_and_ready(namespace, obj["metadata"]["name"])
        if observed is None:
            api.create(namespace, obj)
        elif observed[0] != obj["spec"]["template"]["spec"]["containers"][0]["image"]:
            api.replace_deployment_template(namespace, obj)
        return observed is not None and observed[1] > 0

    return keep
