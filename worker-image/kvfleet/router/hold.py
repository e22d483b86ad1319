"""Requests held while the pool has no Ready worker: how a pool scaled to zero takes its first request.

A pool with `workers.min: 0` runs no worker (and requests no GPU) when idle. A request arriving
then is not refused: the router holds it in a bounded FIFO queue, says so through the Kubernetes API
(`on_change`: the pool view writes the count on the LLMPool, which wakes the operator at once; see
pool.py and docs/router.md), and lets the held requests through, in the order they came, as soon as
a worker is Ready. A full queue answers 429 with Retry-After at once, a wait longer than the timeout
503 with the reason, and a client that goes away frees its place.

Pure asyncio, no I/O of its own: readiness is asked of a callable (the pool view's snapshot), so the
queue is tested with exact small cases.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

# How often a non-empty queue asks whether a worker is Ready (the pool view updates from watches).
POLL_S = 0.1


class HoldFull(Exception):
    """The queue holds its maximum already: the client should come back (429, Retry-After)."""


class HoldTimeout(Exception):
    """No worker became Ready within the timeout (503)."""


class HoldQueue:
    """A bounded FIFO of requests waiting for the pool's first Ready worker."""

    def __init__(self, max_held: int, timeout_s: float, ready: Callable[[], bool],
                 on_change: Callable[[int], None] = lambda held: None, poll_s: float = POLL_S) -> None:
        if max_held < 0 or timeout_s <= 0:
            raise ValueError("a hold queue needs max_held >= 0 and a positive timeout")
        self.max_held = max_held
        self.timeout_s = timeout_s
        self.ready = ready
        self.on_change = on_change
        self.poll_s = poll_s
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._releaser: asyncio.Task[None] | None = None

    @property
    def num_held(self) -> int:
        return len(self._waiters)

    async def wait_for_worker(self) -> bool:
        """Return once a worker is Ready: at once (False) if one is and nobody is held before this
        request, else after holding it (True). Raises HoldFull or HoldTimeout; a cancelled caller (the
        client went away) leaves the queue."""
        if not self._waiters and self.ready():
            return False
        if len(self._waiters) >= self.max_held:
            raise HoldFull(f"{len(self._waiters)} requests are already waiting for the pool's first worker")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.on_change(len(self._waiters))
        if self._releaser is None or self._releaser.done():
            self._releaser = asyncio.create_task(self._release_when_ready())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
        except TimeoutError:
            raise HoldTimeout(f"no worker of the pool became Ready within {self.timeout_s:g} s") from None
        finally:
            if not waiter.done():
                waiter.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self.on_change(len(self._waiters))
        return True

    async def _release_when_ready(self) -> None:
        """Release every held request, first come first, once a worker is Ready."""
        while self._waiters:
            if self.ready():
                while self._waiters:
                    waiter = self._waiters.popleft()
                    if not waiter.done():
                        waiter.set_result(None)
                self.on_change(0)
                return
            await asyncio.sleep(self.poll_s)
