"""The worker agent: one engine behind an OpenAI-compatible HTTP API, reporting its KV load.

It is the only process in a worker pod. It serves `/v1/completions` and `/v1/chat/completions`
(streamed as server-sent events or whole), the probes (`/healthz` is "the process and the engine are
alive", `/readyz` is "the model is loaded, send traffic"), `/metrics`, and `/internal/*` endpoints for
the pool's own components, which require the pool's token. Bad input gets an OpenAI-format 4xx and
never reaches the engine; a client that goes away aborts its request and frees its KV at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

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
from kvfleet.worker.openai_api import (
    MAX_BODY_BYTES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now_s,
    usage,
    validation_error,
)
from kvfleet.worker.reporter import LoadReporter, WriteReport
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


@dataclass
class _Job:
    """One admitted request, ready for the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]


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
        self.metrics = WorkerMetrics(
            kv_used_bytes=lambda: float(sum(r.kv_bytes for r in self._usage())),
            kv_capacity_bytes=lambda: float(self._info.kv_capacity_bytes if self._info else 0),
            running=lambda: float(len(self._usage())),
            waiting=lambda: float(self.engine.num_waiting() if self._info else 0),
            gpu=gpu or GPUProbe(),
        )

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

            self.reporter = LoadReporter(self.engine.kv_usage, info.kv_capacity_bytes, counted,
                                         interval_s=self.config.report_interval_s)
            self._tasks.append(asyncio.create_task(self.reporter.run()))

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
        while self._active and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        if self._active:
            log.warning("aborting %d requests still running after %.0f s: %s", len(self._active),
                        self.config.drain_timeout_s, ", ".join(sorted(self._active)))
        if self.reporter is not None:
            await self.reporter.maybe_write()  # the last word on what this pod holds
        for task in self._tasks:
            task.cancel()
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
        raw = await request.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start})", code="invalid_encoding") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as err:
            raise APIError(400, f"malformed JSON: {err.msg} at line {err.lineno} column {err.colno}",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

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
        return _Job(request_id, prompt_ids, params, body.stop_strings())

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        info = self._require_engine()
        raw = await self._read_json(request)
        try:
            body = CompletionRequest.model_validate(raw)
        except ValidationError as err:
            raise validation_error(err) from None
        prompt_ids = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        job = self._job(info, self._request_id(request, "cmpl"), body, prompt_ids, body.max_tokens)
        created = now_s()

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
        created = now_s()

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

    async def _deltas(self, job: _Job) -> AsyncGenerator[tuple[str, str | None, tuple[int, ...]], None]:
        """(text delta, finish reason or None, token ids of this step) until the request ends.

        Stop strings end the request here: the engine's stream is closed, which aborts it there.
        """
        try:
            stream = self.engine.generate(job.request_id, job.prompt_token_ids, job.params)
            detok = self.tokenizer.detokenizer(job.prompt_token_ids)
            stops = StopStrings(job.stops)
            self._active.add(job.request_id)
            self.metrics.prompt_tokens.inc(len(job.prompt_token_ids))
            if self.reporter is not None:
                self.reporter.nudge()
            finish: str | None = None
            async for out in _checked(stream):
                self.metrics.generated(len(out.new_token_ids))
                text = stops.feed(detok.add(out.new_token_ids))
                if stops.stopped:
                    finish = "stop"
                    yield text, finish, out.new_token_ids
                    break
                if out.finished:
                    finish = out.finish_reason or "stop"
                    yield text + stops.feed(detok.flush()) + stops.finish(), finish, out.new_token_ids
                    break
                yield text, None, out.new_token_ids
            self.metrics.requests.labels(finish or "abort").inc()
        finally:
            self._active.discard(job.request_id)
            if self.reporter is not None:
                self.reporter.nudge()

    async def _collect(self, job: _Job) -> tuple[str, str, int]:
        parts: list[str] = []
        finish = "abort"
        tokens = 0
        async for text, reason, ids in self._deltas(job):
            parts.append(text)
            tokens += len(ids)
            if reason is not None:
                finish = reason
        return "".join(parts), finish, tokens

    async def _stream(self, request: web.Request, job: _Job, chunks: Callable[[str, str | None], list[dict[str, Any]]],
                      include_usage: bool, first: dict[str, Any]) -> web.StreamResponse:
        # Errors the engine raises before its first output still become a plain 4xx, not a broken stream.
        with_tokens = request.headers.get(TOKEN_STREAM_HEADER, "").lower() == "tokens"
        deltas = self._deltas(job)
        try:
            head = await anext(deltas)
        except StopAsyncIteration:
            head = ("", "abort", ())
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
            await send_step(*head)
            if head[1] is None:
                async for text, reason, ids in deltas:
                    await send_step(text, reason, ids)
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
