"""The worker agent: one engine behind an OpenAI-compatible HTTP API, reporting its KV load.

It is the only process in a worker pod. It serves `/v1/completions` and `/v1/chat/completions`
(streamed as server-sent events or whole), the probes (`/healthz` is "the process and the engine are
alive", `/readyz` is "the model is loaded, send traffic"), `/metrics`, and `/internal/*` endpoints for
the pool's own components, which require the pool's token. Bad input gets an OpenAI-format 4xx and
never reaches the engine; a client that goes away aborts its request and frees its KV at once.

It is also both ends of a live migration (docs/migration.md): as the source it runs the move
(`migration.executor`) and ends the request's stream with a hand-off (`kvfleet.migrated` for a
router, a relay of the target's continuation for a direct client); as the target it takes the
request in on its migration port and serves its continuation at `/internal/requests/{id}/stream`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from kvfleet.worker.engines.base import (
    DuplicateRequest,
    Engine,
    EngineError,
    EngineInfo,
    RequestTooLong,
    SamplingParams,
    StepOutput,
)
from kvfleet.worker.gpu import GPUProbe
from kvfleet.worker.metrics import WorkerMetrics
from kvfleet.worker.migration.executor import MODES, Executor, MigrationMetrics, MigrationResult, Mode
from kvfleet.worker.migration.handoff import (
    HANDOFF_ATTACH_TIMEOUT_S,
    Adopted,
    Continue,
    HandedRequest,
    HandoffError,
    Handoffs,
    HandoffTarget,
    LiveRequest,
    Moved,
    RequestMoved,
    StreamPosition,
    TextState,
    follow,
)
from kvfleet.worker.migration.transport import MIGRATION_PORT, Listener, TCPTransport, split_address
from kvfleet.worker.openai_api import (
    MAX_BODY_BYTES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now_s,
    parse_json_object,
    usage,
    validation_error,
)
from kvfleet.worker.reporter import LoadReporter, WriteReport, measured_from
from kvfleet.worker.text import StopStrings, Tokenizer

log = logging.getLogger(__name__)

# Request ids travel in KV-load reports and KVMigration names: keep them short and plain.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
REQUEST_ID_HEADER = "X-Request-Id"
# `X-Kvfleet-Stream: tokens` (the router sends it): every streamed chunk also carries the token ids
# it covers, `"kvfleet": {"index": tokens before it, "token_ids": [...]}`, and the first one the prompt's
# ids, so the router can resume a request elsewhere from exactly what the client has seen.
TOKEN_STREAM_HEADER = "X-Kvfleet-Stream"


@dataclass(frozen=True)
class AgentConfig:
    model_name: str
    pool_token: str | None = None
    report_interval_s: float = 5.0
    # How long a SIGTERM waits for running requests before aborting them.
    drain_timeout_s: float = 25.0
    # Where migrations come in (transport.py): None takes none (and without a pool token there are
    # none either); 0 picks a free port (tests). Every worker of a pool uses the same port.
    migration_host: str = "0.0.0.0"
    migration_port: int | None = MIGRATION_PORT


@dataclass
class _Job:
    """One admitted request, ready for the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    model: str = ""
    created: int = field(default_factory=now_s)


@dataclass(frozen=True)
class _Resumed:
    """A request handed over to this worker: the stream its engine continues it in, and where it stood."""

    stream: AsyncIterator[StepOutput]
    handed: HandedRequest


