"""The vLLM engine's `KVMigratable` capability: KV moves through kvfleet's connector inside vLLM.

capabilities.py documents the calls; vllm/connector.py is the half that runs inside vLLM's EngineCore
and says how each ask is carried out there. This half is the agent's: it speaks to the connector over
its pipe (`ConnectorClient`), and keeps what the agent must see of moves in flight:
- a suspended request's KV stays in vLLM's blocks until `release` (or its resume here): it counts in
  kv_usage() under its id, as MELL must see it;
- KV reserved or imported for a request about to be resumed here is staged inside the EngineCore (by
  tokens, whatever the source's block size: `KVFormat.any_block_size`) and counts the same way;
  `reserve_kv` refuses when the blocks vLLM has free (as far as the engine's own accounting knows:
  vllm.py's module docstring) cannot hold it, so a full target refuses before the bytes move.
- What is staged is loaded when the request resumes (vLLM allocates its blocks and the connector
  fills them before the step's forward); if that load fails, vLLM recomputes the blocks
  (`kv_load_failure_policy="recompute"`) and `resume_notes` says so for the migration's message.
- A request with a structured-output constraint moves like any other: wherever it resumes (here after a
  rollback, or on another engine) its grammar is rebuilt from its output (kvfleet's grammar, applied in
  vLLM by kvfleet's logits processor: vllm/structured.py), not restarted.

Every call runs on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvfleet.worker.engines.base import RequestKV, SamplingParams, StepOutput, kv_blocks_bytes
from kvfleet.worker.engines.capabilities import KVBlocks, KVFormat, MigrationError, SuspendedRequest
from kvfleet.worker.engines.vllm.pipe import LOOP_OPS, Pipe, connect

if TYPE_CHECKING:
    from kvfleet.worker.engines.vllm.engine import VLLMEngine

log = logging.getLogger(__name__)

# How long an ask may wait for the EngineCore (a suspend waits for the request's next step).
ASK_TIMEOUT_S = 30.0
# How long start() waits for the EngineCore's connector to listen and say hello.
CONNECT_TIMEOUT_S = 30.0


AskHandler = Callable[[dict[str, Any], torch.Tensor | None], Awaitable[tuple[dict[str, Any], torch.Tensor | None]]]


class ConnectorClient:
    """The agent's end of the pipe to the connector in the EngineCore, on the event loop.

    `ask` sends one ask and waits for its answer: (header, tensor or None). Asks the EngineCore's
    loop thread carries out are first acknowledged as queued; `wake` (a cheap call into the EngineCore)
    then makes an idle EngineCore step, so the ask is carried out even with no request running.
    """

    def __init__(self, wake: Callable[[], Awaitable[Any]], on_event: Callable[[dict[str, Any]], None],
                 on_ask: AskHandler | None = None) -> None:
        self._wake = wake
        self._on_event = on_event
        # The EngineCore's own asks (corepipe.py `call`), answered {"reply_to": seq, "ok", ...}.
        self._on_ask = on_ask
        self._asks: set[asyncio.Task[None]] = set()
        self._pipe: Pipe | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seq = 0
        self._waiting: dict[int, asyncio.Queue[tuple[dict[str, Any], torch.Tensor | None]]] = {}
        self._hello: asyncio.Future[dict[str, Any]] | None = None
        self._closed = threading.Event()

    async def open(self, socket_path: str, authkey: bytes) -> dict[str, Any]:
        """Connects and returns the connector's hello (its layout, or why it refuses every move)."""
        self._loop = loop = asyncio.get_running_loop()
        self._hello = loop.create_future()
        conn = await asyncio.to_thread(connect, socket_path, authkey)
        self._pipe = Pipe(conn, self._from_thread, self._closed_from_thread, "kvfleet-agent")
        return await asyncio.wait_for(self._hello, CONNECT_TIMEOUT_S)

    def close(self) -> None:
        if self._pipe is not None:
            self._pipe.close()

    def _from_thread(self, header: dict[str, Any], tensor: torch.Tensor | None) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, header, tensor)

    def _closed_from_thread(self) -> None:
        self._closed.set()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all)

    def _fail_all(self) -> None:
        for waiting in self._waiting.values():
            waiting.put_nowait(({"ok": False, "error": "the connection to vLLM's EngineCore ended"}, None))

    def _dispatch(self, header: dict[str, Any], tensor: torch.Tensor | None) -> None:
        if header.get("op") == "hello":
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(header)
        elif header.get("event"):
            self._on_event(header)
        elif header.get("core_ask"):
            task = asyncio.get_running_loop().create_task(self._answer(header, tensor))
            self._asks.add(task)
            task.add_done_callback(self._asks.discard)
        elif (waiting := self._waiting.get(int(header.get("seq", 0)))) is not None:
            waiting.put_nowait((header, tensor))

    async def _answer(self, header: dict[str, Any], tensor: torch.Tensor | None) -> None:
        reply: dict[str, Any] = {"reply_to": int(header.get("seq", 0))}
        data: torch.Tensor | None = None
        try:
            if self._on_ask is None:
                raise MigrationError(f"this agent answers no {header.get('op')!r}")
            fields, data = await self._on_ask(header, tensor)
            reply.update(ok=True, **fields)
        except Exception as err:  # the EngineCore's call fails with the reason
            reply.update(ok=False, error=f"{type(err).__name__}: {err}", lost=bool(getattr(err, "lost", False)))
            data = None
        if self._pipe is not None:
            self._pipe.send(reply, data)

    async def ask(self, op: str, tensor: torch.Tensor | None = None, **fields: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
        if self._pipe is None or self._closed.is_set():
            raise MigrationError("no connection to vLLM's EngineCore")
        self._seq += 1
        seq = self._seq
        answers: asyncio.Queue[tuple[dict[str, Any], torch.Tensor | None]] = asyncio.Queue()
        self._waiting[seq] = answers
        try:
            self._pipe.send({"op": op, "seq": seq, **fields}, tensor)
            header, data = await asyncio.wait_for(answers.get(), ASK_TIMEOUT_S)
            if header.get("queued") and op in LOOP_OPS:
                await self._wake()
                header, data = await asyncio.wait_for(answers.get(), ASK_TIMEOUT_S)
        except TimeoutError:
            raise MigrationError(f"vLLM's EngineCore did not answer {op!r} within {ASK_TIMEOUT_S:.0f} s") from None
        finally:
            del self._waiting[seq]
        if not header.get("ok"):
            raise MigrationError(str(header.get("error", f"{op} refused")))
        return header, data


@dataclass
class _Held:
    """KV of a request that is not running here but holds (or will hold) blocks: suspended or staged."""

    tokens: int


class VLLMKVMigration:
    """KVMigratable over vLLM through kvfleet's connector (module docstring)."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine
        self._client: ConnectorClient | None = None
        self._format: KVFormat | None = None
        self._refusal = "vLLM is not started"
        self._suspended: dict[str, _Held] = {}
        self._staged: dict[str, _Held] = {}
        self._notes: dict[str, list[str]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def open(self, socket_path: str, authkey: bytes, dtype: str) -> None:
        """Connects to the connector of a started engine."""
        client = ConnectorClient(self._engine.wake, self._on_event)
        hello = await client.open(socket_path, authkey)
        self._client = client
        if hello.get("refusal"):
            self._refusal = str(hello["refusal"])
            return
        self._format = KVFormat(int(hello["layers"]), int(hello["kv_heads"]), int(hello["head_dim"]), dtype,
                                int(hello["block_size_tokens"]), any_block_size=True)

    def client(self) -> ConnectorClient:
        """The pipe to the connector, once open (vllm/lending.py asks its blocks through it too)."""
        if self._client is None:
            raise RuntimeError("the connector's pipe is not open")
        return self._client

    def close(self) -> None:
        self._refusal = "vLLM is stopped"
        self._format = None
        if self._client is not None:
            self._client.close()

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("op") == "memory":
            self._engine.memory_report(event)
        elif event.get("op") == "load_failed":
            self._notes.setdefault(str(event.get("request")), []).append(
                f"loading the KV into vLLM failed ({event.get('error')}): vLLM recomputed it")

    def _ready(self) -> tuple[ConnectorClient, KVFormat]:
        if self._client is None or self._format is None:
            raise MigrationError(self._refusal)
        return self._client, self._format

    def kv_format(self) -> KVFormat:
        return self._ready()[1]

    def resume_notes(self, request_id: str) -> list[str]:
        """What went differently from the plan when the request resumed here (a failed KV load)."""
        return self._notes.pop(request_id, [])

    # -- source ------------------------------------------------------------------------------------

    async def export_kv(self, request_id: str, first_block: int = 0, end_block: int | None = None) -> KVBlocks:
        client, fmt = self._ready()
        header, data = await client.ask("export", id=request_id, first_block=first_block, end_block=end_block)
        bs = fmt.block_size_tokens
        if data is None:
            data = torch.empty((fmt.layers, 2, 0, bs, fmt.kv_heads, fmt.head_dim), dtype=getattr(torch, fmt.dtype))
        return KVBlocks(request_id, int(header["first_block"]), int(header["num_tokens"]), bs, data)

    async def suspend(self, request_id: str) -> SuspendedRequest:
        client, _ = self._ready()
        request = self._engine.running_request(request_id)
        if request is None:
            raise MigrationError(f"request {request_id!r} is not queued or running on this engine")
        if self._engine.spans(request_id):
            # Its KV lives on several workers (DistKV): no one target holds it, and the operator orders no
            # move for it (docs/distkv.md).
            raise MigrationError(f"request {request_id!r} borrows KV from other workers and is not moved")
        request.suspending = True
        try:
            header, _ = await client.ask("suspend", id=request_id)
        except MigrationError:
            request.suspending = False
            raise
        if not header.get("suspended"):
            raise MigrationError(f"request {request_id!r} finished in vLLM ({header.get('status')}) before it stopped")
        # Its stream ends once it has passed on the last token (vllm.py); the tokens are the stream's.
        await request.ended.wait()
        outputs = tuple(request.output_token_ids)
        cached = int(header["num_cached_tokens"])
        if cached != len(request.prompt_token_ids) + len(outputs) - 1:
            self.release(request_id)
            raise MigrationError(f"vLLM kept KV of {cached} tokens for a request of {len(request.prompt_token_ids)} "
                                 f"prompt and {len(outputs)} output tokens")
        # Counted as while it ran (prompt + output), so that its report does not change when it stops.
        self._suspended[request_id] = _Held(cached + 1)
        return SuspendedRequest(request_id, tuple(request.prompt_token_ids), outputs, request.params, cached)

    # -- target ------------------------------------------------------------------------------------

    def reserve_kv(self, request_id: str, num_blocks: int) -> None:
        _, fmt = self._ready()
        info = self._engine.info
        if self._engine.running_request(request_id) is not None:
            raise MigrationError(f"request {request_id!r} is already running on this engine")
        block_bytes = info.block_size_tokens * info.kv_bytes_per_token
        capacity_blocks = info.kv_capacity_bytes // block_bytes
        used_blocks = sum(r.kv_bytes for r in self._engine.kv_usage() if r.request_id != request_id) // block_bytes
        if num_blocks > capacity_blocks - used_blocks:
            raise MigrationError(f"no room for {num_blocks} KV blocks: {capacity_blocks - used_blocks} of "
                                 f"{capacity_blocks} are free")
        held = self._staged.setdefault(request_id, _Held(0))
        held.tokens = max(held.tokens, num_blocks * fmt.block_size_tokens)

    async def import_kv(self, request_id: str, kv: KVBlocks) -> None:
        client, fmt = self._ready()
        layers, two, blocks, block_size, heads, head_dim = kv.data.shape
        theirs = (layers, heads, head_dim, str(kv.data.dtype).removeprefix("torch."))
        if theirs != (fmt.layers, fmt.kv_heads, fmt.head_dim, fmt.dtype) or two != 2 or block_size != kv.block_size_tokens:
            raise MigrationError(f"KV blocks of shape {tuple(kv.data.shape)} ({kv.data.dtype}) do not fit this engine's "
                                 f"cache ({fmt.layers} layers, {fmt.kv_heads} KV heads of {fmt.head_dim}, {fmt.dtype})")
        tokens = kv.data.reshape(layers, 2, blocks * block_size, heads, head_dim)[:, :, :kv.num_tokens]
        first_token = kv.first_block * kv.block_size_tokens
        await client.ask("stage", tokens, id=request_id, first_token=first_token, num_tokens=kv.num_tokens)
        held = self._staged.setdefault(request_id, _Held(0))
        held.tokens = max(held.tokens, first_token + kv.num_tokens)

    def resume(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
               params: SamplingParams) -> AsyncIterator[StepOutput]:
        load = request_id in self._staged or request_id in self._suspended
        stream = self._engine.continue_request(request_id, prompt_token_ids, output_token_ids, params, load)
        # The connector hands what it holds for the request to its blocks when vLLM schedules it.
        self._staged.pop(request_id, None)
        self._suspended.pop(request_id, None)
        return stream

    def release(self, request_id: str) -> None:
        held = self._staged.pop(request_id, None) or self._suspended.pop(request_id, None)
        if held is None or self._client is None:
            return
        task = asyncio.get_running_loop().create_task(self._release(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, request_id: str) -> None:
        assert self._client is not None
        try:
            await self._client.ask("release", id=request_id)
        except MigrationError as err:
            log.warning("releasing the KV vLLM holds for %s: %s", request_id, err)

    # -- accounting --------------------------------------------------------------------------------

    def held_kv(self) -> list[RequestKV]:
        """Requests not running here whose KV vLLM holds or will hold: suspended, or staged to resume."""
        info = self._engine.info
        return [RequestKV(rid, held.tokens, kv_blocks_bytes(held.tokens, info.block_size_tokens, info.kv_bytes_per_token))
                for rid, held in sorted({**self._suspended, **self._staged}.items())]
