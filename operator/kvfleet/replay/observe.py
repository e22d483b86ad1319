"""What a replay watches on the cluster while it sends: the pool's status, its worker pods, its moves.

Everything here comes from the API server (and the router's speed endpoint), as `kubectl get` would
show it, so a replay on a real cluster records the same things as one on the local control plane:
GPUs in use and the fluid lower bound once a second from the LLMPool's status; every worker pod's
lifetime (created: its creationTimestamp; gone: when it left the API) and GPUs, for the billed
GPU-seconds; every KVMigration's last state, kept even after its TTL deletes it; and each worker's
latest measured speed, kept after a scale-down removes the worker.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvfleet.api.models import GROUP, POOL_LABEL, VERSION
from kvfleet.api.speed import SPEED_PROFILE_PATH, SpeedProfile
from kvfleet.replay.streams import Clock

logger = logging.getLogger(__name__)

ROUTER_LABEL = "kvfleet.dev/router"
WORKER_SELECTOR = "app.kubernetes.io/component=worker"
GPU_RESOURCE = "nvidia.com/gpu"
ROUTER_PORT = 8000


@dataclass(frozen=True)
class Sample:
    """The pool's status at one moment of the replay."""

    at_s: float
    gpus_in_use: int
    lower_bound_gpus: int
    workers: int
    streams_in_flight: int


@dataclass
class PodLife:
    """One worker pod: when the API server created it and when it left, on the replay's clock."""

    name: str
    uid: str
    gpus: int
    created_s: float
    ready_s: float | None = None  # when it first turned Ready (the kubelet's condition time)
    gone_s: float | None = None
    deleted_s: float | None = None  # when its deletion was asked for (its deletionTimestamp less its grace period)


def timestamp_s(text: str) -> float:
    """An API server timestamp (RFC 3339, `Z`) as wall-clock seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def pod_gpus(pod: dict[str, Any]) -> int:
    """GPUs the pod requested (a worker asks for whole GPUs in its limits and requests)."""
    return sum(int(((c.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE, 0))
               for c in pod["spec"].get("containers") or [])


class PoolObserver:
    """Polls one pool's objects on its own thread until `stop()`."""

    def __init__(self, pool: str, namespace: str, clock: Clock, *, kubeconfig: str | None = None,
                 router_url: str | None = None, interval_s: float = 0.5) -> None:
        if kubeconfig is not None or not _in_cluster():
            config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        else:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()
        self.pool = pool
        self.namespace = namespace
        self.clock = clock
        self.router_url = router_url
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.pods: dict[str, PodLife] = {}  # by uid
        self.migrations: dict[str, dict[str, Any]] = {}  # by name: the last state seen
        self.profiles: dict[str, SpeedProfile] = {}  # by worker pod: its latest
        self.in_flight: Callable[[], int] = lambda: 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.errors = 0

    # -- one-off reads ---------------------------------------------------------------------------------

    def get_pool(self) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "llmpools", self.pool))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def set_policy(self, policy: str) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, "llmpools", self.pool,
                                                   {"spec": {"scheduling": {"policy": policy}}})

    def find_router_url(self) -> str | None:
        """The pool's ready router pod, by pod IP (reachable on the local cluster and from inside one)."""
        for pod in self._pods(f"{ROUTER_LABEL}={self.pool}"):
            status = pod.get("status") or {}
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
            if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
                return f"http://{status['podIP']}:{ROUTER_PORT}"
        return None

    def _pods(self, selector: str) -> list[dict[str, Any]]:
        """Pods as the API serialises them (camelCase dicts, RFC 3339 strings)."""
        listing = self.core.list_namespaced_pod(self.namespace, label_selector=selector)
        return [self.core.api_client.sanitize_for_serialization(p) for p in listing.items]

    # -- the polling thread ----------------------------------------------------------------------------

    def start(self) -> None:
        self.poll_once()
        self._thread = threading.Thread(target=self._run, name="replay-observer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.poll_once()  # the last word: pods and moves as they are at the end
            self.poll_profiles()
        except Exception as err:  # the record keeps what the last good poll saw
            self.errors += 1
            logger.warning("replay observer, last poll: %s", err)

    def pod_lives(self) -> list[PodLife]:
        """The pods seen so far (a copy: the polling thread adds to them)."""
        with self._lock:
            return list(self.pods.values())

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(self.interval_s):
            ticks += 1
            try:
                self.poll_once(sample=ticks % max(1, round(1.0 / self.interval_s)) == 0)
                if ticks % max(1, round(5.0 / self.interval_s)) == 0:
                    self.poll_profiles()
            except Exception as err:  # an API hiccup costs a sample, not the replay
                self.errors += 1
                logger.warning("replay observer: %s", err)

    def poll_once(self, sample: bool = True) -> None:
        now_s = self.clock.now_s()
        if sample:
            st = ((self.get_pool() or {}).get("status")) or {}
            self.samples.append(Sample(now_s, int(st.get("gpusInUse", 0)), int(st.get("lowerBoundGpus", 0)),
                                       int(st.get("workers", 0)), self.in_flight()))
        self._poll_pods(now_s)
        self._poll_migrations()

    def _poll_pods(self, now_s: float) -> None:
        seen = set()
        for pod in self._pods(f"{POOL_LABEL}={self.pool},{WORKER_SELECTOR}"):
            meta = pod["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            if uid not in self.pods:
                created = self.clock.at_wall_s(timestamp_s(meta["creationTimestamp"]))
                with self._lock:
                    self.pods[uid] = PodLife(meta["name"], uid, pod_gpus(pod), created)
            life = self.pods[uid]
            if life.deleted_s is None and meta.get("deletionTimestamp"):
                # The API server sets deletionTimestamp to the request's time plus the grace period.
                grace_s = float(meta.get("deletionGracePeriodSeconds") or 0)
                life.deleted_s = self.clock.at_wall_s(timestamp_s(meta["deletionTimestamp"])) - grace_s
            if life.ready_s is None:
                for c in (pod.get("status") or {}).get("conditions") or []:
                    if c["type"] == "Ready" and c["status"] == "True" and c.get("lastTransitionTime"):
                        life.ready_s = self.clock.at_wall_s(timestamp_s(c["lastTransitionTime"]))
        for life in self.pods.values():
            if life.gone_s is None and life.uid not in seen:
                # Gone between the last poll and this one: the midpoint is off by at most half an interval.
                life.gone_s = now_s - self.interval_s / 2

    def _poll_migrations(self) -> None:
        listing = cast(dict[str, Any], self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "kvmigrations"))
        for m in listing["items"]:
            if (m.get("spec") or {}).get("pool") == self.pool:
                self.migrations[m["metadata"]["name"]] = m

    def poll_profiles(self) -> None:
        """Each worker's latest measured speed, from the router (which asks the workers)."""
        if self.router_url is None:
            return
        try:
            with urllib.request.urlopen(f"{self.router_url}{SPEED_PROFILE_PATH}", timeout=5) as response:
                body = json.loads(response.read())
        except Exception as err:  # an older router, or one restarting: the replay keeps what it has
            logger.info("no speed profile from the router: %s", err)
            return
        for worker, profile in (body.get("workers") or {}).items():
            try:
                self.profiles[worker] = SpeedProfile.model_validate(profile)
            except ValueError as err:  # a worker of another version: its speed is left out
                logger.info("speed profile of %s unreadable: %s", worker, err)


def _in_cluster() -> bool:
    return "KUBERNETES_SERVICE_HOST" in os.environ
