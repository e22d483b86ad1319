"""Leader election on a coordination.k8s.io Lease, so that two operator replicas never both act.

kopf's peering is not leader election: replicas of equal priority all pause (kopf's docs, "peering").
This is the client-go pattern instead: a replica acts only while it holds the Lease, renews it every
third of its duration, and exits the moment it cannot prove it still holds it, so a replica that
was partitioned away stops before another one takes over. Waiting replicas take over once the Lease
has not been renewed for its whole duration.

Exiting from the renewal thread is not enough on its own: a leader frozen for longer than the lease
(SIGSTOP, a stalled VM, a long GC pause) wakes with every thread runnable at once, and the epoch
thread can write before the renewal thread finds out a standby took over. So the elector also fences
writes: `ensure_leading()`, called before each write of an epoch (kvfleet.operator.kube), refuses and
steps down unless the last successful renewal is younger than the lease, on the monotonic clock
(which keeps counting while the process is stopped). The renewal's time is taken before its request
is sent, as the renewTime it writes is, so the fence never outlives what a standby reads.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """A write was refused because this replica can no longer prove it holds the Lease."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _micro(ts: dt.datetime) -> str:
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, namespace: str, name: str = "kvfleet-operator", lease_duration_s: float = 15.0,
                 identity: str | None = None) -> None:
        self.namespace = namespace
        self.name = name
        self.lease_duration_s = lease_duration_s
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        self.api = client.CoordinationV1Api()
        # Monotonic time until which the last successful acquire or renewal holds (-inf: never held).
        self._held_until_monotonic_s = -math.inf
        self._on_lost: Callable[[], None] | None = None

    def leading(self) -> bool:
        """Whether the last successful acquire or renewal is younger than the lease's duration."""
        return time.monotonic() < self._held_until_monotonic_s

    def ensure_leading(self, action: str) -> None:
        """The write fence: return if this replica still holds the Lease, else step down (`on_lost` of
        keep()) and raise LeaseLost, so that `action` is never sent."""
        if self.leading():
            return
        age_s = time.monotonic() - (self._held_until_monotonic_s - self._written_duration_s())
        log.error("lease last renewed %.1fs ago (it lasts %ds): stepping down instead of %s",
                  age_s, self._written_duration_s(), action)
        if self._on_lost is not None:
            self._on_lost()
        raise LeaseLost(f"{self.identity} no longer holds the lease; refused {action}")

    def _written_duration_s(self) -> int:
        """The duration written into the Lease (whole seconds): what the other replicas go by."""
        return max(1, round(self.lease_duration_s))

    def try_acquire_or_renew(self) -> bool:
        """One round of the election: take the Lease if it is free or expired, renew it if held; True
        while this replica leads. The elector's loop calls it every retry period."""
        # Taken before any request, like `now` (the renewTime written): the lease a standby reads
        # expires no earlier than this plus its duration.
        attempt_monotonic_s = time.monotonic()
        now = _now()
        duration_s = self._written_duration_s()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as err:
            if err.status != 404:
                raise
            body = {"metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": duration_s, "renewTime": _micro(now),
                             "acquireTime": _micro(now), "leaseTransitions": 0}}
            try:
                # A dict body goes to the API server as it is (its times in MicroTime's format); the
                # client's annotations ask for its V1Lease model.
                self.api.create_namespaced_lease(self.namespace, body)  # type: ignore[arg-type]
                self._held_until_monotonic_s = attempt_monotonic_s + duration_s
                return True
            except ApiException as create_err:
                if create_err.status == 409:
                    return False
                raise
        # The API server always returns a Lease's spec (an empty one at least).
        assert lease.spec is not None
        held_by = lease.spec.holder_identity
        renewed = lease.spec.renew_time
        lease_s = lease.spec.lease_duration_seconds or self.lease_duration_s
        expired = renewed is None or (now - renewed).total_seconds() > lease_s
        if held_by != self.identity and not expired:
            return False
        acquired, transitions = lease.spec.acquire_time, lease.spec.lease_transitions
        if held_by != self.identity:
            acquired, transitions = now, (transitions or 0) + 1
        lease.spec = client.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=duration_s, renew_time=now,
                                        acquire_time=acquired, lease_transitions=transitions)
        try:
            # A replace guarded by resourceVersion: of two replicas racing for an expired lease, one wins.
            self.api.replace_namespaced_lease(self.name, self.namespace, lease)
            self._held_until_monotonic_s = attempt_monotonic_s + duration_s
            return True
        except ApiException as err:
            if err.status == 409:
                return False
            raise

    def acquire(self, stopping: threading.Event | None = None) -> None:
        """Block until this replica holds the Lease."""
        log.info("waiting to lead as %s (lease %s/%s)", self.identity, self.namespace, self.name)
        while not (stopping and stopping.is_set()):
            try:
                if self.try_acquire_or_renew():
                    log.info("became the leader as %s", self.identity)
                    return
            except ApiException as err:
                log.warning("lease not acquired: %s %s", err.status, err.reason)
            except Exception as err:  # the API server is away (a restart): wait for it like for the lease
                log.warning("lease not acquired: %s", err)
            time.sleep(self.lease_duration_s / 5)

    def keep(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew in the background; call `on_lost` when another replica holds the lease or renewal has
        not succeeded for two thirds of it. `on_lost` is also what ensure_leading() calls."""
        self._on_lost = on_lost

        def loop() -> None:
            last_ok = time.monotonic()
            while True:
                time.sleep(self.lease_duration_s / 3)
                try:
                    if self.try_acquire_or_renew():
                        last_ok = time.monotonic()
                        continue
                    log.error("another replica holds the lease: stepping down")
                except Exception as err:  # the API server may be briefly away
                    log.warning("lease renewal failed: %s", err)
                    if time.monotonic() - last_ok < self.lease_duration_s * 2 / 3:
                        continue
                    log.error("lease not renewed for %.0fs: stepping down", time.monotonic() - last_ok)
                on_lost()
                return

        thread = threading.Thread(target=loop, name="lease", daemon=True)
        thread.start()
        return thread
