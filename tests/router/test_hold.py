"""The router's hold queue (kvfleet.router.hold): requests wait for a pool's first Ready worker in a
bounded FIFO; exact cases for the bounds, the timeout, the order and a client that goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from kvfleet.router.hold import HoldFull, HoldQueue, HoldTimeout

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 30))


class Pool:
    def __init__(self) -> None:
        self.ready = False
        self.signalled: list[int] = []


def queue(pool: Pool, max_held: int = 3, timeout_s: float = 5.0) -> HoldQueue:
    return HoldQueue(max_held, timeout_s, lambda: pool.ready, pool.signalled.append, poll_s=0.01)


def test_a_ready_pool_holds_nothing() -> None:
    pool = Pool()
    pool.ready = True
    assert run(queue(pool).wait_for_worker()) is False
    assert pool.signalled == []


def test_held_requests_go_in_the_order_they_came_once_a_worker_is_ready() -> None:
    pool = Pool()
    q = queue(pool)
    released: list[int] = []

    async def client(i: int) -> None:
        assert await q.wait_for_worker() is True
        released.append(i)

    async def scenario() -> None:
        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(client(i)))
            await asyncio.sleep(0.02)
        assert q.num_held == 3 and released == []
        pool.ready = True
        await asyncio.gather(*tasks)

    run(scenario())
    assert released == [0, 1, 2]
    assert pool.signalled == [1, 2, 3, 0]  # the demand rose with each, and was withdrawn once


def test_a_full_queue_refuses_at_once_and_a_long_wait_times_out() -> None:
    pool = Pool()
    q = queue(pool, max_held=2, timeout_s=0.3)

    async def scenario() -> None:
        waiting = [asyncio.create_task(q.wait_for_worker()) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(HoldFull):
            await q.wait_for_worker()
        for task in waiting:
            with pytest.raises(HoldTimeout):
                await task
        assert q.num_held == 0

    run(scenario())
    assert pool.signalled[-1] == 0


def test_a_client_that_goes_away_frees_its_place() -> None:
    pool = Pool()
    q = queue(pool, max_held=1)

    async def scenario() -> None:
        gone = asyncio.create_task(q.wait_for_worker())
        await asyncio.sleep(0.05)
        assert q.num_held == 1
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert q.num_held == 0
        stays = asyncio.create_task(q.wait_for_worker())  # the freed place is taken
        await asyncio.sleep(0.05)
        assert q.num_held == 1
        pool.ready = True
        assert await stays is True

    run(scenario())
