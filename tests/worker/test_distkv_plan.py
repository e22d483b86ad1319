"""A worker's reading of its pool's DistKV plan (worker/distkv/creditors.py): its creditor candidates,
and DGFM's recalls (Infinite-LLM §4.5), each generation of which it carries out exactly once however
often it reads the same status."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvfleet.worker.distkv.creditors import (
    Creditor,
    PoolPlanCreditors,
    Recall,
    candidates_from_status,
    recalls_from_status,
)


def status(generation: int, recalls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"distkv": {
        "candidates": [{"worker": "w0", "creditors": [{"pod": "w1", "address": "10.0.0.1:8001", "lendableBytes": 64},
                                                     {"pod": "w0", "address": "10.0.0.0:8001"},  # itself: skipped
                                                     {"address": "no pod"}]}],  # malformed: skipped
        "dgfm": {"swaps": 1, "swappedBytes": 0, "generation": generation, "recalls": recalls}}}


def test_the_plan_gives_this_workers_creditors_and_recalls_and_skips_what_is_not_its_own_or_malformed() -> None:
    plan = status(3, [{"worker": "w0", "creditor": "w1", "bytes": 4096}, {"worker": "w1", "creditor": "w0", "bytes": 4096},
                      {"worker": "w0", "creditor": "w2"}, {"worker": "w0", "creditor": "w2", "bytes": 0}])
    assert candidates_from_status(plan, "w0") == (Creditor("w1", "10.0.0.1:8001", 64),)
    assert recalls_from_status(plan, "w0") == (3, (Recall("w1", 4096),))
    assert Recall("w1", 100, 20).due_bytes(150) == 100 and Recall("w1", 100, 20).due_bytes(50) == 30
    assert Recall("w1", 100, 20).due_bytes(10) == 0
    assert recalls_from_status(plan, "w9") == (3, ())
    assert recalls_from_status(None, "w0") == (0, ())
    assert recalls_from_status({"distkv": {"dgfm": {"generation": "x"}}}, "w0") == (0, ())


def test_each_generation_of_recalls_is_carried_out_once_for_what_the_debt_still_exceeds_and_failures_are_retried(
        ) -> None:
    async def scenario() -> list[tuple[str, int]]:
        current: dict[str, Any] = {"status": status(1, [
            {"worker": "w0", "creditor": "w1", "bytes": 100, "downToBytes": 20},
            {"worker": "w0", "creditor": "w2", "bytes": 50}])}
        owed = {"w1": 120, "w2": 50}

        async def read() -> Mapping[str, Any] | None:
            return current["status"]

        done: list[tuple[str, int]] = []

        async def recall(pod: str, num_bytes: int) -> int:
            done.append((pod, num_bytes))
            if pod == "w2":
                raise RuntimeError("the lender is gone")  # logged; the rest goes on, and it is tried again
            owed[pod] -= num_bytes
            return num_bytes

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        plan = PoolPlanCreditors(read, "w0")
        plan.on_recall, plan.owed = recall, lambda: owed
        for _ in range(5):  # the same status read five times: w1 once, w2 tried three times in all
            await plan.refresh()
            await settle()
        # A new generation repeats w1's order (the pool's orders changed elsewhere; this worker's report is
        # on its way): its debt is at the target already, so nothing is recalled twice.
        current["status"] = status(2, [{"worker": "w0", "creditor": "w1", "bytes": 100, "downToBytes": 20}])
        await plan.refresh()
        await settle()
        owed["w1"] = 40  # it grew since
        current["status"] = status(3, [{"worker": "w0", "creditor": "w1", "bytes": 7, "downToBytes": 20}])
        await plan.refresh()
        await settle()
        return done

    assert asyncio.run(scenario()) == [("w1", 100), ("w2", 50), ("w2", 50), ("w2", 50), ("w1", 7)]


def test_a_borrowing_worker_hands_the_plans_recalls_to_its_engine(tiny_model_dir: Path) -> None:
    """The worker's entry point wires DGFM's orders to the engine's recall: a recall in the pool's status
    reaches a builtin engine (which has nothing of its own at that creditor, so brings nothing home)."""
    from kvfleet.worker.__main__ import follow_pool_plan
    from kvfleet.worker.distkv.options import DistKVOptions
    from kvfleet.worker.engines import EngineConfig, load_engine
    from kvfleet.worker.engines.builtin.options import BuiltinOptions

    async def scenario() -> list[tuple[str, int, int]]:
        engine = load_engine("builtin", EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=1 << 20, dtype="float32"),
                             BuiltinOptions(attention="distattention", distkv=DistKVOptions(borrow=True)))
        borrowing = engine.capabilities.borrowing
        assert borrowing is not None
        calls: list[tuple[str, int, int]] = []
        recall = borrowing.recall

        async def counted(pod: str, num_bytes: int) -> int:
            calls.append((pod, num_bytes, got := await recall(pod, num_bytes)))
            return got

        borrowing.recall = counted  # type: ignore[method-assign]

        async def read() -> Mapping[str, Any] | None:
            return status(5, [{"worker": "w0", "creditor": "w1", "bytes": 1 << 16}])

        plan = PoolPlanCreditors(read, "w0")
        run = follow_pool_plan(plan, engine)
        assert run == plan.run and plan.on_recall is not None and plan.owed == borrowing.borrowed_bytes
        plan.owed = lambda: {"w1": 1 << 16}  # as if it owed w1 what the order asks for
        await engine.start()
        try:
            await plan.refresh()
            for _ in range(50):
                if calls:
                    break
                await asyncio.sleep(0.01)
        finally:
            await engine.stop()
        return calls

    assert asyncio.run(scenario()) == [("w1", 1 << 16, 0)]
