"""The replay: a workload under one policy, epoch by epoch: how many GPUs, how full, how many migrations.

Time advances in scheduling epochs (MELL §IV: instances report at the start of each epoch, the
scheduler answers with a plan). Within an epoch each GPU decodes its batch at the speed of the
setup's speed model (speed_model.py), so KV grows at a realistic rate and a fuller GPU decodes more slowly.

What the scheduler is told about a request is its KV *reservation*: the blocks it holds now plus
the blocks it can write before the next epoch at the fastest decode speed. That way a GPU that the
plan keeps within C stays within C until the next plan, without knowing any output length (MELL
Finding 2). Actual KV (without the look-ahead) is what utilization and the fluid lower bound use.

Migrations cost the planner's choice (§V): a KV transfer takes bytes / link bandwidth, a token
transfer a re-prefill. Deterministic: no clock, no randomness (synthetic workloads take their seed outside).

What a cloud bills is a worker *pod*, from the moment it asks for its GPU until it is deleted, not
the GPUs a plan holds active: so the replay keeps a pod behind each active GPU, which takes
`scale_up_s` to become ready when new and lingers, billed and warm, `scale_down_delay_s` after the
plan lets its GPU go (the LLMPool's `autoscaling.scaleDownDelaySeconds`). Requests wait for their
pod; what they wait, and how fast they decode, is reported per request (queueing delay, TPOT).
Two bounds are reported: each run's own fluid bound (the KV that run held) and one shared by every
policy, computed from the workload alone (bounds.py). What a run reports is result.py's.

How a plan is carried out is `execution`. "plan" (the default, MELL §VII's simulator) does exactly
what each plan says: a request placed or moved onto a GPU whose pod is still starting waits there,
idle, until the pod is ready. "operator" does what kvfleet's operator and router do with the same plan
(operator/kvfleet/operator/epoch.py, worker-image/kvfleet/router/placement.py): the router sends a
request only to a Ready worker with room for its whole size, so a request whose GPU is still starting,
or has no room for that, runs meanwhile on another Ready worker (or waits in a worker's queue, whose
engine starts it when its KV fits); the operator then moves every request that is not where the plan
holds it, once the plan's GPU has a Ready pod with room and unless the request's worker reports it
finishing (its remaining output ends within two report intervals); a GPU the plan lets go keeps its
pod, billed, until the requests on it have left. The moves counted are the ones made, as a live
pool's KVMigrations are. `report_lag_epochs` (operator only) is how late the plan hears of what
happened: a worker writes its report at most once an epoch and the operator reads it at its next
pass, so a live plan learns of an arrival, a growth or a finish about an epoch after it. With a lag
the router places a new request as it arrives, before any plan holds it (where Allocate puts it on
the last plan's state if that worker is Ready with room, else the fullest Ready worker with room,
else a queue), and the operator moves it once a plan holds it elsewhere; a GPU whose requests finished
stays held, and its pod billed, until the plan hears. 0 (the default) is a plan that hears at once.
Carried out as written, the plan is told each request's final size when it arrives (prompt + output,
the trace's: the default policy's per-request growth estimate, kvfleet.mell.mell_default rule 6);
operated, it is told none, as a live operator's reports carry no output budget.

With a `PrefixCacheSpec` (`--prefix-cache`) each worker also keeps the prompt blocks of the requests
that finished on its GPU (MemServe §4.1-4.2, kvfleet.sim.prefix_cache), in the KV memory its running
requests leave free, for as long as its pod lives (warm pods keep theirs): a request placed on a GPU
prefills only what that GPU does not hold of its prompt's leading hash blocks. Placement is
cache-blind unless the spec has a prompt tree (`prompt_tree`, a pool router's MemServe §6 routing):
then each Arrive names the GPUs holding its prompt's prefixes, grouped by length, longest first, and
the default policy places it on the fullest GPU with room of the first group it can (rule 7 of
kvfleet.mell.mell_default). Each running request still
holds its whole prompt's KV: counting a prefix two running requests share once would make a
request's size depend on what runs beside it, which the MELL core's per-request sizes cannot say.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from itertools import chain

from kvfleet.api.models import AutoscalingSpec
from kvfleet.mell.allocate import allocate_on_snapshot
from kvfleet.mell.cluster import ClusterPolicy, PolicyConfig
from kvfleet.mell.migration import Boundaries, plan_migrations
from kvfleet.mell.models import Arrive, Event, EventBatch, Finish, Grow, Location, Migration, Plan
from kvfleet.mell.policy import make_policy, policy_config
from kvfleet.sim.bounds import shared_bound
from kvfleet.sim.hardware import BLOCK_SIZE_TOKENS
from kvfleet.sim.prefix_cache import GpuPrefixCache, PrefixCacheSpec
from kvfleet.sim.result import RunResult
from kvfleet.sim.speed_model import Setup
from kvfleet.sim.traces import TraceRequest

# How the replay carries out each plan (module docstring): as written, or as kvfleet's operator does.
EXECUTIONS = ("plan", "operator")
# A worker reports a request finishing when its remaining output ends within this many report
# intervals (one epoch each); the operator orders no move for it (worker-image/kvfleet/worker/reporter.py).
FINISHING_INTERVALS = 2

# The LLMPool's default, so that a bare `simulate` bills what a default pool would.
DEFAULT_SCALE_DOWN_DELAY_S = float(AutoscalingSpec.model_fields["scale_down_delay_seconds"].default)


def migration_boundaries(setup: Setup, epoch_s: float) -> Boundaries:
    """The §V boundaries of one epoch on `setup`: each link carries its bandwidth x epoch, each instance
    re-prefills a tenth of what it could in an epoch (the rest is its decode batch's)."""
    return Boundaries(
        intra_node_link_bytes=int(setup.intra_node_bytes_per_s * epoch_s),
        inter_node_link_bytes=int(setup.inter_node_bytes_per_s * epoch_s),
        instance_prefill_tokens=int(epoch_s * setup.prefill_tokens_per_s() * 0.1),
    )


def merge_plans(now_s: float, plans: list[Plan]) -> Plan:
    """One epoch's plans as one, in order (what the epoch did in all): moves, placements and GPU
    changes concatenated, the spans of the last plan (the state the epoch ends in)."""
    return Plan(
        now_s,
        tuple(x for p in plans for x in p.placements),
        tuple(x for p in plans for x in p.migrations),
        tuple(x for p in plans for x in p.preemptions),
        plans[-1].spans if plans else (),
        tuple(x for p in plans for x in p.activate_gpu_ids),
        tuple(x for p in plans for x in p.terminate_gpu_ids),
        tuple(x for p in plans for x in p.moves_per_operation),
        sum(p.num_moves_cancelled for p in plans),
    )


@dataclass
class _Live:
    """A request the replay is decoding: where it runs, how far it got, what the scheduler was told.

    `earliest_decode_s` (arrival + prefill) is when it could decode had nothing made it wait;
    `waited_s` adds up what did (the epoch, a pod starting, re-prefills), `decoding_s` the time it
    decoded: the queueing delay and the TPOT reported when it finishes.
    """

    req: TraceRequest
    gpu_id: str
    decode_from_s: float
    not_before_s: float = 0.0  # the start of the epoch it arrived in: no decode is owed before
    prefill_tokens: int = 0  # its prompt, less what the prefix cache held where it was first placed
    generated: float = 0.0
    reported_bytes: int = 0
    earliest_decode_s: float = 0.0
    last_decoded_s: float | None = None
    waited_s: float = 0.0
    decoding_s: float = 0.0
    first_token_s: float | None = None  # when its first decode step ended (TTFT = this - arrival)
    routed: bool = False  # placed by the router on arrival, before a plan held it (report_lag_epochs)


@dataclass
class _Pod:
    """A model worker pod: billed from `created_s` until deleted; `released_s` is set while warm."""

    created_s: float
    ready_s: float
    released_s: float | None = None
    # Historical KV is the worker's (its engine's GPU memory): it stays while the pod is warm, goes
    # on with it to the next GPU the plans ask for, and is lost when the pod is deleted.
    prefix_cache: GpuPrefixCache | None = None


def simulate(
    requests: list[TraceRequest],
    setup: Setup,
    policy_name: str,
    epoch_s: float = 1.0,
    config: PolicyConfig | None = None,
    on_epoch: Callable[[int], None] | None = None,
    lookahead_epochs: float = 1.0,
    scale_up_s: float = 0.0,
    scale_down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S,
    batching: bool = True,
    prefix_cache: PrefixCacheSpec | None = None,
    execution: str = "plan",
    min_workers: int = 0,
    max_workers: int | None = None,
    report_lag_epochs: int = 0,
) -> RunResult:
    """Replay `requests` (sorted by arrival) under one policy.

    Each epoch runs the same steps in this order (the order is part of the results: events reach
    the scheduler as finishes, then growths, then arrivals): decode, report growth, admit arrivals,
    schedule, apply the plan, record the epoch. `scale_up_s` is how long a new worker pod takes to
    be ready (node and pod start); `scale_down_delay_s` how long an emptied one stays, warm and
    billed. With `scale_up_s=0` the replay is the one without pods: they only add the bill.
    `batching=False` schedules every operation on its own (`_Replay.schedule_unbatched`), the
    baseline of MELL's Fig. 13. `prefix_cache` turns on the per-GPU prefix cache model (module
    docstring); without it the replay is exactly the one before the model existed. `execution` is
    "plan" or "operator" (module docstring; "operator" needs `batching`, as the operator batches).
    `min_workers` is the LLMPool's `workers.min`: that many pods run, ready and billed, from the start
    of the replay to its end, whether the plans hold GPUs or not. `max_workers` is `workers.max`: no
    more pods than that, held, draining or warm (execution="operator" only: a GPU the plan holds
    without a pod is served when one is free, and until then its requests run or queue elsewhere).
    `report_lag_epochs` (execution="operator" only): the plan hears each epoch's events that many
    epochs later (module docstring).
    """
    if report_lag_epochs < 0 or (report_lag_epochs and execution != "operator"):
        raise ValueError("report_lag_epochs must be >= 0, and above 0 only with execution='operator'")
    if min_workers < 0:
        raise ValueError("min_workers must be >= 0")
    if max_workers is not None and (execution != "operator" or max_workers < max(1, min_workers)):
        raise ValueError("max_workers needs execution='operator' and at least max(1, min_workers)")
    if execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}, not {execution!r}")
    if execution == "operator" and not batching:
        raise ValueError("the operator schedules each epoch's events as one batch: execution='operator' needs batching")
    if prefix_cache is not None and prefix_cache.prompt_tree and execution != "plan":
        # The operated replay's router places arrivals before the plan hears of them (route_arrivals),
        # by bytes only: it does not model the router's prompt tree.
        raise ValueError("a prefix cache with a prompt tree is modelled with execution='plan' only")
    if epoch_s <= 0:
        raise ValueError("epoch_s must be positive")
    if scale_up_s < 0 or scale_down_delay_s < 0:
        raise ValueError("scale_up_s and scale_down_delay_s must be >= 0")
    cfg = config or policy_config(policy_name, setup.capacity_bytes)
    bounds = migration_boundaries(setup, epoch_s)
    # A policy that plans by link budgets plans within the §V boundaries the replay costs its moves against.
    cfg = cfg.within_link_budgets(bounds.intra_node_link_bytes, bounds.inter_node_link_bytes)
    replay = _Replay(requests, setup, make_policy(policy_name, cfg), epoch_s, lookahead_epochs, scale_up_s,
                     scale_down_delay_s, prefix_cache, min_workers, max_workers)
    replay.result.batching = batching
    # A live pool's reports carry no output budget, so the operated replay tells the plan none either.
    replay.tell_final_sizes = execution == "plan"
    now_s = 0.0
    epoch = 0
    unheard: deque[list[Event]] = deque()  # each epoch's events, until the plan hears them
    # Until the plan has heard the last finish: a GPU's pod stays held until then (report_lag_epochs).
    while replay.has_work() or any(unheard):
        epoch += 1
        start_s, now_s = now_s, epoch * epoch_s
        events = replay.decode_epoch(start_s, now_s)
        events += replay.report_growth()
        arrivals = replay.admit_arrivals(now_s)
        events += arrivals
        moves: tuple[Migration, ...] | None = None
        if execution == "operator":
            if report_lag_epochs:
                replay.route_arrivals(arrivals, now_s)
                unheard.append(events)
                events = unheard.popleft() if len(unheard) > report_lag_epochs else []
            plan = replay.policy.schedule(EventBatch(now_s, tuple(events)))
            moves = replay.apply_plan_as_operated(plan, now_s)
        elif batching:
            plan = replay.policy.schedule(EventBatch(now_s, tuple(events)))
            replay.apply_plan(plan, now_s)
        else:
            plan = replay.schedule_unbatched(events, now_s)
        replay.record_epoch(plan, now_s, moves)
        if on_epoch is not None:
            on_epoch(epoch)
    replay.close_pods(now_s)
    return replay.result


