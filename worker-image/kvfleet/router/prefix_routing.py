"""The router's prefix-locality state around the pure rules of locality.py: the global prompt tree,
the prefill queued on each worker, each session's last worker, the tokenizer, and the cost model
fitted from the workers' measured prefill speed.

Everything here is updated from what passes through the router anyway (MemServe §6's update path):
a prompt's ids when a worker's first chunk names them, the whole response when it ends. The two
things asked of workers are asked rarely: the tokenizer once (`GET /kvfleet/tokenizer`), the speed
profiles every PROFILE_REFRESH_S (`GET /kvfleet/speed-profile`, as `kvfleet replay` asks them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import aiohttp
from pydantic import ValidationError

from kvfleet.api.speed import SpeedProfile
from kvfleet.router.locality import GlobalPromptTree, LocalityInput, PrefillCost, Queued, queued_s
from kvfleet.router.placement import PoolSnapshot
from kvfleet.router.pool import PoolView
from kvfleet.router.speed import gather_profiles
from kvfleet.serving.tokens import TOKENIZER_PATH, PromptTokenizer

log = logging.getLogger(__name__)

PROFILE_REFRESH_S = 30.0
TOKENIZER_RETRY_S = 10.0
# The tree's bound, in (block, worker) pairs: at 16 tokens a block, 2M pairs are 32M tokens of
# prompts, far more than a few workers' caches hold, in a few hundred MB of router memory at most.
MAX_TREE_BLOCKS = 2_000_000
# How old a worker's KV-load report may be (workers write at most one an epoch, and the pool's view
# lags the write): blocks the router saw more recently are not cut by it.
REPORT_LAG_S = 10.0
# Sessions remembered for session affinity (least recently placed forgotten first).
MAX_SESSIONS = 100_000


class PrefixRouting:
    """Prefix locality for one router (the module docstring)."""

    def __init__(self, view: PoolView, session: Callable[[], aiohttp.ClientSession],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view = view
        self.session = session
        self.clock = clock
        self.tokenizer: PromptTokenizer | None = None
        self.tree: GlobalPromptTree | None = None
        self.cost = PrefillCost()
        self._queued: dict[str, Queued] = {}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._tokenizer_asked_s = float("-inf")
        self._lock = asyncio.Lock()

    # -- what the router asks of workers -------------------------------------------------------------

    async def ensure_tokenizer(self) -> PromptTokenizer | None:
        """The pool's tokenizer, asked of a Ready worker until one answers (not more often than
        TOKENIZER_RETRY_S), then kept: one model per pool."""
        if self.tokenizer is not None or self.clock() - self._tokenizer_asked_s < TOKENIZER_RETRY_S:
            return self.tokenizer
        async with self._lock:
            if self.tokenizer is not None:
                return self.tokenizer
            self._tokenizer_asked_s = self.clock()
            for worker in self.view.snapshot().ready_workers():
                try:
                    async with self.session().get(f"http://{worker.address}{TOKENIZER_PATH}",
                                                  timeout=aiohttp.ClientTimeout(total=10)) as resp:
                        if resp.status != 200:
                            continue
                        self.tokenizer = PromptTokenizer.from_payload(await resp.json())
                except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as err:
                    log.info("no tokenizer from %s yet: %s", worker.pod_name, err)
                    continue
                snapshot = self.view.snapshot()
                self.tree = GlobalPromptTree(self.tokenizer.block_size_tokens, snapshot.prefix_ttl_s, MAX_TREE_BLOCKS)
                log.info("prefix routing: tokenizer from %s, %d-token blocks", worker.pod_name,
                         self.tokenizer.block_size_tokens)
                break
        return self.tokenizer

    async def refresh_profiles(self, timeout_s: float) -> None:
        """Refit exec(x, y) from the workers' speed profiles every PROFILE_REFRESH_S while the pool
        routes by its prompt tree, forever (a background task)."""
        refreshed_s = float("-inf")
        while True:
            await asyncio.sleep(1.0)
            snapshot = self.view.snapshot()
            weighs = snapshot.locality == "prompt-tree" or snapshot.disaggregation is not None
            if not weighs or self.clock() - refreshed_s < PROFILE_REFRESH_S:
                continue
            refreshed_s = self.clock()
            try:
                answer = await gather_profiles(self.session(), tuple(self.view.snapshot().ready_workers()), timeout_s)
                merged = answer.get("merged")
                if merged is not None:
                    self.cost = PrefillCost.from_profile(SpeedProfile.model_validate(merged))
            except (aiohttp.ClientError, TimeoutError, ValidationError, ValueError) as err:
                log.info("speed profiles not refreshed: %s", err)

    # -- the request path ----------------------------------------------------------------------------

    def prompt_ids(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]]) -> list[int] | None:
        """The prompt's token ids: as given, or as the pool's tokenizer makes them; None without one."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt) if self.tokenizer is not None else None
        if all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]  # type: ignore[arg-type]  # checked just above
        if self.tokenizer is None:
            return None
        return self.tokenizer.encode_chat([m for m in prompt if isinstance(m, Mapping)])

    def locality(self, snapshot: PoolSnapshot, prompt_ids: list[int] | None, user: str | None) -> LocalityInput | None:
        """What placement weighs for this request (None: MELL's choice alone)."""
        if snapshot.locality == "none":
            return None
        if snapshot.locality == "session":
            pod = self._sessions.get(user) if user else None
            return LocalityInput(len(prompt_ids or ()), {}, {}, self.cost, session_pod=pod) if pod else None
        tree = self.tree
        if tree is None or prompt_ids is None:
            return None
        now_s = self.clock()
        tree.ttl_s = snapshot.prefix_ttl_s
        tree.expire(now_s)
        for worker in snapshot.workers:
            # A worker's report bounds what the tree believes it holds: its evictions reach the tree.
            if worker.prefix_cache_blocks is not None:
                tree.trim(worker.pod_name, worker.prefix_cache_blocks, seen_before_s=now_s - REPORT_LAG_S)
        live = {w.pod_name for w in snapshot.workers}
        for gone in [w for w in tree.workers() if w not in live]:
            tree.forget(gone)
        cached = tree.match(prompt_ids, now_s)
        if not cached:
            return None
        return LocalityInput(len(prompt_ids), cached, queued_s(self._queued.values(), self.cost), self.cost)

    def disaggregated_input(self, snapshot: PoolSnapshot, prompt_ids: list[int] | None, prompt_tokens: int,
                            user: str | None) -> LocalityInput:
        """What a disaggregated pool's placement weighs (kvfleet.router.disaggregation), always: the
        prompt tree's matches where the pool caches, the prefill queued per worker, exec(x, y)."""
        matched = self.locality(snapshot, prompt_ids, user) if snapshot.locality == "prompt-tree" else None
        cached = matched.cached_tokens if matched is not None else {}
        return LocalityInput(prompt_tokens, cached, queued_s(self._queued.values(), self.cost), self.cost)

    def placed(self, request_id: str, pod_name: str, prompt_ids: list[int] | None, locality: LocalityInput | None,
               prompt_tokens: int | None = None) -> None:
        """The request was sent to `pod_name`: its prefill is queued there until its first token
        (`prompt_tokens`: its estimated length, where the router has no ids for it)."""
        if prompt_ids is None and prompt_tokens is None:
            return
        cached_tokens = locality.cached_tokens.get(pod_name, 0) if locality is not None else 0
        self._queued[request_id] = Queued(pod_name, len(prompt_ids) if prompt_ids is not None else prompt_tokens or 0,
                                          cached_tokens)
        if self.tree is not None and cached_tokens and prompt_ids is not None:
            self.tree.touch(pod_name, prompt_ids[:cached_tokens], self.clock())

    def started(self, request_id: str) -> None:
        """Its first token came back: its prefill is no longer ahead of anyone."""
        self._queued.pop(request_id, None)

    def remember(self, pod_name: str, token_ids: list[int]) -> None:
        """`pod_name`'s cache holds these tokens' KV now (a disaggregated pool's prefill worker: the
        prompt it cached, and under PD-Caching-3 the answer sent back)."""
        if self.tree is not None and token_ids:
            self.tree.insert(pod_name, token_ids, self.clock())

    def ended(self, request_id: str, pod_name: str | None, token_ids: list[int] | None, user: str | None) -> None:
        """The response came back through the router (§6's update path): `pod_name` now caches its
        prompt and output, and is the session's worker."""
        self._queued.pop(request_id, None)
        if pod_name is None:
            return
        if user:
            self._sessions[user] = pod_name
            self._sessions.move_to_end(user)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        if self.tree is not None and token_ids:
            self.tree.insert(pod_name, token_ids, self.clock())
