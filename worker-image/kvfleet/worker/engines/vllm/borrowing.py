"""The vLLM engine's `KVBorrowing` capability: a request longer than vLLM's whole KV cache, served with
blocks other workers lend (Infinite-LLM §4.3, §4.6), as the builtin engine serves it.

Who does what:
- **The scheduler side of kvfleet's connector** (connector.py, EngineCore's loop thread) tells a
  spanning request (prompt + max_tokens beyond the cache) from the rest and, after scheduling a step,
  whether the request's next step finds the blocks it needs. If not, it orders the request's oldest
  full blocks (computed in earlier steps, so their KV is written) moved to leases during this step;
  once the move is confirmed it frees them in vLLM's KV cache manager as vLLM's sliding window frees
  what leaves it (the blocks become vLLM's null block: internals.skip_blocks). So the request's local
  blocks always hold its newest tokens and its remote KV is a prefix.
- **The worker side** (`CoreBorrowing`, in the EngineCore next to the KV cache) reads the blocks to
  move and hands them to the agent over the core pipe (corepipe.py); during the forward it asks the
  agent for each spanning request's attention over its remote KV, layer by layer.
- **The attention backend** (attention.py) finds a spanning request by its block table: leading null
  blocks are remote tokens. It attends over the local blocks (the table and the lengths shifted past
  the remote prefix: positions are in the keys already, so attention over a part does not depend on
  where the part sits), asks for the remote part meanwhile, and merges the two with ScaleReduce.
- **The agent** (`VLLMKVBorrowing`, on the event loop) holds the leases, as the builtin engine does:
  whom to ask (the operator's plan), room in leases (`distkv.parts.LeaseFinder`), writes, the shipped
  queries (§4.6: the query travels, never the KV), and what the reports say is borrowed.

Faults, as in the builtin engine (docs/distkv.md): a lender that fails a call (it died or left) loses
the request's remote KV. The step's output for it is thrown away and it is computed again from its
start, prompt and output so far, borrowing afresh from the creditors that answer: the worker side
reports the request's first local block (a block only it holds) as a failed load, so that vLLM's
`kv_load_failure_policy="recompute"` rewinds it and drops its sampled token, and the scheduler side
then has vLLM's scheduler preempt it. Its stream waits; the client sees a delay, not a gap. A request
that loses its lenders more than MAX_LOSSES times (a loss counted once, whatever layers found it), or
for which no creditor has room, fails with the reason.

DGFM's recall (§4.5): told by the operator to bring KV home from a creditor, the agent reads the
newest tokens of the request's leases there back and holds them in its own memory (distkv/parts.py),
and the creditor trims the leases. The EngineCore does not notice: the tokens still count as the
request's remote prefix, now attended in the agent with no lender in between. They stay there for
the request's life: putting them back into vLLM's blocks would mean rewriting a running request's
block table in the scheduler and the model runner both, which vLLM has no interface for (the
builtin engine does move them into its own blocks).

Every remote call of a forward crosses the core pipe to the agent and back before the network: a
round trip of about 0.6 ms on the machines this was built on (docs/distkv.md).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvfleet.worker.distkv.creditors import Creditors
from kvfleet.worker.distkv.parts import LeaseFinder, NoRoomToBorrow, RemotePartLost, RemoteParts, recall_requests
from kvfleet.worker.distkv.wire import pack_partial, unpack_partial
from kvfleet.worker.engines.capabilities import LeaseOpener
from kvfleet.worker.engines.vllm import internals
from kvfleet.worker.engines.vllm.corepipe import CallFailed

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvfleet.worker.engines.vllm.connector import PlainKVLayout
    from kvfleet.worker.engines.vllm.corepipe import CorePipe

log = logging.getLogger(__name__)

# A request whose remote KV is lost this many times fails instead of being computed once more.
MAX_LOSSES = 3


# -- in the EngineCore -------------------------------------------------------------------------------


class CoreBorrowing:
    """The worker side's half (module docstring): moves and remote attention through the core pipe."""

    def __init__(self, pipe: CorePipe, layout: PlainKVLayout, layers: list[torch.Tensor]) -> None:
        self._pipe = pipe
        self._layout = layout
        self._layers = layers
        # The step's spanning requests: (the agent's id, blocks moved out, the local blocks' ids): how the
        # backend, which sees block tables and not requests, finds them (attention.py `_shifted`).
        self.spans: list[tuple[str, int, list[int]]] = []
        # Requests whose remote KV was lost this step (the agent's id -> why): their output is dropped.
        self.lost: dict[str, str] = {}

    def lose(self, request_id: str, reason: str) -> None:
        if request_id not in self.lost:
            log.warning("kvfleet: request %s lost KV other workers held: %s; it is computed again", request_id, reason)
        self.lost.setdefault(request_id, reason)

    def lost_blocks(self) -> set[int]:
        """The first local block of each request that lost remote KV this step: a block only it holds, so
        vLLM's failed-load handling rewinds it and no other request."""
        return {local[0] for request_id, _, local in self.spans if request_id in self.lost and local}

    def spill(self, request_id: str, block_ids: list[int], first_token: int) -> None:
        """Blocks of a request (its tokens from `first_token` on) into its leases; raises when they
        could not all be moved (the agent says why)."""
        kv = torch.stack([self._layout.read(layer, block_ids) for layer in self._layers])  # [L, 2, n, bs, h, d]
        self._pipe.call("distkv-spill", kv.flatten(2, 3), id=request_id, first_token=first_token)

    def submit(self, request_id: str, layer: int, q: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Ask for q [rows, q_heads, head_dim] over the request's remote KV; the returned call waits for
        (out, lse) in float32 and raises if the agent could not answer (a lender is lost)."""
        try:
            if request_id in self.lost:  # an earlier layer found its lender gone: no layer waits on it again
                raise CallFailed(self.lost[request_id], lost=True)
            wait = self._pipe.submit("distkv-attend", q.detach().float().contiguous(), id=request_id, layer=layer)
        except CallFailed as err:
            failed = err

            def refused() -> tuple[torch.Tensor, torch.Tensor]:
                raise failed

            return refused
        rows, heads, dim = (int(d) for d in q.shape)

        def collect() -> tuple[torch.Tensor, torch.Tensor]:
            _, data = wait()
            return unpack_partial(data, rows, heads, dim)

        return collect

    def release(self, request_id: str) -> None:
        """The request ended (or starts again): its leases go back. Not waited for: the step goes on, and an
        agent that is stopping its engine frees what it holds anyway."""
        try:
            self._pipe.notify("distkv-release", id=request_id)
        except Exception as err:  # the agent frees what it holds when its engine stops anyway
            log.warning("kvfleet: releasing the leases of %s failed: %s", request_id, err)


# The EngineCore's borrowing, for the attention backend (set by the connector's worker side).
CORE: CoreBorrowing | None = None


@dataclass
class _Span:
    """A spanning request as the scheduler side follows it: its first `remote_blocks` blocks are in
    leases (and null here), the next `moving` are being moved this step."""

    request: Request
    agent_id: str
    remote_blocks: int = 0
    moving: int = 0
    failed: str | None = None


@dataclass(frozen=True)
class SpillOrder:
    """Move these blocks (a request's tokens from `first_token` on) to its leases during the step."""

    request: str            # vLLM's id
    agent_id: str
    block_ids: list[int]
    first_token: int


@dataclass
class StepPlan:
    spills: list[SpillOrder] = field(default_factory=list)
    # Requests with remote KV: (the agent's id, blocks moved out, local block ids) (CoreBorrowing.spans).
    spans: list[tuple[str, int, list[int]]] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)   # agent ids whose leases go back


class SpanPlanner:
    """The scheduler side's half (module docstring), on EngineCore's loop thread."""

    def __init__(self, block_size_tokens: int, usable_blocks: int, batched_tokens: int) -> None:
        self.block_size = block_size_tokens
        self.usable_blocks = usable_blocks
        self.batched_tokens = batched_tokens
        self.spans: dict[str, _Span] = {}   # vLLM's id -> span
        self.releases: list[str] = []        # agent ids whose leases go back at the next step

    def admitted(self, request: Request, agent_id: str | None) -> None:
        """A request whose prompt and output cannot fit the whole cache spans (it borrows as it grows)."""
        needed = request.num_prompt_tokens + (request.max_tokens or 0)
        if agent_id is not None and -(-needed // self.block_size) > self.usable_blocks:
            self.spans[request.request_id] = _Span(request, agent_id)

    def plan(self, scheduled_tokens: Mapping[str, int], block_ids_of: Callable[[str], list[int]],
             free_blocks: int) -> StepPlan:
        """After vLLM scheduled a step: what its spanning requests move, and where their local blocks start."""
        plan = StepPlan(releases=self.releases)
        self.releases = []
        bs = self.block_size
        for rid, span in self.spans.items():
            req = span.request
            if req.num_computed_tokens == 0 and (span.remote_blocks or span.moving or span.failed):
                # Preempted: vLLM freed its blocks and computes it again from the start; its leases go.
                plan.releases.append(span.agent_id)
                span.remote_blocks = span.moving = 0
                span.failed = None
            scheduled = scheduled_tokens.get(rid, 0)
            if not scheduled:
                continue
            blocks = block_ids_of(rid)
            if span.remote_blocks:
                plan.spans.append((span.agent_id, span.remote_blocks, blocks[span.remote_blocks:]))
            if span.failed is not None:
                continue
            done = req.num_computed_tokens + scheduled   # once this step has run
            # Its prompt, or after a preemption its prompt and output so far, is computed in chunks.
            following = min(req.num_tokens - done, self.batched_tokens) if done < req.num_tokens else 1
            short = -(-(done + following) // bs) - len(blocks) - free_blocks
            first = span.remote_blocks + span.moving
            # Only blocks computed before this step hold their KV while it runs, and only full ones move.
            movable = req.num_computed_tokens // bs - first
            count = min(short, movable)
            if count <= 0:
                continue
            plan.spills.append(SpillOrder(rid, span.agent_id, blocks[first:first + count], first * bs))
            span.moving += count
            free_blocks += count
        return plan

    def confirmed(self, moved: Mapping[str, int], failed: Mapping[str, str], lost: Mapping[str, str],
                  manager: Any, scheduler: Any) -> None:
        """What the worker side moved: those blocks are freed in vLLM (null in the request's table). A
        request that lost remote KV (vLLM rewound it to its start: module docstring) gives back every
        block and lease, and is computed again."""
        for span in self.spans.values():
            if span.agent_id in lost:
                internals.preempt(scheduler, span.request)
                self.releases.append(span.agent_id)
                span.remote_blocks = span.moving = 0
                span.failed = None
        for rid, count in moved.items():
            moving = self.spans.get(rid)
            if moving is None or moving.agent_id in lost:
                continue
            moving.moving -= count
            moving.remote_blocks += count
            internals.skip_blocks(manager, rid, moving.remote_blocks)
        for rid, reason in failed.items():
            stuck = self.spans.get(rid)
            if stuck is not None:
                # Its blocks stay local and what the agent holds for it goes: vLLM preempts it when it runs
                # out, and it starts again (or the agent failed it, when no creditor has room).
                log.warning("kvfleet: moving KV of %s to a lender failed: %s", stuck.agent_id, reason)
                stuck.moving, stuck.failed = 0, reason
                if not stuck.remote_blocks:
                    self.releases.append(stuck.agent_id)

    def finished(self, request: Request) -> str | None:
        """The agent's id of a finished request whose leases go back, if it had any."""
        span = self.spans.pop(request.request_id, None)
        return span.agent_id if span is not None and (span.remote_blocks or span.moving) else None


# -- in the agent's process ------------------------------------------------------------------------------


class _Lost(RuntimeError):
    """Answered to the EngineCore: the request's remote KV is lost (corepipe.CallFailed.lost)."""

    lost = True


class VLLMKVBorrowing:
    """The leases of this engine's spanning requests (capabilities.KVBorrowing; module docstring)."""

    def __init__(self) -> None:
        self._open_lease: LeaseOpener | None = None
        self._creditors: Creditors | None = None
        self._parts: dict[str, RemoteParts] = {}
        self._finder: LeaseFinder | None = None
        self._block_size = 0
        self._token_bytes = 0
        self._losses: dict[str, int] = {}
        self._lost: set[str] = set()    # lost and not yet released: counted once
        self._closing: set[asyncio.Task[None]] = set()
        self.bytes_sent = self.bytes_received = 0
        # Fails a request with a message (the engine aborts it in vLLM and its stream raises).
        self.fail: Callable[[str, str], None] = lambda request_id, message: None

    def attach(self, open_lease: LeaseOpener, creditors: Creditors) -> None:
        self._open_lease, self._creditors = open_lease, creditors

    def open(self, block_size_tokens: int, kv_bytes_per_token: int) -> None:
        self._block_size, self._token_bytes = block_size_tokens, kv_bytes_per_token
        self._finder = LeaseFinder(uuid.uuid4().hex[:12], block_size_tokens)

    async def close(self) -> None:
        parts, self._parts = self._parts, {}
        await asyncio.gather(*(p.close() for p in parts.values()), return_exceptions=True)

    def borrowable_bytes(self) -> int:
        """What the creditors said they could lend (a hint: the contract decides)."""
        if self._creditors is None or self._open_lease is None:
            return 0
        return sum(c.lendable_bytes for c in self._creditors.candidates())

    def borrowed_bytes(self) -> Mapping[str, int]:
        borrowed: dict[str, int] = {}
        for remote in self._parts.values():
            remote.lent_bytes(self._token_bytes, borrowed)
        return borrowed

    def forget(self, request_id: str) -> None:
        """The request ended here: its count of losses goes, and any lease still held for it (a move that
        failed part-way, or that the EngineCore stopped waiting for)."""
        self._losses.pop(request_id, None)
        self._lost.discard(request_id)
        remote = self._drop(request_id)
        if remote is not None:
            task = asyncio.get_running_loop().create_task(remote.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def recall(self, creditor_pod: str, num_bytes: int) -> int:
        """DGFM's recall (§4.5): up to `num_bytes` of this engine's KV at `creditor_pod` read back and held in
        this process (parts.py), the creditor's blocks given back. The EngineCore's view does not change:
        the tokens stay out of vLLM's blocks, attended here instead of at the lender (module docstring)."""
        def lost(_: RemoteParts, err: RemotePartLost) -> None:  # the next step finds the lease dead and counts it
            log.warning("%s (during a DGFM recall)", err)

        return await recall_requests(self._parts.values(), creditor_pod, num_bytes, self._block_size,
                                     self._token_bytes, lost)

    def held_bytes(self) -> int:
        """Recalled KV held in this process (DGFM)."""
        return sum(h.nbytes for remote in self._parts.values() for h in remote.held)

    def _drop(self, request_id: str) -> RemoteParts | None:
        """A request's leases, out of this engine's books (their wire bytes kept in the totals); the caller closes them."""
        remote = self._parts.pop(request_id, None)
        if remote is not None:
            sent, received = remote.wire_bytes()
            self.bytes_sent, self.bytes_received = self.bytes_sent + sent, self.bytes_received + received
        return remote

    def remote_tokens(self, request_id: str) -> int:
        """The request's tokens out of vLLM's blocks: at lenders, or recalled and held here."""
        remote = self._parts.get(request_id)
        return 0 if remote is None else remote.num_tokens

    def lent_tokens(self, request_id: str) -> int:
        """The request's tokens at lenders."""
        remote = self._parts.get(request_id)
        return 0 if remote is None else remote.lent_tokens

    def wire_bytes(self) -> tuple[int, int]:
        sent, received = self.bytes_sent, self.bytes_received
        for remote in self._parts.values():
            s, r = remote.wire_bytes()
            sent, received = sent + s, received + r
        return sent, received

    async def on_ask(self, header: dict[str, Any], tensor: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The EngineCore's calls (CoreBorrowing)."""
        op, request_id = header.get("op"), str(header.get("id", ""))
        try:
            if op == "distkv-spill":
                if tensor is None:
                    raise ValueError("a spill without its KV")
                await self._spill(request_id, int(header["first_token"]), tensor)
                return {}, None
            if op == "distkv-attend":
                remote = self._parts.get(request_id)
                if tensor is None or remote is None or not remote.num_tokens:
                    raise ValueError(f"request {request_id} has no remote KV to attend")
                try:
                    out, lse = await remote.attend(int(header["layer"]), tensor)
                except Exception as err:  # any failure of a lease: its KV is out of reach
                    raise RemotePartLost(request_id, str(err) or type(err).__name__) from err
                return {}, pack_partial(out, lse)
        except NoRoomToBorrow as err:
            self.fail(request_id, str(err))
            raise
        except RemotePartLost as err:
            if request_id not in self._lost:  # every layer of the step finds it: one loss
                self._lost.add(request_id)
                losses = self._losses[request_id] = self._losses.get(request_id, 0) + 1
                if losses > MAX_LOSSES:
                    self.fail(request_id, f"request {request_id} lost the KV other workers lent it {losses} times; "
                                          "giving up")
            raise _Lost(str(err)) from err
        if op == "distkv-release":
            self._lost.discard(request_id)
            remote = self._drop(request_id)
            if remote is not None:
                await remote.close()
            return {}, None
        raise ValueError(f"unknown ask {op!r}")

    async def _spill(self, request_id: str, first_token: int, kv: torch.Tensor) -> None:
        """kv [layers, 2, tokens, heads, dim], whole blocks of this engine, into the request's leases."""
        if self._finder is None or self._open_lease is None or self._creditors is None:
            raise RuntimeError("this worker is not set up to borrow KV (no creditors)")
        remote = self._parts.get(request_id)
        if remote is None:
            remote = self._parts[request_id] = RemoteParts(request_id, asyncio.get_running_loop())
        if first_token != remote.num_tokens:
            raise ValueError(f"request {request_id}: a move from token {first_token} after {remote.num_tokens} moved")
        async with remote.moving:
            await self._spill_locked(remote, kv)

    async def _spill_locked(self, remote: RemoteParts, kv: torch.Tensor) -> None:
        assert self._finder is not None and self._open_lease is not None and self._creditors is not None
        request_id, bs = remote.request_id, self._block_size
        num_blocks, moved = int(kv.shape[2]) // bs, 0
        while moved < num_blocks:
            part, granted = await self._finder.room(remote, num_blocks - moved, self._open_lease, self._creditors)
            try:
                await part.lease.write(part.num_tokens, kv[:, :, moved * bs:(moved + granted) * bs])
            except Exception as err:  # refused or failed, the lease cannot take its KV: start again
                raise RemotePartLost(request_id, str(err) or type(err).__name__) from err
            part.num_tokens += granted * bs
            moved += granted
