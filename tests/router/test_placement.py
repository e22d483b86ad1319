"""A pool policy's Allocate as the router applies it, with exact small cases: MELL's Fig. 10 (§VI-C,
the `mell-paper` policy) and the default's best fit.

The rule is the scheduling core's (kvfleet.mell.allocate_one); these cases check what the router
adds around it (the route first, "fits now", the new-GPU worker, fallbacks) and that the pool's
policy and weights reach it. C is 120 bytes, so the classes are L (60, 120], M (40, 60], S (30, 40], T (15, 30],
tiny up to 15.
"""

from __future__ import annotations

from typing import Any

from kvfleet.mell import PolicyConfig, SizeClass
from kvfleet.router.placement import (
    NoRoute,
    PoolSnapshot,
    ReportedRequest,
    Reservation,
    RouteChoice,
    WorkerState,
    class_name,
    estimate_prompt_tokens,
    place,
    request_kv_bytes,
)

C = 120


def worker(name: str, order: int, *sizes: int, ready: bool = True) -> WorkerState:
    from kvfleet.mell import size_class

    reported = tuple(ReportedRequest(f"{name}-r{i}", s, size_class(s, C)) for i, s in enumerate(sizes))
    return WorkerState(name, f"10.0.0.{order}:8000", ready, order, C, reported)


def choose(workers: list[WorkerState], kv_bytes: int, routes: dict[str, str] | None = None,
           reservations: tuple[Reservation, ...] = (), exclude: frozenset[str] = frozenset(),
           config: PolicyConfig | None = None, policy: str = "mell-paper") -> RouteChoice | NoRoute:
    return place(PoolSnapshot(tuple(workers), routes or {}, config=config, policy=policy), reservations, kv_bytes,
                 default_capacity_bytes=C, exclude=exclude)


def test_the_default_policy_places_on_the_fullest_worker_that_fits_with_headroom() -> None:
    # C = 120, headroom 5% = 6; a holds 90, b 60, c nothing.
    workers = [worker("a", 0, 90), worker("b", 1, 60), worker("c", 2)]
    chosen = choose(workers, 20, policy="mell")  # 90 + 20 + 6 <= 120: the fullest
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("a", "allocate:best-fit")
    chosen = choose(workers, 26, policy="mell")  # 90 + 26 + 6 > 120 and 60 + 26 + 6 <= 120
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("b", "allocate:best-fit")
    chosen = choose(workers, 58, policy="mell")  # fits b only without headroom (60 + 58 <= 120)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("b", "allocate:best-fit-in-headroom")
    chosen = choose(workers, 70, policy="mell")  # fits nowhere busy: the empty worker
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("c", "allocate:new-GPU")


def test_a_request_larger_than_any_worker_goes_to_the_one_with_most_room_to_borrow_the_rest() -> None:
    # DistKV: its newest KV stays on its worker, the rest is lent by the others (docs/distkv.md).
    workers = [worker("a", 0, 90), worker("b", 1, 10), worker("c", 2, 60)]
    chosen = choose(workers, 3 * C, routes={"L": "a"})
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("b", "spanning")
    assert isinstance(choose(workers, 3 * C, exclude=frozenset({"b"})), RouteChoice)
    assert isinstance(choose([worker("a", 0, ready=False)], 3 * C), NoRoute)


def test_class_names_follow_mell_with_tiny_as_t_and_oversize_as_l() -> None:
    assert [class_name(b, C) for b in (10, 20, 35, 50, 100, 500)] == ["T", "T", "S", "M", "L", "L"]


def test_the_route_wins_when_it_is_ready_and_fits() -> None:
    workers = [worker("a", 0, 100), worker("b", 1)]
    assert choose(workers, 20, {"T": "b"}) == RouteChoice("b", "10.0.0.1:8000", "route")


def test_a_full_route_falls_back_to_allocate_t_on_the_l_gpu_with_room() -> None:
    # Route b is full; a is an L-GPU (70) with room for a T-request (20): Fig. 10, Allocate 1.
    workers = [worker("a", 0, 70), worker("b", 1, 30, 30, 30, 30)]
    assert choose(workers, 20, {"T": "b"}) == RouteChoice("a", "10.0.0.0:8000", "allocate:T-on-L-GPU")


def test_t_prefers_the_l_gpu_of_highest_priority_then_the_latest_t_gpu() -> None:
    l_busy, l_idle = worker("a", 0, 70, 10), worker("b", 1, 70)
    assert choose([l_busy, l_idle], 20).pod_name == "b"  # fewer requests, more free: higher priority
    t_old, t_new = worker("c", 2, 20), worker("d", 3, 20)
    chosen = choose([t_old, t_new], 20)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("d", "allocate:T-on-latest-T-GPU")


def test_sm_goes_to_an_l_gpu_only_when_l_plus_it_stays_below_c() -> None:
    # S(i_L) + S(i) < C: 70 + 45 = 115 < 120 fits on a; 80 + 45 = 125 does not on b.
    a, b, m = worker("a", 0, 70), worker("b", 1, 80), worker("m", 2, 45)
    chosen = choose([a, b, m], 45)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("a", "allocate:SM-on-L-GPU")
    chosen = choose([b, m], 45)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("m", "allocate:SM-on-latest-SM-GPU")


def test_l_takes_a_new_gpu_the_empty_worker_first_activated() -> None:
    workers = [worker("a", 0, 20), worker("e2", 5), worker("e1", 4)]
    chosen = choose(workers, 90)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("e1", "allocate:new-GPU")


