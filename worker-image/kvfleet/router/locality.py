"""Prefix locality in the router: MemServe's global prompt tree (§6) and its cost model (§5.3).

Workers with a prefix cache (docs/caching.md) prefill a request only past the longest prefix of its
prompt they still hold. Which worker that is, the router can know without asking anyone: every
request's prompt and output token ids pass through it (the workers' router-mode streams carry them),
so it keeps one radix tree over those ids, by whole KV blocks as the workers cache them, whose nodes
say which workers hold the block and since when (MemServe §6: "the same [radix trees] as the ones
used by MemPool with one extra field per tree node pointing to the instance"). It is updated when a
response comes back through the router (§6, the update path), so it is best effort: entries expire
after a TTL (§6, Discussion), the tree is bounded in size, and each worker's part is cut down to the
number of blocks its KV-load report says its cache holds, least recently used first, which is how the
workers' own evictions reach it.

Placement (§6, the lookup path, and equation 1 of §5.3.1): among the workers MELL finds room on, a
worker holding a longer cached prefix than MELL's own choice takes the request when its predicted
time to first token, the prefills already queued there plus this one's, is lower:

    argmin_p  sum_{x' queued on p} exec(x', y'_p) + exec(x, y_p)

where exec(x, y) is the time to prefill a prompt of x tokens of which a fraction y is cached, here
the workers' measured prefill time (their speed profiles, kvfleet.api.speed) at the uncached
x * (1 - y) tokens. MELL's choice stands when no worker caches more of the prompt, so packing (and
when a worker is full) is still MELL's. Session affinity (MemServe Table 6's session-ID policy) is
kept selectable to be measured against.

Pure: no I/O and no clock (time comes in as `now_s`), so it is tested with exact small cases.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvfleet.api.speed import SpeedProfile
from kvfleet.sim.profile import Curve

# How the router weighs prefix locality: the global prompt tree (MemServe §6), the worker a session
# (the OpenAI `user` field) was last placed on (MemServe Table 6's session-ID policy), or not at all.
Locality = Literal["prompt-tree", "session", "none"]
LOCALITIES: tuple[Locality, ...] = ("prompt-tree", "session", "none")

# exec(x, y) before any worker has measured its prefill: one unit a token. Only the ranking of the
# candidates matters, and with one rate for all it ranks by uncached tokens queued plus this one's.
UNMEASURED_S_PER_TOKEN = 1e-4


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    parent: _Node | None
    depth: int  # blocks from the root: this node is the prompt's block depth - 1
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    # Worker pod -> when the block was last seen there (a response through the router, a placement).
    seen_s: dict[str, float] = field(default_factory=dict)


class GlobalPromptTree:
    """Which workers hold which prompt prefixes, by whole KV blocks (the module docstring)."""

    def __init__(self, block_size_tokens: int, ttl_s: float, max_blocks: int) -> None:
        if block_size_tokens < 1 or ttl_s <= 0 or max_blocks < 1:
            raise ValueError("a prompt tree needs a block size, a TTL and a size bound, all positive")
        self.block_size_tokens = block_size_tokens
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._root = _Node((), None, 0)
        self._count: dict[str, int] = {}  # worker -> blocks it holds in the tree
        # Per worker, (seen_s, -depth, tiebreak, node): the least recently seen first and, among those
        # seen at once, the deepest (a parent is seen whenever a child is, so leaves go first).
        # Entries whose node was seen again or dropped since are stale and skipped.
        self._heaps: dict[str, list[tuple[float, int, int, _Node]]] = {}
        self._tiebreak = itertools.count()

    @property
    def num_blocks(self) -> int:
        """(block, worker) pairs held: a block two workers hold counts twice."""
        return sum(self._count.values())

    def blocks_of(self, worker: str) -> int:
        return self._count.get(worker, 0)

    def _keys(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        bs = self.block_size_tokens
        return [tuple(tokens[i:i + bs]) for i in range(0, len(tokens) - len(tokens) % bs, bs)]

    def insert(self, worker: str, tokens: Sequence[int], now_s: float) -> None:
        """`worker` holds the whole blocks of `tokens` as of `now_s` (a response came back from it)."""
        node = self._root
        heap = self._heaps.setdefault(worker, [])
        for key in self._keys(tokens):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, node, node.depth + 1)
            if worker not in child.seen_s:
                self._count[worker] = self._count.get(worker, 0) + 1
            child.seen_s[worker] = now_s
            heapq.heappush(heap, (now_s, -child.depth, next(self._tiebreak), child))
            node = child
        if len(heap) > 4 * self._count.get(worker, 0) + 1024:
            self._compact(worker)
        self.expire(now_s)
        while self.num_blocks > self.max_blocks:
            self._evict_oldest()

    def match(self, tokens: Sequence[int], now_s: float) -> dict[str, int]:
        """Worker -> tokens of the longest prefix of `tokens` it holds (unexpired), for every worker
        holding at least one block of it (§6's match against every instance's tree at once)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        node = self._root
        fresh_after = now_s - self.ttl_s
        for key in self._keys(tokens):
            child = node.children.get(key)
            if child is None:
                break
            here = {w for w, seen in child.seen_s.items() if seen >= fresh_after}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for worker in alive:
                matched[worker] = child.depth * self.block_size_tokens
            node = child
        return matched

    def touch(self, worker: str, tokens: Sequence[int], now_s: float) -> None:
        """The blocks of `tokens` that `worker` holds are in use there now (a request placed for them):
        they are the last its cache would evict, so the tree's LRU order follows the worker's."""
        node = self._root
        for key in self._keys(tokens):
            child = node.children.get(key)
            if child is None or worker not in child.seen_s:
                return
            child.seen_s[worker] = now_s
            heapq.heappush(self._heaps[worker], (now_s, -child.depth, next(self._tiebreak), child))
            node = child

    def expire(self, now_s: float) -> None:
        """Drop what was last seen more than the TTL ago (§6: the workers' evictions are not seen)."""
        for worker, heap in self._heaps.items():
            while self._live_top(worker, heap) and heap[0][0] < now_s - self.ttl_s:
                self._pop(worker, heap)

    def trim(self, worker: str, num_blocks: int, seen_before_s: float = float("inf")) -> None:
        """Keep at most `num_blocks` of `worker`'s blocks, the most recently seen (its report says its
        cache holds no more), but none seen since `seen_before_s`: a report is written at most once an
        epoch, so one that predates a response cannot speak for the blocks that response left."""
        heap = self._heaps.get(worker, [])
        while (self._count.get(worker, 0) > max(0, num_blocks) and self._live_top(worker, heap)
               and heap[0][0] < seen_before_s):
            self._pop(worker, heap)

    def forget(self, worker: str) -> None:
        """The worker is gone: none of its blocks are anywhere any more."""
        self.trim(worker, 0)
        self._heaps.pop(worker, None)
        self._count.pop(worker, None)

    def workers(self) -> Iterable[str]:
        return list(self._count)

    def _compact(self, worker: str) -> None:
        """Rebuild the worker's heap from its live entries: every insert pushes its whole path, so
        stale entries would otherwise pile up for as long as the worker serves."""
        heap: list[tuple[float, int, int, _Node]] = []
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            seen_s = n.seen_s.get(worker)
            if seen_s is not None:
                heap.append((seen_s, -n.depth, next(self._tiebreak), n))
                stack.extend(n.children.values())
        heapq.heapify(heap)
        self._heaps[worker] = heap

    def _evict_oldest(self) -> None:
        worker = min((w for w, heap in self._heaps.items() if self._live_top(w, heap)),
                     key=lambda w: self._heaps[w][0][:3])
        self._pop(worker, self._heaps[worker])

    @staticmethod
    def _live_top(worker: str, heap: list[tuple[float, int, int, _Node]]) -> bool:
        """Drop stale entries off the top; whether a live one is left there."""
        while heap:
            seen_s, _, _, node = heap[0]
            if node.seen_s.get(worker) == seen_s and node.parent is not None:
                return True
            heapq.heappop(heap)
        return False

    def _pop(self, worker: str, heap: list[tuple[float, int, int, _Node]]) -> None:
        """Remove the worker's least recently seen live entry, with what it holds below it (never
        seen later than it, so never fresher)."""
        while heap:
            seen_s, _, _, node = heapq.heappop(heap)
            if node.seen_s.get(worker) == seen_s and node.parent is not None:
                self._drop(worker, node)
                return

    def _drop(self, worker: str, node: _Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.seen_s.pop(worker, None) is not None:
                self._count[worker] -= 1
                stack.extend(n.children.values())
        # Unlink nodes no worker holds any more, upwards from here.
        n = node
        while n.parent is not None and not n.seen_s and not n.children:
            parent = n.parent
            del parent.children[n.key]
            n.parent = None
            n = parent
        if self._count.get(worker) == 0:
            del self._count[worker]


@dataclass(frozen=True)
class PrefillCost:
    """MemServe's exec(x, y) (§5.3): seconds to prefill x prompt tokens of which y are cached.

    The workers' measured prefill time (their speed profiles' prefill points: seconds a step took
    against the prompt tokens it prefilled) at the uncached x * (1 - y) tokens, through the points as
    the simulator replays them (kvfleet.sim.profile.Curve). The profiles do not separate the cached
    prefix's share of attention (§5.3.2's a x^2 y term), so that is not modelled.
    """

    curve: Curve | None = None

    @staticmethod
    def from_profile(profile: SpeedProfile | None) -> PrefillCost:
        if profile is None or not profile.prefill:
            return PrefillCost()
        return PrefillCost(Curve.through((p.tokens, p.step_seconds, p.samples) for p in profile.prefill))

    def exec_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        new_tokens = max(1, prompt_tokens - cached_tokens)  # the last token is always computed
        if self.curve is None:
            return new_tokens * UNMEASURED_S_PER_TOKEN
        return self.curve.at(new_tokens)


@dataclass(frozen=True)
class Queued:
    """A request the router placed whose first token has not come back: prefill work still ahead of
    a new request on its worker (equation 1's first term)."""

    pod_name: str
    prompt_tokens: int
    cached_tokens: int


def queued_s(queued: Iterable[Queued], cost: PrefillCost) -> dict[str, float]:
    """Worker -> seconds of prefill queued there (equation 1's sum)."""
    out: dict[str, float] = {}
    for q in queued:
        out[q.pod_name] = out.get(q.pod_name, 0.0) + cost.exec_s(q.prompt_tokens, q.cached_tokens)
    return out


@dataclass(frozen=True)
class LocalityInput:
    """What placement weighs besides MELL: the prompt's length, each worker's cached prefix of it,
    the prefill queued on each, the cost model, and (session affinity) the session's last worker."""

    prompt_tokens: int
    cached_tokens: Mapping[str, int]
    queued_s: Mapping[str, float]
    cost: PrefillCost
    session_pod: str | None = None


def predicted_s(locality: LocalityInput, pod_name: str) -> float:
    """Equation 1's objective for one worker: its queued prefill plus this prompt's past its cache."""
    return (locality.queued_s.get(pod_name, 0.0)
            + locality.cost.exec_s(locality.prompt_tokens, locality.cached_tokens.get(pod_name, 0)))


def prefer_cached(default_pod: str, fitting: Sequence[str], locality: LocalityInput) -> str | None:
    """A worker to take the request instead of MELL's `default_pod`, or None to keep MELL's.

    Only among `fitting` (workers MELL finds room on), only one caching more of the prompt than the
    default, and only when equation 1 predicts it sooner to its first token (ties: the longer prefix,
    then the name, so the choice is deterministic).
    """
    base = locality.cached_tokens.get(default_pod, 0)
    better = [p for p in fitting if locality.cached_tokens.get(p, 0) > base]
    if not better:
        return None
    best = min(better, key=lambda p: (predicted_s(locality, p), -locality.cached_tokens.get(p, 0), p))
    return best if predicted_s(locality, best) < predicted_s(locality, default_pod) else None
