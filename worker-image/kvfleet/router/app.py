"""The router's HTTP front end: OpenAI completions and chat in, placed on a worker, relayed back.

Requests are validated with the worker's own OpenAI models (kvfleet.worker.openai_api), so a bad
request gets the same 400 from the router as from a worker and never occupies one. Every request is
streamed from the worker in router mode whatever the client asked for (relay.py), and converted back
here: whole JSON or server-sent events, completion or chat shape. Stop strings are applied here, not
by the worker, so that a request resumed on another worker still stops at a stop string that spans
the two workers' outputs.

Backpressure: at most `max_in_flight` requests are relayed at once; the next gets 429 with
Retry-After. A pool with no Ready worker, or none with room for the request's KV, gets 503 with
Retry-After, in OpenAI's error format.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.placement import (
    NoPlacement,
    Placement,
    Reservation,
    estimate_prompt_tokens,
    place,
    request_kv_bytes,
)
from kvfleet.router.pool import PoolView
from kvfleet.router.relay import REQUEST_ID_HEADER, Relay, RelayFailed, Timeouts, Unplaceable, WorkerRefused
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
from kvfleet.worker.stops import StopStrings

log = logging.getLogger(__name__)

# How often the router asks a worker again for model facts it could not read (KV bytes per token).
INFO_RETRY_S = 10.0
_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def new_seed() -> int:
    """A seed for a sampled request that came without one (31 bits: every engine takes it)."""
    return secrets.randbelow(2**31)


@dataclass(frozen=True)
class RouterConfig:
    pool_name: str
    namespace: str = ""
    pool_token: str | None = None
    max_in_flight: int = 256
    retry_after_s: int = 1
    timeouts: Timeouts = field(default_factory=Timeouts)
    # Workers a request may fail on before the client gets an error.
    max_attempts: int = 4


@dataclass(frozen=True)
class ModelInfo:
    """What every worker of the pool shares (one model): read once from a worker, not per request."""

    model_name: str
    max_model_len: int
    kv_bytes_per_token: int | None  # from /internal/requests, which needs the pool token
    capacity_bytes: int | None


class Router:
    def __init__(self, config: RouterConfig, view: PoolView) -> None:
        self.config = config
        self.view = view
        self.metrics = RouterMetrics()
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = 0
        self._reservations: dict[str, Reservation] = {}
        self._info: ModelInfo | None = None
        self._info_asked_s = float("-inf")
        self._info_lock = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _: web.Application) -> None:
        # Connections to workers are pooled; no total timeout (a stream lasts as long as it generates),
        # the relay bounds the first token and the silences.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=self.config.timeouts.connect_s))
        self.view.start()

    async def _on_cleanup(self, _: web.Application) -> None:
        self.view.stop()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router's app has not started"
        return self._session

    # ---------------------------------------------------------------------------------- middleware

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as err:
            self.metrics.errors.labels(str(err.status)).inc()
            headers = {"Retry-After": str(self.config.retry_after_s)} if err.status in (429, 503) else {}
            return web.json_response(err.body(), status=err.status, headers=headers)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.errors.labels("413").inc()
            return web.json_response(APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes").body(), status=413)

    # -------------------------------------------------------------------------------------- probes

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _readyz(self, _: web.Request) -> web.Response:
        # Ready once the pool has been read: from then on every request gets a worker or a clear 503.
        if self.view.snapshot().synced:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": "reading the pool from the API server"}, status=503)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, _: web.Request) -> web.Response:
        info = await self._model_info()
        if info is None:
            raise APIError(503, "the pool has no Ready worker; retry shortly", error_type="server_error", code="no_ready_worker")
        return web.json_response({"object": "list", "data": [
            {"id": info.model_name, "object": "model", "created": 0, "owned_by": "kvfleet", "max_model_len": info.max_model_len}]})

    async def _model_info(self) -> ModelInfo | None:
        """The pool's model, asked of a Ready worker the first time it is needed (then kept)."""
        if self._info is not None and self._info.kv_bytes_per_token is not None:
            return self._info
        if self._info is not None and time.monotonic() - self._info_asked_s < INFO_RETRY_S:
            return self._info  # partial (no pool token, or /internal refused): not asked again per request
        async with self._info_lock:
            if self._info is not None and (self._info.kv_bytes_per_token is not None or not self.config.pool_token):
                return self._info
            self._info_asked_s = time.monotonic()
            for worker in self.view.snapshot().ready_workers():
                try:
                    async with self.session.get(f"http://{worker.address}/v1/models") as resp:
                        model = (await resp.json())["data"][0]
                    per_token = capacity = None
                    if self.config.pool_token:
                        async with self.session.get(f"http://{worker.address}/internal/requests",
                                                    headers={"Authorization": f"Bearer {self.config.pool_token}"}) as resp:
                            if resp.status == 200:
                                internal = await resp.json()
                                per_token, capacity = int(internal["kvBytesPerToken"]), int(internal["capacityBytes"])
                    self._info = ModelInfo(str(model["id"]), int(model["max_model_len"]), per_token, capacity)
                    return self._info
                except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as err:
                    log.info("model information from %s not available yet: %s", worker.pod_name, err)
            return self._info

    # ------------------------------------------------------------------------------- OpenAI routes

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        return parse_json_object(await request.read())

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        self.metrics.requests.labels(endpoint).inc()
        if self._in_flight >= self.config.max_in_flight:
            raise APIError(429, f"the router is relaying {self._in_flight} requests, its limit; retry shortly",
                           error_type="rate_limit_error", code="router_busy")
        self._in_flight += 1
        self.metrics.in_flight.inc()
        try:
            return await self._serve_admitted(request, chat)
        finally:
            self._in_flight -= 1
            self.metrics.in_flight.dec()

    async def _serve_admitted(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrived_s = time.monotonic()
        raw = await self._read_json(request)
        body: CompletionRequest | ChatCompletionRequest
        try:
            if chat:
                body = ChatCompletionRequest.model_validate(raw)
                messages = [{"content": m.text()} for m in body.messages]
            else:
                body = CompletionRequest.model_validate(raw)
        except ValidationError as err:
            raise validation_error(err) from None
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        if not self.view.snapshot().synced:
            raise APIError(503, "the router has not read its pool yet; retry shortly", error_type="server_error",
                           code="router_starting")
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is not None and not _REQUEST_ID.match(given):
            raise APIError(400, f"{REQUEST_ID_HEADER} must match {_REQUEST_ID.pattern}", param=REQUEST_ID_HEADER)
        request_id = given or new_id("chatcmpl" if chat else "cmpl")

        info = await self._model_info()
        if isinstance(body, ChatCompletionRequest):
            prompt_tokens = estimate_prompt_tokens(messages)
            max_tokens = body.output_limit()
        else:
            prompt_tokens = estimate_prompt_tokens(body.prompt)
            max_tokens = body.max_tokens

        def kv_bytes(num_prompt_tokens: int) -> int:
            if info is None or info.kv_bytes_per_token is None:
                return 0  # unknown until a worker tells: every request looks small (class T)
            return request_kv_bytes(num_prompt_tokens, max_tokens, info.kv_bytes_per_token, info.max_model_len)

        estimate = {"bytes": kv_bytes(prompt_tokens)}

        def choose(exclude: frozenset[str]) -> Placement | NoPlacement:
            others = [r for r in self._reservations.values() if r.request_id != request_id]
            capacity = (info.capacity_bytes if info else None) or 1
            choice = place(self.view.snapshot(), others, estimate["bytes"], default_capacity_bytes=capacity, exclude=exclude)
            if isinstance(choice, Placement):
                self.metrics.placements.labels(choice.rule).inc()
                log.debug("%s (%d bytes of KV) -> %s by %s", request_id, estimate["bytes"], choice.pod_name, choice.rule)
            return choice

        def on_worker(pod_name: str, prompt_ids: list[int] | None) -> None:
            if prompt_ids is not None:
                estimate["bytes"] = kv_bytes(len(prompt_ids))  # exact now that the worker has tokenized it
            self._reservations[request_id] = Reservation(request_id, pod_name, estimate["bytes"])

        forward = {k: v for k, v in raw.items() if k not in ("stop", "stream_options")}
        if body.temperature > 0 and body.seed is None:
            # The router, not a worker, picks a sampled request's seed: a resume on another worker after
            # a death then continues the same draws (the builtin engine draws per (seed, position)).
            forward["seed"] = new_seed()
        relay = Relay(self.session, request_id, request.path, forward, place=choose, pool_token=self.config.pool_token,
                      timeouts=self.config.timeouts, max_attempts=self.config.max_attempts, on_worker=on_worker,
                      on_event=self._count_event)
        try:
            return await self._respond(request, relay, body, chat, arrived_s)
        finally:
            self._reservations.pop(request_id, None)

    def _count_event(self, kind: str) -> None:
        (self.metrics.resumes if kind == "resume" else self.metrics.migrations).inc()

    async def _respond(self, request: web.Request, relay: Relay, body: CompletionRequest | ChatCompletionRequest,
                       chat: bool, arrived_s: float) -> web.StreamResponse:
        created = now_s()
        stops = StopStrings(body.stop_strings())
        first_text_seen = False

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, str] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                return {"id": relay.request_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            return {"id": relay.request_id, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        async with contextlib.aclosing(relay.steps()) as steps:
            # The first step before any byte goes out, so that a refusal is still a plain HTTP error.
            try:
                head = await anext(steps, None)
            except WorkerRefused as err:
                self.metrics.errors.labels(str(err.status)).inc()
                return web.json_response(err.body, status=err.status)
            except Unplaceable as err:
                raise APIError(503, err.why.message, error_type="server_error", code=err.why.reason.replace("-", "_")) from None
            except RelayFailed as err:
                raise APIError(502, str(err), error_type="server_error", code="workers_failed") from None

            async def rest() -> Any:
                nonlocal first_text_seen
                step = head
                while step is not None:
                    text = stops.feed(step.text)
                    finish = "stop" if stops.stopped else step.finish_reason
                    if finish is not None and not stops.stopped:
                        text += stops.finish()
                    if text and not first_text_seen:
                        first_text_seen = True
                        self.metrics.time_to_first_token.observe(time.monotonic() - arrived_s)
                    yield text, finish
                    if finish is not None:
                        return
                    step = await anext(steps, None)

            if not body.stream:
                parts: list[str] = []
                finish_reason = "stop"
                try:
                    async for text, finish in rest():
                        parts.append(text)
                        finish_reason = finish or finish_reason
                except (RelayFailed, Unplaceable, WorkerRefused) as err:
                    raise APIError(502, f"the request failed midway: {err}", error_type="server_error",
                                   code="workers_failed") from None
                text = "".join(parts)
                counts = usage(len(relay.prompt_token_ids or []), len(relay.output_token_ids))
                id_header = {REQUEST_ID_HEADER: relay.request_id}
                if chat:
                    return web.json_response({
                        "id": relay.request_id, "object": "chat.completion", "created": created, "model": body.model,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                     "finish_reason": finish_reason}], "usage": counts}, headers=id_header)
                result = chunk(text, finish_reason)
                result["usage"] = counts
                return web.json_response(result, headers=id_header)

            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   REQUEST_ID_HEADER: relay.request_id})
            await response.prepare(request)

            async def send(payload: dict[str, Any]) -> None:
                await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

            if chat:
                await send(chunk(None, None, role=True))
            try:
                async for text, finish in rest():
                    if text or finish is not None:
                        await send(chunk(text, finish))
            except (RelayFailed, Unplaceable, WorkerRefused) as err:
                self.metrics.errors.labels("502").inc()
                await send(APIError(502, f"the request failed midway: {err}", error_type="server_error",
                                    code="workers_failed").body())
                return response
            if body.include_usage_in_stream():
                await send({"id": relay.request_id, "object": chunk(None, None)["object"], "created": created,
                            "model": body.model, "choices": [],
                            "usage": usage(len(relay.prompt_token_ids or []), len(relay.output_token_ids))})
            await response.write(b"data: [DONE]\n\n")
            return response
