"""The gManager's pure core: the global debt ledger, creditor choice and DGFM (Infinite-LLM §4.3-4.5).

A request larger than one worker's KV capacity (MELL's size class X, a `Span`) keeps part of its KV
cache in rBlocks lent by other workers and is attended with DistAttention. Somebody has to know who
has room, who owes whom, and when lending has fragmented so badly that debts run in circles; in
Infinite-LLM ("Infinite-LLM: Efficient LLM Service for Long Context with DistAttention and
Distributed KVCache", Lin et al., arXiv 2401.02669) that is the gManager. The operator plays the
gManager: it builds a `DebtLedger` from the workers' reports each epoch, answers borrowing with
`creditor_candidates` / `plan_borrowing` (the contract protocol, §4.4), and runs
`eliminate_debt_cycles` (DGFM, §4.5, Algorithm 1) to give borrowed memory back. Everything here is a
pure function of its arguments (randomness is an injected `random.Random`), so the operator, the
simulator and the tests share it; the Kubernetes wiring lives in kvfleet.operator.

The ledger counts rBlocks, not bytes. The rManager allocates and lends whole physical rBlocks (§4.3),
the lending cap is a number of rBlocks (§4.3), and DGFM's threshold is a number of rBlocks per swap
(§4.5), so blocks are the unit every rule is stated in; integers also keep the arithmetic exact.
`block_bytes` travels with the ledger, and `free_blocks_for_bytes` / `blocks_needed_for_bytes` turn the
byte counts that workers and MELL speak into blocks, rounding each way so that nobody lends half a
block or borrows too little.

Direction convention, everywhere: a debt (debtor, creditor, n) means n of the debtor's rBlocks live
on the creditor. In the debt graph that is an edge debtor -> creditor of weight n.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvfleet.mell.models import Location

# Communication cost from a debtor to a candidate creditor, lower is closer (§4.4 "locality").
CostFn = Callable[[str, str], float]

DEFAULT_NUM_CANDIDATES = 3  # §4.4: "The gManager proposes three potential creditor IDs"

COST_SAME_NODE = 0
COST_SAME_ZONE = 1
COST_ELSEWHERE = 2


class LedgerError(ValueError):
    """Worker reports that cannot be one consistent ledger (negative blocks, self-debt, unknown ids)."""


# ---- units ----


def free_blocks_for_bytes(num_bytes: int, block_bytes: int) -> int:
    """Whole rBlocks that fit in `num_bytes` of free memory: rounded down, a part-block cannot be lent."""
    _check_block_bytes(block_bytes)
    if num_bytes < 0:
        raise LedgerError(f"free bytes must be >= 0, not {num_bytes}")
    return num_bytes // block_bytes


def blocks_needed_for_bytes(num_bytes: int, block_bytes: int) -> int:
    """rBlocks needed to hold `num_bytes` of KV: rounded up, the last block may be part-full."""
    _check_block_bytes(block_bytes)
    if num_bytes < 0:
        raise LedgerError(f"needed bytes must be >= 0, not {num_bytes}")
    return -(-num_bytes // block_bytes)


def _check_block_bytes(block_bytes: int) -> None:
    if block_bytes <= 0:
        raise LedgerError(f"block_bytes must be positive, not {block_bytes}")


# ---- the global debt ledger (§4.4, Figure 4) ----


@dataclass(frozen=True)
class WorkerDebtReport:
    """What one worker's heartbeat says (§4.4 "Each instance periodically transmits heartbeat signals").

    `borrowed_blocks` maps creditor id -> rBlocks of this worker's KV that live there. Only the debtor
    reports an edge: its rManager's rBlock table (§4.3) knows where each of its own logical rBlocks
    lives, while a creditor only holds anonymous remote blocks. One reporter per edge means two
    heartbeats taken at different moments (the paper's loose coherence) can never contradict each
    other about a debt; what a creditor has lent is derived from its debtors' reports.
    """

    instance_id: str
    free_blocks: int
    lend_cap_blocks: int
    borrowed_blocks: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceAccount:
    """One row of the ledger: an instance's free rBlocks and its §4.3 cap on rBlocks lent to others."""

    instance_id: str
    free_blocks: int
    lend_cap_blocks: int


@dataclass(frozen=True)
class Debt:
    """`num_blocks` of the debtor's rBlocks live on the creditor (a debt-graph edge debtor -> creditor)."""

    debtor_id: str
    creditor_id: str
    num_blocks: int


@dataclass(frozen=True)
class DebtLedger:
    """The global debt ledger (§4.4, Figure 4): every instance's free room and every inter-instance debt.

    Immutable and canonical: accounts sorted by id, debts sorted by (debtor, creditor) with only
    positive entries, so two ledgers with the same facts compare equal. Build it with `build_ledger`
    (from reports) or directly; the constructor validates either way.
    """

    block_bytes: int
    accounts: tuple[InstanceAccount, ...]
    debts: tuple[Debt, ...] = ()
    _by_id: Mapping[str, InstanceAccount] = field(init=False, repr=False, compare=False)
    _debt_map: Mapping[tuple[str, str], int] = field(init=False, repr=False, compare=False)
    _lent: Mapping[str, int] = field(init=False, repr=False, compare=False)
    _borrowed: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_block_bytes(self.block_bytes)
        by_id: dict[str, InstanceAccount] = {}
        for account in self.accounts:
            if account.instance_id in by_id:
                raise LedgerError(f"instance {account.instance_id!r} is in the ledger twice")
            if account.free_blocks < 0 or account.lend_cap_blocks < 0:
                raise LedgerError(f"instance {account.instance_id!r}: free_blocks ({account.free_blocks}) and "
                                  f"lend_cap_blocks ({account.lend_cap_blocks}) must be >= 0")
            by_id[account.instance_id] = account
        debt_map: dict[tuple[str, str], int] = {}
        for debt in self.debts:
            key = (debt.debtor_id, debt.creditor_id)
            if debt.debtor_id == debt.creditor_id:
                raise LedgerError(f"instance {debt.debtor_id!r} cannot owe itself")
            for role, instance_id in (("debtor", debt.debtor_id), ("creditor", debt.creditor_id)):
                if instance_id not in by_id:
                    raise LedgerError(f"{role} {instance_id!r} of a debt {debt.debtor_id!r} -> {debt.creditor_id!r} "
                                      "has no account in the ledger")
            if debt.num_blocks < 0:
                raise LedgerError(f"debt {debt.debtor_id!r} -> {debt.creditor_id!r} is negative ({debt.num_blocks})")
            if key in debt_map:
                raise LedgerError(f"debt {debt.debtor_id!r} -> {debt.creditor_id!r} is in the ledger twice")
            debt_map[key] = debt.num_blocks
        # Canonical form: sorted, zero debts dropped (a paid-off debt is no edge of the debt graph).
        object.__setattr__(self, "accounts", tuple(sorted(self.accounts, key=lambda a: a.instance_id)))
        object.__setattr__(self, "debts", tuple(sorted((d for d in self.debts if d.num_blocks > 0),
                                                       key=lambda d: (d.debtor_id, d.creditor_id))))
        object.__setattr__(self, "_by_id", MappingProxyType(by_id))
        object.__setattr__(self, "_debt_map", MappingProxyType({k: n for k, n in debt_map.items() if n > 0}))
        lent = dict.fromkeys(by_id, 0)
        borrowed = dict.fromkeys(by_id, 0)
        for (debtor_id, creditor_id), num_blocks in debt_map.items():
            lent[creditor_id] += num_blocks
            borrowed[debtor_id] += num_blocks
        object.__setattr__(self, "_lent", MappingProxyType(lent))
        object.__setattr__(self, "_borrowed", MappingProxyType(borrowed))

    @property
    def instance_ids(self) -> tuple[str, ...]:
        return tuple(a.instance_id for a in self.accounts)

    def account(self, instance_id: str) -> InstanceAccount:
        try:
            return self._by_id[instance_id]
        except KeyError:
            raise LedgerError(f"instance {instance_id!r} is not in the ledger") from None

    def debt_blocks(self, debtor_id: str, creditor_id: str) -> int:
        return self._debt_map.get((debtor_id, creditor_id), 0)

    def debt_map(self) -> Mapping[tuple[str, str], int]:
        """(debtor, creditor) -> rBlocks, positive entries only."""
        return self._debt_map

    def lent_blocks(self, instance_id: str) -> int:
        """rBlocks of other instances held by this one (its credit)."""
        return self._lent[self.account(instance_id).instance_id]

    def borrowed_blocks(self, instance_id: str) -> int:
        """rBlocks of this instance held by others (its debt)."""
        return self._borrowed[self.account(instance_id).instance_id]

    def room_blocks(self, instance_id: str) -> int:
        """rBlocks this instance can still lend: its free blocks, limited by what the §4.3 cap leaves.

        Lent above the cap (the cap was lowered after lending) is not an error, the blocks are there;
        it just leaves no room until debts are repaid.
        """
        account = self.account(instance_id)
        return max(0, min(account.free_blocks, account.lend_cap_blocks - self.lent_blocks(instance_id)))


def build_ledger(reports: Iterable[WorkerDebtReport], block_bytes: int) -> DebtLedger:
    """The ledger from one epoch's heartbeats (§4.4). Inconsistent reports raise `LedgerError`.

    Refused, with a message naming the instances: two reports for one instance, negative counts, a
    worker that says it borrowed from itself, and a worker that says it borrowed from an instance
    that sent no report. The last is refused rather than guessed at because the ledger cannot give
    the creditor a room or a cap; the caller decides (wait for the heartbeat, or drop the debt of a
    creditor pod that is gone and re-place its blocks).
    """
    accounts: list[InstanceAccount] = []
    debts: list[Debt] = []
    for report in reports:
        accounts.append(InstanceAccount(report.instance_id, report.free_blocks, report.lend_cap_blocks))
        for creditor_id, num_blocks in report.borrowed_blocks.items():
            debts.append(Debt(report.instance_id, creditor_id, num_blocks))
    return DebtLedger(block_bytes, tuple(accounts), tuple(debts))


# ---- the contract protocol (§4.4) ----


def locality_cost(locations: Mapping[str, Location]) -> CostFn:
    """§4.4's "relative communication cost" from where pods run: same node 0, same zone 1, else 2.

    The same order as MELL's GPU distance (same node before same zone before elsewhere). An instance
    whose location is unknown (a pod not yet bound to a node) counts as elsewhere: it is the last
    place to send KV that must be read every decoding step.
    """

    def cost(debtor_id: str, creditor_id: str) -> float:
        here, there = locations.get(debtor_id), locations.get(creditor_id)
        if here is None or there is None:
            return COST_ELSEWHERE
        if here.node_id == there.node_id:
            return COST_SAME_NODE
        if here.zone_id == there.zone_id:
            return COST_SAME_ZONE
        return COST_ELSEWHERE

    return cost


def _ranked_creditors(ledger: DebtLedger, debtor_id: str, cost: CostFn, refused: frozenset[str],
                      room: Mapping[str, int]) -> list[str]:
    """Instances that may lend to `debtor_id`, closest first, then most room first, then by id."""
    ledger.account(debtor_id)  # an unknown debtor is a caller's error, say so
    eligible = [i for i in ledger.instance_ids if i != debtor_id and i not in refused and room[i] > 0]
    # §4.4 "locality & availability": lowest relative communication cost, then highest available memory.
    return sorted(eligible, key=lambda i: (cost(debtor_id, i), -room[i], i))


def creditor_candidates(ledger: DebtLedger, debtor_id: str, blocks_needed: int, cost: CostFn, *,
                        count: int = DEFAULT_NUM_CANDIDATES,
                        refused: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The gManager's answer ③ to a debtor's query ① (§4.4): up to `count` creditor ids, in the order to try.

    A candidate is another instance whose room under its cap holds all `blocks_needed` (the debtor
    approaches them one after the other "until successful allocation is confirmed by one of them",
    so one candidate must be able to say yes to the whole request). Instances in `refused` answered
    false since their last heartbeat and get no new requests until it comes (§4.4 "Competing
    Candidates"); `clear_refusals` lifts the mark. An empty answer means no single instance can hold
    the request: `plan_borrowing` splits it.
    """
    if blocks_needed <= 0:
        raise LedgerError(f"blocks_needed must be positive, not {blocks_needed}")
    if count <= 0:
        raise LedgerError(f"count must be positive, not {count}")
    room = {i: ledger.room_blocks(i) for i in ledger.instance_ids}
    ranked = _ranked_creditors(ledger, debtor_id, cost, refused, room)
    return tuple(i for i in ranked if room[i] >= blocks_needed)[:count]


def clear_refusals(refused: frozenset[str], heartbeat_ids: Iterable[str]) -> frozenset[str]:
    """§4.4: a creditor that refused is skipped "until more resources become available", i.e. its next heartbeat."""
    return refused - frozenset(heartbeat_ids)


@dataclass(frozen=True)
class BorrowRequest:
    """A debtor needs `num_blocks` more rBlocks than it has (§4.4 query ①)."""

    debtor_id: str
    num_blocks: int


@dataclass(frozen=True)
class Grant:
    """`num_blocks` of the debtor's rBlocks go to the creditor."""

    debtor_id: str
    creditor_id: str
    num_blocks: int


@dataclass(frozen=True)
class BorrowPlan:
    """One epoch's borrowing: grants in request order, requests left unmet, and the ledger after."""

    grants: tuple[Grant, ...]
    unmet: tuple[BorrowRequest, ...]
    ledger: DebtLedger


def plan_borrowing(ledger: DebtLedger, requests: Sequence[BorrowRequest], cost: CostFn, *,
                   refused: frozenset[str] = frozenset()) -> BorrowPlan:
    """Place one epoch's competing borrow requests (§4.4 "Competing Candidates"), all or nothing each.

    Requests are served first-come-first-serve in the given order, as the creditor's rManager does.
    Each goes whole to the best creditor (closest, then most room) that can hold it, as in the
    paper's contract; the room it takes is subtracted before the next request is ranked, so among
    equally close creditors the next debtor goes to whoever now has most room: competing debtors
    are spread evenly instead of all landing on the instance that looked emptiest at the start.

    When no single creditor can hold a request it is split over creditors in the same order, each
    filled to its room. The paper's protocol confirms an allocation with one creditor and does not
    say whether one request may be split; rBlocks are independent units (§4.3) and Figure 4's Inst-1
    borrows from two instances at once, so splitting stays within the paper, and MELL's spanning
    items (requests larger than a worker) need it. A request the whole pool cannot hold gets nothing
    and is returned in `unmet`: half a spanning item cannot run, and taking room for it would starve
    the requests after it. Room is min(free, cap - lent) (§4.3 cap), never exceeded.
    """
    room = {i: ledger.room_blocks(i) for i in ledger.instance_ids}
    debt_map = dict(ledger.debt_map())
    free = {a.instance_id: a.free_blocks for a in ledger.accounts}
    grants: list[Grant] = []
    unmet: list[BorrowRequest] = []
    for request in requests:
        if request.num_blocks <= 0:
            raise LedgerError(f"request of {request.debtor_id!r} must borrow a positive number of blocks, "
                              f"not {request.num_blocks}")
        ranked = _ranked_creditors(ledger, request.debtor_id, cost, refused, room)
        if sum(room[i] for i in ranked) < request.num_blocks:
            unmet.append(request)
            continue
        whole = [i for i in ranked if room[i] >= request.num_blocks]
        pieces: list[tuple[str, int]] = []
        if whole:
            pieces.append((whole[0], request.num_blocks))
        else:
            left = request.num_blocks
            for creditor_id in ranked:
                take = min(left, room[creditor_id])
                pieces.append((creditor_id, take))
                left -= take
                if left == 0:
                    break
        for creditor_id, num_blocks in pieces:
            grants.append(Grant(request.debtor_id, creditor_id, num_blocks))
            room[creditor_id] -= num_blocks
            free[creditor_id] -= num_blocks
            key = (request.debtor_id, creditor_id)
            debt_map[key] = debt_map.get(key, 0) + num_blocks
    accounts = tuple(InstanceAccount(a.instance_id, free[a.instance_id], a.lend_cap_blocks) for a in ledger.accounts)
    after = DebtLedger(ledger.block_bytes, accounts, tuple(Debt(d, c, n) for (d, c), n in debt_map.items()))
    return BorrowPlan(tuple(grants), tuple(unmet), after)


# ---- DGFM: debt-graph-based fragmented memory management (§4.5, Figure 5, Algorithm 1) ----


def debt_graph(ledger: DebtLedger, min_blocks: int = 1) -> dict[str, tuple[str, ...]]:
    """Adjacency of the debt graph (§4.5): debtor -> creditors it owes at least `min_blocks`, sorted."""
    return _graph(ledger.instance_ids, ledger.debt_map(), min_blocks)


def _graph(nodes: Iterable[str], debt_map: Mapping[tuple[str, str], int], min_blocks: int) -> dict[str, tuple[str, ...]]:
    graph: dict[str, list[str]] = {i: [] for i in nodes}
    for (debtor_id, creditor_id), num_blocks in debt_map.items():
        if num_blocks >= min_blocks:
            graph[debtor_id].append(creditor_id)
    # Sorted neighbours: the traversal, and so the swaps, depend on the seed only.
    return {i: tuple(sorted(creditors)) for i, creditors in graph.items()}


def find_cycle_from(graph: Mapping[str, Sequence[str]], start_id: str) -> tuple[str, ...] | None:
    """Algorithm 1's HasCycle(G, v, visited, parent) from one start node: a directed cycle reachable from it.

    Returns the cycle as its nodes in edge order (n0 -> n1 -> ... -> n0, the closing edge implied), or
    None. Two corrections to the pseudo-code as printed, both needed for a *directed* graph:
    line 5 calls DFS where it means HasCycle itself; and line 7's test "u is visited and u != parent"
    is the test for an undirected graph. In a directed debt graph it reports a cycle on a cross edge
    to a finished node (a->b, a->c, b->c has none) and misses a mutual debt a->b->a (there u is the
    parent), the simplest cycle DGFM can resolve. The directed test is "u is on the current DFS
    path", which is what the `parent` argument approximates. The DFS is iterative, so a long debt
    chain cannot hit Python's recursion limit; the order of lines 2-8 is kept.
    """
    visited: set[str] = {start_id}  # line 12 (fresh per start) and line 2
    path: list[str] = [start_id]  # the recursion stack of HasCycle; replaces `parent`
    on_path: set[str] = {start_id}
    iterators = [iter(graph.get(start_id, ()))]
    while iterators:
        neighbor = next(iterators[-1], None)  # line 3: foreach neighbor u of v
        if neighbor is None:  # line 9: no cycle through v, return to the caller
            iterators.pop()
            on_path.discard(path.pop())
            continue
        if neighbor not in visited:  # line 4-5: recurse
            visited.add(neighbor)
            path.append(neighbor)
            on_path.add(neighbor)
            iterators.append(iter(graph.get(neighbor, ())))
        elif neighbor in on_path:  # line 7-8, directed: a back edge closes a cycle
            return tuple(path[path.index(neighbor):])
    return None


def find_cycle(graph: Mapping[str, Sequence[str]], order: Sequence[str]) -> tuple[str, ...] | None:
    """Algorithm 1's Main (lines 10-15): try each start node in `order`, return the first cycle found."""
    for start_id in order:  # line 11
        cycle = find_cycle_from(graph, start_id)  # lines 12-13
        if cycle is not None:
            return cycle  # line 14
    return None  # line 15


@dataclass(frozen=True)
class BlockMove:
    """`num_blocks` of `owner_id`'s rBlocks move from `from_id` to `to_id`."""

    owner_id: str
    from_id: str
    to_id: str
    num_blocks: int


@dataclass(frozen=True)
class DebtSwap:
    """One resolved cycle (§4.5, Figure 5): every instance on it recalls `num_blocks` from its creditor.

    `cycle` lists the instances in debt order: cycle[i] owes cycle[i+1], the last owes the first.
    Each instance recalls `num_blocks` of its own rBlocks from its creditor and, to make the room,
    sends back the same number it holds for its debtor: every instance's occupancy is unchanged, so
    the swap needs no free memory anywhere, and each debt on the cycle drops by `num_blocks`. The
    gManager freezes these rBlocks at the instances until the swap is done (§4.5).
    """

    cycle: tuple[str, ...]
    num_blocks: int

    @property
    def recalls(self) -> tuple[BlockMove, ...]:
        """One move per edge: the debtor's blocks come home from its creditor."""
        n = len(self.cycle)
        return tuple(BlockMove(owner_id=self.cycle[i], from_id=self.cycle[(i + 1) % n], to_id=self.cycle[i],
                               num_blocks=self.num_blocks) for i in range(n))


@dataclass(frozen=True)
class DgfmResult:
    swaps: tuple[DebtSwap, ...]
    ledger: DebtLedger

    def recalls(self) -> tuple[Debt, ...]:
        """What each debtor brings home from each creditor over all the swaps, one entry per edge
        (the gManager's requests to the rManagers, §4.5): sorted by (debtor, creditor)."""
        total: dict[tuple[str, str], int] = {}
        for swap in self.swaps:
            for move in swap.recalls:
                key = (move.owner_id, move.from_id)
                total[key] = total.get(key, 0) + move.num_blocks
        return tuple(Debt(d, c, n) for (d, c), n in sorted(total.items()))


def eliminate_debt_cycles(ledger: DebtLedger, rng: random.Random, *, min_swap_blocks: int) -> DgfmResult:
    """DGFM (§4.5): repeatedly find a debt cycle from a random node and resolve it by its minimum debt.

    Each iteration shuffles the start order with `rng` (the paper "selects a node at random"; the
    rest of the order is Algorithm 1's Main loop, so a random start that reaches no cycle does not
    end the search early) and runs Algorithm 1. A found cycle is resolved by recall-and-swap of its
    minimum debt, which zeroes at least that edge, so the loop ends after at most as many iterations
    as there are debts.

    `min_swap_blocks` is §4.5's "empirical threshold for the minimum number of memory blocks (rBlocks)
    to be swapped at each node". On a cycle every node swaps exactly the cycle's minimum, so a cycle
    is worth swapping exactly when every edge on it is at least the threshold: the search runs on the
    graph of those edges only, and the result has no cycle whose minimum reaches the threshold.
    Balances are conserved: every instance's debt and credit fall by the same amount and free blocks
    do not change.
    """
    if min_swap_blocks <= 0:
        raise LedgerError(f"min_swap_blocks must be positive, not {min_swap_blocks}")
    debt_map = dict(ledger.debt_map())
    swaps: list[DebtSwap] = []
    nodes = list(ledger.instance_ids)
    while True:
        graph = _graph(nodes, debt_map, min_swap_blocks)
        order = list(nodes)
        rng.shuffle(order)
        cycle = find_cycle(graph, order)
        if cycle is None:
            break
        edges = [(cycle[i], cycle[(i + 1) % len(cycle)]) for i in range(len(cycle))]
        num_blocks = min(debt_map[edge] for edge in edges)
        for edge in edges:
            debt_map[edge] -= num_blocks
        swaps.append(DebtSwap(cycle, num_blocks))
    after = DebtLedger(ledger.block_bytes, ledger.accounts, tuple(Debt(d, c, n) for (d, c), n in debt_map.items()))
    return DgfmResult(tuple(swaps), after)
