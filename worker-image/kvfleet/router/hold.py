"""Requests held while the pool has no Ready worker: how a pool scaled to zero takes its first request.

A pool with `workers.min: 0` runs no worker (and requests no GPU) when idle. A request arriving
then is not refused: the router holds it in a bounded FIFO queue, says so through the Kubernetes API
(`on_change`: the pool view writes the count on the LLMPool, which wakes the operator at once; see
pool.py and docs/router.md), and lets the held requests through, in the order they came, as soon as
a worker is Ready. A full queue answers 429 with Retry-After at once, a wait longer than the timeout
503 with the reason, and a client that goes away frees its place.

Pure asyncio, no I/O of its own: readiness is asked of a callable (the pool view's snapshot), and
time comes from an injected clock and sleep (the real ones by default), so the queue is tested with
exact small cases on a clock the test moves, without waiting real seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# How often a non-empty queue asks whether a worker is Ready (the pool view updates from watches).
POLL_S = 0.1


class HoldFull(Exception):
    """The queue holds its maximum already: the client should come back (429, Retry-After)."""


class HoldTimeout(Exception):
    """No worker became Ready within the timeout (503)."""


@dataclass(eq=False)
class _Held:
    """One held request: the future its handler awaits, and when it gives up (on the queue's clock)."""

    waiter: asyncio.Future[None]
    deadline_s: float


class HoldQueue:
    """A bounded FIFO of requests waiting for the pool's first Ready worker.

    One task (the releaser) runs while anything is held: every `poll_s` it asks `ready()`, and it fails
    each request whose timeout has passed. `clock` (monotonic seconds) and `sleep` are the only time the
    queue knows, so a test hands it a clock it moves by hand."""

    def __init__(self, max_held: int, timeout_s: float, ready: Callable[[], bool],
                 on_change: Callable[[int], None] = lambda held: None, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if max_held < 0 or timeout_s <= 0:
            raise ValueError("a hold queue needs max_held >= 0 and a positive timeout")
        self.max_held = max_held
        self.timeout_s = timeout_s
        self.ready = ready
        self.on_change = on_change
        self.poll_s = poll_s
        self.clock = clock
        self.sleep = sleep
        # First come first; with one timeout, deadlines ascend too.
        self._waiters: deque[_Held] = deque()
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
        held = _Held(asyncio.get_running_loop().create_future(), self.clock() + self.timeout_s)
        self._waiters.append(held)
        self.on_change(len(self._waiters))
        if self._releaser is None or self._releaser.done():
            self._releaser = asyncio.create_task(self._release_when_ready())
        try:
            await held.waiter  # the releaser resolves it: released, or HoldTimeout
        finally:
            if held in self._waiters:  # cancelled while held: the client went away
                self._waiters.remove(held)
                self.on_change(len(self._waiters))
        return True

    async def _release_when_ready(self) -> None:
        """Release every held request, first come first, once a worker is Ready; fail those whose
        timeout passes first."""
        try:
            while self._waiters:
                if self.ready():
                    while self._waiters:
                        held = self._waiters.popleft()
                        if not held.waiter.done():
                            held.waiter.set_result(None)
                    self.on_change(0)
                    return
                now = self.clock()
                if self._waiters[0].deadline_s <= now:
                    while self._waiters and self._waiters[0].deadline_s <= now:
                        held = self._waiters.popleft()
                        if not held.waiter.done():
                            held.waiter.set_exception(
                                HoldTimeout(f"no worker of the pool became Ready within {self.timeout_s:g} s"))
                    self.on_change(len(self._waiters))
                    continue
                await self.sleep(min(self.poll_s, self._waiters[0].deadline_s - now))
        except Exception as err:  # e.g. ready() failed: logged here, as nothing awaits this task
            log.exception("the hold queue's releaser stopped")
            self._fail_held(f"the hold queue stopped ({err!r})")
        except BaseException:  # cancelled (the loop is closing)
            self._fail_held("the hold queue stopped")
            raise

    def _fail_held(self, reason: str) -> None:
        """Answer every request still held, since nothing else would wake it."""
        for held in self._waiters:
            if not held.waiter.done():
                held.waiter.set_exception(HoldTimeout(reason))
