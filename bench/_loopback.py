"""What the benchmarks that serve on loopback share (a helper, not a benchmark: the leading underscore
keeps it out of tests/unit/test_benchmarks.py's list; the benches that import it run in make test)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import aiohttp


def free_port() -> int:
    """A TCP port nothing listens on now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_ready(session: aiohttp.ClientSession, address: str, timeout_s: float = 300, poll_s: float = 0.1,
                     check: Callable[[], None] = lambda: None) -> None:
    """Until `address` answers /readyz with 200; `check` raises if what serves it has died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check()
        try:
            async with session.get(f"http://{address}/readyz") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(poll_s)
    raise RuntimeError(f"{address} not ready within {timeout_s:.0f} s")
