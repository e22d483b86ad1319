"""Where a borrower finds lenders: the gManager's answer to "who has room for me" (Infinite-LLM §4.4).

In the paper a debtor asks the gManager and gets three creditor candidates, nearest first, then
negotiates with them directly; a creditor whose room is gone refuses and the debtor asks the next
(the contract protocol). Here the operator plays the gManager: each epoch it publishes, in the
LLMPool's `status.distkv.candidates`, every worker's standing list of candidates (docs/distkv.md),
and `PoolPlanCreditors` keeps this worker's list fresh by reading it. A standing list, instead of a
question per request, lets a borrower start at once; the creditor's refusal keeps it honest when the
list is stale. `StaticCreditors` is a fixed list, for a pool run without the operator (tests, the
bench, a hand-made pair of workers).

A refused creditor is skipped until the next list arrives (clear_refusals in mell/debt.py does the
same on the operator's side when a heartbeat shows it again).

The same status carries DGFM's orders (§4.5, `status.distkv.dgfm.recalls`): how much of this
worker's KV to bring home from which creditor, and what its debt there comes down to. `PoolPlanCreditors`
hands each new generation of them to the engine's borrowing side (`on_recall`) once, asking only
for what the debt still exceeds its target: the generation counts the whole pool's orders, so a new
one may repeat this worker's order, already carried out while its report was on its way. A
generation some recall of which failed is tried again at the next read (a few times at most).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

# How often the plan is read while the worker runs, and at most how often a borrower that ran out of
# candidates makes it read again at once.
PLAN_REFRESH_S = 5.0
PLAN_MISS_REFRESH_S = 1.0


@dataclass(frozen=True)
class Creditor:
    """A worker that may lend: its pod, its migration port's address, and the room it had (a hint)."""

    pod: str
    address: str
    lendable_bytes: int


class Creditors(Protocol):
    """The borrower's view of who may lend to it, best first."""

    def candidates(self) -> Sequence[Creditor]:
        """Creditors not refused since the list was last renewed, best first."""
        ...

    def refused(self, address: str) -> None:
        """The creditor at `address` refused (no room, or unreachable): skip it until the list is renewed."""
        ...


class StaticCreditors:
    """A fixed list of creditors; a refusal holds for `forget_after_s` (a lender's room comes back)."""

    def __init__(self, creditors: Sequence[Creditor], forget_after_s: float = PLAN_REFRESH_S) -> None:
        self._creditors = tuple(creditors)
        self._refused: dict[str, float] = {}
        self._forget_after_s = forget_after_s

    def candidates(self) -> Sequence[Creditor]:
        now = asyncio.get_running_loop().time()
        self._refused = {a: t for a, t in self._refused.items() if now - t < self._forget_after_s}
        return tuple(c for c in self._creditors if c.address not in self._refused)

    def refused(self, address: str) -> None:
        self._refused[address] = asyncio.get_running_loop().time()


def candidates_from_status(status: Mapping[str, Any] | None, pod_name: str) -> tuple[Creditor, ...]:
    """This worker's candidates in an LLMPool's status (kvfleet.operator.distkv writes them); a
    malformed entry is skipped, not fatal: the operator and the worker may be of different releases."""
    distkv = (status or {}).get("distkv") or {}
    for entry in distkv.get("candidates") or []:
        if not isinstance(entry, dict) or entry.get("worker") != pod_name:
            continue
        found = []
        for item in entry.get("creditors") or []:
            try:
                found.append(Creditor(str(item["pod"]), str(item["address"]), int(item.get("lendableBytes", 0))))
            except (KeyError, TypeError, ValueError):
                log.debug("skipping a malformed creditor entry %r", item)
        return tuple(c for c in found if c.pod != pod_name)
    return ()


@dataclass(frozen=True)
class Recall:
    """DGFM's order to this worker: bring `num_bytes` of its KV home from the creditor `pod`, so that its
    debt there comes down to `down_to_bytes`."""

    pod: str
    num_bytes: int
    down_to_bytes: int = 0

    def due_bytes(self, owed_bytes: int) -> int:
        """What is left to recall when this worker owes `owed_bytes` to the creditor now."""
        return max(0, min(self.num_bytes, owed_bytes - self.down_to_bytes))


def recalls_from_status(status: Mapping[str, Any] | None, pod_name: str) -> tuple[int, tuple[Recall, ...]]:
    """This worker's DGFM recalls in an LLMPool's status and their generation (0 and none when absent)."""
    dgfm = ((status or {}).get("distkv") or {}).get("dgfm") or {}
    try:
        generation = int(dgfm.get("generation", 0))
    except (TypeError, ValueError):
        return 0, ()
    found = []
    for entry in dgfm.get("recalls") or []:
        if not isinstance(entry, dict) or entry.get("worker") != pod_name:
            continue
        try:
            found.append(Recall(str(entry["creditor"]), int(entry["bytes"]), int(entry.get("downToBytes", 0))))
        except (KeyError, TypeError, ValueError):
            log.debug("skipping a malformed recall entry %r", entry)
    return generation, tuple(r for r in found if r.num_bytes > 0 and r.pod != pod_name)


# Carries out one recall: (creditor pod, bytes) -> the bytes brought home (KVBorrowing.recall).
RecallFn = Callable[[str, int], Awaitable[int]]
# What this worker owes each creditor now: pod -> bytes (KVBorrowing.borrowed_bytes).
OwedFn = Callable[[], Mapping[str, int]]
# A generation whose recalls failed is tried this many times in all.
RECALL_TRIES = 3

# Reads the pool's LLMPool status (None when the object is gone).
StatusReader = Callable[[], Awaitable[Mapping[str, Any] | None]]


class PoolPlanCreditors:
    """This worker's candidates from the operator's published plan, read every PLAN_REFRESH_S."""

    def __init__(self, read_status: StatusReader, pod_name: str) -> None:
        self._read = read_status
        self.pod_name = pod_name
        self._creditors: tuple[Creditor, ...] = ()
        self._refused: set[str] = set()
        self._last_read_s = float("-inf")
        self._refreshing: asyncio.Task[None] | None = None
        # DGFM: who carries out this worker's recalls (the engine's borrowing side), and the last
        # generation of them handed over.
        self.on_recall: RecallFn | None = None
        self.owed: OwedFn = dict
        self._recall_generation: int | None = None
        self._recall_tries = 0
        self._recalling: asyncio.Task[bool] | None = None

    def candidates(self) -> Sequence[Creditor]:
        found = tuple(c for c in self._creditors if c.address not in self._refused)
        if not found:
            self._refresh_soon()
        return found

    def refused(self, address: str) -> None:
        self._refused.add(address)

    async def refresh(self) -> None:
        """Read the plan now; a failed read keeps the list it had."""
        self._last_read_s = asyncio.get_running_loop().time()
        try:
            status = await self._read()
        except Exception as err:  # the API server away, or a transient error: try again next time
            log.warning("cannot read the pool's DistKV plan: %s", err)
            return
        creditors = candidates_from_status(status, self.pod_name)
        if creditors != self._creditors:
            log.info("DistKV creditors: %s", ", ".join(c.pod for c in creditors) or "none")
        self._creditors, self._refused = creditors, set()
        self._take_recalls(*recalls_from_status(status, self.pod_name))

    def _take_recalls(self, generation: int, recalls: Sequence[Recall]) -> None:
        """Start a new generation's recalls, or again one whose recalls failed (one run at a time: one
        still running finishes first, and what comes next is taken at the next read)."""
        if self.on_recall is None:
            return
        if self._recalling is not None and not self._recalling.done():
            return
        if generation == self._recall_generation:
            if self._recall_tries >= RECALL_TRIES or (self._recalling is not None and self._recalling.result()):
                return  # done, or tried enough
        else:
            self._recall_generation, self._recall_tries = generation, 0
        if recalls:
            self._recall_tries += 1
            self._recalling = asyncio.get_running_loop().create_task(self._recall(self.on_recall, recalls))
        else:
            self._recall_tries = RECALL_TRIES

    async def _recall(self, on_recall: RecallFn, recalls: Sequence[Recall]) -> bool:
        """Carry out the recalls, each for what the debt still exceeds its target; whether all were done."""
        done = True
        for recall in recalls:
            due = recall.due_bytes(self.owed().get(recall.pod, 0))
            if not due:
                continue
            try:
                done = bool(await on_recall(recall.pod, due)) and done
            except Exception:  # the engine's own fault handling has run; tried again at the next read
                log.exception("recalling KV from %s failed", recall.pod)
                done = False
        return done

    async def run(self) -> None:
        while True:
            await self.refresh()
            # Without candidates (a worker that starts before the operator's first plan names any) a
            # long request is refused at once (admission cannot wait for a read): look again sooner.
            await asyncio.sleep(PLAN_REFRESH_S if self._creditors else PLAN_MISS_REFRESH_S)

    def _refresh_soon(self) -> None:
        loop = asyncio.get_running_loop()
        if self._refreshing is not None and not self._refreshing.done():
            return
        if loop.time() - self._last_read_s < PLAN_MISS_REFRESH_S:
            return
        self._refreshing = loop.create_task(self.refresh())
