"""The router's incremental view of the pool (kvfleet.router.placement.PoolLoads) places every request
where the replaying router did: the cluster rebuilt from every report and reservation, Allocate run
on it (`allocate_one`), per placement.

A random life of a pool: workers report (their states replaced one at a time, as the pool view
publishes them), go NotReady, leave; the router reserves, re-reserves and releases requests; and
between steps a request of random size is placed, with and without a failed worker excluded and with
its own reservation set aside, under the default policy and MELL's Fig. 10.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.mell import MellDefaultConfig, size_class
from kvfleet.router.placement import PoolLoads, PoolSnapshot, ReportedRequest, Reservation, WorkerState

C = 1000
PODS = [f"pool-worker-{i}" for i in range(5)]
IDS = [f"r{i}" for i in range(14)]
PROFILE = settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

report = st.tuples(st.just("report"), st.sampled_from(PODS), st.booleans(),
                   st.lists(st.tuples(st.sampled_from(IDS), st.integers(0, 400)), max_size=4))
reserve = st.tuples(st.just("reserve"), st.sampled_from(PODS), st.sampled_from(IDS), st.integers(0, 500))
release = st.tuples(st.just("release"), st.sampled_from(IDS))
leave = st.tuples(st.just("leave"), st.sampled_from(PODS))
steps = st.lists(st.one_of(report, reserve, release, leave), min_size=1, max_size=30)


def state(pod: str, ready: bool, requests: list[tuple[str, int]]) -> WorkerState:
    index = PODS.index(pod)
    reported = tuple(ReportedRequest(r, b, size_class(b, C)) for r, b in requests)
    return WorkerState(pod, f"10.0.0.{index}:8000", ready, index, C, reported)


@PROFILE
@given(steps, st.lists(st.integers(1, 1200), min_size=1, max_size=4), st.sampled_from(["mell", "mell-paper"]),
       st.sampled_from([None, MellDefaultConfig(capacity_bytes=C, max_load_bytes=800, load_bytes_per_request=30)]))
def test_incremental_placement_is_the_replaying_routers(life: list[tuple[object, ...]], sizes: list[int], policy: str,
                                                        config: MellDefaultConfig | None) -> None:
    if policy != "mell":
        config = None
    workers: dict[str, WorkerState] = {}
    reservations: dict[str, Reservation] = {}
    live = PoolLoads()
    for step in life:
        if step[0] == "report":
            _, pod, ready, requests = step
            workers[str(pod)] = state(str(pod), bool(ready), list(requests))  # type: ignore[arg-type]
        elif step[0] == "reserve":
            _, pod, request_id, kv_bytes = step
            reservations[str(request_id)] = Reservation(str(request_id), str(pod), int(kv_bytes))  # type: ignore[call-overload]
            live.reserve(reservations[str(request_id)])
        elif step[0] == "release":
            reservations.pop(str(step[1]), None)
            live.release(str(step[1]))
        else:
            workers.pop(str(step[1]), None)
        snapshot = PoolSnapshot(tuple(workers[p] for p in PODS if p in workers), {}, config=config, policy=policy)
        live.sync(snapshot)
        rebuilt = PoolLoads(snapshot, reservations.values(), rebuild=True)
        totals = [(load.worker.pod_name, load.committed_bytes, load.num_requests, dict(load.sizes()))
                  for load in live.loads(C, frozenset())]
        assert totals == [(load.worker.pod_name, load.committed_bytes, load.num_requests, dict(load.sizes()))
                          for load in rebuilt.loads(C, frozenset())]
        assert all(committed == sum(sizes.values()) and count == len(sizes) for _, committed, count, sizes in totals)
        for kv_bytes in sizes:
            for exclude in (frozenset(), frozenset(PODS[:1])):
                for own in (None, next(iter(reservations), None)):
                    expected = rebuilt.place(kv_bytes, default_capacity_bytes=C, exclude=exclude, request_id=own)
                    assert live.place(kv_bytes, default_capacity_bytes=C, exclude=exclude, request_id=own) == expected
        # Setting one's own reservation aside put it back as it was.
        assert sorted(map(dataclasses.astuple, live.reservations())) == sorted(
            map(dataclasses.astuple, reservations.values()))
