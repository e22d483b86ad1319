"""The operator as Infinite-LLM's gManager (§4.4-4.5): the pool's debt ledger, published each epoch.

Under DistKV a request longer than one worker's KV capacity keeps part of its KV in blocks other
workers lend it. The workers do the lending and borrowing among themselves (over their migration
ports); what they need from a global view is whom to ask. This module turns one epoch's KV-load
reports into the pure gManager's ledger (kvfleet.mell.debt) and into `status.distkv` of the pool:
the debts, the spanning requests, for each worker its creditor candidates (the contract protocol's
answer, §4.4), and what DGFM (§4.5) finds. A thin adapter: the ranking, the units and DGFM are
mell/debt.py's; here are only the readings of the reports and the shape of the status.

DGFM's recall-and-swap is carried out by the workers: the operator finds the debt cycles, says so
with a `DebtCycle` Event, and publishes in `status.distkv.dgfm.recalls` what each debtor on a cycle
brings home from its creditor (§4.5: "the gManager issues requests to the rManager in the
corresponding instances"). Workers read the order with their creditor candidates and act on each
`generation` once (worker/distkv/creditors.py); their next reports show the smaller ledger, and DGFM
on it finds the cycle gone. Without `spec.distkv.dgfm: true` (the default is false: docs/distkv.md says
why) the cycles are reported and nothing moves.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.api.models import (
    MAX_CREDITOR_CANDIDATES,
    MAX_DISTKV_ENTRIES,
    CandidateEntry,
    CreditorEntry,
    DebtEntry,
    DgfmStatus,
    DistKVStatus,
    RecallEntry,
    SpanEntry,
)
from kvfleet.api.reports import KVLoadReport
from kvfleet.mell.debt import (
    DebtLedger,
    DgfmResult,
    WorkerDebtReport,
    blocks_needed_for_bytes,
    build_ledger,
    creditor_candidates,
    eliminate_debt_cycles,
    free_blocks_for_bytes,
    locality_cost,
)
from kvfleet.mell.models import Location
from kvfleet.operator.epoch import WorkerView
from kvfleet.operator.resources import MIGRATION_PORT

log = logging.getLogger(__name__)

# §4.5's "empirical threshold for the minimum number of rBlocks to be swapped at each node". One
# block, the least there is: a recalled block is read once, and saves a lender round trip in every
# layer of every later step of its request (docs/distkv.md measures what a swap costs and returns).
MIN_SWAP_BLOCKS = 1

EVENT_REASON = "DebtCycle"


@dataclass(frozen=True)
class DistKVPlan:
    """One epoch's gManager: the ledger, DGFM's result on it, and `status.distkv` (camelCase)."""

    ledger: DebtLedger
    dgfm: DgfmResult
    status: dict[str, Any]


def kv_block_bytes(reports: Iterable[KVLoadReport]) -> int:
    """Bytes of one KV block (the ledger's unit, an rBlock): block size x KV bytes per token.

    Each report's `kv_bytes_per_token` (read off its running requests), the largest over the pool
    (workers of one pool run one model). Before any worker gives its block size or runs a request
    the unit is one byte: byte counts are exact then, and nothing is rounded to blocks.
    """
    reports = list(reports)
    block_size_tokens = max((r.block_size_tokens for r in reports if r.block_size_tokens is not None), default=None)
    if block_size_tokens is None:
        return 1
    kv_bytes_per_token = max((n for r in reports if (n := r.kv_bytes_per_token()) is not None), default=0)
    return block_size_tokens * kv_bytes_per_token if kv_bytes_per_token > 0 else 1


def _address(pod_ip: str) -> str:
    """Where a borrower opens its lease: the creditor's migration port (IPv6 in brackets)."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"{host}:{MIGRATION_PORT}"


def debt_reports(workers: Sequence[WorkerView], block_bytes: int) -> list[WorkerDebtReport]:
    """Each ready reporting worker's heartbeat (§4.4) in rBlocks.

    Free: capacity less its requests' KV and its lent blocks, plus what its prefix cache would evict
    (room, docs/caching.md). The cap: debt.py's room subtracts, from the cap, what the debtors'
    reports say the worker lent; the worker's own `lentBytes` is the fresher word on its own memory,
    so the cap handed in is its room under the cap by its own count plus what the ledger will subtract.
    Debts to a pod that is not a ready reporting worker of the pool are left out (debug log): the
    ledger has no account for it, and no borrower should be sent to it.
    """
    names = {w.pod_name for w in workers}
    borrowed: dict[str, dict[str, int]] = {}
    ledger_lent: dict[str, int] = dict.fromkeys(names, 0)
    for w in workers:
        assert w.report is not None
        mine: dict[str, int] = {}
        for creditor, num_bytes in sorted((w.report.borrowed or {}).items()):
            if creditor not in names or creditor == w.pod_name:
                log.debug("%s reports %d bytes borrowed from %s, which is not another ready worker of the pool: "
                          "left out of the ledger", w.pod_name, num_bytes, creditor)
                continue
            mine[creditor] = blocks_needed_for_bytes(num_bytes, block_bytes)
            ledger_lent[creditor] += mine[creditor]
        borrowed[w.pod_name] = mine
    out: list[WorkerDebtReport] = []
    for w in workers:
        report = w.report
        assert report is not None
        lent_bytes = report.lent_bytes or 0
        free_bytes = max(0, report.capacity_bytes - report.used_bytes - lent_bytes + (report.evictable_bytes or 0))
        cap_room_bytes = max(0, report.lend_cap_bytes - lent_bytes) if report.lend_cap_bytes is not None else 0
        cap_room_blocks = free_blocks_for_bytes(cap_room_bytes, block_bytes)
        out.append(WorkerDebtReport(w.pod_name, free_blocks_for_bytes(free_bytes, block_bytes),
                                    cap_room_blocks + ledger_lent[w.pod_name] if cap_room_blocks else 0,
                                    borrowed[w.pod_name]))
    return out


def plan(workers: Iterable[WorkerView], seed: str, *, execute: bool = True,
         previous_status: Mapping[str, Any] | None = None) -> DistKVPlan:
    """The epoch's ledger, DGFM on it (seeded by `seed`) and `status.distkv`, from the ready workers' reports.

    With `execute` the status orders the recalls; their `generation` is the previous status's, one more
    when the recalls differ from the ones it ordered."""
    ready = sorted((w for w in workers if w.ready and w.report is not None), key=lambda w: w.pod_name)
    reports = [w.report for w in ready if w.report is not None]
    block_bytes = kv_block_bytes(reports)
    ledger = build_ledger(debt_reports(ready, block_bytes), block_bytes)
    cost = locality_cost({w.pod_name: Location(w.node_name, w.zone) for w in ready if w.node_name})
    ip_of = {w.pod_name: w.pod_ip for w in ready if w.pod_ip}

    candidates: list[CandidateEntry] = []
    for w in ready:
        if w.pod_name not in ip_of:
            continue
        # Every creditor with at least one block of room, in the §4.4 order (closest, then most room);
        # a borrower takes what it needs from them in turn, so no size is asked for here.
        ranked = creditor_candidates(ledger, w.pod_name, 1, cost, count=len(ledger.instance_ids))
        creditors = [CreditorEntry(pod=c, address=_address(ip_of[c]), lendable_bytes=ledger.room_blocks(c) * block_bytes)
                     for c in ranked if c in ip_of][:MAX_CREDITOR_CANDIDATES]
        candidates.append(CandidateEntry(worker=w.pod_name, creditors=creditors))

    names = set(ledger.instance_ids)
    debts = [DebtEntry(debtor=w.pod_name, creditor=creditor, bytes=num_bytes)
             for w in ready for creditor, num_bytes in sorted((w.report.borrowed or {}).items() if w.report else ())
             if creditor in names and creditor != w.pod_name and num_bytes > 0]
    spans = sorted((SpanEntry(request=r.id, worker=w.pod_name, borrowed_bytes=r.borrowed_bytes)
                    for w in ready for r in (w.report.requests if w.report else []) if r.borrowed_bytes),
                   key=lambda s: (s.worker, s.request))

    # A seed of the pool alone, not of the epoch: the same ledger gives the same swaps, so a pool
    # whose debts do not change does not rewrite its status (or post an Event) every epoch.
    dgfm = eliminate_debt_cycles(ledger, random.Random(seed), min_swap_blocks=MIN_SWAP_BLOCKS)
    status = DistKVStatus(
        lent_bytes=sum(r.lent_bytes or 0 for r in reports),
        borrowed_bytes=sum(sum((r.borrowed or {}).values()) for r in reports),
        debts=debts[:MAX_DISTKV_ENTRIES],
        spans=spans[:MAX_DISTKV_ENTRIES],
        candidates=candidates[:MAX_DISTKV_ENTRIES],
        dgfm=dgfm_status(dgfm, block_bytes, execute, previous_status),
    )
    return DistKVPlan(ledger, dgfm, status.model_dump(by_alias=True, mode="json"))


def dgfm_status(dgfm: DgfmResult, block_bytes: int, execute: bool,
                previous_status: Mapping[str, Any] | None) -> DgfmStatus:
    """`status.distkv.dgfm`: the swaps, and the recalls to carry out with the generation they carry."""
    recalls = [RecallEntry(worker=d.debtor_id, creditor=d.creditor_id, bytes=d.num_blocks * block_bytes,
                           down_to_bytes=dgfm.ledger.debt_blocks(d.debtor_id, d.creditor_id) * block_bytes)
               for d in (dgfm.recalls() if execute else ())][:MAX_DISTKV_ENTRIES]
    before = ((previous_status or {}).get("distkv") or {}).get("dgfm") or {}
    try:
        generation = int(before.get("generation", 0))
    except (TypeError, ValueError):
        generation = 0
    ordered = [r.model_dump(by_alias=True, mode="json") for r in recalls]
    if ordered != (before.get("recalls") or []):
        generation += 1
    return DgfmStatus(swaps=len(dgfm.swaps), swapped_bytes=swapped_bytes(dgfm, block_bytes), generation=generation,
                      recalls=recalls)


def swapped_bytes(dgfm: DgfmResult, block_bytes: int) -> int:
    """KV the swaps would move: on a cycle every instance recalls the cycle's minimum from its creditor."""
    return sum(len(swap.cycle) * swap.num_blocks for swap in dgfm.swaps) * block_bytes


def cycle_message(dgfm: DgfmResult, block_bytes: int, execute: bool = True) -> str:
    """The `DebtCycle` Event's message: how many cycles, the first of them, and whether workers swap."""
    first = dgfm.swaps[0]
    more = f" and {len(dgfm.swaps) - 1} more" if len(dgfm.swaps) > 1 else ""
    action = ("the workers on them recall their KV (status.distkv.dgfm.recalls)" if execute
              else "not carried out (spec.distkv.dgfm is false)")
    return (f"DGFM found {len(dgfm.swaps)} debt cycle(s) ({swapped_bytes(dgfm, block_bytes)} bytes to swap): "
            f"{' -> '.join((*first.cycle, first.cycle[0]))}{more}; {action}")


def dgfm_changed(previous_status: Mapping[str, Any] | None, plan_status: Mapping[str, Any]) -> bool:
    """Whether this epoch's DGFM says something new (an Event is posted only then, not every epoch)."""
    before = ((previous_status or {}).get("distkv") or {}).get("dgfm") or {}
    now = plan_status.get("dgfm") or {}
    return any(before.get(k) != now.get(k) for k in ("swaps", "swappedBytes", "recalls"))
