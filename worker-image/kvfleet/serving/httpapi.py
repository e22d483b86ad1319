"""HTTP scaffolding the router and the workers share: their headers, request ids, errors, probes, SSE.

The router talks to workers with headers only the two of them know (`X-Kvfleet-Stream`, the pool
token on `/internal/*`) and names requests with `X-Request-Id`; both answer errors in OpenAI's
format, serve the same probes and `/metrics`, and stream server-sent events. Each of those is
defined here once, so the two sides cannot drift apart.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvfleet.serving.credentials import PoolCredentials
from kvfleet.serving.openai_api import MAX_BODY_BYTES, APIError, new_id, parse_json_object

REQUEST_ID_HEADER = "X-Request-Id"
# Request ids travel in KV-load reports and KVMigration names: keep them short and plain.
REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# `X-Kvfleet-Stream: tokens` (the router sends it): every streamed chunk also carries the token ids
# it covers, `"kvfleet": {"index": tokens before it, "token_ids": [...]}`, and the first one the prompt's
# ids, so the router can resume a request elsewhere from exactly what the client has seen.
TOKEN_STREAM_HEADER = "X-Kvfleet-Stream"
TOKEN_STREAM_MODE = "tokens"
# The pool token guards every `/internal/*` path of a worker (docs/migration.md).
AUTHORIZATION_HEADER = "Authorization"
INTERNAL_PREFIX = "/internal/"
# A router's request continued on a worker after the one it ran on died (the worker's OpenAIRoutes.resume).
RESUME_PATH = INTERNAL_PREFIX + "resume"
# Ends a source's stream when its request moved: the data names the target (docs/migration.md).
MIGRATED_EVENT = "kvfleet.migrated"


@dataclass(frozen=True)
class Migrated:
    """The data of a MIGRATED_EVENT: the request continues on the target pod from output index `index`.

    A source writes it and the router and a source relaying a continuation read it; the one
    definition keeps the bytes both sides see the same.
    """

    request_id: str
    index: int
    target_pod: str
    # The target's HTTP address (ip:port): where readers attach to the continued stream.
    target_address: str

    def event(self) -> bytes:
        """The whole server-sent event that ends the source's stream."""
        return sse_event(MIGRATED_EVENT, {"request_id": self.request_id, "index": self.index,
                                          "target": {"pod": self.target_pod, "address": self.target_address}})

    @classmethod
    def parse(cls, data: str) -> Migrated:
        """The event's data as written by `event` (a missing pod name reads as "": the address suffices)."""
        body = json.loads(data)
        target = body["target"]
        return cls(str(body["request_id"]), int(body["index"]), str(target.get("pod", "")), str(target["address"]))


# A router's request in a disaggregated pool (docs/disaggregation.md): the worker prefills it and then
# hands it to this decode worker. Sent with the pool token only: a worker honours it from the router.
DECODE_TARGET_HEADER = "X-Kvfleet-Decode-Target"


# Decode workers named in one header at most: the router's choice and a few to try when it has no room.
MAX_DECODE_TARGETS = 4


@dataclass(frozen=True)
class DecodeTarget:
    """A decode worker a prefill worker hands a request to once prefilled: its pod, HTTP address and
    migration address ("" : the HTTP address's host on the pool's migration port)."""

    pod: str
    address: str
    migration_address: str = ""

    def to_json(self) -> dict[str, str]:
        return {"pod": self.pod, "address": self.address, "migrationAddress": self.migration_address}

    def header(self) -> dict[str, str]:
        return header_of((self,))

    @classmethod
    def parse(cls, value: str) -> tuple[DecodeTarget, ...]:
        """The header's value as `header_of` writes it (a list, best first; one object is read as a list
        of one); ValueError naming what is wrong."""
        try:
            body = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{DECODE_TARGET_HEADER} is not JSON: {err}") from None
        items = body if isinstance(body, list) else [body]
        if not 0 < len(items) <= MAX_DECODE_TARGETS or not all(_is_target(item) for item in items):
            raise ValueError(f'{DECODE_TARGET_HEADER} must be 1 to {MAX_DECODE_TARGETS} of {{"pod": ..., '
                             '"address": "ip:port", "migrationAddress": ...}, best first')
        return tuple(cls(item["pod"], item["address"], item.get("migrationAddress", "")) for item in items)


def header_of(targets: tuple[DecodeTarget, ...]) -> dict[str, str]:
    """The header naming these decode workers, best first (the others are tried when one has no room)."""
    return {DECODE_TARGET_HEADER: json.dumps([t.to_json() for t in targets[:MAX_DECODE_TARGETS]])}


def _is_target(item: object) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("pod"), str) and isinstance(item.get("address"), str)
            and bool(item["address"]) and isinstance(item.get("migrationAddress", ""), str))


# Where a request handed over to a worker continues (docs/migration.md): the target serves it, the
# source's relay and the router read it with `?after=<chunks already seen>`.
CONTINUATION_ROUTE = "/internal/requests/{request_id}/stream"


def continuation_path(request_id: str) -> str:
    """The continuation's path for one request (request ids are URL-safe: REQUEST_ID_PATTERN)."""
    return CONTINUATION_ROUTE.format(request_id=request_id)


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_DONE = b"data: [DONE]\n\n"


