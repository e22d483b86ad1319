"""The router's `GET /kvfleet/speed-profile` against fake workers: each worker's profile, their merge,
and who could not be asked (slow, refused, no address) or had none to give."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvfleet.api.speed import DecodePoint, PrefillPoint, SpeedProfile
from kvfleet.router.app import Router, RouterConfig
from kvfleet.router.placement import PoolSnapshot, WorkerState
from kvfleet.router.pool import StaticPoolView

C = 16 * 1024 * 1024


def profile(decode: list[DecodePoint], prefill: list[PrefillPoint], link: float | None = None,
            capacity_bytes: int = C) -> dict[str, Any]:
    return SpeedProfile(engine="builtin", model="tiny", kv_bytes_per_token=2048, capacity_bytes=capacity_bytes,
                        link_bytes_per_second=link, decode=decode, prefill=prefill).model_dump(mode="json", by_alias=True)


A = profile([DecodePoint(batch=1, context_tokens=10, step_seconds=0.01, samples=2),
             DecodePoint(batch=4, context_tokens=400, step_seconds=0.05, samples=1)],
            [PrefillPoint(tokens=100, step_seconds=0.2, samples=1)])
# Context 11 is A's batch-1 bucket (7) again; its prefill of 120 tokens is A's bucket (14) too.
B = profile([DecodePoint(batch=1, context_tokens=11, step_seconds=0.02, samples=1)],
            [PrefillPoint(tokens=120, step_seconds=0.4, samples=3)], link=2e9)


class FakeWorker:
    """Answers GET /kvfleet/speed-profile with a fixed status and body, after an optional delay."""

    def __init__(self, status: int, body: dict[str, Any], delay_s: float = 0.0) -> None:
        self.status, self.body, self.delay_s = status, body, delay_s
        self.asked = 0
        self.runner: web.AppRunner | None = None

    async def handle(self, _: web.Request) -> web.Response:
        self.asked += 1
        await asyncio.sleep(self.delay_s)
        return web.json_response(self.body, status=self.status)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/kvfleet/speed-profile", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"127.0.0.1:{self.runner.addresses[0][1]}"


def closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


async def ask_router(workers: list[tuple[str, str]], timeout_s: float = 0.5) -> tuple[int, dict[str, Any]]:
    """Starts a router in front of (pod name, address) workers and asks it once."""
    view = StaticPoolView(PoolSnapshot(tuple(WorkerState(name, address, True, i, C)
                                             for i, (name, address) in enumerate(workers)), {}))
    router = Router(RouterConfig(pool_name="test", speed_profile_timeout_s=timeout_s), view)
    runner = web.AppRunner(router.app(), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/kvfleet/speed-profile") as resp:
            return resp.status, await resp.json()
    finally:
        await runner.cleanup()


def test_the_router_gathers_every_workers_profile_and_merges_them() -> None:
    async def scenario() -> None:
        a, b = FakeWorker(200, A), FakeWorker(200, B)
        vllm = FakeWorker(404, {"error": {"message": "the vllm engine does not measure its step speed",
                                          "type": "not_found_error", "param": None, "code": "speed_not_measured"}})
        slow = FakeWorker(200, A, delay_s=5.0)
        fakes = [a, b, vllm, slow]
        addresses = [await f.start() for f in fakes]
        try:
            started = asyncio.get_running_loop().time()
            status, body = await ask_router([("w-0", addresses[0]), ("w-1", addresses[1]), ("w-2", addresses[2]),
                                             ("w-3", addresses[3]), ("w-4", closed_address()), ("w-5", "")])
            # In parallel: the slow worker's 0.5 s timeout, once, bounds the answer (not 5 s, nor 0.5 s each).
            assert asyncio.get_running_loop().time() - started < 2.5
        finally:
            for f in fakes:
                assert f.runner is not None
                await f.runner.cleanup()
        assert status == 200, body
        assert [f.asked for f in fakes] == [1, 1, 1, 1]
        assert body["workers"] == {"w-0": A, "w-1": B}
        assert body["unreachable"] == ["w-3", "w-4", "w-5"]
        assert body["unmeasured"] == {"w-2": "the vllm engine does not measure its step speed"}
        merged = SpeedProfile.model_validate(body["merged"])
        assert (merged.engine, merged.model, merged.kv_bytes_per_token, merged.capacity_bytes) == ("builtin", "tiny", 2048, C)
        assert merged.link_bytes_per_second == 2e9  # the one measured link
        # Sample-weighted: batch 1 at (10 x 2 + 11) / 3 tokens, (0.01 x 2 + 0.02) / 3 s; batch 4 as A had it.
        assert [(p.batch, p.context_tokens, p.samples) for p in merged.decode] == [(1, pytest.approx(31 / 3), 3),
                                                                                  (4, 400.0, 1)]
        assert [p.step_seconds for p in merged.decode] == pytest.approx([0.04 / 3, 0.05])
        assert [(p.tokens, p.samples) for p in merged.prefill] == [(pytest.approx(115.0), 4)]
        assert merged.prefill[0].step_seconds == pytest.approx((0.2 + 0.4 * 3) / 4)

    asyncio.run(scenario())


def test_profiles_that_do_not_merge_are_each_kept_and_the_merge_is_null() -> None:
    async def scenario() -> None:
        a, other = FakeWorker(200, A), FakeWorker(200, profile([], [PrefillPoint(tokens=8, step_seconds=0.1, samples=1)],
                                                               capacity_bytes=2 * C))
        addresses = [await a.start(), await other.start()]
        try:
            status, body = await ask_router([("w-0", addresses[0]), ("w-1", addresses[1])])
        finally:
            for f in (a, other):
                assert f.runner is not None
                await f.runner.cleanup()
        assert status == 200
        assert sorted(body["workers"]) == ["w-0", "w-1"] and body["workers"]["w-1"]["capacityBytes"] == 2 * C
        assert body["merged"] is None
        assert body["unreachable"] == [] and body["unmeasured"] == {}

    asyncio.run(scenario())


def test_a_pool_without_workers_answers_an_empty_profile_set() -> None:
    status, body = asyncio.run(ask_router([]))
    assert (status, body) == (200, {"workers": {}, "merged": None, "unreachable": [], "unmeasured": {}})
