"""MELL's Allocate as the router applies it (MELL §VI-C, Fig. 10), with exact small cases.

C is 120 bytes, so the classes are L (60, 120], M (40, 60], S (30, 40], T (15, 30], tiny up to 15.
"""

from __future__ import annotations

from kvfleet.mell.models import SizeClass
from kvfleet.router.placement import (
    NoPlacement,
    Placement,
    PoolSnapshot,
    ReportedRequest,
    Reservation,
    WorkerState,
    class_name,
    estimate_prompt_tokens,
    place,
    request_kv_bytes,
)

C = 120


def worker(name: str, order: int, *sizes: int, ready: bool = True) -> WorkerState:
    from kvfleet.mell.models import size_class

    reported = tuple(ReportedRequest(f"{name}-r{i}", s, size_class(s, C)) for i, s in enumerate(sizes))
    return WorkerState(name, f"10.0.0.{order}:8000", ready, order, C, reported)


def choose(workers: list[WorkerState], kv_bytes: int, routes: dict[str, str] | None = None,
           reservations: tuple[Reservation, ...] = (), exclude: frozenset[str] = frozenset()) -> Placement | NoPlacement:
    return place(PoolSnapshot(tuple(workers), routes or {}), reservations, kv_bytes, default_capacity_bytes=C, exclude=exclude)


def test_class_names_follow_mell_with_tiny_as_t_and_oversize_as_l() -> None:
    assert [class_name(b, C) for b in (10, 20, 35, 50, 100, 500)] == ["T", "T", "S", "M", "L", "L"]


def test_the_route_wins_when_it_is_ready_and_fits() -> None:
    workers = [worker("a", 0, 100), worker("b", 1)]
    assert choose(workers, 20, {"T": "b"}) == Placement("b", "10.0.0.1:8000", "route")


def test_a_full_route_falls_back_to_allocate_t_on_the_l_gpu_with_room() -> None:
    # Route b is full; a is an L-GPU (70) with room for a T-request (20): Fig. 10, Allocate 1.
    workers = [worker("a", 0, 70), worker("b", 1, 30, 30, 30, 30)]
    assert choose(workers, 20, {"T": "b"}) == Placement("a", "10.0.0.0:8000", "allocate:T-on-L-GPU")


def test_t_prefers_the_l_gpu_of_highest_priority_then_the_latest_t_gpu() -> None:
    l_busy, l_idle = worker("a", 0, 70, 10), worker("b", 1, 70)
    assert choose([l_busy, l_idle], 20).pod_name == "b"  # fewer requests, more free: higher priority
    t_old, t_new = worker("c", 2, 20), worker("d", 3, 20)
    chosen = choose([t_old, t_new], 20)
    assert isinstance(chosen, Placement) and (chosen.pod_name, chosen.rule) == ("d", "allocate:T-on-latest-T-GPU")


def test_sm_goes_to_an_l_gpu_only_when_l_plus_it_stays_below_c() -> None:
    # S(i_L) + S(i) < C: 70 + 45 = 115 < 120 fits on a; 80 + 45 = 125 does not on b.
    a, b, m = worker("a", 0, 70), worker("b", 1, 80), worker("m", 2, 45)
    chosen = choose([a, b, m], 45)
    assert isinstance(chosen, Placement) and (chosen.pod_name, chosen.rule) == ("a", "allocate:SM-on-L-GPU")
    chosen = choose([b, m], 45)
    assert isinstance(chosen, Placement) and (chosen.pod_name, chosen.rule) == ("m", "allocate:SM-on-latest-SM-GPU")


def test_l_takes_a_new_gpu_the_empty_worker_first_activated() -> None:
    workers = [worker("a", 0, 20), worker("e2", 5), worker("e1", 4)]
    chosen = choose(workers, 90)
    assert isinstance(chosen, Placement) and (chosen.pod_name, chosen.rule) == ("e1", "allocate:new-GPU")


def test_least_loaded_when_allocate_finds_nothing() -> None:
    # An L-request and no empty worker: Allocate would activate a GPU; the one with most room takes it.
    workers = [worker("a", 0, 50), worker("b", 1, 20)]
    chosen = choose(workers, 65)
    assert isinstance(chosen, Placement) and (chosen.pod_name, chosen.rule) == ("b", "least-loaded")


def test_reservations_not_yet_reported_count_once() -> None:
    a = worker("a", 0, 70)
    # The router sent a-r0 (reported at 70, reserved at 100) and x (not reported yet, 15): 115 held.
    reservations = (Reservation("a-r0", "a", 100), Reservation("x", "a", 15))
    fits = choose([a], 5, reservations=reservations)
    assert isinstance(fits, Placement) and not fits.rule.startswith("queued")
    queued = choose([a], 6, reservations=reservations)
    assert isinstance(queued, Placement) and queued.rule == "queued:emptiest"


def test_without_room_a_request_queues_on_its_route_and_only_no_ready_worker_is_refused() -> None:
    assert isinstance(none := choose([worker("a", 0, ready=False)], 10), NoPlacement) and none.reason == "no-ready-worker"
    full = choose([worker("a", 0, 110), worker("b", 1, 105)], 20)
    assert isinstance(full, Placement) and (full.pod_name, full.rule) == ("b", "queued:emptiest")
    routed = choose([worker("a", 0, 110), worker("b", 1, 105)], 20, routes={"T": "a"})
    assert isinstance(routed, Placement) and (routed.pod_name, routed.rule) == ("a", "queued:route")


def test_excluded_workers_are_skipped() -> None:
    chosen = choose([worker("a", 0), worker("b", 1)], 10, exclude=frozenset({"a"}))
    assert isinstance(chosen, Placement) and chosen.pod_name == "b"


def test_request_size_is_prompt_plus_budget_capped_by_the_context() -> None:
    assert request_kv_bytes(10, 20, 2, 100) == 60
    assert request_kv_bytes(10, None, 2, 100) == 200  # chat without a budget: the rest of the context
    assert request_kv_bytes(10, 500, 2, 100) == 200
    assert estimate_prompt_tokens([1, 2, 3]) == 3
    assert estimate_prompt_tokens("x" * 40) == 11
    assert SizeClass.L > SizeClass.T
