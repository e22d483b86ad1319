"""Where a new request goes: MELL's Allocate rule (MELL §VI-C, Fig. 10) on the router's view of the pool.

The operator runs MELL once per epoch and publishes, per size class, the worker that Allocate would
give the next request (`status.routingTable`). Between epochs the router keeps placing requests, and
the table can go stale: its worker may have filled up with requests the router sent since, or gone.
So the router checks the route against its own live view (the workers' KV-load reports plus the
requests it placed itself and the reports do not show yet) and, when the route does not fit, asks
the scheduling core's Allocate on that view (`kvfleet.mell.allocate_one`, the rule's one home) with
the pool's GPU-priority weights. Placing where MELL would means the next epoch orders no migration
for the request. Pure: no I/O, no clock, so it is tested with exact small cases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvfleet.mell import (
    GpuLoad,
    GpuTotals,
    PolicyConfig,
    allocate_on_totals,
    allocate_one,
    cluster_snapshot,
    policy_config,
)
from kvfleet.mell.size_classes import SizeClass, class_of_name, size_class
from kvfleet.router.locality import Locality, LocalityInput, prefer_cached
from kvfleet.serving.httpapi import DecodeTarget

# Rough bytes of UTF-8 text per token of a BPE tokenizer, for prompts the router sees as text (it has
# no tokenizer: the model's files live with the workers). The first streamed chunk gives the exact count.
TEXT_BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class ReportedRequest:
    request_id: str
    kv_bytes: int
    size_class: SizeClass


@dataclass(frozen=True)
class PDSettings:
    """A disaggregated pool's spec as the router uses it (the LLMPool's spec.disaggregation)."""

    # MemServe §5's milestones: none (PD-Basic), prefill (cache at P), decode (at P and D), full (D's
    # KV back to P): which workers' caches the router's prompt tree believes in.
    caching: str = "full"
    # "always" (the paper: every request prefilled on a prefill worker) or "per-request"
    # (kvfleet.router.disaggregation.choose).
    choice: str = "per-request"
    # The pool's link for KV between workers (spec.migration.communicationBoundaryBytesPerSecond).
    link_bytes_per_s: float = 10e9


@dataclass(frozen=True)
class WorkerState:
    """One worker pod as the router sees it (from the Kubernetes API, never per request)."""

    pod_name: str
    address: str  # "ip:port" of the agent
    ready: bool
    # Higher is more recently activated: the worker index the operator names pods by (activation order).
    activation_order: int
    capacity_bytes: int | None  # from its KV-load report; None before its first report
    reported: tuple[ReportedRequest, ...] = ()
    # Blocks its prefix cache holds, from its report; None: it has no cache (or has not said).
    prefix_cache_blocks: int | None = None
    # Its role in a disaggregated pool ("prefill" or "decode", its pod's kvfleet.dev/role label); None:
    # a colocated pool's worker.
    role: str | None = None
    # "ip:port" of its migration port (its pod's `migration` container port); "": the pool's default.
    migration_address: str = ""


@dataclass(frozen=True)
class PoolSnapshot:
    workers: tuple[WorkerState, ...]
    # Size class name (L, M, S, T) -> worker pod, the operator's routing table.
    routes: Mapping[str, str]
    # False until the view has read the cluster once: the router is not ready before.
    synced: bool = True
    # The pool's MELL knobs (kvfleet.api.scheduling.scheduler_config of its spec), so that the
    # router's Allocate ranks GPUs with the pool's weights; None (pool not read yet): MELL's defaults.
    # Its capacity is not used: C is what the workers report.
    config: PolicyConfig | None = None
    # The pool's scheduling.policy: the router previews the same policy's Allocate as the operator runs.
    policy: str = "mell"
    # The pool's prefixCaching.routing and ttlSeconds (kvfleet.router.locality); "none" unless the
    # pool's workers cache prefixes (prefixCaching.enabled).
    locality: Locality = "none"
    prefix_ttl_s: float = 600.0
    # The pool's spec.disaggregation while enabled (kvfleet.router.disaggregation); None: colocated.
    disaggregation: PDSettings | None = None

    def ready_workers(self) -> list[WorkerState]:
        return [w for w in self.workers if w.ready and w.address]


@dataclass(frozen=True)
class Reservation:
    """A request the router placed and has not seen end: what it will hold at most, and where."""

    request_id: str
    pod_name: str
    kv_bytes: int


@dataclass(frozen=True)
class RouteChoice:
    """The worker a new request goes to (not kvfleet.mell.models.Placement: a request on a GPU in MELL's model)."""

    pod_name: str
    address: str
    # How it was chosen: "route", "allocate:<step>", "least-loaded" or "queued:<where>" (logged, counted in metrics).
    rule: str
    # A disaggregated pool's decode workers, best first: this worker prefills the request and hands it
    # to the first that takes it. Empty: it runs here.
    decode: tuple[DecodeTarget, ...] = ()


@dataclass(frozen=True)
class NoRoute:
    reason: str  # "no-ready-worker" (a request is never refused for want of room: it queues)
    message: str


def class_name(kv_bytes: int, capacity_bytes: int) -> str:
    """The routing-table class of a request of this size: tiny ones travel as T multi-items (§VI-C),
    and one larger than C (DistAttention's case) needs a whole GPU, like an L-request."""
    cls = size_class(kv_bytes, capacity_bytes)
    if cls == SizeClass.TINY:
        return "T"
    if cls == SizeClass.X:
        return "L"
    return cls.name


def request_kv_bytes(prompt_tokens: int, max_tokens: int | None, kv_bytes_per_token: int, max_model_len: int | None) -> int:
    """The most KV the request will hold: prompt plus its whole output budget.

    MELL sizes a request by its current KV and moves it when it grows into another class (Update);
    the router knows the budget up front, so placing by the final size avoids those moves.
    """
    output = max_tokens
    if max_model_len is not None:
        room = max(0, max_model_len - prompt_tokens)
        output = room if output is None else min(output, room)
    return (prompt_tokens + (output or 0)) * kv_bytes_per_token


class _Load:
    """One Ready worker as a placement reads it (kept per worker until its totals change)."""

    __slots__ = ("worker", "capacity_bytes", "committed_bytes", "num_requests", "sizes", "totals")

    def __init__(self, worker: WorkerState, capacity_bytes: int, committed_bytes: int, num_requests: int,
                 sizes: Callable[[], Mapping[str, int]]) -> None:
        self.worker = worker
        self.capacity_bytes = capacity_bytes
        self.committed_bytes = committed_bytes  # KV held or reserved on it
        self.num_requests = num_requests
        # The request id -> KV bytes behind those totals (read only where the policy needs them: `allocate`).
        self.sizes = sizes
        self.totals = GpuTotals(worker.pod_name, worker.activation_order, committed_bytes, num_requests)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.committed_bytes

    def fits(self, kv_bytes: int) -> bool:
        # A request larger than C takes a whole (empty) worker; DistAttention spreads the rest.
        return self.committed_bytes + min(kv_bytes, self.capacity_bytes) <= self.capacity_bytes


class _PodBook:
    """One worker's requests as the router counts them: reported, reserved, and their totals."""

    __slots__ = ("reported", "reserved", "committed_bytes", "num_requests", "load")

    def __init__(self) -> None:
        self.reported: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        self.committed_bytes = 0
        self.num_requests = 0
        self.load: _Load | None = None  # as the last placement read it; None once the totals change

    def held(self, request_id: str) -> int:
        """What one request counts for here: a request the report shows and the router placed counts
        once, at the larger of the two (the report has its KV so far, the reservation what it will
        grow to); -1: not here."""
        reported = self.reported.get(request_id, -1)
        reserved = self.reserved.get(request_id, -1)
        return max(reported, reserved)

    def set_reserved(self, request_id: str, kv_bytes: int | None) -> None:
        before = self.held(request_id)
        if kv_bytes is None:
            self.reserved.pop(request_id, None)
        else:
            self.reserved[request_id] = kv_bytes
        self._count(before, self.held(request_id))

    def set_reported(self, reported: Mapping[str, int]) -> None:
        self.reported = dict(reported)
        self.load = None
        self.committed_bytes = sum(self.held(r) for r in {**self.reported, **self.reserved})
        self.num_requests = len(self.reported.keys() | self.reserved.keys())

    def _count(self, before: int, after: int) -> None:
        self.load = None
        self.committed_bytes += max(after, 0) - max(before, 0)
        self.num_requests += (after >= 0) - (before >= 0)

    def sizes(self) -> dict[str, int]:
        return {r: self.held(r) for r in {**self.reported, **self.reserved}}


class PoolLoads:
    """Where the pool's KV is as the router sees it, kept up to date as reports and placements arrive.

    The workers' reports come with each new `PoolSnapshot` (`sync`: only the workers whose state
    changed are re-read), the router's own placements as reservations (`reserve`, `release`). A
    placement then reads each worker's totals (`place`, time in the number of workers), where
    rebuilding them from every request in flight cost tens of milliseconds at a thousand
    (bench/placement.py measures both). Not thread-safe: the router's event loop is its one user.
    """

    def __init__(self, snapshot: PoolSnapshot | None = None, reservations: Iterable[Reservation] = (), *,
                 rebuild: bool = False) -> None:
        # Decide every placement on the cluster rebuilt from every request (`allocate_one`), as the
        # router did before it kept totals: the baseline bench/placement.py and the tests compare with.
        self.rebuild = rebuild
        self.snapshot = PoolSnapshot((), {}, synced=False)
        self._books: dict[str, _PodBook] = {}
        self._states: dict[str, WorkerState] = {}
        self._reservations: dict[str, Reservation] = {}
        for reservation in reservations:
            self.reserve(reservation)
        if snapshot is not None:
            self.sync(snapshot)

    def _book(self, pod_name: str) -> _PodBook:
        book = self._books.get(pod_name)
        if book is None:
            book = self._books[pod_name] = _PodBook()
        return book

    def sync(self, snapshot: PoolSnapshot) -> None:
        """Take the pool's newest view; a worker whose state is the one already read costs nothing."""
        if snapshot is self.snapshot:
            return
        seen = set()
        for worker in snapshot.workers:
            seen.add(worker.pod_name)
            if self._states.get(worker.pod_name) is worker:
                continue
            self._states[worker.pod_name] = worker
            self._book(worker.pod_name).set_reported({r.request_id: r.kv_bytes for r in worker.reported})
        for gone in self._states.keys() - seen:
            del self._states[gone]
            self._book(gone).set_reported({})
        self.snapshot = snapshot

    def reserve(self, reservation: Reservation) -> None:
        """The router placed this request (again): it holds at most `kv_bytes` on that worker."""
        self.release(reservation.request_id)
        self._reservations[reservation.request_id] = reservation
        self._book(reservation.pod_name).set_reserved(reservation.request_id, reservation.kv_bytes)

    def release(self, request_id: str) -> Reservation | None:
        """The request ended (or is being placed again): it no longer counts where it was reserved."""
        reservation = self._reservations.pop(request_id, None)
        if reservation is not None:
            self._book(reservation.pod_name).set_reserved(request_id, None)
        return reservation

    def reservation(self, request_id: str) -> Reservation | None:
        return self._reservations.get(request_id)

    def reservations(self) -> list[Reservation]:
        return list(self._reservations.values())

    def loads(self, default_capacity_bytes: int, exclude: frozenset[str]) -> list[_Load]:
        loads = []
        for w in self.snapshot.ready_workers():
            if w.pod_name in exclude:
                continue
            book = self._book(w.pod_name)
            capacity = w.capacity_bytes or default_capacity_bytes
            load = book.load
            if load is None or load.worker is not w or load.capacity_bytes != capacity:
                load = book.load = _Load(w, capacity, book.committed_bytes, book.num_requests, book.sizes)
            loads.append(load)
        return loads

    def place(self, kv_bytes: int, *, default_capacity_bytes: int, exclude: frozenset[str] = frozenset(),
              locality: LocalityInput | None = None, request_id: str | None = None) -> RouteChoice | NoRoute:
        """`place` on this view; `request_id`'s own reservation (a request placed again after its
        worker failed) does not count against it."""
        own = self.release(request_id) if request_id is not None else None
        try:
            return _place(self.snapshot, self.loads(default_capacity_bytes, exclude), kv_bytes, locality, self.rebuild)
        finally:
            if own is not None:
                self.reserve(own)


def allocate(loads: list[_Load], fitting: Sequence[_Load], kv_bytes: int, config: PolicyConfig | None,
             policy: str = "mell", rebuild: bool = False) -> tuple[_Load, str] | None:
    """The pool policy's Allocate (the default's best fit with headroom; for `mell-paper` MELL §VI-C,
    Fig. 10, J.Allocate(i)), from the scheduling core, restricted to what a router can do: choose a
    worker.

    The core decides from the workers' totals where the policy reads nothing else
    (`allocate_on_totals`: the default policy, no worker over its cap), and otherwise restores the
    policy from the router's view (the workers' requests and activation order) and places the request
    with the pool's knobs (`allocate_one`). "Activate a new GPU" means a worker holding
    nothing (the operator keeps warm empty workers, the floor and headroom, for exactly this), the one
    activated first. The moves Allocate also orders (departing T-requests from an L-GPU, moving an
    S/M-request to a new L-GPU) are the operator's next epoch; since the router cannot make them, the
    chosen worker must also fit the request as it is now, or there is no choice (None).
    """
    if not fitting:  # the loads that fit the request now
        return None  # whatever Allocate chose, neither a worker in use nor an empty one could take it
    # The core plans with one C; where reports differ, the smallest never overfills a worker.
    capacity = min(load.capacity_bytes for load in loads)
    config = dataclasses.replace(config or policy_config(policy, capacity), capacity_bytes=capacity)
    in_use = [load for load in loads if load.num_requests]
    # A request larger than C takes a whole worker (DistAttention spreads the rest): an L-request of C.
    size = min(kv_bytes, capacity)
    decision = None if rebuild else allocate_on_totals([load.totals for load in in_use], size, config, policy)
    if decision is None:
        gpus = [GpuLoad(load.worker.pod_name, load.worker.activation_order, tuple(load.sizes().items()))
                for load in in_use]
        decision = allocate_one(cluster_snapshot(gpus, capacity), size, config, policy)
    if decision.new_gpu:
        empty = [load for load in loads if not load.num_requests and load.fits(kv_bytes)]
        if not empty:
            return None
        return min(empty, key=lambda load: (load.worker.activation_order, load.worker.pod_name)), "allocate:new-GPU"
    chosen = next(load for load in loads if load.worker.pod_name == decision.gpu_id)
    if not chosen.fits(kv_bytes):
        return None
    return chosen, f"allocate:{decision.step}"


def _roomiest(loads: Sequence[_Load]) -> _Load:
    """The worker with the most free KV, then the fewest requests (then by name, for determinism)."""
    return max(loads, key=lambda load: (load.free_bytes, -load.num_requests, load.worker.pod_name))


def place(snapshot: PoolSnapshot, reservations: Sequence[Reservation], kv_bytes: int, *, default_capacity_bytes: int,
          exclude: frozenset[str] = frozenset(), locality: LocalityInput | None = None) -> RouteChoice | NoRoute:
    """The worker for a new request of `kv_bytes` (its estimated final KV), or why there is none.

    In order: the routing table's worker for the request's class if it is Ready and fits; MELL's
    Allocate on the router's view; the least-loaded Ready worker that fits (the pool has Ready
    workers but no reports yet, or Allocate found nothing); otherwise the worker it queues on (the
    route, else the emptiest). Only a pool without a Ready worker has no placement. `exclude` names
    workers that just failed this request.

    With `locality` (kvfleet.router.locality), a worker that fits may take the request instead of
    MELL's choice: the session's last worker (session affinity), or one that caches a longer prefix
    of the prompt and is predicted sooner to its first token (MemServe §6, equation 1). A request no
    worker has room for queues where MELL says, whatever is cached.
    """
    return PoolLoads(snapshot, reservations).place(kv_bytes, default_capacity_bytes=default_capacity_bytes,
                                                   exclude=exclude, locality=locality)


def _place(snapshot: PoolSnapshot, loads: list[_Load], kv_bytes: int, locality: LocalityInput | None,
           rebuild: bool) -> RouteChoice | NoRoute:
    if not loads:
        return NoRoute("no-ready-worker", "the pool has no Ready worker; retry shortly")
    if kv_bytes > max(load.capacity_bytes for load in loads):
        # Larger than any one worker (DistKV, docs/distkv.md): its worker keeps its newest KV and
        # borrows the rest from the others, so the worker with the most room takes it. Whether the
        # pool can lend the rest is the worker's to say (it reads the operator's plan): a pool
        # without room answers 400 context_length_exceeded, saying how much it could lend.
        spanning = _roomiest(loads)
        return RouteChoice(spanning.worker.pod_name, spanning.worker.address, "spanning")
    fitting = [load for load in loads if load.fits(kv_bytes)]
    route_name = snapshot.routes.get(class_name(kv_bytes, loads[0].capacity_bytes)) if snapshot.routes else None
    route = next((load for load in loads if load.worker.pod_name == route_name), None) if route_name else None
    choice: RouteChoice | None = None
    if route is not None and route.fits(kv_bytes):
        choice = RouteChoice(route.worker.pod_name, route.worker.address, "route")
    elif (chosen := allocate(loads, fitting, kv_bytes, snapshot.config, snapshot.policy, rebuild)) is not None:
        choice = RouteChoice(chosen[0].worker.pod_name, chosen[0].worker.address, chosen[1])
    elif fitting:
        best = _roomiest(fitting)
        choice = RouteChoice(best.worker.pod_name, best.worker.address, "least-loaded")
    if choice is not None:
        return _with_locality(choice, fitting, locality) if locality is not None else choice
    # No worker has room: the request still goes to a worker, where the engine queues it. Refusing
    # it would be worse than late: MELL scales out only for load it can see, and a queued request is
    # in its worker's KV-load report (as queued), so the next epoch allocates it a GPU (a new worker
    # if need be) and the operator moves it there; a request a router kept to itself would never
    # make the pool grow. It queues where MELL would put it (the route), else on the emptiest worker.
    if route is not None:
        return RouteChoice(route.worker.pod_name, route.worker.address, "queued:route")
    emptiest = _roomiest(loads)
    return RouteChoice(emptiest.worker.pod_name, emptiest.worker.address, "queued:emptiest")


def _with_locality(choice: RouteChoice, fitting: Sequence[_Load], locality: LocalityInput) -> RouteChoice:
    by_name = {load.worker.pod_name: load.worker for load in fitting}
    if locality.session_pod is not None:
        session = by_name.get(locality.session_pod)
        if session is not None:
            return RouteChoice(session.pod_name, session.address, "session")
        return choice
    preferred = prefer_cached(choice.pod_name, list(by_name), locality)
    if preferred is None:
        return choice
    worker = by_name[preferred]
    return RouteChoice(worker.pod_name, worker.address, "prefix")


def parse_class(name: str) -> SizeClass:
    return class_of_name(name)


def estimate_prompt_tokens(prompt: str | Sequence[int] | Sequence[Mapping[str, object]]) -> int:
    """Prompt tokens: exact for token ids, estimated for text and chat messages (the worker tokenizes)."""
    if isinstance(prompt, str):
        return len(prompt.encode()) // TEXT_BYTES_PER_TOKEN + 1
    total = 0
    for item in prompt:
        if isinstance(item, int):
            total += 1
        else:  # a chat message: its text plus a few tokens of the chat template around it
            total += len(str(item.get("content", "")).encode()) // TEXT_BYTES_PER_TOKEN + 4
    return max(1, total)