class _Replay:
    """The state of one `simulate` run between epochs, and the steps that advance it.

    A class rather than one long loop so that each step (decode, growth, arrivals, applying the
    plan, costing migrations, recording) can be read, and extended, on its own: the decode GPUs of a
    disaggregated pool (kvfleet.sim.disaggregation) are this replay with its arrivals, prefix
    matching and caching replaced.
    """

    def __init__(
        self, requests: list[TraceRequest], setup: Setup, policy: ClusterPolicy, epoch_s: float, lookahead_epochs: float,
        scale_up_s: float, scale_down_delay_s: float, prefix_cache: PrefixCacheSpec | None = None,
        min_workers: int = 0, max_workers: int | None = None,
    ) -> None:
        self.setup = setup
        self.policy = policy
        self.epoch_s = epoch_s
        self.capacity_bytes = setup.capacity_bytes
        self.kv_bytes_per_token = setup.kv_bytes_per_token
        self.block_bytes = BLOCK_SIZE_TOKENS * self.kv_bytes_per_token
        # Whether an Arrive gives the request's final size (the default policy's growth estimate, rule 6).
        self.tell_final_sizes = True
        # Look-ahead: tokens a request can write in one epoch at the fastest step (batch 1, no KV).
        self.lookahead_tokens = math.ceil(lookahead_epochs * epoch_s / setup.step_s(1, 0))
        self.boundaries = migration_boundaries(setup, epoch_s)
        # Where each GPU the plans activated is, kept after the policy forgets a GPU it terminated.
        self.locations: dict[str, Location] = {}
        self.live: dict[str, _Live] = {}
        # Request ids per GPU, as an insertion-ordered set: the order fixes the order of Finish events.
        self.on_gpu: dict[str, dict[str, None]] = {}
        self.pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.next_arrival = 0
        self.result = RunResult(
            policy=policy.name, epoch_s=epoch_s, capacity_bytes=self.capacity_bytes, num_requests=len(requests),
            scale_up_s=scale_up_s, scale_down_delay_s=scale_down_delay_s,
            shared_bound=shared_bound(requests, setup, epoch_s, prefix_cache), prefix_cache=prefix_cache is not None,
        )
        self.scale_up_s = scale_up_s
        self.scale_down_delay_s = scale_down_delay_s
        self.pods: dict[str, _Pod] = {}  # the pod behind each GPU the plans hold
        # Released, not yet deleted, in the order they were released; the pool's floor starts here, ready.
        self.warm: list[_Pod] = [_Pod(created_s=0.0, ready_s=0.0, released_s=0.0) for _ in range(min_workers)]
        self.min_workers = min_workers
        self.max_workers = max_workers
        # GPUs the plans hold that have no pod, at max_workers (served in this order as pods free).
        self.unserved: dict[str, None] = {}
        self.over_capacity: set[str] = set()
        self.prefix_spec = prefix_cache
        # Tokens in each hash block of a request's prompt (`_prompt_block_tokens`), once per request.
        self._block_tokens: dict[str, tuple[int, ...]] = {}
        self._blocks_by_hash: dict[str, dict[int, tuple[int, ...]]] = {}
        # execution="operator" only: GPUs the plans let go whose pods still hold requests (kept, billed,
        # until those leave), and requests no Ready worker had room for (in a worker's queue, not decoding).
        self.draining: set[str] = set()
        # Each maps to the GPU whose worker queues it, or "" while no worker is Ready (the router refuses it
        # and the client retries: not a move).
        self.queued: dict[str, str] = {}

    def has_work(self) -> bool:
        return self.next_arrival < len(self.pending) or bool(self.live)

    def reservation_bytes(self, tokens: float) -> int:
        """What the scheduler is told a request holds: its blocks after one look-ahead of decoding."""
        blocks = math.ceil((tokens + self.lookahead_tokens) / BLOCK_SIZE_TOKENS)
        return blocks * self.block_bytes

    def decode_epoch(self, start_s: float, now_s: float) -> list[Event]:
        """Decode every GPU's batch from `start_s` to `now_s` at the speed the batch allows; finish the done.

        The step time of a GPU is fixed for the epoch by its KV at the start of the epoch.
        """
        events: list[Event] = []
        for rids in self.on_gpu.values():
            if not rids:
                continue
            members = [self.live[r] for r in rids]
            kv = sum(int(m.req.prompt_tokens + m.generated) * self.kv_bytes_per_token for m in members)
            step = self.setup.step_s(len(members), kv)
            for m in members:
                begin_s = max(start_s, m.decode_from_s)
                busy_s = now_s - begin_s
                before = m.generated
                if busy_s > 0:
                    if m.first_token_s is None:
                        m.first_token_s = begin_s + step
                    m.generated += busy_s / step
                    # Time since it last decoded (or could first decode) is waiting: exactly 0 when
                    # it decoded through the previous epoch, since this epoch begins where it ended.
                    m.waited_s += begin_s - (m.earliest_decode_s if m.last_decoded_s is None else m.last_decoded_s)
                    m.last_decoded_s = now_s
                if m.generated >= m.req.output_tokens:
                    events.append(Finish(m.req.request_id))
                    self._record_finish(m, before, step, begin_s, busy_s)
                elif busy_s > 0:
                    m.decoding_s += busy_s
        # In the order they finished (events), not a set's: it is the order their blocks enter the caches.
        for event in events:
            m = self.live.pop(event.request_id)
            del self.on_gpu[m.gpu_id][event.request_id]
            self._keep_prefix(m)
        self.bound_prefix_caches()
        return events

    def _keep_prefix(self, m: _Live) -> None:
        """A finished request's prompt blocks become historical KV on the GPU it finished on (MemServe
        §4.1 `insert` on completion). Only the prompt: the trace hashes no output blocks."""
        spec = self.prefix_spec
        if spec is None or not m.req.hash_ids:
            return
        pod = self.pods[m.gpu_id]  # it ran there this epoch, so the GPU and its pod are held
        if pod.prefix_cache is None:
            pod.prefix_cache = GpuPrefixCache(self.kv_bytes_per_token, spec.host_bytes)
        pod.prefix_cache.insert(m.req.hash_ids, self._prompt_block_tokens(m.req))

    def _prompt_block_tokens(self, req: TraceRequest) -> tuple[int, ...]:
        """Tokens in each of `req`'s prompt hash blocks (PrefixCacheSpec.block_tokens), worked out once per
        request: placement, finishing and every epoch's sharing measurement read them."""
        blocks = self._block_tokens.get(req.request_id)
        if blocks is None:
            assert self.prefix_spec is not None
            blocks = tuple(self.prefix_spec.block_tokens(req.prompt_tokens, len(req.hash_ids)))
            self._block_tokens[req.request_id] = blocks
        return blocks

    def bound_prefix_caches(self) -> None:
        """Keep each GPU's historical KV within the memory its running requests leave free (after they
        grew and finished: `_run_on` does the same when a request comes to a GPU)."""
        # Only held pods run requests; a warm pod's cache was bounded by C when it was let go.
        for gpu_id in self.pods:
            self._bound_prefix_cache(gpu_id)

    def _bound_prefix_cache(self, gpu_id: str) -> None:
        """MemServe retains history only in free memory (§4: MemPool hands blocks to active requests
        first), so blocks go, least recently used first, once cached + running KV would pass C.

        Running KV counts a request spanning GPUs whole on the GPU of its tail, and a request that
        found its prefix here both in its own KV and in the cache (the model does not share blocks):
        both only evict sooner.
        """
        pod = self.pods.get(gpu_id)
        cache = None if pod is None else pod.prefix_cache
        if cache is None:
            return
        self.result.num_prefix_evictions += cache.evict_to(max(0, self.capacity_bytes - self._running_kv_bytes(gpu_id)))

    def _match_prefix(self, m: _Live, gpu_id: str) -> None:
        """Where a request is first placed, its prefill skips the prompt's leading hash blocks that
        GPU holds (MemServe §4.2 `match`), but always computes at least the last prompt token."""
        req = m.req
        hit_tokens = host_tokens = 0
        pod = self.pods.get(gpu_id)
        cache = None if pod is None else pod.prefix_cache
        spec = self.prefix_spec
        if cache is not None and spec is not None and req.hash_ids:
            hit_tokens = cache.match(req.hash_ids, self._prompt_block_tokens(req))
            host_tokens = cache.last_host_tokens
        m.prefill_tokens = max(1, req.prompt_tokens - hit_tokens)
        result = self.result
        result.prompt_tokens += req.prompt_tokens
        result.prefix_hit_tokens += hit_tokens
        result.prefix_host_hit_tokens += host_tokens
        result.prefill_tokens_saved += req.prompt_tokens - m.prefill_tokens
        if hit_tokens:
            result.num_prefix_hits += 1
            # Blocks found in the host tier are copied back over the host link before it decodes
            # (swap_in), at line rate and beside its prefill of the rest.
            swap_in_s = host_tokens * self.kv_bytes_per_token / spec.host_link_bytes_per_s if spec and host_tokens else 0.0
            # Nothing else has moved its start yet (a pod that is not ready does so after this).
            m.earliest_decode_s = req.arrival_s + self.setup.prefill_s(m.prefill_tokens) + swap_in_s
            m.decode_from_s = max(m.earliest_decode_s, m.not_before_s)

    def _record_finish(self, m: _Live, before: float, step: float, begin_s: float, busy_s: float) -> float:
        """Queueing delay, TPOT, TTFT and JCT of a request done this epoch; returns when it finished.

        It finishes inside the epoch, when `generated` reaches its output: its last decode took
        the remaining tokens x the step, not the whole epoch.
        """
        finish_s = begin_s + (m.req.output_tokens - before) * step
        if busy_s > 0:
            m.decoding_s += (m.req.output_tokens - before) * step
        self.result.queue_delays_s.append(m.waited_s)
        if m.req.output_tokens > 0:  # TPOT of a request with no output is undefined
            self.result.tpots_s.append(m.decoding_s / m.req.output_tokens)
        # Its first step was timed at the step of the epoch it began in; one that straddled an epoch end
        # may really have ended sooner, but never after its last token.
        first_token_s = finish_s if m.first_token_s is None else min(m.first_token_s, finish_s)
        self.result.ttfts_s.append(first_token_s - m.req.arrival_s)
        self.result.jcts_s.append(finish_s - m.req.arrival_s)
        self.result.last_finish_s = max(self.result.last_finish_s, finish_s)
        return finish_s

    def report_growth(self) -> list[Event]:
        """A Grow for each running request whose reservation passed what the scheduler last heard."""
        events: list[Event] = []
        for rid, m in self.live.items():
            want = self.reservation_bytes(m.req.prompt_tokens + m.generated)
            if want > m.reported_bytes:
                m.reported_bytes = want
                events.append(Grow(rid, want))
                if want > self.capacity_bytes:
                    self._count_over_capacity(rid)
        return events

    def _count_over_capacity(self, request_id: str) -> None:
        if request_id not in self.over_capacity:
            self.over_capacity.add(request_id)
            self.result.num_over_capacity_requests += 1

    def admit_arrivals(self, now_s: float) -> list[Event]:
        """An Arrive for each request that arrived during the epoch ending at `now_s`.

        Decoding starts after the prefill, and never before the epoch began (no decode is owed
        for time before the scheduler heard of the request).
        """
        events: list[Event] = []
        while self.next_arrival < len(self.pending) and self.pending[self.next_arrival].arrival_s < now_s:
            req = self.pending[self.next_arrival]
            self.next_arrival += 1
            m = _Live(req, "", req.arrival_s + self.setup.prefill_s(req.prompt_tokens), not_before_s=now_s - self.epoch_s,
                      prefill_tokens=req.prompt_tokens)
            m.earliest_decode_s = m.decode_from_s
            m.decode_from_s = max(m.decode_from_s, m.not_before_s)
            m.reported_bytes = self.reservation_bytes(req.prompt_tokens)
            if m.reported_bytes > self.capacity_bytes:
                self._count_over_capacity(req.request_id)
            self.live[req.request_id] = m
            # Its final size (the trace's prompt + output) where the plan is told it (`tell_final_sizes`).
            final_bytes = self.reservation_bytes(req.prompt_tokens + req.output_tokens) if self.tell_final_sizes else None
            events.append(Arrive(req.request_id, m.reported_bytes, final_bytes, self._cached_on(req)))
        return events

    def _cached_on(self, req: TraceRequest) -> tuple[tuple[str, ...], ...]:
        """With a prompt tree (PrefixCacheSpec.prompt_tree): the held GPUs whose caches hold the start of
        `req`'s prompt, grouped by the tokens they hold, the longest cached prefix first (each group by GPU
        id, for a deterministic replay). The tree is exact here (MemServe §6's is best effort, its entries
        expire) and looking does not make a block recent (`peek`)."""
        spec = self.prefix_spec
        if spec is None or not spec.prompt_tree or not req.hash_ids:
            return ()
        blocks = self._prompt_block_tokens(req)
        tiers: dict[int, list[str]] = {}
        for gpu_id, pod in self.pods.items():
            if pod.prefix_cache is not None:
                tokens = pod.prefix_cache.peek(req.hash_ids, blocks)
                if tokens:
                    tiers.setdefault(tokens, []).append(gpu_id)
        return tuple(tuple(sorted(tiers[tokens])) for tokens in sorted(tiers, reverse=True))

    def schedule_unbatched(self, events: list[Event], now_s: float) -> Plan:
        """Without request operation batching (MELL §VI-C, Fig. 13's baseline): each operation is
        scheduled, and its moves carried out, on its own, in the order the replay produced them, so
        no move is reordered or cancelled (A->B->A costs two moves). The epoch's moves are costed
        together, against one epoch's §V boundaries, as batched ones are. Returns the epoch's plans
        merged, for recording."""
        # One batch per operation, then an empty one that ends the epoch: it runs the policy's
        # per-epoch work (the load balancer's rebalancing, once an epoch as batched) and Algorithm 1's
        # idle-GPU step even in an epoch without events.
        batches: list[tuple[Event, ...]] = [(event,) for event in events] + [()]
        plans: list[Plan] = []
        for i, batch in enumerate(batches):
            plan = self.policy.schedule(EventBatch(now_s, batch), end_of_epoch=i == len(batches) - 1)
            # The replay decoded the whole epoch first, so a request whose Finish comes later in this
            # epoch's events is already gone here, yet an earlier operation may move it: the move an
            # unbatched scheduler makes (and batching cancels) is counted and costed, with nothing to
            # relocate.
            self.apply_plan(replace(plan, migrations=tuple(m for m in plan.migrations if m.request_id in self.live),
                                    preemptions=tuple(m for m in plan.preemptions if m.request_id in self.live)),
                            now_s, cost_migrations=False)
            plans.append(plan)
        merged = merge_plans(now_s, plans)
        if merged.migrations:
            self._cost_migrations(merged.migrations, now_s)
        return merged

    def apply_plan(self, plan: Plan, now_s: float, cost_migrations: bool = True) -> None:
        """Carry out the plan on the replayed cluster, checking it moves what is really there.

        The pods of GPUs the plan lets go are released first, so that a GPU it activates in the
        same plan takes one of them, warm, rather than asking for a new one.
        """
        self._release_pods(plan.terminate_gpu_ids, now_s)
        self._activate(plan.activate_gpu_ids, now_s)
        for pl in plan.placements:
            m = self.live[pl.request_id]
            if m.gpu_id:  # a request whose tail passed C starts a new tail elsewhere
                del self.on_gpu[m.gpu_id][pl.request_id]
            elif self.prefix_spec is not None:
                self._match_prefix(m, pl.gpu_id)
            self._run_on(m, pl.request_id, pl.gpu_id, now_s)
        for mig in (*plan.migrations, *plan.preemptions):
            m = self.live[mig.request_id]
            if m.gpu_id != mig.source_gpu_id:
                raise AssertionError(f"plan moves {mig.request_id} from {mig.source_gpu_id}, it is on {m.gpu_id}")
            del self.on_gpu[m.gpu_id][mig.request_id]
            self._run_on(m, mig.request_id, mig.target_gpu_id, now_s)
        for mig in plan.preemptions:
            # vLLM recompute: the request re-prefills everything it had before decoding again.
            m = self.live[mig.request_id]
            tokens = m.req.prompt_tokens + int(m.generated)
            m.decode_from_s = max(m.decode_from_s, self._start_s(m.gpu_id, now_s) + self.setup.prefill_s(tokens))
        if plan.migrations and cost_migrations:
            self._cost_migrations(plan.migrations, now_s)
        self._terminate(plan.terminate_gpu_ids)

    def apply_plan_as_operated(self, plan: Plan, now_s: float) -> tuple[Migration, ...]:
        """Carry out the plan as kvfleet's operator and router would (module docstring); the moves made.

        The plan says where each request should be; where it is differs while its GPU's pod starts,
        while a move waits for that pod, and for a request that finishes where it is. Requests whose KV
        spans GPUs (larger than C) follow the plan as written: the live pool never moves them.
        """
        spanning = {sp.request_id for sp in plan.spans}
        # A worker that holds requests is not released (epoch.py: `holding`): its GPU drains first.
        let_go = [g for g in plan.terminate_gpu_ids if not self._holds(g)]
        self.draining.update(g for g in plan.terminate_gpu_ids if self._holds(g))
        self._release_pods(let_go, now_s)
        for gpu_id in list(self.unserved):  # oldest first, before the GPUs this plan activates
            if gpu_id in plan.terminate_gpu_ids or self._pod_for(gpu_id, now_s) is not None:
                del self.unserved[gpu_id]
        self._activate(plan.activate_gpu_ids, now_s)
        for pl in plan.placements:
            rid = pl.request_id
            m = self.live.get(rid)
            if m is None or m.routed:  # finished before the plan heard of it, or placed on arrival: moved
                continue           # like any request away from its plan's GPU (`_level_moves`)
            if m.gpu_id:  # a request whose tail passed C starts a new tail elsewhere: as planned
                del self.on_gpu[m.gpu_id][rid]
                self._run_on(m, rid, pl.gpu_id, now_s)
                continue
            self._route(m, pl.gpu_id, now_s)
        for mig in plan.migrations:
            if mig.request_id in spanning and mig.request_id in self.live \
                    and self.live[mig.request_id].gpu_id == mig.source_gpu_id:
                m = self.live[mig.request_id]
                del self.on_gpu[m.gpu_id][mig.request_id]
                self._run_on(m, mig.request_id, mig.target_gpu_id, now_s)
        moves, recomputes = self._level_moves(spanning, {p.request_id for p in plan.preemptions}, now_s)
        self._admit_queued(now_s)
        if moves:
            self._cost_migrations(tuple(mv for mv in moves if mv.source_gpu_id), now_s)
        for mv in recomputes:  # vLLM recompute (the baselines' preemption): the request re-prefills all it had
            m = self.live[mv.request_id]
            m.decode_from_s = max(m.decode_from_s, now_s + self.setup.prefill_s(m.req.prompt_tokens + int(m.generated)))
        self.policy.note_moved([mv.request_id for mv in moves], now_s)
        for gpu_id in sorted(self.draining):
            if not self._holds(gpu_id):
                self.draining.discard(gpu_id)
                self.on_gpu.pop(gpu_id, None)
                self._release_pods([gpu_id], now_s)
        self._terminate(g for g in plan.terminate_gpu_ids if g not in self.draining)
        return moves

    def _level_moves(self, spanning: set[str], preempted: set[str],
                     now_s: float) -> tuple[tuple[Migration, ...], tuple[Migration, ...]]:
        """The operator's level-triggered step (epoch.py `_moves`): every request away from where the plan
        holds it moves there, once that GPU's pod is Ready and unless it is finishing where it is.
        Returns the migrations made and, apart, the preemptions (recomputes) made."""
        moves: list[Migration] = []
        recomputes: list[Migration] = []
        for rid, m in list(self.live.items()):
            if rid in spanning or rid not in self.policy.item_of:  # not yet heard of (report_lag_epochs)
                continue
            want = self.policy.gpu_of(rid)
            if want == m.gpu_id or not self._ready(want, now_s):
                continue
            if m.gpu_id and self._finishing(m):
                continue
            if not self._has_room(want, m):
                continue
            if m.gpu_id:
                move = Migration(rid, m.gpu_id, want, m.reported_bytes, "preempt" if rid in preempted else "level")
                (recomputes if rid in preempted else moves).append(move)
                del self.on_gpu[m.gpu_id][rid]
            else:  # out of a queue, or let in by the router: it prefills where it lands, from now
                if self.queued.pop(rid) not in ("", want):  # from another worker's queue: a move without KV
                    moves.append(Migration(rid, "", want, 0, "level"))
                if self.prefix_spec is not None:
                    self._match_prefix(m, want)
                m.decode_from_s = max(m.decode_from_s, now_s + self.setup.prefill_s(m.prefill_tokens))
            self._run_on(m, rid, want, now_s)
        return tuple(moves), tuple(recomputes)

    def _admit_queued(self, now_s: float) -> None:
        """A worker's engine starts what waits in its queue, oldest first, as its KV frees, whatever the
        plan says (the operator then moves it like any request away from its GPU)."""
        for rid, gpu_id in list(self.queued.items()):
            m = self.live[rid]
            if gpu_id and self._ready(gpu_id, now_s) and self._has_room(gpu_id, m):
                del self.queued[rid]
                if self.prefix_spec is not None:
                    self._match_prefix(m, gpu_id)
                m.decode_from_s = max(m.decode_from_s, now_s + self.setup.prefill_s(m.prefill_tokens))
                self._run_on(m, rid, gpu_id, now_s)

    def _has_room(self, gpu_id: str, m: _Live) -> bool:
        """The operator moves a request only to a target with room for it now (epoch.py and
        migrations.admit_by_room): C less the KV of what runs there, one block kept back per running
        request for its growth."""
        running = len(self.on_gpu.get(gpu_id, {}))
        need = int(m.req.prompt_tokens + m.generated) * self.kv_bytes_per_token
        return self._running_kv_bytes(gpu_id) + running * self.block_bytes + need <= self.capacity_bytes

    def _running_kv_bytes(self, gpu_id: str) -> int:
        """The KV of the requests running on the GPU now: prompt and what each has generated so far."""
        return sum(int(self.live[r].req.prompt_tokens + self.live[r].generated)
                   for r in self.on_gpu.get(gpu_id, {})) * self.kv_bytes_per_token

    def _holds(self, gpu_id: str) -> bool:
        """Its worker runs or queues a request (and so reports it)."""
        return bool(self.on_gpu.get(gpu_id)) or gpu_id in self.queued.values()

    def _ready(self, gpu_id: str, now_s: float) -> bool:
        pod = self.pods.get(gpu_id)
        return pod is not None and pod.ready_s <= now_s

    def _final_bytes(self, m: _Live) -> int:
        """What the router reserves for a request: its prompt and whole output (kvfleet.router.placement)."""
        return (m.req.prompt_tokens + m.req.output_tokens) * self.kv_bytes_per_token

    def _free_bytes(self, now_s: float) -> dict[str, int]:
        """Each Ready worker's room as a router sees it: C less the whole size of each request it runs or
        queues there. One pass over the queue for every worker."""
        free = {g: self.capacity_bytes - sum(self._final_bytes(self.live[r]) for r in self.on_gpu.get(g, {}))
                for g in self.pods if self._ready(g, now_s)}
        for rid, g in self.queued.items():
            if g in free:
                free[g] -= self._final_bytes(self.live[rid])
        return free

    def route_arrivals(self, arrivals: list[Event], now_s: float) -> None:
        """The router places each new request as it comes, before a plan holds it (report_lag_epochs):
        where Allocate puts it on the last plan's state (the operator's routing table, which the router
        follows: worker-image/kvfleet/router/placement.py) if that worker is Ready with room, else as
        `_routed` does without a plan."""
        for event in arrivals:
            m = self.live[event.request_id]
            m.routed = True
            choice = allocate_on_snapshot(self.policy.snapshot(), m.reported_bytes, self.policy.cfg, self.policy.name)
            self._route(m, None if choice.new_gpu else choice.gpu_id, now_s)

    def _route(self, m: _Live, planned: str | None, now_s: float) -> None:
        """A new request where the router sends it (`_routed`), prefilling there what the GPU's prefix
        cache does not hold; or left in the queue `_routed` put it in."""
        where = self._routed(planned, m, now_s)
        if where is not None:
            if self.prefix_spec is not None:
                self._match_prefix(m, where)
            self._run_on(m, m.req.request_id, where, now_s)

    def _routed(self, planned: str | None, m: _Live, now_s: float) -> str | None:
        """Where the router sends a new request the plan put on `planned` (None: no plan holds it yet);
        None when it queues (in a worker's queue, or at the router while no worker is Ready:
        `self.queued` says which).

        The router counts each request it sent at its whole size (prompt + output), and sends a request
        only to a Ready worker with room for that: the plan's GPU if so, else the fullest Ready worker
        that has room (its Allocate on what it sees: worker-image/kvfleet/router/placement.py). With no
        room anywhere it queues at the plan's GPU if Ready, else at the roomiest Ready worker."""
        need = self._final_bytes(m)
        free = self._free_bytes(now_s)
        if planned is not None and free.get(planned, -1) >= need:
            return planned
        fitting = [(room, g) for g, room in free.items() if room >= need]
        if fitting:
            return min(fitting, key=lambda fg: fg[0])[1]  # ties: the pod held longest
        if planned is not None and planned in free:
            self.queued[m.req.request_id] = planned
        else:
            self.queued[m.req.request_id] = max(free, key=lambda g: free[g]) if free else ""
        return None

    def _finishing(self, m: _Live) -> bool:
        """Its worker would report it finishing: what it has left to write ends within two report intervals
        at the step its GPU decodes at now."""
        remaining = m.req.output_tokens - m.generated
        step_s = self.setup.step_s(len(self.on_gpu[m.gpu_id]), self._running_kv_bytes(m.gpu_id))
        return remaining * step_s <= FINISHING_INTERVALS * self.epoch_s

    def _activate(self, gpu_ids: Iterable[str], now_s: float) -> None:
        for gpu_id in gpu_ids:
            self.on_gpu.setdefault(gpu_id, {})
            gpu = self.policy.gpus.get(gpu_id)
            if gpu is not None:
                self.locations[gpu_id] = gpu.location
            if self._pod_for(gpu_id, now_s) is None:
                self.unserved[gpu_id] = None

    def _pod_for(self, gpu_id: str, now_s: float) -> _Pod | None:
        """The pod behind `gpu_id`: its own, else the last one released less than the delay ago
        (ready at once, already billed), else a new one, billed now and ready `scale_up_s` later;
        None at `max_workers` pods.

        Pods are interchangeable: a warm pod is a GPU slot, whatever the policy calls the GPU.
        """
        pod = self.pods.get(gpu_id)
        if pod is not None:
            return pod
        self._expire_warm(now_s)
        if self.warm:
            pod = self.warm.pop()
            pod.released_s = None
        elif self.max_workers is not None and len(self.pods) + len(self.warm) >= self.max_workers:
            return None
        else:
            pod = _Pod(created_s=now_s, ready_s=now_s + self.scale_up_s)
        self.pods[gpu_id] = pod
        return pod

    def _expire_warm(self, now_s: float) -> None:
        """Delete the warm pods released `scale_down_delay_s` or more before `now_s`, oldest first, down
        to the pool's floor (`min_workers` pods, held or warm)."""
        keep: list[_Pod] = []
        alive = len(self.pods) + len(self.warm)
        for pod in self.warm:
            assert pod.released_s is not None
            deleted_s = pod.released_s + self.scale_down_delay_s
            if deleted_s <= now_s and alive > self.min_workers:
                self.result.pod_lifetimes_s.append((pod.created_s, deleted_s))
                alive -= 1
            else:
                keep.append(pod)
        self.warm = keep

    def _release_pods(self, gpu_ids: Iterable[str], now_s: float) -> None:
        for gpu_id in gpu_ids:
            pod = self.pods.pop(gpu_id, None)
            if pod is not None:
                pod.released_s = now_s
                self.warm.append(pod)

    def close_pods(self, end_s: float) -> None:
        """At the end of the run: the GPUs still held are let go and every warm pod lingers its delay,
        but the floor's (`min_workers`), which live until the run ends: at `end_s`, or when the last
        other pod is deleted (a live replay's record ends when the pool has drained to its floor)."""
        self._release_pods(list(self.pods), end_s)
        self._expire_warm(end_s)
        floor = min(self.min_workers, len(self.warm))
        others = self.warm[:len(self.warm) - floor]  # released first, so deleted first
        last_s = end_s
        for pod in others:
            assert pod.released_s is not None
            last_s = max(last_s, pod.released_s + self.scale_down_delay_s)
            self.result.pod_lifetimes_s.append((pod.created_s, pod.released_s + self.scale_down_delay_s))
        self.result.pod_lifetimes_s.extend((pod.created_s, last_s) for pod in self.warm[len(others):])
        self.warm = []

    def _run_on(self, m: _Live, request_id: str, gpu_id: str, now_s: float) -> None:
        m.gpu_id = gpu_id
        self.on_gpu.setdefault(gpu_id, {})[request_id] = None
        # A request cannot run on a pod that is still starting: one that never decoded prefills
        # there once it is ready, a moved one resumes then. (Only a pod not ready *now* pushes it:
        # with scale_up_s=0 decode_from_s is left alone and the replay is the one without pods.)
        pod = self._pod_for(gpu_id, now_s)
        # No pod (at max_workers; only a request larger than C is sent to such a GPU, as planned): taken
        # as one that starts now, a simplification for a case the live pool refuses anyway.
        ready_s = now_s + self.scale_up_s if pod is None else pod.ready_s
        if ready_s > now_s:
            if m.last_decoded_s is None and m.generated == 0:
                ready_s += self.setup.prefill_s(m.prefill_tokens)
            m.decode_from_s = max(m.decode_from_s, ready_s)
        if self.prefix_spec is not None:
            self._bound_prefix_cache(gpu_id)  # before the next request placed here looks its prefix up

    def _start_s(self, gpu_id: str, now_s: float) -> float:
        """When work sent to `gpu_id` now can begin: now, or when its pod is ready."""
        pod = self.pods.get(gpu_id)
        return now_s if pod is None or pod.ready_s <= now_s else pod.ready_s

    def _cost_migrations(self, migrations: tuple[Migration, ...], now_s: float) -> None:
        """Charge each migration the transfer the §V planner picks: KV over its link, or a re-prefill.

        A token transfer also delays the request's decoding by its re-prefill.
        """
        sched = plan_migrations(
            migrations,
            lambda gid: self.locations.get(gid) or self.policy.gpus[gid].location,
            self.kv_bytes_per_token,
            self.boundaries,
        )
        setup = self.setup
        for cm in sched.kv:
            link_bw = setup.intra_node_bytes_per_s if cm.link_id.startswith("intra:") else setup.inter_node_bytes_per_s
            self.result.migration_time_s += cm.migration.size_bytes / link_bw
        for cm in sched.token:
            secs = setup.prefill_s(cm.num_tokens)
            self.result.migration_time_s += secs
            m = self.live.get(cm.migration.request_id)
            if m is not None:  # None: moved without batching, then finished within the epoch
                m.decode_from_s = max(m.decode_from_s, self._start_s(m.gpu_id, now_s) + secs)
        self.result.num_kv_transfers += len(sched.kv)
        self.result.num_token_transfers += len(sched.token)
        self.result.num_deferred += len(sched.deferred)

    def _terminate(self, gpu_ids: Iterable[str]) -> None:
        for gpu_id in gpu_ids:
            if self.on_gpu.pop(gpu_id, None):
                raise AssertionError(f"plan terminates {gpu_id} while requests run on it")

    def record_epoch(self, plan: Plan, now_s: float, moves: tuple[Migration, ...] | None = None) -> None:
        """Append this epoch's GPUs, actual KV and fluid lower bound, and add up the moves made: the
        plan's, or `moves` where the replay made others (execution="operator")."""
        migrations = plan.migrations if moves is None else moves
        c = self.capacity_bytes
        heads = {sp.request_id: len(sp.gpu_ids) - 1 for sp in plan.spans}
        total_kv = 0
        for rids in self.on_gpu.values():
            kv_on_gpu = 0
            for r in rids:
                kv_r = int(self.live[r].req.prompt_tokens + self.live[r].generated) * self.kv_bytes_per_token
                total_kv += kv_r
                # A request larger than C has whole chunks of C on head GPUs; only its tail is here.
                kv_on_gpu += kv_r - heads.get(r, 0) * c
            if kv_on_gpu > c:
                self.result.num_capacity_violations += 1
        result = self.result
        result.times_s.append(now_s)
        result.gpus.append(self.policy.num_gpus() + len(self.draining))
        result.kv_bytes.append(total_kv)
        result.lower_bound.append(math.ceil(total_kv / c))
        result.migrations_per_epoch.append(len(migrations))
        result.num_migrations += len(migrations)
        result.migrated_bytes += sum(mg.size_bytes for mg in migrations)
        result.num_preemptions += len(plan.preemptions)
        result.num_spanning = max(result.num_spanning, len(plan.spans))
        result.max_moves_per_operation = max(result.max_moves_per_operation, *plan.moves_per_operation, 0)
        result.num_moves_cancelled += plan.num_moves_cancelled
        result.num_item_moves += sum(plan.moves_per_operation)
        if self.prefix_spec is not None:
            self._measure_sharing()

    def _measure_sharing(self) -> None:
        """What counting shared prompt blocks once would save this epoch (the replay counts each running
        request's whole prompt): the tokens of hash blocks that two or more running requests hold on the
        same GPU, beyond the largest copy, and the same over the whole pool (the most any placement could
        share). Summed over epochs beside the running prompt tokens, for the time-averaged ratios.

        It runs every epoch, so blocks are counted in bulk (a GPU whose blocks are all distinct, most of
        them, needs no count) and only those held more than once are looked up again for their tokens."""
        running: list[TraceRequest] = []
        same_gpu = 0
        for rids in self.on_gpu.values():
            reqs = [self.live[r].req for r in rids]
            running += reqs
            blocks = list(chain.from_iterable(req.hash_ids for req in reqs))
            if len(set(blocks)) < len(blocks):
                same_gpu += self._second_copies(Counter(blocks), reqs)
        result = self.result
        result.running_prompt_tokens += sum(req.prompt_tokens for req in running)
        result.shared_same_gpu_tokens += same_gpu
        result.shared_pool_tokens += self._second_copies(Counter(chain.from_iterable(req.hash_ids for req in running)),
                                                         running)

    def _second_copies(self, counts: Counter[int], reqs: list[TraceRequest]) -> int:
        """Tokens of every copy of a block beyond its largest, among `reqs` (`counts`: each hash's copies)."""
        shared = {h for h, n in counts.items() if n > 1}
        if not shared:
            return 0
        copies: dict[int, list[int]] = {}
        for req in reqs:
            blocks = self._prompt_blocks_by_hash(req)
            for hash_id in shared.intersection(blocks):
                copies.setdefault(hash_id, []).extend(blocks[hash_id])
        return sum(sum(c) - max(c) for c in copies.values())

    def _prompt_blocks_by_hash(self, req: TraceRequest) -> dict[int, tuple[int, ...]]:
        """`_prompt_block_tokens` by hash id (a hash a prompt repeats has a copy per place), once per request."""
        by_hash = self._blocks_by_hash.get(req.request_id)
        if by_hash is None:
            lists: dict[int, list[int]] = {}
            for hash_id, tokens in zip(req.hash_ids, self._prompt_block_tokens(req)):
                lists.setdefault(hash_id, []).append(tokens)
            by_hash = self._blocks_by_hash[req.request_id] = {h: tuple(t) for h, t in lists.items()}
        return by_hash