def sse_data(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as compact JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_event(event: str, payload: dict[str, Any]) -> bytes:
    """One named server-sent event (`event: <event>`) carrying `payload` as compact JSON."""
    return f"event: {event}\n".encode() + sse_data(payload)


async def sse_events(content: aiohttp.StreamReader, idle_s: float | None = None) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) of each server-sent event read from a response body, until it ends.

    The one reader of the streams `sse_data` and `sse_event` write: the router relaying a worker, a
    source relaying its migrated request's target. An event without a name is "message"; several
    data lines are joined with newlines. A silence longer than `idle_s` raises TimeoutError (None:
    wait as long as the connection's own timeouts allow); only time spent waiting for the stream
    counts, not the time the caller takes over an event.

    The limit is one timer per stream that looks at when data last came, and fails the stream
    (`StreamReader.set_exception`) once the silence is long enough: `asyncio.wait_for` around every
    line made a task per line, a quarter of the router's CPU under load (bench/load.py).
    """
    loop = asyncio.get_running_loop()
    last_s = loop.time()
    reading = True
    timer: asyncio.TimerHandle | None = None

    def check() -> None:
        nonlocal timer
        timer = None
        if not reading:
            return  # re-armed when the caller asks for the next event
        quiet_s = loop.time() - last_s
        if idle_s is not None and quiet_s >= idle_s:
            content.set_exception(TimeoutError(f"no data for {idle_s:.0f} s"))
        elif idle_s is not None:
            timer = loop.call_at(last_s + idle_s, check)

    if idle_s is not None:
        timer = loop.call_later(idle_s, check)
    event, data = "", list[str]()
    try:
        while True:
            raw = await content.readline()
            last_s = loop.time()
            if not raw:
                return
            line = raw.decode().rstrip("\r\n")
            if not line:
                if data:
                    reading = False
                    yield event or "message", "\n".join(data)
                    reading, last_s = True, loop.time()
                    if idle_s is not None and timer is None:
                        timer = loop.call_later(idle_s, check)
                event, data = "", list[str]()
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
    finally:
        if timer is not None:
            timer.cancel()


def bearer(token: str) -> dict[str, str]:
    """The header that carries the pool token."""
    return {AUTHORIZATION_HEADER: f"Bearer {token}"}


def request_id(request: web.Request, prefix: str) -> str:
    """The client's `X-Request-Id` if it gave a valid one, else a new id starting with `prefix`."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return new_id(prefix)
    if not REQUEST_ID_PATTERN.match(given):
        raise APIError(400, f"{REQUEST_ID_HEADER} must match {REQUEST_ID_PATTERN.pattern}", param=REQUEST_ID_HEADER)
    return given


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object, or the OpenAI-format 400 that says what is wrong with it."""
    return parse_json_object(await request.read())


def openai_errors(count: Callable[[int], None], *, retry_after_s: int | None = None,
                  convert_http_errors: bool = True) -> Middleware:
    """Middleware answering APIError, and a body over MAX_BODY_BYTES, in OpenAI's error format.

    `count(status)` is called for each of those. With `retry_after_s`, a 429 or 503 tells the client
    when to come back. `convert_http_errors` also answers aiohttp's own 4xx/5xx (an unknown path, a
    wrong method) in OpenAI's format, uncounted.
    """

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as err:
            count(err.status)
            headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None and err.status in (429, 503) else {}
            return web.json_response(err.body(), status=err.status, headers=headers)
        except web.HTTPRequestEntityTooLarge:
            count(413)
            return web.json_response(APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes").body(), status=413)
        except web.HTTPException as err:
            if convert_http_errors and err.status >= 400:
                body = APIError(err.status, err.reason, code=err.reason.lower().replace(" ", "_")).body()
                return web.json_response(body, status=err.status)
            raise

    return errors


def pool_token_auth(credentials: PoolCredentials | None) -> Middleware:
    """Middleware requiring the pool token on `/internal/*`, and on any request naming a decode worker
    (DECODE_TARGET_HEADER: it has this worker connect to another and send KV there); without a token
    those are closed. A token this pod does not know makes it re-read the pool's Secret once (a peer
    may have learnt of a rotation first, kvfleet.serving.credentials) before it refuses."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(INTERNAL_PREFIX) or DECODE_TARGET_HEADER in request.headers:
            if credentials is None:
                raise APIError(403, "internal endpoints are disabled: the worker has no pool token",
                               error_type="permission_error")
            header = request.headers.get(AUTHORIZATION_HEADER, "")
            given = header.removeprefix("Bearer ") if header.startswith("Bearer ") else ""
            if not credentials.accepts_token(given) and not (
                    await credentials.refresh_after_miss() and credentials.accepts_token(given)):
                raise APIError(401, "the pool token is required (Authorization: Bearer ...)",
                               error_type="authentication_error")
        return await handler(request)

    return auth


def healthz(failure: Callable[[], str | None] = lambda: None) -> Handler:
    """GET /healthz: 200 while alive; 500 with the reason once `failure()` names one (restart me)."""

    async def handle(_: web.Request) -> web.StreamResponse:
        reason = failure()
        if reason:
            return web.json_response({"ok": False, "reason": reason}, status=500)
        return web.json_response({"ok": True})

    return handle


def readyz(not_ready: Callable[[], str | None]) -> Handler:
    """GET /readyz: 200 when `not_ready()` is None, else 503 with its reason (send no traffic yet)."""

    async def handle(_: web.Request) -> web.StreamResponse:
        reason = not_ready()
        if reason is None:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": reason}, status=503)

    return handle


def metrics(registry: CollectorRegistry, refresh: Callable[[], object] | None = None) -> Handler:
    """GET /metrics: the registry in Prometheus' text format, after `refresh` (in a thread: it may block)."""

    async def handle(_: web.Request) -> web.StreamResponse:
        if refresh is not None:
            await asyncio.to_thread(refresh)
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle
