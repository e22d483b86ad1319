"""The leader's write fence: a replica writes only while its last successful renewal is younger than
the lease, on the monotonic clock, so that a leader frozen past its lease (SIGSTOP) and woken after a
standby took over makes no write before its renewal thread notices. Exact cases over a fake Lease API
and a fake monotonic clock; and `Kube`, whose every write passes the fence before it is sent."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvfleet.operator import kube as kube_module
from kvfleet.operator import leader
from kvfleet.operator.leader import LeaderElector, LeaseLost


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class FakeLeases:
    """One Lease, as the API server would keep it (replace guarded by who holds it, not versions)."""

    def __init__(self) -> None:
        self.lease: client.V1Lease | None = None
        self.fail_next: ApiException | None = None

    def read_namespaced_lease(self, name: str, namespace: str) -> client.V1Lease:
        if self.lease is None:
            raise ApiException(status=404)
        return self.lease

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any]) -> None:
        spec = body["spec"]
        self.lease = client.V1Lease(spec=client.V1LeaseSpec(
            holder_identity=spec["holderIdentity"], lease_duration_seconds=spec["leaseDurationSeconds"],
            renew_time=dt.datetime.now(dt.UTC)))

    def replace_namespaced_lease(self, name: str, namespace: str, lease: client.V1Lease) -> None:
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        self.lease = lease


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(leader.time, "monotonic", fake)
    return fake


def elector(leases: FakeLeases, lease_duration_s: float = 2.0) -> LeaderElector:
    made = LeaderElector("default", lease_duration_s=lease_duration_s, identity="me")
    made.api = leases  # type: ignore[assignment]
    return made


def test_a_replica_that_never_acquired_does_not_lead(clock: Clock) -> None:
    lost: list[bool] = []
    made = elector(FakeLeases())
    made._on_lost = lambda: lost.append(True)
    assert not made.leading()
    with pytest.raises(LeaseLost, match="refused create_pod"):
        made.ensure_leading("create_pod")
    assert lost == [True]


def test_the_fence_holds_for_exactly_the_lease_after_the_last_renewal(clock: Clock) -> None:
    leases = FakeLeases()
    made = elector(leases, lease_duration_s=2.0)
    assert made.try_acquire_or_renew()  # created at 1000.0
    clock.now_s = 1001.999
    made.ensure_leading("patch_llmpool_status")  # no raise
    clock.now_s = 1001.5
    assert made.try_acquire_or_renew()  # renewed at 1001.5: holds until 1003.5
    clock.now_s = 1003.499
    assert made.leading()
    clock.now_s = 1003.5
    assert not made.leading()


def test_the_fence_counts_from_before_the_renewal_was_sent(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A renewal whose request took 1.5 s still holds only 2 s from when it was sent (the renewTime it wrote)."""
    leases = FakeLeases()
    made = elector(leases, lease_duration_s=2.0)
    slow_replace = leases.replace_namespaced_lease
    assert made.try_acquire_or_renew()

    def replace(name: str, namespace: str, lease: client.V1Lease) -> None:
        clock.now_s += 1.5
        slow_replace(name, namespace, lease)

    monkeypatch.setattr(leases, "replace_namespaced_lease", replace)
    clock.now_s = 1001.0
    assert made.try_acquire_or_renew()  # sent at 1001.0, answered at 1002.5
    clock.now_s = 1002.999
    assert made.leading()
    clock.now_s = 1003.0
    assert not made.leading()


def test_a_failed_renewal_does_not_extend_the_fence(clock: Clock) -> None:
    leases = FakeLeases()
    made = elector(leases, lease_duration_s=2.0)
    assert made.try_acquire_or_renew()
    clock.now_s = 1001.0
    leases.fail_next = ApiException(status=409)
    assert not made.try_acquire_or_renew()
    clock.now_s = 1002.0
    assert not made.leading()


def test_the_fence_uses_the_whole_seconds_written_into_the_lease(clock: Clock) -> None:
    """--lease-duration=2.4 writes leaseDurationSeconds=2, which is what a standby waits for."""
    leases = FakeLeases()
    made = elector(leases, lease_duration_s=2.4)
    assert made.try_acquire_or_renew()
    assert leases.lease is not None and leases.lease.spec.lease_duration_seconds == 2
    clock.now_s = 1002.0
    assert not made.leading()


def test_a_leader_woken_after_a_freeze_steps_down_before_writing(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    """SIGSTOP for 5 s with a 2 s lease, then SIGCONT: the first write is refused and on_lost runs,
    whatever the renewal thread (still asleep) would have found."""
    leases = FakeLeases()
    made = elector(leases, lease_duration_s=2.0)
    assert made.try_acquire_or_renew()
    lost: list[bool] = []
    made._on_lost = lambda: lost.append(True)
    clock.now_s += 5.0
    with pytest.raises(LeaseLost):
        made.ensure_leading("create_pod")
    assert lost == [True]
    assert "lease last renewed 5.0s ago (it lasts 2s): stepping down instead of create_pod" in caplog.text


class RecordingCore:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def delete_namespaced_pod(self, name: str, namespace: str) -> None:
        self.calls.append(f"delete {namespace}/{name}")


def bare_kube(core: RecordingCore, write_fence: kube_module.WriteFence) -> kube_module.Kube:
    """A Kube without the kubeconfig its constructor loads: only its write path is under test."""
    made = kube_module.Kube.__new__(kube_module.Kube)
    made._local = threading.local()
    made._write_fence = write_fence
    made.core = core  # type: ignore[assignment]
    return made


def test_kube_sends_no_write_the_fence_refuses(clock: Clock) -> None:
    leases = FakeLeases()
    made = elector(leases, lease_duration_s=2.0)
    made._on_lost = lambda: None
    assert made.try_acquire_or_renew()
    core = RecordingCore()
    api = bare_kube(core, made.ensure_leading)
    api.delete_pod("ns", "p-worker-0")
    assert core.calls == ["delete ns/p-worker-0"]
    clock.now_s += 2.0
    with pytest.raises(LeaseLost, match="refused delete_pod"):
        api.delete_pod("ns", "p-worker-1")
    assert core.calls == ["delete ns/p-worker-0"]
    assert api.writes() == {"delete_pod": 1}