def test_least_loaded_when_allocate_finds_nothing() -> None:
    # An L-request and no empty worker: Allocate would activate a GPU; the one with most room takes it.
    workers = [worker("a", 0, 50), worker("b", 1, 20)]
    chosen = choose(workers, 65)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("b", "least-loaded")


def test_reservations_not_yet_reported_count_once() -> None:
    a = worker("a", 0, 70)
    # The router sent a-r0 (reported at 70, reserved at 100) and x (not reported yet, 15): 115 held.
    reservations = (Reservation("a-r0", "a", 100), Reservation("x", "a", 15))
    fits = choose([a], 5, reservations=reservations)
    assert isinstance(fits, RouteChoice) and not fits.rule.startswith("queued")
    queued = choose([a], 6, reservations=reservations)
    assert isinstance(queued, RouteChoice) and queued.rule == "queued:emptiest"


def test_without_room_a_request_queues_on_its_route_and_only_no_ready_worker_is_refused() -> None:
    assert isinstance(none := choose([worker("a", 0, ready=False)], 10), NoRoute) and none.reason == "no-ready-worker"
    full = choose([worker("a", 0, 110), worker("b", 1, 105)], 20)
    assert isinstance(full, RouteChoice) and (full.pod_name, full.rule) == ("b", "queued:emptiest")
    routed = choose([worker("a", 0, 110), worker("b", 1, 105)], 20, routes={"T": "a"})
    assert isinstance(routed, RouteChoice) and (routed.pod_name, routed.rule) == ("a", "queued:route")


def test_excluded_workers_are_skipped() -> None:
    chosen = choose([worker("a", 0), worker("b", 1)], 10, exclude=frozenset({"a"}))
    assert isinstance(chosen, RouteChoice) and chosen.pod_name == "b"


def test_request_size_is_prompt_plus_budget_capped_by_the_context() -> None:
    assert request_kv_bytes(10, 20, 2, 100) == 60
    assert request_kv_bytes(10, None, 2, 100) == 200  # chat without a budget: the rest of the context
    assert request_kv_bytes(10, 500, 2, 100) == 200
    assert estimate_prompt_tokens([1, 2, 3]) == 3
    assert estimate_prompt_tokens("x" * 40) == 11
    assert SizeClass.L > SizeClass.T


# ---- where the core's Allocate differs from the rule the router used to carry (docs/router.md)


def test_t_on_l_ranks_by_free_memory_first_as_mells_priority_weights_say() -> None:
    # MELL's GPU priority is weight_free x free/C - weight_requests x requests (§VI-C; 1.0 and 0.001 by
    # default): b (2 requests, 43 free) outranks a (1 request, 20 free). The router's old rule put
    # fewer requests first and chose a.
    chosen = choose([worker("a", 0, 100), worker("b", 1, 61, 16)], 20)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("b", "allocate:T-on-L-GPU")


def test_a_tiny_request_joins_the_oldest_under_filled_multi_item() -> None:
    # Tiny requests travel in multi-items of up to C/4, refilled oldest GPU first (§VI-C, mell_paper.py);
    # the old rule sent them to the newest T-GPU (d).
    chosen = choose([worker("c", 2, 10), worker("d", 3, 10)], 5)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("c", "allocate:tiny-in-multi-item")


def test_s_goes_to_the_latest_s_gpu_not_an_m_gpu() -> None:
    # Allocate S/M: "the most recently activated GPU of the request's class" (mell_paper.py, Theorem 1), so an
    # S-request takes a new GPU rather than the M-GPU the old rule chose.
    chosen = choose([worker("m", 2, 45), worker("e", 5)], 35)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("e", "allocate:new-GPU")


def test_a_choice_that_needs_the_operators_moves_falls_back_to_least_loaded() -> None:
    # Allocate case 2 puts the M-request on L-GPU a and evicts its T-request; the router cannot move
    # it, and a does not fit the request now (90 + 45 > 120), so the least-loaded worker takes it.
    chosen = choose([worker("a", 0, 70, 20), worker("e", 5)], 45)
    assert isinstance(chosen, RouteChoice) and (chosen.pod_name, chosen.rule) == ("e", "least-loaded")


def test_the_pools_weights_reach_the_routers_choice() -> None:
    from kvfleet.router.pool import config_of

    def pool(**scheduling: Any) -> dict[str, Any]:
        return {"spec": {"model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"},
                         "scheduling": {"policy": "mell-paper", **scheduling}}}

    # a: L-GPU, 2 requests, 40 free; b: newer L-GPU, 1 request, 50 free. With the workload weight, b
    # ranks higher; with workloadWeight 0 every GPU ranks the same and MELL's tie-break, the older
    # GPU, decides. (Both workload terms scale together and distance ranks only the sources of moves,
    # so switching the workload term off is what changes a new request's GPU.)
    workers = [worker("a", 0, 70, 10), worker("b", 1, 70)]
    default = config_of(pool())
    flat = config_of(pool(workloadWeight=0.0))
    assert default is not None and flat is not None and (flat.weight_free, flat.weight_requests) == (0.0, 0.0)
    assert default.capacity_bytes == 2**30  # the spec's C; the router plans with the reported one
    with_default = choose(workers, 20, config=default)
    assert isinstance(with_default, RouteChoice) and with_default.pod_name == "b"
    with_flat = choose(workers, 20, config=flat)
    assert isinstance(with_flat, RouteChoice) and (with_flat.pod_name, with_flat.rule) == ("a", "allocate:T-on-L-GPU")
    assert config_of(None) is None and config_of({"spec": {"model": {}}}) is None  # unreadable: MELL's defaults
