"""What an engine can do beyond the `Engine` contract, declared so that callers never ask its type.

Engines differ: the builtin engine can hand a running request's KV blocks to another engine, vLLM
cannot (its public API exposes no running request's KV). The executor, the agent and the router
must not branch on which engine runs, so every engine answers `engine.capabilities` with an
`EngineCapabilities`: one field per optional feature, holding the object that implements it (one
the engine builds and hands out, such as the builtin engine's BuiltinKVMigration) or None where the
engine lacks it. A caller asks the capability, never the type:

    migration = engine.capabilities.migration
    if migration is not None:
        kv = await migration.export_kv(request_id)

Adding a feature (elastic capacity, lending KV blocks, a prefix cache) follows the same steps: a
Protocol here with what its callers need, a field on `EngineCapabilities` defaulting to None (so no
engine has to change), and the engines that have it fill the field in.

`KVMigratable` is the first such feature: what live migration (migration/executor.py) needs from the
engines at both ends. Source S, destination D, on the engines' event loops:

    # staged copy while the request keeps decoding on S (full blocks only, by default):
    kv = await S.export_kv(request_id, first_block=0)          # -> KVBlocks
    D.reserve_kv(request_id, kv.end_block)                      # refuse before the bytes move
    await D.import_kv(request_id, kv)                          # D fills the blocks
    kv = await S.export_kv(request_id, first_block=kv.end_block)   # ... more stages
    state = await S.suspend(request_id)                        # stop decoding, keep the KV on S
    kv = await S.export_kv(request_id, first_block=...)        # last stage, partial block included
    await D.import_kv(request_id, kv)
    stream = D.resume(request_id, state.prompt_token_ids, state.output_token_ids, state.params)
    S.release(request_id)                                      # free the KV on S

An engine with the capability can both export and import: a migration in KV mode needs it at both
ends, and falls back to moving tokens otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client.registry import Collector

from kvfleet.worker.engines.base import EngineError, SamplingParams, StepOutput

if TYPE_CHECKING:
    # Annotations only: the report path (reporter.py, and the tests' scripted worker) imports this
    # module and need not pay torch's import (1.4 s of CPU on these machines).
    import torch

    from kvfleet.worker.distkv.creditors import Creditors


class MigrationError(EngineError):
    """A migration call that cannot be carried out (unknown request, wrong state, no room)."""


@dataclass(frozen=True)
class SuspendedRequest:
    """All a destination needs to continue a request, besides its KV."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    # With the seed the source used (its own choice when the client gave none).
    params: SamplingParams
    # Tokens whose K and V are in the cache: prompt + output except the last output token.
    num_cached_tokens: int


@dataclass(frozen=True)
class KVBlocks:
    """A run of one request's KV blocks, all layers: what one stage of a KV migration carries."""

    request_id: str
    first_block: int
    # Valid tokens in these blocks, from the first block's start; the last block may be partial.
    num_tokens: int
    block_size_tokens: int
    # [layers, 2 (K, V), blocks, block_size_tokens, kv_heads, head_dim], on the CPU.
    data: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])

    @property
    def end_block(self) -> int:
        """The first block after these: where the next stage starts."""
        return self.first_block + self.num_blocks

    @property
    def end_token(self) -> int:
        """Tokens covered from the start of the request up to the end of these blocks' valid tokens."""
        return self.first_block * self.block_size_tokens + self.num_tokens

    @property
    def nbytes(self) -> int:
        return int(self.data.numel() * self.data.element_size())


