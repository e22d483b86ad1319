"""A disaggregated prefill/decode pool, replayed: how many prefill and decode GPUs a trace needs.

Colocated serving (run.py) prefills and decodes on the same GPUs. Disaggregated serving splits them:
P prefill GPUs compute prompts, then send each prompt's KV to one of D decode GPUs, which generate
the output. What that costs and buys depends on what each role caches, which is what MemServe
("MemServe: Flexible Mem Pool for Building Disaggregated LLM Serving with Caching", §5.1) builds up in
four designs, modelled here as four `PdCaching` modes over the traces' prompt block hashes
(`TraceRequest.hash_ids`, matched per GPU by kvfleet.sim.prefix_cache as in colocated runs):

* `none` (PD-Basic): no cache; P sends the whole prompt's KV.
* `prefill` (PD-Caching-1): P keeps each prompt's KV once its prefill is done (§5.1 step 2), so a
  later prompt sharing its leading blocks prefills only the rest; D caches nothing, so P still sends
  the whole prompt's KV.
* `decode` (PD-Caching-2): as `prefill`, and D keeps a finished request's KV (its prompt and the
  answer it wrote): P sends only the blocks the chosen decode GPU does not hold.
* `full` (PD-Caching-3): as `decode`, and D sends the decode phase's KV (the answer) back to the
  prefill GPU when the request ends (§5.1 step 5), so a conversation's next turn prefills only its
  new tokens.

The prefill side is a queue per GPU: a prompt arrives, the global scheduler picks the prefill GPU
that minimises its queued prefill time plus this prompt's uncached prefill time (MemServe §5.3.1, Eq.
1, with exec(x, y) the setup's prefill time of the uncached tokens), ties to the most cached prefix
(§6's prompt trees, one per role), and the GPU prefills one prompt after another. With the setup's
compute-bound prefill (time linear in tokens) batching prompts would not finish them sooner, so one
at a time is the same throughput. The decode side is the colocated replay's machinery (run.py's
`_Replay`): a prompt whose prefill has ended is packed onto the decode GPUs by the policy (the default
MELL policy) by its KV bytes, decodes at the setup's step time for its GPU's batch, grows, finishes
and may be migrated as in a colocated run. Two differences: the pool has D GPUs, so a prefilled
request waits (its KV held at P) until the policy can place it within D (a trial of the epoch's plan
on a copy of the policy: the core has no GPU cap of its own), and requests that outgrow D GPUs are
preempted and recompute their KV, as a full vLLM engine does; and placing a request starts its KV
transfer, bytes / link speed, before it can decode.

The trace hashes prompts only, so an answer's blocks have no ids. A conversation's next turn repeats
its previous prompt and answer, so `answer_blocks` names them from the trace: the first later prompt
that extends a request's whole prompt blocks and is long enough to hold its answer is taken to be its
next turn, and the blocks of that prompt the answer completes are the answer's. Pure and
deterministic, like the rest of kvfleet.sim.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvfleet.mell.cluster import ClusterPolicy, PolicyConfig
from kvfleet.mell.models import Arrive, Event, EventBatch, Finish, Plan
from kvfleet.mell.policy import make_policy, policy_config
from kvfleet.sim.prefix_cache import GpuPrefixCache, PrefixCacheSpec
from kvfleet.sim.result import nearest_rank
from kvfleet.sim.run import _Live, _Replay, merge_plans, migration_boundaries
from kvfleet.sim.speed_model import Setup
from kvfleet.sim.traces import DEFAULT_HASH_BLOCK_TOKENS, TraceRequest

# One 200 Gb/s NIC per GPU: what an NVIDIA DGX A100 gives each of its eight A100s for compute traffic
# (eight single-port ConnectX-6 HDR InfiniBand adapters, DGX A100 datasheet), at line rate.
DEFAULT_LINK_GBPS = 200.0


class PdCaching(StrEnum):
    """What each role caches (MemServe §5.1, Table 4): see the module docstring."""

    NONE = "none"  # PD-Basic
    PREFILL = "prefill"  # PD-Caching-1
    DECODE = "decode"  # PD-Caching-2
    FULL = "full"  # PD-Caching-3

    @property
    def caches_at_prefill(self) -> bool:
        return self is not PdCaching.NONE

    @property
    def caches_at_decode(self) -> bool:
        return self in (PdCaching.DECODE, PdCaching.FULL)

    @property
    def returns_decode_kv(self) -> bool:
        return self is PdCaching.FULL


_SPLIT = re.compile(r"(\d+)P(\d+)D", re.IGNORECASE)


@dataclass(frozen=True)
class PdSplit:
    """How many prefill and decode GPUs a disaggregated pool has: `1P2D` is one and two."""

    prefill_gpus: int
    decode_gpus: int

    def __post_init__(self) -> None:
        if self.prefill_gpus < 1 or self.decode_gpus < 1:
            raise ValueError(f"{self.name}: a disaggregated pool needs at least one prefill and one decode GPU")

    @property
    def name(self) -> str:
        return f"{self.prefill_gpus}P{self.decode_gpus}D"

    @property
    def total_gpus(self) -> int:
        return self.prefill_gpus + self.decode_gpus

    @classmethod
    def parse(cls, text: str) -> PdSplit:
        match = _SPLIT.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not a split like 1P2D (prefill GPUs, then decode GPUs)")
        return cls(int(match.group(1)), int(match.group(2)))


# A run of hash blocks: their ids and the tokens each holds, in prompt order.
Blocks = tuple[tuple[int, ...], tuple[int, ...]]


def prompt_blocks(req: TraceRequest, spec: PrefixCacheSpec) -> Blocks:
    return req.hash_ids, tuple(spec.block_tokens(req.prompt_tokens, len(req.hash_ids)))


def answer_blocks(requests: Sequence[TraceRequest], spec: PrefixCacheSpec) -> dict[str, tuple[int, ...]]:
    """The hash ids of the whole blocks each request's answer completes, named by its next turn.

    A request with prompt P and answer N tokens holds, when it ends, the KV of P + N tokens: whole
    blocks w = P // B of its prompt, then blocks w .. c - 1 with c = (P + N) // B that the answer
    completes (block w begins with the prompt's last partial block, if any). Its next turn is taken to
    be the first later request whose hash_ids begin with those w blocks, has at least P + N prompt
    tokens (it repeats the prompt and the answer) and, where the prompt ends in a partial block, a
    different id for block w (a next turn rewrites that block; the same id is the same partial text,
    a repeat). Its blocks w .. c - 1 are the answer's. A request with no whole prompt block (w = 0)
    or whose hash_ids do not cover its whole blocks is given none: nothing identifies its
    conversation. Two conversations that share only whole blocks of a common prefix (a system prompt)
    cannot be told apart: the first later one is taken, which can credit an answer to another
    conversation (docs/simulator.md, "Disaggregated pools").
    """
    block = spec.hash_block_tokens
    # A trie over hash ids: node -> child per id; per node the indices of the requests through it.
    children: list[dict[int, int]] = [{}]
    through: list[list[int]] = [[]]
    ordered = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    rank = {i: r for r, i in enumerate(ordered)}
    for i in ordered:
        node = 0
        for hash_id in requests[i].hash_ids:
            nxt = children[node].get(hash_id)
            if nxt is None:
                nxt = len(children)
                children[node][hash_id] = nxt
                children.append({})
                through.append([])
            node = nxt
            through[node].append(rank[i])
    out: dict[str, tuple[int, ...]] = {}
    for i in ordered:
        req = requests[i]
        whole = req.prompt_tokens // block
        ends = (req.prompt_tokens + req.output_tokens) // block
        if whole == 0 or ends == whole or len(req.hash_ids) < whole:
            continue
        node = 0
        for hash_id in req.hash_ids[:whole]:
            node = children[node][hash_id]
        later = through[node]
        partial = req.hash_ids[whole] if len(req.hash_ids) > whole else None
        for r in later[bisect.bisect_right(later, rank[i]):]:
            turn = requests[ordered[r]]
            if (turn.prompt_tokens >= req.prompt_tokens + req.output_tokens and len(turn.hash_ids) > whole
                    and turn.hash_ids[whole] != partial):
                out[req.request_id] = turn.hash_ids[whole:ends]
                break
    return out


def context_blocks(req: TraceRequest, spec: PrefixCacheSpec, answer: tuple[int, ...]) -> Blocks:
    """A finished request's KV as hash blocks: its whole prompt blocks, the answer's blocks, then the
    prompt's partial last block (least recent: only a repeat of the same prompt finds it)."""
    ids, tokens = prompt_blocks(req, spec)
    whole = req.prompt_tokens // spec.hash_block_tokens
    block = spec.hash_block_tokens
    return (ids[:whole] + answer + ids[whole:],
            tokens[:whole] + (block,) * len(answer) + tokens[whole:])


@dataclass
class _PrefillGpu:
    """One prefill GPU: its queue (when it is free again), its prompt cache, and the blocks on their
    way into that cache (a prefill that has not ended yet, a decode GPU's answer on the wire)."""

    index: int
    cache: GpuPrefixCache
    busy_until_s: float = 0.0
    busy_s: float = 0.0
    incoming: list[tuple[float, int, Blocks]] = field(default_factory=list)  # a heap: (at, seq, blocks)


@dataclass(frozen=True)
class _Prefilled:
    """Where and when a request's prefill ran, and what it found cached there."""

    gpu_index: int
    start_s: float
    done_s: float
    hit_tokens: int


class _PrefillPool:
    """P prefill GPUs, each a FIFO queue of prefills with a prompt cache (when the mode caches at P)."""

    def __init__(self, num_gpus: int, setup: Setup, spec: PrefixCacheSpec, caching: PdCaching) -> None:
        self.setup = setup
        self.spec = spec
        self.caching = caching
        self.gpus = [_PrefillGpu(i, GpuPrefixCache(setup.kv_bytes_per_token)) for i in range(num_gpus)]
        self.hit_tokens = 0
        self.evictions = 0
        self._seq = 0

    def deliver(self, gpu_index: int, at_s: float, blocks: Blocks) -> None:
        """Blocks that enter a prefill GPU's cache at `at_s` (§4.1 `insert`, or §4.3 transfer_with_insert)."""
        if not self.caching.caches_at_prefill or not blocks[0]:
            return
        self._seq += 1
        heapq.heappush(self.gpus[gpu_index].incoming, (at_s, self._seq, blocks))

    def _catch_up(self, gpu: _PrefillGpu, until_s: float) -> None:
        """Insert what reached `gpu` by `until_s`; the cache may then fill all of C (no prefill holds KV
        between prefills, and the next one makes room for itself in `assign`)."""
        while gpu.incoming and gpu.incoming[0][0] <= until_s:
            _, _, (ids, tokens) = heapq.heappop(gpu.incoming)
            gpu.cache.insert(ids, tokens)
            self.evictions += gpu.cache.evict_to(self.setup.capacity_bytes)

    def assign(self, req: TraceRequest) -> _Prefilled:
        """Route a prompt at its arrival (MemServe §5.3.1 Eq. 1: least queued prefill time plus its own
        uncached prefill time, ties to the longest cached prefix, then the lowest index) and queue it."""
        ids, tokens = prompt_blocks(req, self.spec)
        use_cache = self.caching.caches_at_prefill and bool(ids)
        best: tuple[float, int, int] | None = None
        for gpu in self.gpus:
            hit = 0
            if use_cache:
                self._catch_up(gpu, req.arrival_s)
                hit = gpu.cache.peek(ids, tokens)
            cost = max(0.0, gpu.busy_until_s - req.arrival_s) + self.setup.prefill_s(max(1, req.prompt_tokens - hit))
            key = (cost, -hit, gpu.index)
            if best is None or key < best:
                best = key
        assert best is not None
        gpu = self.gpus[best[2]]
        start_s = max(req.arrival_s, gpu.busy_until_s)
        hit = 0
        if use_cache:
            # The engine matches when the prefill starts: what the prefills queued before it inserted is there.
            self._catch_up(gpu, start_s)
            hit = gpu.cache.match(ids, tokens)
        prefill_tokens = max(1, req.prompt_tokens - hit)
        # The prompt's uncached KV is active while it prefills; history gives way to it (MemServe §4).
        self.evictions += gpu.cache.evict_to(max(0, self.setup.capacity_bytes - prefill_tokens * self.setup.kv_bytes_per_token))
        prefill_s = self.setup.prefill_s(prefill_tokens)
        done_s = start_s + prefill_s
        gpu.busy_until_s = done_s
        gpu.busy_s += prefill_s
        self.hit_tokens += hit
        self.deliver(gpu.index, done_s, (ids, tokens))  # PD-Caching-1: the prompt's KV stays at P
        return _Prefilled(gpu.index, start_s, done_s, hit)


@dataclass(frozen=True)
class _Handoff:
    """A request waiting for a decode GPU: prefilled (its KV still at P), or preempted by a decode GPU
    (`resume`: its decode state; its KV is gone, it recomputes it where it is placed next)."""

    req: TraceRequest
    prefilled: _Prefilled
    resume: _Live | None = None


class _DecodeReplay(_Replay):
    """The decode GPUs: run.py's replay, fed by the prefill pool, capped at D GPUs, with KV transfers.

    Pods stand for the D physical GPUs: never deleted (an infinite scale-down delay), ready at once,
    each keeping its cache while the policy leaves its GPU idle, and given to the next GPU it activates.
    """

    def __init__(
        self, setup: Setup, policy: ClusterPolicy, epoch_s: float, lookahead_epochs: float, spec: PrefixCacheSpec,
        caching: PdCaching, link_bytes_per_s: float, max_gpus: int, answers: dict[str, tuple[int, ...]],
        prefill: _PrefillPool,
    ) -> None:
        super().__init__([], setup, policy, epoch_s, lookahead_epochs, 0.0, math.inf, spec)
        self.spec = spec
        self.caching = caching
        self.link_bytes_per_s = link_bytes_per_s
        self.max_gpus = max_gpus
        self.answers = answers
        self.prefill = prefill
        self.prefilling: list[tuple[float, int, _Handoff]] = []  # a heap by the end of the prefill
        self.queue: list[_Handoff] = []  # prefilled, waiting for room, in the order the prefills ended
        self.handoffs: dict[str, _Handoff] = {}
        self.finished_s: dict[str, float] = {}
        self._seq = 0
        self.transfer_bytes = 0
        self.return_bytes = 0
        self.decode_hit_tokens = 0
        self.over_cap_epochs = 0
        self.num_preemptions = 0
        self.decode_waits_s: list[float] = []

    def has_work(self) -> bool:
        return bool(self.live or self.queue or self.prefilling)

    def hand_off(self, req: TraceRequest, prefilled: _Prefilled) -> None:
        self._seq += 1
        heapq.heappush(self.prefilling, (prefilled.done_s, self._seq, _Handoff(req, prefilled)))

    def admit_and_schedule(self, events: list[Event], now_s: float) -> Plan:
        """Schedule the epoch with as many of the waiting requests, first come first, as the policy can
        place on at most D GPUs; apply that plan; preempt what growth pushed past D.

        The policy knows no GPU cap, so each try schedules a copy of it and the copy that fits is kept
        (more waiting requests need no fewer GPUs, so the most that fit are found by bisection). A
        request that does not fit even in an empty pool is placed anyway (and counted in
        `over_cap_epochs` while the pool holds more than D GPUs).
        """
        while self.prefilling and self.prefilling[0][0] <= now_s:
            self.queue.append(heapq.heappop(self.prefilling)[2])
        if self.queue:
            trial, plan = self._try(events, len(self.queue), now_s)
            admitted = len(self.queue)
            if trial.num_gpus() > self.max_gpus:
                low, high = 0, len(self.queue) - 1  # the most that fit lie in [low, high]
                best = self._try(events, 0, now_s)
                while low < high:
                    mid = (low + high + 1) // 2
                    candidate = self._try(events, mid, now_s)
                    if candidate[0].num_gpus() <= self.max_gpus:
                        low, best = mid, candidate
                    else:
                        high = mid - 1
                admitted = low
                if admitted == 0 and not self.live:
                    best, admitted = self._try(events, 1, now_s), 1
                trial, plan = best
            self.policy = trial
            for handoff in self.queue[:admitted]:
                self._admit(handoff, now_s)
            del self.queue[:admitted]
        else:
            plan = self.policy.schedule(EventBatch(now_s, tuple(events)))
        self.apply_plan(plan, now_s)
        extra = self.policy.num_gpus() - self.max_gpus
        if extra > 0 and len(self.live) > 1:
            preempted = self._preempt(extra, now_s)
            if preempted is not None:
                plan = merge_plans(now_s, [plan, preempted])
        if self.policy.num_gpus() > self.max_gpus:
            self.over_cap_epochs += 1
        return plan

    def _try(self, events: list[Event], count: int, now_s: float) -> tuple[ClusterPolicy, Plan]:
        trial = copy.deepcopy(self.policy)
        arrivals = [Arrive(h.req.request_id, self._waiting_bytes(h)) for h in self.queue[:count]]
        return trial, trial.schedule(EventBatch(now_s, (*events, *arrivals)))

    def _waiting_bytes(self, handoff: _Handoff) -> int:
        m = handoff.resume
        return self.reservation_bytes(handoff.req.prompt_tokens + (0.0 if m is None else m.generated))

    def _preempt(self, extra: int, now_s: float) -> Plan | None:
        """The pool has D GPUs: when requests grew past them (the policy moved some to GPUs beyond D; it
        never preempts), the requests of the `extra` least loaded GPUs are preempted, as vLLM's decode
        engine preempts when it runs out of KV blocks: they leave the policy, lose their KV (even one
        whose transfer had not ended) and wait at the head of the queue; placed again, they recompute
        their prompt and the tokens they wrote there. None where those GPUs hold only the leading parts
        of a request larger than C (it stays; the epoch counts as over the cap)."""
        gpus = sorted((g for g in self.policy.gpus.values() if not g.idle), key=lambda g: (g.load_bytes, g.gpu_id))
        victims = [rid for g in gpus[:extra] for rid in self.on_gpu.get(g.gpu_id, {})]
        if not victims:
            return None
        resumed: list[_Handoff] = []
        for rid in victims:
            m = self.live.pop(rid)
            del self.on_gpu[m.gpu_id][rid]
            m.gpu_id = ""
            resumed.append(_Handoff(m.req, self.handoffs[rid].prefilled, resume=m))
        self.num_preemptions += len(victims)
        self.queue[:0] = resumed
        plan = self.policy.schedule(EventBatch(now_s, tuple(Finish(rid) for rid in victims)))
        self.apply_plan(plan, now_s)
        return plan

    def _admit(self, handoff: _Handoff, now_s: float) -> None:
        req = handoff.req
        m = handoff.resume
        if m is None:
            # Its transfer starts where the plan places it (now), so decoding waits for that (`_match_prefix`).
            m = _Live(req, "", now_s, not_before_s=now_s, prefill_tokens=req.prompt_tokens - handoff.prefilled.hit_tokens)
            m.earliest_decode_s = now_s
            self.decode_waits_s.append(now_s - handoff.prefilled.done_s)
        m.not_before_s = now_s
        m.reported_bytes = self._waiting_bytes(handoff)
        if m.reported_bytes > self.capacity_bytes:
            self._count_over_capacity(req.request_id)
        self.live[req.request_id] = m
        self.handoffs[req.request_id] = handoff

    def _match_prefix(self, m: _Live, gpu_id: str) -> None:
        """Where the policy first places a request, P sends the prompt KV the decode GPU lacks (all of
        it unless the mode caches at D) and the request decodes once it has arrived."""
        req = m.req
        if self.handoffs[req.request_id].resume is not None:
            # Preempted: its KV is gone; it recomputes the prompt and what it wrote where it lands.
            m.decode_from_s = m.not_before_s + self.setup.prefill_s(req.prompt_tokens + int(m.generated))
            return
        hit = 0
        pod = self.pods.get(gpu_id)
        if self.caching.caches_at_decode and req.hash_ids and pod is not None and pod.prefix_cache is not None:
            hit = pod.prefix_cache.match(*prompt_blocks(req, self.spec))
        sent_bytes = (req.prompt_tokens - hit) * self.kv_bytes_per_token
        self.decode_hit_tokens += hit
        self.transfer_bytes += sent_bytes
        result = self.result
        result.prompt_tokens += req.prompt_tokens
        m.decode_from_s = m.not_before_s + sent_bytes / self.link_bytes_per_s
        m.earliest_decode_s = m.decode_from_s

    def _record_finish(self, m: _Live, before: float, step: float, begin_s: float, busy_s: float) -> float:
        finish_s = super()._record_finish(m, before, step, begin_s, busy_s)
        self.finished_s[m.req.request_id] = finish_s
        return finish_s

    def _keep_prefix(self, m: _Live) -> None:
        """A finished request's KV stays at its decode GPU (PD-Caching-2) and, in the full mode, its
        answer goes back to the prefill GPU that computed its prompt (PD-Caching-3)."""
        req = m.req
        if not self.caching.caches_at_decode or not req.hash_ids:
            return
        blocks = context_blocks(req, self.spec, self.answers.get(req.request_id, ()))
        pod = self.pods[m.gpu_id]
        if pod.prefix_cache is None:
            pod.prefix_cache = GpuPrefixCache(self.kv_bytes_per_token)
        pod.prefix_cache.insert(*blocks)
        if self.caching.returns_decode_kv:
            sent_bytes = req.output_tokens * self.kv_bytes_per_token
            self.return_bytes += sent_bytes
            arrive_s = self.finished_s[req.request_id] + sent_bytes / self.link_bytes_per_s
            self.prefill.deliver(self.handoffs[req.request_id].prefilled.gpu_index, arrive_s, blocks)


@dataclass(frozen=True)
class DisaggResult:
    """What one disaggregated run reports. Per-request lists are in the order requests finished."""

    split: PdSplit
    caching: PdCaching
    policy: str
    link_bytes_per_s: float
    epoch_s: float
    num_requests: int
    duration_s: float  # until the last request finished, in whole epochs
    decode_gpus: tuple[int, ...]  # decode GPUs the policy held at each epoch end
    decode_over_cap_epochs: int  # epochs whose plan held more than D decode GPUs
    decode_preemptions: int  # requests a full decode pool preempted (they recompute their KV)
    prefill_busy_s: float  # seconds the prefill GPUs computed, all together
    ttfts_s: tuple[float, ...]  # arrival to the end of the first decode step
    jcts_s: tuple[float, ...]  # arrival to the last token
    tpots_s: tuple[float, ...]
    decode_waits_s: tuple[float, ...]  # end of the prefill to placement on a decode GPU
    transfer_bytes: int  # prompt KV sent from prefill to decode GPUs
    return_bytes: int  # answer KV sent back from decode to prefill GPUs (full)
    prompt_tokens: int
    prefill_hit_tokens: int
    decode_hit_tokens: int
    prefill_evictions: int
    decode_evictions: int
    num_migrations: int
    capacity_violations: int

    @property
    def decode_gpus_peak(self) -> int:
        return max(self.decode_gpus, default=0)

    @property
    def decode_gpus_mean(self) -> float:
        return sum(self.decode_gpus) / len(self.decode_gpus) if self.decode_gpus else 0.0

    @property
    def busy_gpu_s(self) -> float:
        """GPU-seconds at work: prefill time on P plus decode GPU-epochs the policy held."""
        return self.prefill_busy_s + sum(self.decode_gpus) * self.epoch_s

    @property
    def held_gpu_s(self) -> float:
        """GPU-seconds the pool holds: P + D GPUs for the whole run (a provisioned pool is billed whole)."""
        return self.split.total_gpus * self.duration_s

    @property
    def prefill_utilization(self) -> float:
        return self.prefill_busy_s / (self.split.prefill_gpus * self.duration_s) if self.duration_s else 0.0

    @property
    def mean_transfer_bytes(self) -> float:
        return self.transfer_bytes / self.num_requests if self.num_requests else 0.0

    @property
    def ttft_mean_s(self) -> float:
        return _mean(self.ttfts_s)

    @property
    def ttft_p99_s(self) -> float:
        return nearest_rank(self.ttfts_s, 99)

    @property
    def jct_mean_s(self) -> float:
        return _mean(self.jcts_s)

    @property
    def jct_p99_s(self) -> float:
        return nearest_rank(self.jcts_s, 99)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def simulate_disaggregated(
    requests: Sequence[TraceRequest],
    setup: Setup,
    split: PdSplit,
    caching: PdCaching = PdCaching.NONE,
    link_bytes_per_s: float = DEFAULT_LINK_GBPS * 1e9 / 8,
    policy_name: str = "mell",
    epoch_s: float = 1.0,
    config: PolicyConfig | None = None,
    lookahead_epochs: float = 1.0,
    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS,
    on_epoch: Callable[[int], None] | None = None,
) -> DisaggResult:
    """Replay `requests` on `split.prefill_gpus` prefill and `split.decode_gpus` decode GPUs of `setup`.

    Each epoch: the decode GPUs decode (finished requests leave, their KV cached per the mode), running
    requests report growth, the epoch's arrivals are routed to prefill GPUs and queued (each at its own
    arrival time), then the requests whose prefill has ended are placed on decode GPUs as far as D
    GPUs allow (the policy's plan for the epoch) and their KV transfers start.
    """
    if epoch_s <= 0:
        raise ValueError("epoch_s must be positive")
    if not link_bytes_per_s > 0:
        raise ValueError("link_bytes_per_s must be positive")
    spec = PrefixCacheSpec(hash_block_tokens)
    cfg = config or policy_config(policy_name, setup.capacity_bytes)
    bounds = migration_boundaries(setup, epoch_s)
    cfg = cfg.within_link_budgets(bounds.intra_node_link_bytes, bounds.inter_node_link_bytes)
    answers = answer_blocks(requests, spec) if caching.caches_at_decode else {}
    prefill = _PrefillPool(split.prefill_gpus, setup, spec, caching)
    decode = _DecodeReplay(setup, make_policy(policy_name, cfg), epoch_s, lookahead_epochs, spec, caching,
                           link_bytes_per_s, split.decode_gpus, answers, prefill)
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
    next_arrival = 0
    now_s = 0.0
    epoch = 0
    while next_arrival < len(pending) or decode.has_work():
        epoch += 1
        start_s, now_s = now_s, epoch * epoch_s
        events = decode.decode_epoch(start_s, now_s)
        events += decode.report_growth()
        while next_arrival < len(pending) and pending[next_arrival].arrival_s < now_s:
            req = pending[next_arrival]
            next_arrival += 1
            decode.hand_off(req, prefill.assign(req))
        plan = decode.admit_and_schedule(events, now_s)
        decode.record_epoch(plan, now_s)
        if on_epoch is not None:
            on_epoch(epoch)
    r = decode.result
    return DisaggResult(
        split=split, caching=caching, policy=decode.policy.name, link_bytes_per_s=link_bytes_per_s, epoch_s=epoch_s,
        num_requests=len(pending), duration_s=r.duration_s, decode_gpus=tuple(r.gpus),
        decode_over_cap_epochs=decode.over_cap_epochs, decode_preemptions=decode.num_preemptions,
        prefill_busy_s=sum(g.busy_s for g in prefill.gpus),
        ttfts_s=tuple(r.ttfts_s), jcts_s=tuple(r.jcts_s), tpots_s=tuple(r.tpots_s),
        decode_waits_s=tuple(decode.decode_waits_s), transfer_bytes=decode.transfer_bytes,
        return_bytes=decode.return_bytes, prompt_tokens=r.prompt_tokens, prefill_hit_tokens=prefill.hit_tokens,
        decode_hit_tokens=decode.decode_hit_tokens, prefill_evictions=prefill.evictions,
        decode_evictions=r.num_prefix_evictions, num_migrations=r.num_migrations,
        capacity_violations=r.num_capacity_violations,
    )
