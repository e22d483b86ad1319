"""kvfleet's default policy (`mell`): MELL's epochs, batching and migration, with a consolidating packer.

MELL's Fig. 10 (mell_paper.py, the `mell-paper` policy) places each request by its size class, so that a
bounded number of GPUs is ever partly full (Theorem 1). Measured on the paper's own workloads
(docs/mell.md, bench/policies.py) that is not enough to beat plain best-fit: the newest T/S/M GPUs
stay partly filled, class changes of growing requests cause moves, and at the scale of real traces
(4-16 GPUs) one or two partly filled GPUs are the whole difference. This policy keeps everything of
MELL that pays (epochs, request operation batching §VI-C, the §V migration planner and boundaries,
DistAttention spans for requests larger than C, all in cluster.py) and replaces the placement rules:

1. Allocate (batched): an epoch's arrivals are placed largest first (best-fit decreasing, which packs
   a batch better than arrival order), each on the fullest GPU that holds it with growth headroom
   left, else the fullest that holds it at all, and only else on a new GPU.
2. Update: a request grows in place. A GPU whose reservations pass its capacity sheds the fewest
   requests that bring it back under capacity less headroom (one request when one suffices, the
   smallest such), each to the emptiest GPU that holds it with headroom (room to grow), else as in 1.
3. Consolidate: at the end of the epoch, the least loaded GPU is emptied when the other GPUs can take
   every request on it with headroom left.
4. Only moves the links carry: every move (and every GPU started for one) fits the epoch's §V
   communication boundary of its link, and no request moves twice in an epoch (so the link a move is
   charged to is the one its copy takes): no migration is ever deferred. When no link can carry any
   request of an overloaded GPU, the smallest that clears it is recomputed elsewhere (a preemption).
5. Objective: with a TPOT objective, no GPU is packed past the load at which its decode step would
   break it (`MellDefaultConfig.max_load_bytes` and `load_bytes_per_request`). A span's tail GPU
   counts the span's heads too: its step attends over the request's whole KV (Infinite-LLM §4.2's
   DistAttention waits for every head's part), so a request packed beside it decodes at its speed.
6. Growth room per request: where an Arrive gives a request's final size, the headroom of rules 1-3
   is the room the GPU's own requests will write over a horizon (those finishing sooner leave);
   without final sizes it is the pool headroom as before (`growth_estimate`).
7. Prefix affinity: where an Arrive names GPUs whose prefix caches hold the start of its prompt
   (grouped by prefix length, longest first), it goes to the fullest GPU of the first group that
   holds it with growth room: MemServe §6's "instance with the longest common prefix", with its load
   deciding among equals, within rule 1's capacity (`prefix_affinity`).

Pure between epochs, as every policy: all it keeps across them is the state a snapshot holds.
Every rule is a MellDefaultConfig knob; docs/mell.md gives the measurement behind each default.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from kvfleet.mell.cluster import ClusterPolicy, PolicyConfig
from kvfleet.mell.migration import link_of
from kvfleet.mell.models import Arrive, EventBatch, Location, Plan
from kvfleet.mell.size_classes import SizeClass, size_class
from kvfleet.mell.state import ClusterSnapshot, Gpu, Item, ItemSnapshot

# How a GPU's growth room is estimated (MellDefaultConfig.growth_estimate).
GROWTH_ESTIMATES = ("per-request", "pool")
# Requests as `_room` reads them: (size in bytes, bytes still to write or None where unknown).
Growth = tuple[tuple[int, int | None], ...]


@dataclass(frozen=True)
class MellDefaultConfig(PolicyConfig):
    """Knobs of the default policy, one per rule of the module docstring."""

    # Share of C kept free for growth when placing and consolidating (rules 1-3): on every GPU with
    # growth_estimate="pool", else only on GPUs holding a request whose final size is unknown.
    headroom_fraction: float = 0.05
    # Rule 6, growth room (rules 1-3). "per-request" (the default): a GPU keeps room for what its own
    # requests will still write, from each one's final size (Arrive.final_size_bytes: prompt + output
    # budget), each growing by at most growth_horizon_fraction x C and those that finish sooner leaving
    # (a GPU's requests decode in lockstep, a token each per step). It is the default because a request
    # about to finish needs no room and one with thousands of tokens to go needs more than 5% of C: it
    # packs tighter and sheds less (docs/mell.md). A request without a final size (the live operator
    # today, whose reports carry none) gets the pool allowance on its GPU, so "per-request" without final
    # sizes is exactly "pool". "pool": headroom_fraction of C on every GPU, whatever its requests.
    growth_estimate: str = "per-request"
    growth_horizon_fraction: float = 0.1
    # Rule 1: an epoch's arrivals are placed largest first (best-fit decreasing), not in arrival order.
    arrivals_largest_first: bool = True
    # Rules 1-2: a request that fits nowhere with headroom may use a GPU's headroom before a GPU starts.
    fill_without_headroom: bool = True
    # Rule 2: a request shed by an overloaded GPU goes to the emptiest GPU (room to grow), not the fullest.
    # Only a request whose final size is unknown (or with growth_estimate="pool"): rule 6 gives one
    # whose final size is known its own room to grow wherever it goes, so it goes best fit, and the
    # emptiest GPU is the one consolidation would empty next.
    relieve_to_emptiest: bool = True
    # Rule 3: empty the least loaded GPU when the others take its requests; at most this many an epoch,
    # and only while all KV fits in one GPU fewer filled to this share of C.
    consolidate: bool = True
    max_consolidations_per_epoch: int = 1
    consolidate_fill: float = 0.9
    # Rule 3: the least loaded GPUs tried, in that order, for one to empty (1: only the least loaded):
    # the least loaded often holds a request that just moved (it waits) or one no other GPU has room
    # for, while the next one could be emptied.
    consolidate_candidates: int = 4
    # A request moved less than this long ago is not moved again by choice (consolidation, or relief
    # while another request can clear the overload): each move costs its request a pause and a copy,
    # and a live pool's reports lag its moves, so a quick second move is the likeliest to fail.
    min_move_interval_s: float = 30.0
    # Rule 5, a TPOT objective as a load cap: a GPU holds at most max_load_bytes less
    # load_bytes_per_request per request it serves (the decode step model, models.tpot_load_cap).
    max_load_bytes: int | None = None
    load_bytes_per_request: int = 0
    # Rule 7: an arrival goes to a GPU with the longest cached prefix of its prompt (Arrive.prefix_tiers,
    # MemServe §6's locality-aware choice), the fullest of those that hold it with growth room; else rule 1.
    # A hit skips that much prefill. False: placement by bytes alone, the cache-blind router.
    prefix_affinity: bool = True
    # Rule 4, the §V communication boundary of one epoch per link (None: unbounded): only moves
    # within it are planned, so none is deferred.
    intra_node_move_budget_bytes: int | None = None
    inter_node_move_budget_bytes: int | None = None

    def within_link_budgets(self, intra_node_bytes: int, inter_node_bytes: int) -> PolicyConfig:
        """Rule 4 needs budgets: the given ones, unless this config already sets either."""
        if self.intra_node_move_budget_bytes is not None or self.inter_node_move_budget_bytes is not None:
            return self
        return dataclasses.replace(self, intra_node_move_budget_bytes=intra_node_bytes,
                                   inter_node_move_budget_bytes=inter_node_bytes)


class MellDefaultPolicy(ClusterPolicy):
    name = "mell"
    config_type: ClassVar[type[PolicyConfig]] = MellDefaultConfig
    uses_free_index = True

    def __init__(self, config: MellDefaultConfig) -> None:
        super().__init__(config)
        self.cfg: MellDefaultConfig = config
        if config.growth_estimate not in GROWTH_ESTIMATES:
            raise ValueError(f"growth_estimate must be one of {', '.join(GROWTH_ESTIMATES)}, "
                             f"not {config.growth_estimate!r}")
        self._headroom = int(config.headroom_fraction * config.capacity_bytes)
        self._per_request = config.growth_estimate == "per-request"
        self._horizon_bytes = int(config.growth_horizon_fraction * config.capacity_bytes)
        # Rule 6: each live request's final size, where its Arrive gave one; and those given by this
        # batch's arrivals, taken up when each is placed (a Finish and an Arrive of the same request
        # in one batch, as the operator sends for a restarted request, keep the new one's).
        self._final_bytes: dict[str, int] = {}
        self._arriving_final_bytes: dict[str, int] = {}
        # Rule 7: the GPUs this batch's arrivals would find their prompt's prefix on, longest first.
        self._arriving_preferred: dict[str, tuple[tuple[str, ...], ...]] = {}
        self._overloaded: dict[str, Gpu] = {}
        self._link_used: dict[str, int] = {}
        # Items moved this epoch: none moves twice, so the link each migration is charged to is the
        # one its copy takes (a second move would make the plan's move origin -> final, uncharged).
        self._moved_items: set[int] = set()
        # When each item last moved (epoch time), for min_move_interval_s; pruned as it expires.
        self._moved_at_s: dict[int, float] = {}
        self._now_s = 0.0
        # The rule the last Allocate took (rule 1), for allocate_one's AllocateDecision.step.
        self.last_allocate_step = ""

    def restore(self, snap: ClusterSnapshot) -> None:
        """Every request is an item of its own here (multi-items are Fig. 10's, §VI-C), so a rebuilt
        state's multi-items are split; a GPU restored over its cap is relieved at the next epoch."""
        items = tuple(ItemSnapshot((member,), False, it.gpu_id) for it in snap.items for member in it.members)
        super().restore(dataclasses.replace(snap, items=items))
        for request_id, moved_s in snap.moved_at_s:
            item = self.item_of.get(request_id)
            if item is not None:
                self._moved_at_s[item.item_id] = moved_s
        for request_id, final_bytes in snap.final_sizes_bytes:
            if request_id in self.item_of:
                self._final_bytes[request_id] = final_bytes
        for gpu in self.gpus.values():
            if not gpu.idle and gpu.load_bytes > self._cap(gpu, 0):
                self._overloaded[gpu.gpu_id] = gpu

    def snapshot(self) -> ClusterSnapshot:
        snap = super().snapshot()
        moved = tuple(sorted((rid, self._moved_at_s[item.item_id]) for rid, item in self.item_of.items()
                             if item.item_id in self._moved_at_s))
        finals = tuple(sorted((rid, b) for rid, b in self._final_bytes.items() if rid in self.item_of))
        return dataclasses.replace(snap, moved_at_s=moved, final_sizes_bytes=finals)

    # ================================================================ epoch

    def schedule(self, batch: EventBatch, *, end_of_epoch: bool = True) -> Plan:
        # Best-fit decreasing over the epoch's arrivals: the larger requests are placed first.
        arrivals = [e for e in batch.events if isinstance(e, Arrive)]
        if self.cfg.arrivals_largest_first:
            arrivals.sort(key=lambda e: -e.size_bytes)
        others = [e for e in batch.events if not isinstance(e, Arrive)]
        self._now_s = batch.now_s
        self._arriving_final_bytes = {e.request_id: e.final_size_bytes for e in arrivals
                                      if e.final_size_bytes is not None}
        self._arriving_preferred = {e.request_id: e.prefix_tiers for e in arrivals
                                    if e.prefix_tiers and self.cfg.prefix_affinity}
        plan = super().schedule(EventBatch(batch.now_s, (*others, *arrivals)), end_of_epoch=end_of_epoch)
        if end_of_epoch:
            self._link_used = {}  # each epoch's moves have the links' budgets to themselves (§V)
            self._moved_items = set()
            horizon_s = batch.now_s - self.cfg.min_move_interval_s
            self._moved_at_s = {i: t for i, t in self._moved_at_s.items() if t > horizon_s}
        return plan

    def note_moved(self, request_ids: Iterable[str], now_s: float) -> None:
        for request_id in request_ids:
            item = self.item_of.get(request_id)
            if item is not None:
                self._moved_at_s[item.item_id] = now_s

    def _settling(self, item: Item) -> bool:
        """Moved this epoch, or too recently to be moved again by choice (min_move_interval_s)."""
        moved_s = self._moved_at_s.get(item.item_id)
        return item.item_id in self._moved_items or (
            moved_s is not None and self._now_s - moved_s < self.cfg.min_move_interval_s)

    def on_arrive(self, request_id: str, size_bytes: int) -> None:
        self._relieve()
        final_bytes = self._arriving_final_bytes.pop(request_id, None)
        if final_bytes is not None:
            self._final_bytes[request_id] = final_bytes
        item = self._new_item(size_class(size_bytes, self.capacity_bytes), {request_id: size_bytes}, False)
        preferred = self._arriving_preferred.pop(request_id, ())
        self._put(item, self._with_prefix(item, preferred) or self._target(item), "allocate", None)

    def _finish(self, request_id: str) -> None:
        # Not in on_finish: a tail that passes C is finished and arrives again (cluster._grow), the
        # same request with the same final size.
        super()._finish(request_id)
        self._final_bytes.pop(request_id, None)

    def on_finish(self, request_id: str) -> None:
        item = self.item_of.pop(request_id, None)
        if item is None:
            raise ValueError(f"unknown request {request_id!r} finished")
        self._moved_at_s.pop(item.item_id, None)
        gpu = self._remove(item)
        if gpu.load_bytes <= self._cap(gpu, 0):
            self._overloaded.pop(gpu.gpu_id, None)

    def on_grow(self, request_id: str, size_bytes: int) -> None:
        item = self.item_of.get(request_id)
        if item is None:
            raise ValueError(f"unknown request {request_id!r} grew")
        if size_bytes <= item.size_bytes:
            return  # KV only grows (§VI-A): a stale report changes nothing
        item.members[request_id] = size_bytes
        self._resize(item, size_bytes, size_class(size_bytes, self.capacity_bytes))
        gpu = item.gpu
        assert gpu is not None
        if gpu.load_bytes > self._cap(gpu, 0):
            self._overloaded[gpu.gpu_id] = gpu

    def after_batch(self) -> None:
        self._relieve()
        if self.cfg.consolidate:
            for _ in range(self.cfg.max_consolidations_per_epoch):
                if not self._consolidate_one():
                    break

    # ================================================================ rules

    def _cap(self, gpu: Gpu, extra_requests: int, extra_span_bytes: int = 0) -> int:
        """The load `gpu` may hold with `extra_requests` more requests, whose spans' heads hold
        `extra_span_bytes` (less than 0: a tail leaving): C, or less under a TPOT objective (rule 5).
        A span's tail GPU steps over its whole KV, heads included, so that KV counts against the tail's
        decode step: a request beside a tail decodes at the span's speed."""
        cfg = self.cfg
        if cfg.max_load_bytes is None:
            return self.capacity_bytes
        cap = (cfg.max_load_bytes - (gpu.num_requests + extra_requests) * cfg.load_bytes_per_request
               - self._spans_on(gpu) - extra_span_bytes)
        return min(self.capacity_bytes, cap)

    def _span_bytes(self, item: Item) -> int:
        """Bytes the spans' heads of `item`'s requests hold on GPUs of their own (whole chunks of C)."""
        if not self._heads:
            return 0
        return sum(len(self._heads.get(rid, ())) for rid in item.members) * self.capacity_bytes

    def _spans_on(self, gpu: Gpu) -> int:
        """Bytes held by the heads of the spans whose tails `gpu` holds."""
        if not self._heads:
            return 0
        return sum(self._span_bytes(it) for it in gpu.items.values())

    def _growth(self, item: Item) -> Growth:
        """(size, remaining growth or None) of each request of `item`, as `_room` reads them."""
        return tuple((size, self._remaining(rid, size)) for rid, size in item.members.items())

    def _remaining(self, request_id: str, size: int) -> int | None:
        """Bytes `request_id` will still write (rule 6), None if its final size is unknown. A request
        larger than C holds whole chunks on span heads besides the `size` of its tail here."""
        final_bytes = self._final_bytes.get(request_id)
        if final_bytes is None:
            return None
        heads = self._heads.get(request_id)
        return max(0, final_bytes - size - (len(heads) if heads else 0) * self.capacity_bytes)

    def _room(self, gpu: Gpu | None, extra: Growth = (), without: Item | None = None) -> int:
        """Growth room `gpu` keeps (rules 1-3) with the requests `extra` added and `without` gone.

        "pool": the headroom. "per-request" (rule 6): the most its requests whose final size is known
        will hold above their load now while each writes up to the horizon, a request leaving when it
        reaches its final size (all of a GPU's requests write a token a step, so after x bytes each, those
        with less than x to go have left and the others hold size + x: the peak is at x = a request's
        remaining bytes, or the horizon); plus the headroom where a request's final size is unknown."""
        if not self._per_request or (not self._final_bytes and all(r is None for _, r in extra)):
            # No request has a final size (the live operator's reports carry none): every request is
            # unknown, and walking the GPU's requests would only find that out (bench/mell.py's 100,000).
            return self._headroom
        unknown = False
        load_known = 0
        growing: list[tuple[int, int]] = []  # (remaining bytes up to the horizon, size)
        requests: list[tuple[int, int | None]] = list(extra)
        if gpu is not None:
            for it in gpu.items.values():
                if it is not without:
                    requests.extend(self._growth(it))
        for size, remaining in requests:
            if remaining is None:
                unknown = True
                continue
            load_known += size
            if remaining > 0:
                growing.append((min(remaining, self._horizon_bytes), size))
        peak = load_known
        held = count = 0
        for remaining, size in sorted(growing, reverse=True):
            held += size
            count += 1
            peak = max(peak, held + count * remaining)
        return peak - load_known + (self._headroom if unknown else 0)

    def _fits(self, gpu: Gpu, growth: Growth, size: int, headroom: bool, spans: int) -> bool:
        """Whether `gpu` holds the requests `growth` (`size` bytes in all, `spans` more on their spans'
        heads) within its cap, with their room if asked."""
        room = self._room(gpu, growth) if headroom else 0
        return gpu.load_bytes + size + room <= self._cap(gpu, 1, spans)

    def _takes(self, gpu: Gpu, growth: Growth, size: int, headroom: bool, src: Gpu | None, budgeted: bool,
               spans: int) -> bool:
        """Whether `gpu` can take the requests `growth` (`size` bytes, `spans` on their spans' heads) from
        `src` (None: a new request): it is in use, no span head, not `src`, holds them (with its growth
        room if asked) and, if `budgeted`, the link from `src` still carries them this epoch. The callers
        sum `size` once for every GPU they try."""
        return (not gpu.idle and gpu.category is not SizeClass.X and gpu is not src
                and self._fits(gpu, growth, size, headroom, spans)
                and (src is None or not budgeted or self._link_allows(src, gpu, size)))

    def _least_room(self, headroom: bool, growth: Growth) -> int:
        """The least growth room any GPU would keep with `growth` added, to skip GPUs by the free-bytes
        index alone: the pool headroom where it applies whatever the GPU holds (pool estimates, or a
        request of unknown final size among `growth`), else none."""
        if not headroom:
            return 0
        return self._headroom if not self._per_request or any(r is None for _, r in growth) else 0

    def _best_fit(self, growth: Growth, headroom: bool, src: Gpu | None, budgeted: bool = True,
                  spans: int = 0) -> Gpu | None:
        """The fullest GPU that takes the requests `growth` (`spans` on their spans' heads) from `src`
        (see `_takes`)."""
        index = self._sync_free_index()
        size = sum(s for s, _ in growth)
        pos = bisect_left(index, (size + self._least_room(headroom, growth), -1, ""))
        for i in range(pos, len(index)):  # not a slice: no copy of the index per request
            gpu = self.gpus[index[i][2]]
            if self._takes(gpu, growth, size, headroom, src, budgeted, spans):
                return gpu
        return None

    def _emptiest(self, growth: Growth, src: Gpu, spans: int) -> Gpu | None:
        """The emptiest GPU that takes the requests `growth` (`spans` on their spans' heads) from `src` with
        growth room, within the link budget."""
        index = self._sync_free_index()
        size = sum(s for s, _ in growth)
        least = size + self._least_room(True, growth)
        for free, _, gpu_id in reversed(index):
            if free < least:
                return None
            gpu = self.gpus[gpu_id]
            if self._takes(gpu, growth, size, True, src, True, spans):
                return gpu
        return None

    def _target(self, item: Item, away_from: Gpu | None = None) -> Gpu:
        """Rule 1: the fullest GPU (other than `away_from`) that holds `item` with growth room, else
        without, else a new GPU. No link is involved: a new request, or one recomputed elsewhere."""
        growth = self._growth(item)
        spans = self._span_bytes(item)
        gpu = self._best_fit(growth, True, away_from, budgeted=False, spans=spans)
        self.last_allocate_step = "best-fit"
        if gpu is None and self.cfg.fill_without_headroom:
            gpu = self._best_fit(growth, False, away_from, budgeted=False, spans=spans)
            self.last_allocate_step = "best-fit-in-headroom"
        if gpu is None:
            gpu = self._activate()
            self.last_allocate_step = "new-GPU"
        return gpu

    def _with_prefix(self, item: Item, tiers: tuple[tuple[str, ...], ...]) -> Gpu | None:
        """Rule 7: the fullest GPU of the first of `tiers` (GPUs holding equally long cached prefixes,
        longest first) that holds `item` with growth room. MemServe §6 routes to the instance with the
        longest common prefix, its load deciding among equals; here only where rule 1 would also have
        room, so that a cache hit never costs a shed or a new GPU, and among equals as rule 1 would
        choose (a block every GPU caches, a shared system prompt, then changes nothing)."""
        growth = self._growth(item)
        spans = self._span_bytes(item)
        for tier in tiers:
            taking = [g for g in (self.gpus.get(gpu_id) for gpu_id in tier)
                      if g is not None and self._takes(g, growth, item.size_bytes, True, None, False, spans)]
            if taking:
                self.last_allocate_step = "prefix"
                return min(taking, key=lambda g: (self._free(g), g.seq, g.gpu_id))
        return None

    def _link_allows(self, src: Gpu, dst: Gpu, size: int) -> bool:
        return self._link_allows_to(src, dst.location, size)

    def _link_allows_to(self, src: Gpu, dst: Location, size: int, used: Mapping[str, int] | None = None) -> bool:
        """Whether the epoch's budget of the link from `src` to `dst` still carries `size` bytes (§V),
        given the bytes already sent on each link (`used`, the epoch's so far by default)."""
        budget = self._link_budget(src.location, dst)
        sent = (self._link_used if used is None else used).get(link_of(src.location, dst), 0)
        return budget is None or sent + size <= budget

    def _link_budget(self, src: Location, dst: Location) -> int | None:
        if src.node_id == dst.node_id:
            return self.cfg.intra_node_move_budget_bytes
        return self.cfg.inter_node_move_budget_bytes

    def _move_item(self, item: Item, dst: Gpu, cause: str) -> None:
        src = item.gpu
        assert src is not None
        link = link_of(src.location, dst.location)
        self._link_used[link] = self._link_used.get(link, 0) + item.size_bytes
        self._moved_items.add(item.item_id)
        self._moved_at_s[item.item_id] = self._now_s
        self._move(item, dst, cause)

    def _relieve(self) -> None:
        """Rule 2: every overloaded GPU sheds requests until it is under capacity less headroom.

        Fewest moves first: the smallest request that alone clears the excess, else the largest ones.
        A request moves only where its copy fits the epoch's link budget (an existing GPU, or a new
        one on the same node), so no migration is ever deferred."""
        while self._overloaded:
            _, gpu = self._overloaded.popitem()
            while not gpu.idle and len(gpu.items) > 1 and gpu.load_bytes > self._cap(gpu, 0):
                items = sorted(gpu.items.values(), key=lambda it: (it.size_bytes, it.item_id))
                # Clears: leaves the GPU its growth room (rule 6: the room of the requests that stay)
                # within its cap, which a span's tail that leaves no longer lowers (rule 5).
                clear = {it.item_id for it in items
                         if gpu.load_bytes - it.size_bytes + self._room(gpu, without=it)
                         <= self._cap(gpu, 0, -self._span_bytes(it))}
                clears = [it for it in items if it.item_id in clear]
                order = clears + [it for it in reversed(items) if it.item_id not in clear]
                # One move that clears it, by a settled request if one can; a request moved moments ago
                # only where fewer moves need it (an overloaded engine would otherwise preempt), and
                # none twice in one epoch.
                movable = [it for it in clears if not self._settling(it)] + [
                    it for it in order if it.item_id not in self._moved_items]
                for it in movable:
                    dst = self._within_budget(it, gpu)
                    if dst is not None:
                        self._move_item(it, dst, "overload")
                        break
                else:
                    # No link carries any of them this epoch: the smallest that clears the excess is
                    # recomputed at its new GPU instead (vLLM's recompute preemption; a re-prefill,
                    # reported as a preemption, never a deferred migration).
                    victim = order[0]
                    self._move(victim, self._target(victim, away_from=gpu), "preempt")
                    for rid in victim.members:
                        move = self._moves.get(rid)
                        if move is not None:
                            move[3] = "preempt"  # moved earlier this epoch: the whole way is a recompute

    def _within_budget(self, item: Item, src: Gpu) -> Gpu | None:
        """A GPU that takes `item` from `src` within the link budget: the emptiest with growth room
        (`relieve_to_emptiest`), else best fit with growth room, then without, else a new GPU on a
        node the copy may reach this epoch; None if there is none."""
        growth = self._growth(item)
        spans = self._span_bytes(item)
        emptiest = self.cfg.relieve_to_emptiest and (not self._per_request or any(r is None for _, r in growth))
        dst = self._emptiest(growth, src, spans) if emptiest else None
        if dst is None:
            dst = self._best_fit(growth, True, src, spans=spans)
        if dst is None and self.cfg.fill_without_headroom:
            dst = self._best_fit(growth, False, src, spans=spans)
        if dst is not None:
            return dst
        if self._link_allows_to(src, self._activation_location(src), item.size_bytes):
            return self._activate(src)
        return None

    def _consolidate_one(self) -> bool:
        """Rule 3: empty the least loaded GPU if the others take all of it with headroom, within budget."""
        candidates = [g for g in self.gpus.values() if not g.idle and g.category is not SizeClass.X and g.items]
        if len(candidates) < 2:
            return False
        total = sum(g.load_bytes for g in candidates)
        if total > self.cfg.consolidate_fill * (len(candidates) - 1) * self.capacity_bytes:
            return False
        by_load = sorted(candidates, key=lambda g: (g.load_bytes, -g.seq))
        for victim in by_load[:self.cfg.consolidate_candidates]:
            if any(self._settling(it) for it in victim.items.values()):
                # It waits for its requests to settle; a fuller GPU is tried instead only within
                # consolidate_candidates (emptying it moves more bytes).
                continue
            plan = self._consolidation_plan(victim, candidates)
            if plan is not None:
                for item, dst in plan:
                    self._move_item(item, dst, "consolidate")
                return True
        return False

    def _consolidation_plan(self, victim: Gpu, candidates: list[Gpu]) -> list[tuple[Item, Gpu]] | None:
        """Where each request of `victim` would go (rule 3), or None if the others cannot take them all."""
        # Dry run: the largest items first, each to the fullest other GPU that holds it with headroom.
        tentative: dict[str, int] = {}
        tentative_n: dict[str, int] = {}
        tentative_growth: dict[str, Growth] = {}
        tentative_spans: dict[str, int] = {}
        link_used = dict(self._link_used)
        plan: list[tuple[Item, Gpu]] = []
        for item in sorted(victim.items.values(), key=lambda it: (-it.size_bytes, it.item_id)):
            growth = self._growth(item)
            spans = self._span_bytes(item)
            best: Gpu | None = None
            for g in candidates:
                if g is victim:
                    continue
                load = g.load_bytes + tentative.get(g.gpu_id, 0)
                n_extra = tentative_n.get(g.gpu_id, 0) + 1
                room = self._room(g, tentative_growth.get(g.gpu_id, ()) + growth)
                if load + item.size_bytes + room > self._cap(g, n_extra, tentative_spans.get(g.gpu_id, 0) + spans):
                    continue
                if not self._link_allows_to(victim, g.location, item.size_bytes, link_used):
                    continue
                if best is None or load > best.load_bytes + tentative.get(best.gpu_id, 0):
                    best = g
            if best is None:
                return None
            tentative[best.gpu_id] = tentative.get(best.gpu_id, 0) + item.size_bytes
            tentative_n[best.gpu_id] = tentative_n.get(best.gpu_id, 0) + 1
            tentative_growth[best.gpu_id] = tentative_growth.get(best.gpu_id, ()) + growth
            tentative_spans[best.gpu_id] = tentative_spans.get(best.gpu_id, 0) + spans
            link = link_of(victim.location, best.location)
            link_used[link] = link_used.get(link, 0) + item.size_bytes
            plan.append((item, best))
        return plan