@dataclass(frozen=True)
class KVFormat:
    """How an engine's KV moves: KVBlocks of this shape and dtype pass between two engines whose formats
    agree (`kv_format_mismatch`). Engines of one model agree on all but, maybe, the block size."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_size_tokens: int
    # Imports KV in blocks of any size (vLLM's connector stages it by tokens); else only its own.
    any_block_size: bool = False

    def to_json(self) -> dict[str, object]:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "block_size_tokens": self.block_size_tokens, "any_block_size": self.any_block_size}

    @staticmethod
    def from_json(data: Mapping[str, object]) -> KVFormat:
        return KVFormat(int(str(data["layers"])), int(str(data["kv_heads"])), int(str(data["head_dim"])),
                        str(data["dtype"]), int(str(data["block_size_tokens"])), bool(data.get("any_block_size")))


def kv_format_mismatch(source: KVFormat, target: KVFormat) -> str | None:
    """Why KV cannot move from an engine of format `source` to one of `target`, or None when it can.

    Blocks may differ in size when the target takes any size, or when the source's blocks split into
    whole target blocks (`split_blocks`)."""
    for name in ("layers", "kv_heads", "head_dim", "dtype"):
        if getattr(source, name) != getattr(target, name):
            return f"the engines' KV differs in {name} ({getattr(source, name)} here, {getattr(target, name)} there)"
    bs, target_bs = source.block_size_tokens, target.block_size_tokens
    if bs != target_bs and not target.any_block_size and bs % target_bs:
        return f"blocks of {bs} tokens here do not split into the target's blocks of {target_bs}"
    return None


def split_blocks(kv: KVBlocks, block_size_tokens: int) -> KVBlocks:
    """The same KV in blocks of `block_size_tokens`, which must divide kv's block size (whole blocks out)."""
    if kv.block_size_tokens == block_size_tokens:
        return kv
    factor, rest = divmod(kv.block_size_tokens, block_size_tokens)
    if rest:
        raise MigrationError(f"blocks of {kv.block_size_tokens} tokens do not split into blocks of {block_size_tokens}")
    layers, two, blocks, _, heads, head_dim = kv.data.shape
    tokens = kv.data.reshape(layers, two, blocks * factor, block_size_tokens, heads, head_dim)
    kept = -(-kv.num_tokens // block_size_tokens)   # the source's last block may hold fewer valid tokens
    return KVBlocks(kv.request_id, kv.first_block * factor, kv.num_tokens, block_size_tokens, tokens[:, :, :kept])


class KVMigratable(Protocol):
    """Moving a running request's KV blocks between engines (the calls in the module docstring).

    Refusals raise MigrationError (an EngineError) unless said otherwise.
    """

    def kv_format(self) -> KVFormat:
        """The format this engine's KV moves in; raises MigrationError, with the reason, when it cannot move KV."""
        ...

    async def export_kv(self, request_id: str, first_block: int = 0, end_block: int | None = None) -> KVBlocks:
        """Blocks [first_block, end_block) of the request's block table, all layers, copied to the CPU.

        end_block defaults to the blocks that can no longer change: the full ones while the request
        runs, all that hold KV once it is suspended. A partial block may be asked for explicitly;
        KVBlocks.num_tokens says how many of its tokens are valid. A request that holds no KV
        (queued, or preempted) can only move in token mode: this raises MigrationError.
        """
        ...

    def reserve_kv(self, request_id: str, num_blocks: int) -> None:
        """Allocate (without writing) blocks [0, num_blocks) for KV about to be imported under request_id.

        A destination reserves each stage's blocks before the bytes are sent, so a full destination
        refuses at once instead of after the copy; `import_kv` then writes into them, and `release`
        frees them if the migration is abandoned.
        """
        ...

    async def import_kv(self, request_id: str, kv: KVBlocks) -> None:
        """Allocate (unless reserved) and write blocks for a request about to be resumed here.

        Stages must be contiguous; a stage may re-send the last (partial) block.
        """
        ...

    async def suspend(self, request_id: str) -> SuspendedRequest:
        """At a step boundary, stop scheduling the request and keep its KV.

        Its generate() stream ends without a finished output (the request did not finish: its
        continuation is the stream `resume` returns). Waiting requests can be suspended too.
        """
        ...

    def resume(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
               params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Continue a request; the stream yields only tokens after output_token_ids.

        With KV imported for request_id it re-prefills only the tokens the KV does not cover (KV
        mode: the last token; hybrid mode: the tail after the last block sent); without, all of
        prompt + output (token mode). On the engine where the request is suspended it continues
        from its own KV (rollback of a failed migration). Raises like generate(), before yielding
        anything. It takes no KV argument: what import_kv staged under request_id is the KV, so a
        resume cannot pair tokens with another request's blocks.
        """
        ...

    def release(self, request_id: str) -> None:
        """Free a suspended request's KV on the source, or KV imported on the destination for a
        migration that will not be resumed. Unknown ids are ignored."""
        ...

    def resume_notes(self, request_id: str) -> list[str]:
        """What went otherwise than planned when the request resumed here (vLLM: a KV load that failed and
        was recomputed), for the migration's message; asked once, after its first token."""
        ...


@dataclass(frozen=True)
class MemoryState:
    """An elastic engine's memory at one moment, as its KV-load report carries it."""

    # What KV can hold now without offloading: the pool less what activations hold (eLLM §4.3.1);
    # MELL plans with it (the worker reports it as its capacity).
    kv_capacity_bytes: int
    # KV of waiting or preempted requests parked in host memory (§4.3.2), and the buffer's size.
    cpu_buffer_bytes: int
    cpu_buffer_capacity_bytes: int
    # Chunks the activation side holds now, and the whole pool (KV + activations).
    activation_bytes: int
    budget_bytes: int


class ElasticMemory(Protocol):
    """An engine whose KV capacity moves with its activations and a CPU buffer (eLLM)."""

    def memory_state(self) -> MemoryState:
        """The pool now (on the event loop; cheap: read on every report tick)."""
        ...


@dataclass(frozen=True)
class PrefixCacheStats:
    """A prefix-caching engine's figures so far (MemServe's MemPool), for metrics and reports."""

    hit_tokens: int          # prompt tokens whose KV came from the cache
    prefilled_tokens: int    # tokens prefilled (prompts past their cached prefix, re-prefills)
    # Blocks the cache holds, and of those the ones no running request reads. None where the engine
    # cannot see its cache's blocks (vLLM keeps its block pool in another process): not reported.
    cached_blocks: int | None
    evictable_blocks: int | None
    # The host tier (MemServe Table 1's swap_out / swap_in; the builtin engine's is elastic memory's CPU
    # buffer): cached blocks in host memory now, None where the engine has none; blocks swapped out to
    # it and back in for a request so far.
    host_blocks: int | None = None
    num_swap_outs: int = 0
    num_swap_ins: int = 0


class PrefixCache(Protocol):
    """An engine that keeps finished requests' KV by prompt prefix and starts new ones after it."""

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The cache now (on the event loop; cheap)."""
        ...


class LendingError(EngineError):
    """A lending call refused: no room under the cap, an unknown lease, KV past what the lease holds.
    A lend refused for room says how many blocks the lender could lend instead (`room_blocks`)."""

    def __init__(self, message: str, room_blocks: int = 0) -> None:
        super().__init__(message)
        self.room_blocks = room_blocks


class KVLending(Protocol):
    """rManager's lender side (Infinite-LLM §4.3): blocks of this engine's KV memory lent to a request
    running on another instance, which writes its KV into them and ships its queries here for the
    micro-attention over them (§4.2, §4.6: the query travels, the KV stays). On the event loop.

    A lease is one borrowing request's blocks here, in token order; `write` fills tokens
    [start, start + n) of the lease, `attend` computes attention of query rows over its first
    `num_tokens` tokens (non-causal: a lease holds context older than any query) and returns each
    row's output and log-sum-exp for ScaleReduce at the borrower.
    """

    @property
    def cap_blocks(self) -> int:
        """The most blocks this engine lends out at once (§4.3's hyper-parameter)."""
        ...

    def lent_blocks(self) -> int:
        """Blocks lent out now, over every lease."""
        ...

    async def lend(self, lease_id: str, num_blocks: int) -> None:
        """Grow lease `lease_id` (made on first use) by `num_blocks` blocks, first come first served; raises
        LendingError when the cap or the free blocks do not allow it, with the blocks it could lend
        instead as `room_blocks` (§4.3: a remote allocation that cannot be met is answered false, never
        queued). Async: an engine's block pool may live in another process (vLLM's EngineCore)."""
        ...

    async def write(self, lease_id: str, start_token: int, kv: torch.Tensor) -> None:
        """Store kv [layers, 2, tokens, kv_heads, head_dim] as the lease's tokens from `start_token` on."""
        ...

    async def attend(self, lease_id: str, layer: int, q: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [rows, q_heads, head_dim] over the lease's first `num_tokens` tokens of `layer` ->
        (out [rows, q_heads, head_dim], lse [rows, q_heads]), in float32."""
        ...

    async def read(self, lease_id: str, start_token: int, num_tokens: int) -> torch.Tensor:
        """The lease's tokens [start, start + n) as kv [layers, 2, n, kv_heads, head_dim], a copy on the
        CPU: DGFM's recall (§4.5) takes them home."""
        ...

    async def trim(self, lease_id: str, num_tokens: int) -> int:
        """Keep the lease's first `num_tokens` tokens and give back the blocks past them (the recalled
        tokens' blocks); the blocks the lease still holds."""
        ...

    async def free(self, lease_id: str) -> int:
        """Give the lease's blocks back to this engine; the number freed (0 for an unknown lease)."""
        ...


class RemoteKVLease(Protocol):
    """One lease at one lender, as the borrowing engine uses it (kvfleet.worker.distkv.borrower's
    RemoteLease over the migration port, which engines do not import). A refusal raises LendingError;
    any other exception means the lender is lost."""

    address: str
    blocks: int
    block_size_tokens: int
    bytes_sent: int
    bytes_received: int

    async def lend(self, num_blocks: int) -> None: ...

    async def write(self, start_token: int, kv: torch.Tensor) -> None: ...

    async def attend(self, layer: int, q: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    async def read(self, start_token: int, num_tokens: int) -> torch.Tensor: ...

    async def trim(self, num_tokens: int) -> None: ...

    async def free(self) -> None: ...


# Opens a lease: (lender address, lease id) -> a lease not yet holding any block.
LeaseOpener = Callable[[str, str], RemoteKVLease]


class KVBorrowing(Protocol):
    """rManager's borrower side (Infinite-LLM §4.3): a request larger than this engine's KV memory keeps
    its oldest KV in blocks other workers lend (KVLending there), reached over the pool's migration
    transport; whom to ask comes from the operator's plan (distkv/creditors.py). On the event loop."""

    def attach(self, open_lease: LeaseOpener, creditors: Creditors) -> None:
        """How to reach lenders, and whom to ask first."""
        ...

    def borrowed_bytes(self) -> Mapping[str, int]:
        """Creditor pod -> bytes of KV blocks it lends this engine's requests now (the debt ledger's row)."""
        ...

    async def recall(self, creditor_pod: str, num_bytes: int) -> int:
        """DGFM's recall (Infinite-LLM §4.5, executed): bring up to `num_bytes` of this engine's KV that
        `creditor_pod` lends back into this worker's memory and give the creditor its blocks back; the
        bytes brought home. A lender that fails meanwhile costs what a lost lender always costs."""
        ...


class PrefixKV(Protocol):
    """KV moving by token prefix in and out of an engine's prefix cache, between workers.

    "MemServe: Flexible Mem Pool for Building Disaggregated LLM Serving with Caching" §5 builds
    disaggregated serving with caching on MemPool's transfer API: `transfer_with_insert` has the
    receiver index what it received, and a sender sends only the blocks the receiver's index lacks
    (PD-Caching-2); at a request's end the decode worker sends the decode phase's KV back to the
    prefill worker (PD-Caching-3). These are the engine's halves of that, over its prefix cache (the
    MemPool index): a migration's destination starts a request from the prefix it caches
    (`stage_prefix`), and a worker sends cached blocks to another's cache (`export_prefix`,
    `import_prefix`). Full blocks only, in the engine's own block size; the device tier only.
    """

    def cached_blocks(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of `tokens` the cache holds on the device now."""
        ...

    def stage_prefix(self, request_id: str, tokens: Sequence[int]) -> int:
        """Stage the cached prefix of `tokens` as the first blocks of a request about to be imported
        under request_id (KVMigratable.reserve_kv's blocks [0, n), already written and shared with
        the cache, locked until the request ends or `release`); how many blocks: 0 when nothing of it
        is cached, or the request already has KV here."""
        ...

    async def export_prefix(self, tokens: Sequence[int], first_block: int) -> KVBlocks | None:
        """The cached full blocks of `tokens` from `first_block` on, copied to the CPU; None when the
        cache holds none past it."""
        ...

    async def import_prefix(self, tokens: Sequence[int], kv: KVBlocks) -> int:
        """Write blocks another worker cached for `tokens` into free blocks here and insert them in
        this cache after the prefix it holds already; how many blocks it took in (0: it had them,
        the blocks leave a gap after its prefix, or there is no room, which a cache may meet)."""
        ...


@dataclass(frozen=True)
class LayerPart:
    """KV a by-layer hand-over sends as the prefill computes it: one layer's K and V of a run of a
    request's blocks ([2, blocks, block_size, kv_heads, head_dim]), or (`layer` None) all layers' of
    blocks the prefill did not compute (a cached prefix; KVBlocks' layout)."""

    layer: int | None
    first_block: int
    # Valid tokens in these blocks, from the first block's start.
    num_tokens: int
    block_size_tokens: int
    data: torch.Tensor


class LayerKV(Protocol):
    """KV streamed layer by layer while a prompt is prefilled ("MemServe: Flexible Mem Pool for Building
    Disaggregated LLM Serving with Caching" §5.2, Figure 5's by-layer transfer): the prefill worker's
    engine hands each layer's new KV out as soon as it is in its cache, the decode worker's writes it
    into the blocks staged for the request (KVMigratable.reserve_kv's)."""

    def watch_layers(self, request_id: str, first_block: int) -> asyncio.Queue[LayerPart | None]:
        """From now on, every step that prefills the request's prompt puts its KV there, blocks from
        `first_block` on (blocks before the step's first token that it holds first, as one all-layer
        part), and None once the prompt is prefilled. Until `unwatch`."""
        ...

    def unwatch(self, request_id: str) -> None:
        ...

    async def import_layer(self, request_id: str, part: LayerPart) -> None:
        """Reserve (as reserve_kv) and write one part for a request about to be resumed here."""
        ...


@dataclass(frozen=True)
class EngineCapabilities:
    """The optional features an engine has: each field is the feature's implementation, or None.

    New features are new fields defaulting to None (see the module docstring).
    """

    # Export and import a running request's KV (live migration in KV and hybrid mode).
    migration: KVMigratable | None = None
    # Report a KV capacity that moves with activations, and KV parked in a CPU buffer (eLLM).
    elastic_memory: ElasticMemory | None = None
    # Keep finished requests' KV by prompt prefix and prefill only past it (MemServe's context caching).
    prefix_cache: PrefixCache | None = None
    # Moves KV in and out of that cache by prefix, between workers (disaggregated serving, migrations).
    prefix_kv: PrefixKV | None = None
    # Streams a prompt's KV layer by layer as it is prefilled, and takes it in (by-layer hand-overs).
    layer_kv: LayerKV | None = None
    # Lends KV blocks to requests running elsewhere (DistKV, docs/distkv.md).
    lending: KVLending | None = None
    # Borrows KV blocks for requests larger than its own memory (DistKV, docs/distkv.md).
    borrowing: KVBorrowing | None = None
    # The engine's own Prometheus families (vLLM's stat logger), served at the worker's /metrics in
    # place of the worker's emulation of vLLM's names (worker/metrics.py VLLMNames).
    prometheus_metrics: Collector | None = None
