"""The router's hold queue (kvfleet.router.hold): requests wait for a pool's first Ready worker in a
bounded FIFO; exact cases for the bounds, the timeout, the order and a client that goes away.

The queue runs on a FakeClock: time moves only when a test advances it, so no test waits real seconds
and none depends on how fast this machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from kvfleet.router.hold import POLL_S, HoldFull, HoldQueue, HoldTimeout

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    # A guard against a hung test only: nothing in these tests waits on real time.
    return asyncio.run(asyncio.wait_for(coro, 30))


async def settle() -> None:
    """Let every task that can run, run (asyncio.sleep(0) yields to the loop; no time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


class FakeClock:
    """Monotonic time that moves only on advance(); sleep() waits for it."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now_s + seconds, wake))
        await wake

    async def advance(self, seconds: float) -> None:
        """Move time on by `seconds`, waking each sleeper at its own time (earliest first) and letting
        what it wakes run before the next."""
        end_s = self.now_s + seconds
        while due := sorted((s for s in self._sleepers if s[0] <= end_s and not s[1].done()), key=lambda s: s[0]):
            wake_s, wake = due[0]
            self._sleepers.remove(due[0])
            self.now_s = max(self.now_s, wake_s)
            wake.set_result(None)
            await settle()
        self.now_s = end_s
        await settle()


class Pool:
    def __init__(self) -> None:
        self.ready = False
        self.signalled: list[int] = []


def queue(pool: Pool, clock: FakeClock, max_held: int = 3, timeout_s: float = 5.0) -> HoldQueue:
    return HoldQueue(max_held, timeout_s, lambda: pool.ready, pool.signalled.append, clock=clock, sleep=clock.sleep)


def test_a_ready_pool_holds_nothing() -> None:
    pool = Pool()
    pool.ready = True
    assert run(queue(pool, FakeClock()).wait_for_worker()) is False
    assert pool.signalled == []


def test_held_requests_go_in_the_order_they_came_once_a_worker_is_ready() -> None:
    pool, clock = Pool(), FakeClock()
    q = queue(pool, clock)
    released: list[int] = []

    async def client(i: int) -> None:
        assert await q.wait_for_worker() is True
        released.append(i)

    async def scenario() -> None:
        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(client(i)))
            await settle()
        assert q.num_held == 3 and released == []
        await clock.advance(4.0)  # held for most of the timeout, not released while nothing is Ready
        assert q.num_held == 3 and released == []
        pool.ready = True
        await clock.advance(POLL_S)  # the next poll sees the worker
        assert released == [0, 1, 2] and q.num_held == 0
        await asyncio.gather(*tasks)

    run(scenario())
    assert pool.signalled == [1, 2, 3, 0]  # the demand rose with each, and was withdrawn once


def test_a_full_queue_refuses_at_once() -> None:
    pool, clock = Pool(), FakeClock()
    q = queue(pool, clock, max_held=2)

    async def scenario() -> None:
        waiting = [asyncio.create_task(q.wait_for_worker()) for _ in range(2)]
        await settle()
        with pytest.raises(HoldFull):
            await q.wait_for_worker()
        assert clock.now_s == 0 and q.num_held == 2  # refused without a wait, and the two stay held
        pool.ready = True
        await clock.advance(POLL_S)
        assert await asyncio.gather(*waiting) == [True, True]

    run(scenario())


def test_each_request_times_out_its_own_timeout_after_it_came() -> None:
    pool, clock = Pool(), FakeClock()
    q = queue(pool, clock, timeout_s=5.0)
    timed_out_at: dict[str, float] = {}

    async def client(name: str) -> None:
        with pytest.raises(HoldTimeout, match="within 5 s"):
            await q.wait_for_worker()
        timed_out_at[name] = clock.now_s

    async def scenario() -> None:
        first = asyncio.create_task(client("first"))
        await settle()
        await clock.advance(2.0)
        second = asyncio.create_task(client("second"))
        await settle()
        await clock.advance(2.9)  # t = 4.9: both still held
        assert q.num_held == 2 and timed_out_at == {}
        await clock.advance(0.2)  # t = 5.1: the first is past its timeout, the second is not
        assert set(timed_out_at) == {"first"} and q.num_held == 1
        await clock.advance(2.0)  # t = 7.1
        assert set(timed_out_at) == {"first", "second"} and q.num_held == 0
        await asyncio.gather(first, second)

    run(scenario())
    # Each gave up at its own deadline, not at the next poll after it.
    assert timed_out_at == {"first": pytest.approx(5.0), "second": pytest.approx(7.0)}
    assert pool.signalled == [1, 2, 1, 0]


def test_a_client_that_goes_away_frees_its_place() -> None:
    pool, clock = Pool(), FakeClock()
    q = queue(pool, clock, max_held=1)

    async def scenario() -> None:
        gone = asyncio.create_task(q.wait_for_worker())
        await settle()
        assert q.num_held == 1
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert q.num_held == 0
        stays = asyncio.create_task(q.wait_for_worker())  # the freed place is taken
        await settle()
        assert q.num_held == 1
        pool.ready = True
        await clock.advance(POLL_S)
        assert await stays is True

    run(scenario())
    assert pool.signalled == [1, 0, 1, 0]


def test_requests_still_held_when_the_releaser_stops_are_answered() -> None:
    """If asking for readiness fails, the held requests get an answer (503) instead of waiting forever."""
    clock = FakeClock()
    asked: list[float] = []

    def ready() -> bool:
        asked.append(clock.now_s)
        if len(asked) > 2:  # the first request's check and the releaser's first poll answer; then it fails
            raise ConnectionError("the pool view is gone")
        return False

    q = HoldQueue(3, 5.0, ready, clock=clock, sleep=clock.sleep)

    async def scenario() -> None:
        held = asyncio.create_task(q.wait_for_worker())
        await settle()
        assert q.num_held == 1
        await clock.advance(POLL_S)  # the releaser's next poll raises
        with pytest.raises(HoldTimeout, match="stopped.*the pool view is gone"):
            await held
        assert q.num_held == 0

    run(scenario())
    assert asked == [0.0, 0.0, POLL_S]