class Agent:
    def __init__(self, config: AgentConfig, engine: Engine, tokenizer: Tokenizer, write_report: WriteReport | None,
                 gpu: GPUProbe | None = None) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self._write_report = write_report
        self._info: EngineInfo | None = None
        self._failure: str | None = None
        self._draining = False
        self._active: set[str] = set()
        self.reporter: LoadReporter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.handoffs = Handoffs()
        self._live: dict[str, LiveRequest] = {}
        self._adopted: dict[str, Adopted] = {}
        self._incoming: set[str] = set()
        # Direct clients' streams relayed from the worker their request moved to (drain waits for them).
        self._relays = 0
        self._listener: Listener | None = None
        self._session: aiohttp.ClientSession | None = None
        self.executor: Executor | None = None
        self._when_ready: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self.metrics = WorkerMetrics(
            kv_used_bytes=lambda: float(sum(r.kv_bytes for r in self._usage())),
            kv_capacity_bytes=lambda: float(self._info.kv_capacity_bytes if self._info else 0),
            running=lambda: float(len(self._usage())),
            waiting=lambda: float(self.engine.num_waiting() if self._info else 0),
            gpu=gpu or GPUProbe(),
        )
        self.migration_metrics = MigrationMetrics(self.metrics.registry)

    # ----------------------------------------------------------------------------------- lifecycle

    def _usage(self) -> list[Any]:
        return self.engine.kv_usage() if self._info else []

    @property
    def ready(self) -> bool:
        return self._info is not None and self._failure is None and not self._draining

    async def _start_engine(self) -> None:
        try:
            self._info = await self.engine.start()
        except Exception as err:
            self._failure = f"engine failed to start: {err}"
            log.exception("engine failed to start")
            return
        info = self._info
        log.info("engine %s ready: model %s, KV capacity %d bytes (%d bytes/token, blocks of %d tokens), context %d",
                 info.engine, info.model_path, info.kv_capacity_bytes, info.kv_bytes_per_token, info.block_size_tokens,
                 info.max_model_len)
        if self._write_report is not None:
            write = self._write_report

            async def counted(annotation: str) -> None:
                await write(annotation)
                self.metrics.report_writes.inc()

            self.reporter = LoadReporter(self._reported_usage, info.kv_capacity_bytes, counted,
                                         interval_s=self.config.report_interval_s, queued=self.engine.queued,
                                         measured=measured_from(self.metrics.registry),
                                         block_size_tokens=info.block_size_tokens)
            self._tasks.append(asyncio.create_task(self.reporter.run()))
        if self.config.pool_token:
            transport = TCPTransport(self.config.pool_token)
            self.executor = Executor(self, transport, self.migration_metrics)
            if self.config.migration_port is not None:
                try:
                    self._listener = await transport.listen(self.config.migration_host, self.config.migration_port,
                                                            self.executor.serve)
                except OSError as err:
                    log.error("cannot listen for migrations on %s:%s: %s; this worker takes none in",
                              self.config.migration_host, self.config.migration_port, err)
                else:
                    log.info("migrations come in on %s:%d", self.config.migration_host, self._listener.port)
        for run in self._when_ready:
            self._tasks.append(asyncio.create_task(run()))

    def run_when_ready(self, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs a background loop (the KVMigration watcher) once the engine is up, until shutdown."""
        self._when_ready.append(run)

    def _reported_usage(self) -> list[Any]:
        # KV staged for a migration still in flight towards this worker is not the request's home yet:
        # reporting it would show the operator the request on two pods at once.
        return [r for r in self.engine.kv_usage() if r.request_id not in self._incoming]

    @property
    def migration_port(self) -> int | None:
        """The port migrations come in on (after start-up), or None."""
        return self._listener.port if self._listener is not None else None

    async def _on_startup(self, _: web.Application) -> None:
        self._tasks.append(asyncio.create_task(self._start_engine()))

    async def _on_shutdown(self, _: web.Application) -> None:
        await self.drain()

    async def drain(self) -> None:
        """Stop taking requests, let running ones finish (bounded), then stop the engine."""
        self._draining = True
        log.info("shutting down: no new requests; waiting up to %.0f s for %d running", self.config.drain_timeout_s,
                 len(self._active))
        deadline = asyncio.get_running_loop().time() + self.config.drain_timeout_s
        while (self._active or self._relays) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        if self._active:
            log.warning("aborting %d requests still running after %.0f s: %s", len(self._active),
                        self.config.drain_timeout_s, ", ".join(sorted(self._active)))
        if self.reporter is not None:
            await self.reporter.maybe_write()  # the last word on what this pod holds
        for task in self._tasks:
            task.cancel()
        if self._listener is not None:
            await self._listener.close()
        for adopted in list(self._adopted.values()):
            if adopted.task is not None:
                adopted.task.cancel()
        if self._session is not None:
            await self._session.close()
        await self.engine.stop()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._internal_auth])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/internal/requests", self._internal_requests)
        app.router.add_post("/internal/requests/{request_id}/abort", self._internal_abort)
        app.router.add_post("/internal/requests/{request_id}/migrate", self._internal_migrate)
        app.router.add_get("/internal/requests/{request_id}/stream", self._internal_stream)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app

    # ---------------------------------------------------------------------------------- middleware

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as err:
            self.metrics.rejected.labels(str(err.status)).inc()
            return web.json_response(err.body(), status=err.status)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.rejected.labels("413").inc()
            return web.json_response(APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes").body(), status=413)
        except web.HTTPException as err:
            if err.status >= 400:
                body = APIError(err.status, err.reason, code=err.reason.lower().replace(" ", "_")).body()
                return web.json_response(body, status=err.status)
            raise

    @web.middleware
    async def _internal_auth(self, request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path.startswith("/internal/"):
            token = self.config.pool_token
            if not token:
                raise APIError(403, "internal endpoints are disabled: the worker has no pool token",
                               error_type="permission_error")
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise APIError(401, "the pool token is required (Authorization: Bearer ...)", error_type="authentication_error")
        return await handler(request)

    # -------------------------------------------------------------------------------------- probes

    async def _healthz(self, _: web.Request) -> web.Response:
        if self._failure:
            return web.json_response({"ok": False, "reason": self._failure}, status=500)
        return web.json_response({"ok": True})

    async def _readyz(self, _: web.Request) -> web.Response:
        if self.ready:
            return web.json_response({"ready": True})
        reason = self._failure or ("draining" if self._draining else "loading the model")
        return web.json_response({"ready": False, "reason": reason}, status=503)

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.metrics.refresh_gpu is not None:
            await asyncio.to_thread(self.metrics.refresh_gpu)
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, _: web.Request) -> web.Response:
        info = self._require_engine()
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "kvfleet",
             "max_model_len": info.max_model_len}]})

    # ------------------------------------------------------------------------------------ internal

    async def _internal_requests(self, _: web.Request) -> web.Response:
        info = self._require_engine()
        return web.json_response({
            "capacityBytes": info.kv_capacity_bytes, "kvBytesPerToken": info.kv_bytes_per_token,
            "blockSizeTokens": info.block_size_tokens, "waiting": self.engine.num_waiting(),
            "requests": [{"id": r.request_id, "tokens": r.tokens, "kvBytes": r.kv_bytes} for r in self.engine.kv_usage()]})

    async def _internal_abort(self, request: web.Request) -> web.Response:
        self._require_engine()
        await self.engine.abort(request.match_info["request_id"])
        return web.json_response({"aborted": request.match_info["request_id"]})

    async def _internal_migrate(self, request: web.Request) -> web.Response:
        """Moves a request to another worker now: what the KVMigration watcher does, for tools and tests.

        Body: {"target": {"pod", "address": "ip:port" (HTTP), "migrationAddress" (default: the
        address's host on this worker's migration port)}, "mode": "kv" | "token" | "hybrid",
        "kvBytes": the KV bytes a hybrid move copies (optional; default all full blocks)}.
        """
        self._require_engine()
        raw = await self._read_json(request)
        target = raw.get("target")
        mode = raw.get("mode", "kv")
        kv_bytes = raw.get("kvBytes")
        if kv_bytes is not None and (not isinstance(kv_bytes, int) or kv_bytes < 0):
            raise APIError(400, "kvBytes must be a non-negative integer", param="kvBytes")
        if not isinstance(target, dict) or not isinstance(target.get("pod"), str) or not isinstance(target.get("address"), str):
            raise APIError(400, "target must be {\"pod\": ..., \"address\": \"ip:port\"}", param="target")
        if mode not in MODES:
            raise APIError(400, f"mode must be one of {', '.join(MODES)}", param="mode")
        try:
            host, _ = split_address(target["address"])
        except ValueError as err:
            raise APIError(400, str(err), param="target.address") from None
        migration_address = target.get("migrationAddress") or f"{host}:{self.config.migration_port or MIGRATION_PORT}"
        result = await self.migrate(request.match_info["request_id"], HandoffTarget(target["pod"], target["address"]),
                                    str(migration_address), mode, kv_bytes_limit=kv_bytes)
        return web.json_response(result.to_json())

    async def migrate(self, request_id: str, target: HandoffTarget, migration_address: str, mode: Mode,
                      kv_bytes_limit: int | None = None) -> MigrationResult:
        if self.executor is None:
            return MigrationResult(request_id, False, mode, message="this worker has no pool token: it cannot migrate")
        return await self.executor.migrate(request_id, target, migration_address, mode, kv_bytes_limit)

    async def _internal_stream(self, request: web.Request) -> web.StreamResponse:
        """The continuation of a request handed over to this worker (docs/migration.md)."""
        request_id = request.match_info["request_id"]
        adopted = self._adopted.get(request_id)
        if adopted is None:
            raise APIError(404, f"no request {request_id!r} was handed over to this worker (or it was aborted)",
                           error_type="not_found_error", code="request_not_found")
        try:
            after = int(request.query.get("after", str(adopted.start_index)))
        except ValueError:
            raise APIError(400, "after must be an output token index", param="after") from None
        if after not in adopted.boundaries():
            raise APIError(400, f"the stream of {request_id!r} has no chunk starting at output index {after}; it starts "
                           f"at {adopted.start_index}", param="after")
        if adopted.reader_attached:
            raise APIError(409, f"the stream of {request_id!r} already has a reader", code="stream_attached")
        adopted.reader_attached = adopted.ever_attached = True
        complete = False
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            async for item in adopted.read(after):
                if isinstance(item, Moved):
                    await response.write(item.event())
                    break
                await response.write(b"data: " + json.dumps(adopted.chunk(item), separators=(",", ":")).encode() + b"\n\n")
            else:
                await response.write(b"data: [DONE]\n\n")
            complete = True
        finally:
            adopted.reader_attached = False
            if complete:
                self._adopted.pop(request_id, None)
            elif not adopted.ended and adopted.task is not None:
                log.info("the reader of %s (handed over here) went away; aborting it", request_id)
                adopted.task.cancel()
        return response

    # ------------------------------------------------------------------ the migration executor's host

    def live_request(self, request_id: str) -> LiveRequest | None:
        return self._live.get(request_id)

    def incoming(self, request_id: str, arriving: bool) -> None:
        if arriving:
            self._incoming.add(request_id)
        else:
            self._incoming.discard(request_id)

    def nudge_reporter(self) -> None:
        if self.reporter is not None:
            self.reporter.nudge()

    def accepts_migrations(self) -> bool:
        return self.ready

    def adopt(self, handed: HandedRequest, stream: AsyncIterator[StepOutput]) -> Adopted:
        """Runs a request handed over to this worker, buffering its outputs until a reader attaches."""
        adopted = Adopted(handed)
        job = _Job(handed.request_id, list(handed.prompt_token_ids), handed.params, handed.stops, handed.model,
                   handed.created)

        async def drive() -> None:
            moved: Moved | None = None
            iterated = False
            try:
                async for text, finish, ids in self._deltas(job, follow_moves=False, resumed=_Resumed(stream, handed)):
                    iterated = True
                    adopted.add(text, finish, ids)
            except RequestMoved as err:
                moved = err.moved
            except APIError as err:
                log.warning("request %s handed over here failed: %s", handed.request_id, err.message)
            finally:
                adopted.end(moved)
                if not iterated and moved is None:
                    # A stream never iterated does not abort its request when closed: do it here.
                    await self.engine.abort(handed.request_id)

        adopted.task = asyncio.create_task(drive(), name=f"kvfleet-adopted-{handed.request_id}")
        self._adopted[handed.request_id] = adopted
        asyncio.get_running_loop().call_later(HANDOFF_ATTACH_TIMEOUT_S, self._attach_deadline, adopted)
        return adopted

    def _attach_deadline(self, adopted: Adopted) -> None:
        if adopted.ever_attached:
            return
        request_id = adopted.handed.request_id
        log.warning("no reader attached to %s (handed over here) within %.0f s: aborting it and freeing its KV",
                    request_id, HANDOFF_ATTACH_TIMEOUT_S)
        if self._adopted.get(request_id) is adopted:
            del self._adopted[request_id]
        if adopted.task is not None:
            adopted.task.cancel()

    # ------------------------------------------------------------------------------- OpenAI routes

    def _require_engine(self) -> EngineInfo:
        if self._failure:
            raise APIError(503, self._failure, error_type="server_error")
        if self._info is None:
            raise APIError(503, "the model is still loading", error_type="server_error", code="model_loading")
        if self._draining:
            raise APIError(503, "this worker is shutting down", error_type="server_error", code="draining")
        return self._info

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        return parse_json_object(await request.read())

    def _request_id(self, request: web.Request, prefix: str) -> str:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is None:
            return new_id(prefix)
        if not _REQUEST_ID.match(given):
            raise APIError(400, f"{REQUEST_ID_HEADER} must match {_REQUEST_ID.pattern}", param=REQUEST_ID_HEADER)
        return given

    def _job(self, info: EngineInfo, request_id: str, body: CompletionRequest | ChatCompletionRequest,
             prompt_ids: list[int], max_tokens: int | None) -> _Job:
        if body.model != self.config.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist here; this pool serves {self.config.model_name!r}",
                           param="model", code="model_not_found")
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be below the vocabulary size {vocab}", param="prompt")
        if max_tokens is None:
            max_tokens = info.max_model_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > info.max_model_len:
            raise APIError(400, f"This model's maximum context length is {info.max_model_len} tokens. However, you "
                           f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                           f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens" if len(prompt_ids) < info.max_model_len else "prompt",
                           code="context_length_exceeded")
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos)
        return _Job(request_id, prompt_ids, params, body.stop_strings(), body.model)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        info = self._require_engine()
        raw = await self._read_json(request)
        try:
            body = CompletionRequest.model_validate(raw)
        except ValidationError as err:
            raise validation_error(err) from None
        prompt_ids = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        job = self._job(info, self._request_id(request, "cmpl"), body, prompt_ids, body.max_tokens)
        created = job.created

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": job.request_id, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            return await self._stream(request, job, lambda text, finish: [chunk(text, finish)],
                                      body.include_usage_in_stream(), chunk("", None))
        text, finish, completion_tokens = await self._collect(job)
        result = chunk(text, finish)
        result["usage"] = usage(len(prompt_ids), completion_tokens)
        return web.json_response(result)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        info = self._require_engine()
        raw = await self._read_json(request)
        try:
            body = ChatCompletionRequest.model_validate(raw)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValidationError as err:
            raise validation_error(err) from None
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        try:
            prompt_ids = self.tokenizer.encode_chat(messages)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        job = self._job(info, self._request_id(request, "chatcmpl"), body, prompt_ids, body.output_limit())
        created = job.created

        def chunk(delta: dict[str, str], finish: str | None) -> dict[str, Any]:
            return {"id": job.request_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            return await self._stream(request, job, lambda text, finish: [chunk({"content": text} if text else {}, finish)],
                                      body.include_usage_in_stream(), chunk({"role": "assistant", "content": ""}, None))
        text, finish, completion_tokens = await self._collect(job)
        return web.json_response({
            "id": job.request_id, "object": "chat.completion", "created": created, "model": body.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": usage(len(prompt_ids), completion_tokens)})

    # --------------------------------------------------------------------------------- generation

    async def _deltas(self, job: _Job, follow_moves: bool = True, resumed: _Resumed | None = None
                      ) -> AsyncGenerator[tuple[str, str | None, tuple[int, ...]], None]:
        """(text delta, finish reason or None, token ids of this step) until the request ends.

        Stop strings end the request here: the engine's stream is closed, which aborts it there.
        When a migration stops the request on this engine, the executor's outcome decides what
        follows: the stream the source resumed (rolled back), or the target's continuation, relayed
        (`follow_moves`, a direct client) or left to the reader (RequestMoved, a router). `resumed`
        continues a request handed over to this worker from where the source's stream stood.
        """
        request_id = job.request_id
        stream: AsyncIterator[StepOutput]
        if resumed is None:
            stream = self.engine.generate(request_id, job.prompt_token_ids, job.params)
            detok = self.tokenizer.detokenizer(job.prompt_token_ids)
            stops = StopStrings(job.stops)
            outputs: list[int] = []
            self.metrics.prompt_tokens.inc(len(job.prompt_token_ids))
        else:
            stream = resumed.stream
            detok, stops = resumed.handed.text.restore(self.tokenizer, job.stops)
            outputs = list(resumed.handed.output_token_ids)
        self._live[request_id] = live = LiveRequest(request_id, job.prompt_token_ids, job.params, job.stops, job.created,
                                                    job.model, detok, stops, outputs)
        self._active.add(request_id)
        self.nudge_reporter()
        finish: str | None = None
        relaying = False
        try:
            while True:
                async with aclosing(_checked(stream)) as outs:
                    async for out in outs:
                        ticket = self.handoffs.get(request_id)
                        # An engine that can only stop a request by aborting it (vLLM): that abort is the migration's.
                        handed_over = out.finished and out.finish_reason == "abort" and ticket is not None and ticket.stopping
                        outputs.extend(out.new_token_ids)
                        self.metrics.generated(len(out.new_token_ids))
                        text = stops.feed(detok.add(out.new_token_ids))
                        if stops.stopped:
                            finish = "stop"
                            yield text, finish, out.new_token_ids
                            break
                        if out.finished and not handed_over:
                            finish = out.finish_reason or "stop"
                            yield text + stops.feed(detok.flush()) + stops.finish(), finish, out.new_token_ids
                            break
                        if text or out.new_token_ids or not handed_over:
                            yield text, None, out.new_token_ids
                        if handed_over:
                            break
                if finish is not None:
                    break
                # The engine's stream ended unfinished: a migration stopped it, or it was aborted.
                outcome = await self.handoffs.stopped(request_id, StreamPosition(tuple(outputs), TextState.of(detok, stops)))
                if isinstance(outcome, Continue):
                    log.info("migration of %s rolled back: it continues here", request_id)
                    stream = outcome.stream
                    continue
                if outcome is None:
                    break
                if not follow_moves:
                    raise RequestMoved(outcome)
                # The request lives elsewhere now (it may even come back here): only the relay is ours.
                self._leave(request_id, live)
                relaying = True
                self._relays += 1
                relayed_finish: str | None = None
                async for text, relayed_finish, ids in self._relay(outcome):
                    outputs.extend(ids)
                    yield text, relayed_finish, ids
                finish = relayed_finish
                break
        finally:
            if relaying:
                self._relays -= 1
            else:
                self._leave(request_id, live)
        if not relaying:  # a relayed request ends on, and is counted by, the worker it moved to
            self.metrics.requests.labels(finish or "abort").inc()

    def _leave(self, request_id: str, live: LiveRequest) -> None:
        """The request no longer runs on this engine for this stream (ended, or handed over)."""
        if self._live.get(request_id) is live:
            del self._live[request_id]
            self.handoffs.ended(request_id)
            self._active.discard(request_id)
        self.nudge_reporter()

    async def _relay(self, moved: Moved) -> AsyncGenerator[tuple[str, str | None, tuple[int, ...]], None]:
        """A direct client's continuation: the target's stream, read with the pool token, as deltas."""
        assert self.config.pool_token is not None  # no token, no migration
        if self._session is None:
            self._session = aiohttp.ClientSession()
        log.info("relaying %s from %s (%s) from output index %d", moved.request_id, moved.target.pod,
                 moved.target.address, moved.index)
        try:
            async for chunk in follow(self._session, self.config.pool_token, moved):
                yield chunk.text, chunk.finish_reason, chunk.token_ids
                if chunk.finish_reason is not None:
                    return
        except HandoffError as err:
            log.warning("the continuation of %s is lost: %s", moved.request_id, err)

    async def _collect(self, job: _Job) -> tuple[str, str, int]:
        parts: list[str] = []
        finish = "abort"
        tokens = 0
        async for text, reason, ids in self._deltas(job, follow_moves=True):
            parts.append(text)
            tokens += len(ids)
            if reason is not None:
                finish = reason
        return "".join(parts), finish, tokens

    async def _stream(self, request: web.Request, job: _Job, chunks: Callable[[str, str | None], list[dict[str, Any]]],
                      include_usage: bool, first: dict[str, Any]) -> web.StreamResponse:
        # Errors the engine raises before its first output still become a plain 4xx, not a broken stream.
        with_tokens = request.headers.get(TOKEN_STREAM_HEADER, "").lower() == "tokens"
        # A router follows a migration itself; a direct client gets the continuation relayed.
        deltas = self._deltas(job, follow_moves=not with_tokens)
        moved: Moved | None = None
        head: tuple[str, str | None, tuple[int, ...]] = ("", None, ())
        try:
            head = await anext(deltas)
        except StopAsyncIteration:
            head = ("", "abort", ())
        except RequestMoved as err:  # handed over before its first token
            moved = err.moved
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        tokens = 0

        async def send(payload: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

        async def send_step(text: str, reason: str | None, ids: tuple[int, ...]) -> None:
            nonlocal tokens
            if with_tokens:
                for c in chunks(text, reason):
                    await send({**c, "kvfleet": {"index": tokens, "token_ids": list(ids)}})
            elif text or reason is not None:
                for c in chunks(text, reason):
                    await send(c)
            tokens += len(ids)

        try:
            if with_tokens:
                first = {**first, "kvfleet": {"index": 0, "token_ids": [], "prompt_token_ids": job.prompt_token_ids}}
            await send(first)
            if moved is None:
                await send_step(*head)
                if head[1] is None:
                    try:
                        async for text, reason, ids in deltas:
                            await send_step(text, reason, ids)
                    except RequestMoved as err:
                        moved = err.moved
            if moved is not None:
                # The router reads the rest from the target; no [DONE] here (docs/migration.md).
                await response.write(moved.event())
                return response
            if include_usage:
                await send({"id": job.request_id, "object": first["object"], "created": first["created"],
                            "model": first["model"], "choices": [], "usage": usage(len(job.prompt_token_ids), tokens)})
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client of %s went away; aborting it", job.request_id)
            raise
        finally:
            await deltas.aclose()
        return response


async def _checked(stream: AsyncIterator[StepOutput]) -> AsyncGenerator[StepOutput, None]:
    """The engine's stream with its refusals turned into client errors."""
    try:
        async for out in stream:
            yield out
    except RequestTooLong as err:
        raise APIError(400, str(err), code="context_length_exceeded") from None
    except DuplicateRequest as err:
        raise APIError(409, str(err), param=REQUEST_ID_HEADER, code="duplicate_request_id") from None
    except EngineError as err:
        raise APIError(400, str(err)) from None
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
