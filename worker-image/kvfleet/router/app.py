"""The router's HTTP front end: OpenAI completions and chat in, placed on a worker, relayed back.

Requests are validated with the workers' own OpenAI models (kvfleet.serving.openai_api), so a bad
request gets the same 400 from the router as from a worker and never occupies one. Each request is
then placed (placement.py, with the model's KV facts from model_info.py), relayed from the worker in
router mode (relay.py) and answered in the shape the client asked for (responses.py).

Backpressure: at most `max_in_flight` requests are relayed at once; the next gets 429 with
Retry-After. A pool with no Ready worker, or none with room for the request's KV, gets 503 with
Retry-After, in OpenAI's error format.

`GET /kvfleet/speed-profile` gathers the workers' measured speed for `kvfleet replay` (speed.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvfleet.api.speed import SPEED_PROFILE_PATH
from kvfleet.router.disaggregation import PREFILL, caches, place_disaggregated
from kvfleet.router.hold import HoldFull, HoldQueue, HoldTimeout
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.model_info import ModelInfo, ModelInfoSource
from kvfleet.router.placement import (
    NoRoute,
    PDSettings,
    PoolLoads,
    PoolSnapshot,
    Reservation,
    RouteChoice,
    estimate_prompt_tokens,
    request_kv_bytes,
)
from kvfleet.router.pool import PoolView
from kvfleet.router.prefix_routing import PrefixRouting
from kvfleet.router.relay import OnWorker, Place, Relay, Timeouts
from kvfleet.router.responses import respond
from kvfleet.router.speed import gather_profiles
from kvfleet.serving import httpapi
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.serving.openai_api import (
    MAX_BODY_BYTES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    model_list,
    resume_fields,
    tokenize_request,
    validated,
    version,
)

log = logging.getLogger(__name__)

# How long a worker may take to tokenize or detokenize one body before the next is asked.
TOKENIZE_TIMEOUT_S = 30.0


def new_seed() -> int:
    """A seed for a sampled request that came without one (31 bits: every engine takes it)."""
    return secrets.randbelow(2**31)


@dataclass(frozen=True)
class RouterConfig:
    pool_name: str
    namespace: str = ""
    credentials: PoolCredentials | None = None
    max_in_flight: int = 1024
    retry_after_s: int = 1
    timeouts: Timeouts = field(default_factory=Timeouts)
    # Workers a request may fail on before the client gets an error.
    max_attempts: int = 4
    # How long `GET /kvfleet/speed-profile` waits for each worker (asked in parallel): a worker is an
    # aiohttp handler away from its answer, so one slower than this is busy or gone.
    speed_profile_timeout_s: float = 2.0
    # Requests held while the pool has no Ready worker (scale from zero, hold.py), and how long each
    # waits for one before its 503: a worker's cold start (pod, model load) must fit in it.
    max_held: int = 256
    hold_timeout_s: float = 300.0


class Router:
    def __init__(self, config: RouterConfig, view: PoolView) -> None:
        self.config = config
        self.view = view
        self.metrics = RouterMetrics()
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = 0
        # The pool's KV per worker, the requests this router placed included (placement.PoolLoads).
        self.loads = PoolLoads()
        self.model_info = ModelInfoSource(view, lambda: self.session, config.credentials)
        self.prefix = PrefixRouting(view, lambda: self.session)
        self.hold = HoldQueue(config.max_held, config.hold_timeout_s,
                              lambda: bool(self.view.snapshot().ready_workers()), self._held_changed)
        self._background: list[asyncio.Task[None]] = []

    def app(self) -> web.Application:
        # aiohttp's own 404/405 in OpenAI's format too: a client of the router reads every error the same way.
        errors = httpapi.openai_errors(lambda status: self.metrics.errors.labels(str(status)).inc(),
                                       retry_after_s=self.config.retry_after_s)
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[errors])
        app.router.add_get("/healthz", httpapi.healthz())
        app.router.add_get("/readyz", httpapi.readyz(self._not_ready))
        app.router.add_get("/metrics", httpapi.metrics(self.metrics.registry))
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get(SPEED_PROFILE_PATH, self._speed_profile)
        app.router.add_post("/tokenize", self._to_a_worker)
        app.router.add_post("/detokenize", self._to_a_worker)
        app.router.add_get("/version", self._version)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _: web.Application) -> None:
        # Connections to workers are pooled; no total timeout (a stream lasts as long as it generates),
        # the relay bounds the first token and the silences. No limit on the pool: admission
        # (max_in_flight) bounds the streams, each holding a connection for its whole life. aiohttp's
        # default of 100 made the 101st stream wait for a free connection, and that wait counts
        # against the connect timeout: a request failed on a healthy worker (bench/load.py).
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None, connect=self.config.timeouts.connect_s))
        self.view.start()
        self._background.append(asyncio.create_task(self.prefix.refresh_profiles(self.config.speed_profile_timeout_s)))
        if self.config.credentials is not None:  # the pool's Secret may rotate (kvfleet.serving.credentials)
            self._background.append(asyncio.create_task(self.config.credentials.keep_fresh()))

    async def _on_cleanup(self, _: web.Application) -> None:
        for task in self._background:
            task.cancel()
        self.view.stop()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router's app has not started"
        return self._session

    def worker_of(self, request_id: str) -> str | None:
        """The pod the router last placed the request in flight with this id on; None before it has a
        worker and once it has ended."""
        reservation = self.loads.reservation(request_id)
        return reservation.pod_name if reservation is not None else None

    def _not_ready(self) -> str | None:
        # Ready once the pool has been read: from then on every request gets a worker or a clear 503.
        return None if self.view.snapshot().synced else "reading the pool from the API server"

    async def _models(self, _: web.Request) -> web.Response:
        info = await self.model_info.get()
        if info is None:
            raise APIError(503, "the pool has no Ready worker; retry shortly", error_type="server_error", code="no_ready_worker")
        return web.json_response(model_list(info.model_name, info.max_model_len))

    async def _version(self, _: web.Request) -> web.Response:
        return web.json_response(version())

    async def _to_a_worker(self, request: web.Request) -> web.Response:
        """POST /tokenize and /detokenize, as vLLM's server answers them: the model's tokenizer lives with
        the workers, so a Ready one answers (the next if one cannot be reached); a bad body is refused
        here, without one."""
        raw = await httpapi.read_json(request)
        if request.path == "/tokenize":
            tokenize_request(raw)
        else:
            validated(DetokenizeRequest, raw)
        for worker in self.view.snapshot().ready_workers():
            try:
                async with self.session.post(f"http://{worker.address}{request.path}", json=raw,
                                             timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)) as resp:
                    return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")
            except (aiohttp.ClientError, TimeoutError) as err:
                log.info("%s on %s failed, asking the next worker: %s", request.path, worker.pod_name, err)
        raise APIError(503, "the pool has no Ready worker to tokenize with; retry shortly", error_type="server_error",
                       code="no_ready_worker")

    async def _speed_profile(self, _: web.Request) -> web.Response:
        # Every worker the view knows, Ready or not: a draining worker's numbers are still its own.
        workers = self.view.snapshot().workers
        return web.json_response(await gather_profiles(self.session, workers, self.config.speed_profile_timeout_s))

    # ------------------------------------------------------------------------------- OpenAI routes

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

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
        raw = await httpapi.read_json(request)
        body, prompt = _parse(raw, chat)
        if not self.view.snapshot().synced:
            raise APIError(503, "the router has not read its pool yet; retry shortly", error_type="server_error",
                           code="router_starting")
        request_id = httpapi.request_id(request, "chatcmpl" if chat else "cmpl")
        await self._wait_for_a_worker()
        info = await self.model_info.get()
        max_tokens = body.output_limit() if isinstance(body, ChatCompletionRequest) else body.max_tokens
        prompt_ids = None
        if self.view.snapshot().locality != "none":
            await self.prefix.ensure_tokenizer()
            prompt_ids = self.prefix.prompt_ids(prompt)
        user = body.user
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else estimate_prompt_tokens(prompt)
        # The samples of `n` are separate requests to the workers (each placed, moved and resumed on its
        # own), with vLLM's seeds: seed, seed + 1, ...
        forward = {k: v for k, v in raw.items() if k not in ("stream_options", "n")}
        seed = body.seed
        if body.temperature > 0 and seed is None:
            # The router, not a worker, picks a sampled request's seed: a resume on another worker after
            # a death then continues the same draws (the builtin engine draws per (seed, position)).
            seed = new_seed()
        sample_ids = [request_id] if body.n == 1 else [f"{request_id}-{i}" for i in range(body.n)]
        resume = resume_fields(body)
        relays = []
        for index, sample_id in enumerate(sample_ids):
            choose, on_worker = self._placer(sample_id, info, prompt_tokens, max_tokens, prompt_ids, user)
            if index > 0:
                choose = self._beside(sample_ids[0], choose)
            sample = forward if seed is None else {**forward, "seed": seed + index}
            sample_resume = resume if seed is None else {**resume, "seed": seed + index}
            relays.append(Relay(self.session, sample_id, request.path, sample, resume=sample_resume, place=choose,
                                credentials=self.config.credentials, timeouts=self.config.timeouts,
                                max_attempts=self.config.max_attempts, on_worker=on_worker, on_event=self._count_event))
        try:
            # With prefix caching the first sample runs alone until its first token, so that the others
            # find its prompt cached beside it (one prefill, one copy of the prompt's KV).
            stagger = self.view.snapshot().locality != "none"
            return await respond(request, relays, body, chat, self.metrics, arrived_s, request_id, stagger=stagger)
        finally:
            for relay in relays:
                self.loads.release(relay.request_id)
                self._ended(relay, user)

    def _ended(self, relay: Relay, user: str | None) -> None:
        """The prompt tree learns what the request left cached where (MemServe §6's update path)."""
        done = relay.finish_reason is not None and relay.prompt_token_ids is not None and relay.workers
        tokens = (relay.prompt_token_ids or []) + relay.output_token_ids
        snapshot = self.view.snapshot()
        pd = snapshot.disaggregation
        if pd is None or not done:
            self.prefix.ended(relay.request_id, relay.workers[-1] if done else None, tokens if done else None, user)
            return
        # A disaggregated pool: each role's cache per the pool's milestone (kvfleet.router.disaggregation).
        roles = {w.pod_name: w.role for w in snapshot.workers}
        last = relay.workers[-1]
        self.prefix.ended(relay.request_id, last if caches(roles.get(last), pd.caching) else None, tokens, user)
        first = relay.workers[0]
        if first != last and roles.get(first) == PREFILL and caches(PREFILL, pd.caching):
            # The prefill worker cached the prompt as it handed it over, and got the answer back (full).
            self.prefix.remember(first, tokens if pd.caching == "full" else list(relay.prompt_token_ids or []))

    async def _wait_for_a_worker(self) -> None:
        """Hold the request while the pool has no Ready worker (scaled to zero, or waking): hold.py."""
        try:
            held = await self.hold.wait_for_worker()
        except HoldFull as err:
            self.metrics.held_outcomes.labels("full").inc()
            raise APIError(429, f"the pool is starting its first worker and {err}; retry shortly",
                           error_type="rate_limit_error", code="pool_waking") from None
        except HoldTimeout as err:
            self.metrics.held_outcomes.labels("timeout").inc()
            raise APIError(503, f"the pool has no Ready worker: {err}", error_type="server_error",
                           code="no_ready_worker") from None
        except asyncio.CancelledError:
            self.metrics.held_outcomes.labels("gone").inc()
            raise
        if held:
            self.metrics.held_outcomes.labels("released").inc()

    def _held_changed(self, held: int) -> None:
        self.metrics.held.set(held)
        self.view.signal_held(held)

    def _placer(self, request_id: str, info: ModelInfo | None, prompt_tokens: int, max_tokens: int | None,
                prompt_ids: list[int] | None = None, user: str | None = None) -> tuple[Place, OnWorker]:
        """The relay's two hooks: choose a worker (excluding failed ones), and reserve the request's KV there."""

        def kv_bytes(num_prompt_tokens: int) -> int:
            if info is None or info.kv_bytes_per_token is None:
                return 0  # unknown until a worker tells: every request looks small (class T)
            return request_kv_bytes(num_prompt_tokens, max_tokens, info.kv_bytes_per_token, info.max_model_len)

        estimate = {"bytes": kv_bytes(prompt_tokens)}

        def choose(exclude: frozenset[str]) -> RouteChoice | NoRoute:
            capacity = (info.capacity_bytes if info else None) or 1
            snapshot = self.view.snapshot()
            self.loads.sync(snapshot)
            if snapshot.disaggregation is not None:
                others = [r for r in self.loads.reservations() if r.request_id != request_id]
                return choose_disaggregated(snapshot, snapshot.disaggregation, others, capacity, exclude)
            locality = self.prefix.locality(snapshot, prompt_ids, user)
            choice = self.loads.place(estimate["bytes"], default_capacity_bytes=capacity, exclude=exclude,
                                      locality=locality, request_id=request_id)
            if isinstance(choice, RouteChoice):
                self.metrics.placements.labels(choice.rule).inc()
                self.prefix.placed(request_id, choice.pod_name, prompt_ids, locality)
                if locality is not None:
                    self.metrics.prefix_matched_tokens.inc(locality.cached_tokens.get(choice.pod_name, 0))
                log.debug("%s (%d bytes of KV) -> %s by %s", request_id, estimate["bytes"], choice.pod_name, choice.rule)
            return choice

        def choose_disaggregated(snapshot: PoolSnapshot, pd: PDSettings, others: list[Reservation], capacity: int,
                                 exclude: frozenset[str]) -> RouteChoice | NoRoute:
            tokens = len(prompt_ids) if prompt_ids is not None else prompt_tokens
            locality = self.prefix.disaggregated_input(snapshot, prompt_ids, tokens, user)
            choice = place_disaggregated(snapshot, pd, others, estimate["bytes"], default_capacity_bytes=capacity,
                                         exclude=exclude, locality=locality,
                                         kv_bytes_per_token=(info.kv_bytes_per_token or 0) if info else 0)
            if isinstance(choice, RouteChoice):
                self.metrics.placements.labels(choice.rule).inc()
                self.prefix.placed(request_id, choice.pod_name, prompt_ids, locality, tokens)
                log.debug("%s -> %s%s by %s", request_id, choice.pod_name,
                          f" then {choice.decode[0].pod}" if choice.decode else "", choice.rule)
            return choice

        def on_worker(pod_name: str, ids: list[int] | None) -> None:
            if ids is not None:
                estimate["bytes"] = kv_bytes(len(ids))  # exact now that the worker has tokenized it
                self.prefix.started(request_id)
            self.loads.reserve(Reservation(request_id, pod_name, estimate["bytes"]))

        return choose, on_worker

    def _beside(self, first_id: str, choose: Place) -> Place:
        """A later sample of `n` goes where the first one runs while that worker is Ready and not failed
        for it: the samples share one prompt, whose KV a worker with a prefix cache then holds once."""

        def choose_beside(exclude: frozenset[str]) -> RouteChoice | NoRoute:
            first = self.loads.reservation(first_id)
            if first is not None and first.pod_name not in exclude:
                worker = next((w for w in self.view.snapshot().workers if w.pod_name == first.pod_name and w.ready), None)
                if worker is not None:
                    self.metrics.placements.labels("sibling").inc()
                    return RouteChoice(worker.pod_name, worker.address, "sibling")
            return choose(exclude)

        return choose_beside

    def _count_event(self, kind: str) -> None:
        (self.metrics.resumes if kind == "resume" else self.metrics.migrations).inc()


# A prompt as estimate_prompt_tokens takes it: text, token ids, or chat messages.
Prompt = str | list[int] | list[dict[str, str]]


def _parse(raw: dict[str, Any], chat: bool) -> tuple[CompletionRequest | ChatCompletionRequest, Prompt]:
    """The validated request and its prompt, or the OpenAI-format 400 that says what is wrong."""
    if chat:
        body = validated(ChatCompletionRequest, raw)
        return body, body.text_messages()
    completion = validated(CompletionRequest, raw)
    return completion, completion.prompt
