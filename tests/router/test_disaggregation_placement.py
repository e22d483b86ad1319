"""kvfleet.router.disaggregation: a prefill worker and the decode worker it hands to, exact small cases."""

from __future__ import annotations

from kvfleet.mell.size_classes import SizeClass
from kvfleet.router.disaggregation import caches, choose_prefill, place_disaggregated
from kvfleet.router.locality import LocalityInput, PrefillCost
from kvfleet.router.placement import NoRoute, PDSettings, PoolSnapshot, ReportedRequest, Reservation, RouteChoice, WorkerState
from kvfleet.serving.httpapi import DecodeTarget

CAPACITY = 1000
KV_PER_TOKEN = 1
# exec(x, y) at one unit a token (the unmeasured cost model).
COST = PrefillCost()


def worker(name: str, role: str | None, running: int = 0, used_bytes: int = 0, ready: bool = True) -> WorkerState:
    reported = tuple(ReportedRequest(f"{name}-r{i}", used_bytes // max(1, running), SizeClass.S) for i in range(running))
    return WorkerState(name, f"10.0.0.{abs(hash(name)) % 250}:8000", ready, 0, CAPACITY, reported, role=role,
                       migration_address=f"10.0.0.{abs(hash(name)) % 250}:8001")


def pool(*workers: WorkerState) -> PoolSnapshot:
    return PoolSnapshot(tuple(workers), {}, disaggregation=PDSettings())


def locality(prompt_tokens: int, cached: dict[str, int] | None = None, queued: dict[str, float] | None = None
             ) -> LocalityInput:
    return LocalityInput(prompt_tokens, cached or {}, queued or {}, COST)


ALWAYS = PDSettings(choice="always", link_bytes_per_s=1e6)
PER_REQUEST = PDSettings(choice="per-request", link_bytes_per_s=1e6)


def test_the_prefill_worker_carries_the_decode_worker_mell_chose() -> None:
    snapshot = pool(worker("p0", "prefill"), worker("d0", "decode"), worker("d1", "decode", 1, 100))
    choice = place_disaggregated(snapshot, ALWAYS, [], 50, default_capacity_bytes=CAPACITY, locality=locality(40),
                                 kv_bytes_per_token=KV_PER_TOKEN)
    assert isinstance(choice, RouteChoice)
    assert choice.pod_name == "p0" and choice.rule.startswith("pd:")
    # MELL packs: the decode worker already holding KV takes it, not the empty one; the other is next,
    # for a hand-over d1 refuses.
    d0, d1 = snapshot.workers[1:]
    assert choice.decode == (DecodeTarget("d1", d1.address, d1.migration_address),
                             DecodeTarget("d0", d0.address, d0.migration_address))


def test_without_a_ready_prefill_worker_the_decode_worker_prefills_it_too() -> None:
    snapshot = pool(worker("p0", "prefill", ready=False), worker("d0", "decode"))
    choice = place_disaggregated(snapshot, ALWAYS, [], 50, default_capacity_bytes=CAPACITY)
    assert isinstance(choice, RouteChoice)
    assert (choice.pod_name, choice.rule, choice.decode) == ("d0", "pd:no-prefill-worker", ())


def test_without_a_decode_worker_it_decodes_where_it_is_prefilled() -> None:
    snapshot = pool(worker("p0", "prefill"))
    choice = place_disaggregated(snapshot, ALWAYS, [], 50, default_capacity_bytes=CAPACITY)
    assert isinstance(choice, RouteChoice)
    assert (choice.pod_name, choice.rule, choice.decode) == ("p0", "pd:no-decode-worker", ())
    assert isinstance(place_disaggregated(pool(), ALWAYS, [], 50, default_capacity_bytes=CAPACITY), NoRoute)


def test_when_no_decode_worker_has_room_it_decodes_where_it_is_prefilled() -> None:
    snapshot = pool(worker("p0", "prefill"), worker("d0", "decode", 1, CAPACITY - 10))
    choice = place_disaggregated(snapshot, ALWAYS, [], 50, default_capacity_bytes=CAPACITY)
    assert isinstance(choice, RouteChoice)
    assert (choice.pod_name, choice.rule, choice.decode) == ("p0", "pd:no-decode-room", ())


def test_per_request_keeps_a_short_prompt_on_a_quiet_decode_worker() -> None:
    snapshot = pool(worker("p0", "prefill"), worker("d0", "decode"))
    choice = place_disaggregated(snapshot, PER_REQUEST, [], 50, default_capacity_bytes=CAPACITY, locality=locality(40),
                                 kv_bytes_per_token=KV_PER_TOKEN)
    assert isinstance(choice, RouteChoice)
    assert (choice.pod_name, choice.rule, choice.decode) == ("d0", "pd:local", ())
    # The paper's behaviour, selectable: always disaggregated.
    always = place_disaggregated(snapshot, ALWAYS, [], 50, default_capacity_bytes=CAPACITY, locality=locality(40),
                                 kv_bytes_per_token=KV_PER_TOKEN)
    assert isinstance(always, RouteChoice) and always.pod_name == "p0" and len(always.decode) == 1


def test_per_request_disaggregates_when_the_decode_worker_is_busy_decoding() -> None:
    """Prefilling on D stalls each request decoding there for the prefill's length."""
    busy = pool(worker("p0", "prefill"), worker("d0", "decode", 8, 400))
    choice = place_disaggregated(busy, PER_REQUEST, [], 50, default_capacity_bytes=CAPACITY, locality=locality(40),
                                 kv_bytes_per_token=KV_PER_TOKEN)
    assert isinstance(choice, RouteChoice)
    assert choice.pod_name == "p0" and [t.pod for t in choice.decode] == ["d0"]
    # Reservations count as running too (requests the router placed that no report shows yet).
    quiet = pool(worker("p0", "prefill"), worker("d0", "decode"))
    reserved = [Reservation(f"r{i}", "d0", 10) for i in range(8)]
    choice = place_disaggregated(quiet, PER_REQUEST, reserved, 50, default_capacity_bytes=CAPACITY,
                                 locality=locality(40), kv_bytes_per_token=KV_PER_TOKEN)
    assert isinstance(choice, RouteChoice) and choice.pod_name == "p0"


def test_per_request_counts_the_transfer_time_of_what_the_decode_worker_lacks() -> None:
    snapshot = pool(worker("p0", "prefill"), worker("d0", "decode", 1, 10))
    # A slow link (100 tokens' KV a second): sending 40 tokens takes 0.4 s, prefilling them 4 ms x 2.
    slow = PDSettings(choice="per-request", link_bytes_per_s=100)
    choice = place_disaggregated(snapshot, slow, [], 50, default_capacity_bytes=CAPACITY, locality=locality(40),
                                 kv_bytes_per_token=KV_PER_TOKEN)
    assert isinstance(choice, RouteChoice) and choice.rule == "pd:local"


def test_the_prefill_worker_is_the_one_sooner_to_the_first_token() -> None:
    snapshot = pool(worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode"))
    prefill = PoolSnapshot(snapshot.workers[:2], {})
    # p1 caches 32 of the 40 tokens: it prefills 8, p0 all 40.
    choice = choose_prefill(prefill, [], frozenset(), locality(40, {"p1": 32}))
    assert isinstance(choice, RouteChoice) and (choice.pod_name, choice.rule) == ("p1", "prefix")
    # ...unless its queue is longer than what the cache saves.
    choice = choose_prefill(prefill, [], frozenset(), locality(40, {"p1": 32}, {"p1": 1.0}))
    assert isinstance(choice, RouteChoice) and (choice.pod_name, choice.rule) == ("p0", "least-queued")
    # A failed worker is left out while another is Ready.
    choice = choose_prefill(prefill, [], frozenset({"p1"}), locality(40, {"p1": 32}))
    assert isinstance(choice, RouteChoice) and choice.pod_name == "p0"
    # Without a cost input: the one with the fewest requests in hand.
    choice = choose_prefill(prefill, [Reservation("r", "p0", 1)], frozenset(), None)
    assert isinstance(choice, RouteChoice) and (choice.pod_name, choice.rule) == ("p1", "least-loaded")


def test_which_roles_cache_under_each_milestone() -> None:
    assert [caches("prefill", c) for c in ("none", "prefill", "decode", "full")] == [False, True, True, True]
    assert [caches("decode", c) for c in ("none", "prefill", "decode", "full")] == [False, False, True, True]
