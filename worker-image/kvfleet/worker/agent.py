"""The worker agent: one engine behind an OpenAI-compatible HTTP API, reporting its KV load.

It is the only process in a worker pod. `Agent` owns the engine's lifecycle (start-up, drain on
SIGTERM) and wires the parts that serve it, each in its own module:

- `openai_routes`: `/v1/completions`, `/v1/chat/completions`, `/v1/models` (whole or SSE);
- `streams`: a request's text deltas from the engine, across a migration;
- `adoption`: requests handed over to this worker, served at `/internal/requests/{id}/stream`;
- `reporter`: the KV-load reports the operator packs pods by;
- `/kvfleet/speed-profile`: the engine's measured step speed (engines/speed.py), which the router
  gathers from the pool for `kvfleet replay` and the simulator;
- kvfleet.serving.httpapi: the probes (`/healthz` is "the process and the engine are alive",
  `/readyz` is "the model is loaded, send traffic"), `/metrics`, OpenAI-format errors, and the pool
  token that guards `/internal/*`.

It is also both ends of a live migration (docs/migration.md): here it hosts the migration executor
(the source runs the move; `migration.executor`), listens on the migration port, and serves the
`/internal` endpoints the pool's own components use.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvfleet.api.reports import KVLoadReport
from kvfleet.api.speed import SPEED_PROFILE_PATH
from kvfleet.mell.migration import MoveMode
from kvfleet.serving import httpapi
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.serving.openai_api import MAX_BODY_BYTES, APIError
from kvfleet.serving.tokens import TOKENIZER_PATH
from kvfleet.worker.adoption import Adoptions
from kvfleet.worker.disaggregation import HandOvers, PDConfig
from kvfleet.worker.distkv.borrower import RemoteLease
from kvfleet.worker.distkv.creditors import Creditors
from kvfleet.worker.engines.base import Engine, EngineInfo, StepOutput
from kvfleet.worker.gpu import GPUProbe
from kvfleet.worker.metrics import WorkerMetrics
from kvfleet.worker.migration.executor import Executor, MigrationMetrics, MigrationResult, TransferMetrics, parse_mode
from kvfleet.worker.migration.handoff import Adopted, HandedRequest, Handoffs, HandoffTarget, LiveRequest
from kvfleet.worker.migration.transport import MIGRATION_PORT, Listener, TCPTransport, split_address
from kvfleet.worker.openai_routes import OpenAIRoutes
from kvfleet.worker.reporter import CacheFigures, DistKVFigures, LoadReporter, PDFigures, WriteReport, measured_from
from kvfleet.worker.streams import RequestStreams
from kvfleet.worker.text import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentConfig:
    model_name: str
    # The pool's token and migration key (kvfleet.serving.credentials); None: no internal endpoints, no migrations.
    credentials: PoolCredentials | None = None
    report_interval_s: float = 5.0
    # How long a SIGTERM waits for running requests before aborting them.
    drain_timeout_s: float = 25.0
    # Where migrations come in (transport.py): None takes none (and without a pool token there are
    # none either); 0 picks a free port (tests). Every worker of a pool uses the same port.
    migration_host: str = "0.0.0.0"
    migration_port: int | None = MIGRATION_PORT
    # DistKV (docs/distkv.md): whom an engine that borrows asks for KV blocks; None: it borrows none.
    creditors: Creditors | None = None
    # Its role in a disaggregated pool, and the pool's caching milestone and layout (disaggregation.py).
    disaggregation: PDConfig = PDConfig()


class Agent:
    def __init__(self, config: AgentConfig, engine: Engine, tokenizer: Tokenizer, write_report: WriteReport | None,
                 gpu: GPUProbe | None = None) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self._tokenizer_payload: dict[str, Any] | None = None
        self._write_report = write_report
        self._info: EngineInfo | None = None
        self._failure: str | None = None
        self._draining = False
        self.reporter: LoadReporter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.handoffs = Handoffs()
        self._incoming: set[str] = set()
        self._listener: Listener | None = None
        self.executor: Executor | None = None
        self._when_ready: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self.metrics = WorkerMetrics(
            kv_used_bytes=lambda: float(sum(r.kv_bytes for r in self._usage())),
            kv_capacity_bytes=lambda: float(self._info.kv_capacity_bytes if self._info else 0),
            running=lambda: float(len(self._usage())),
            waiting=lambda: float(self.engine.num_waiting() if self._info else 0),
            gpu=gpu or GPUProbe(),
            prefix_cache=cache.prefix_cache_stats if (cache := engine.capabilities.prefix_cache) is not None else None,
            model_name=config.model_name,
            engine_metrics=engine.capabilities.prometheus_metrics,
        )
        self.migration_metrics = MigrationMetrics(self.metrics.registry)
        self.transfer_metrics = TransferMetrics(self.metrics.registry)
        self.handovers: HandOvers | None = None
        self.streams = RequestStreams(engine, tokenizer, self.metrics, self.handoffs, config.credentials,
                                      self.nudge_reporter)
        self.adoptions = Adoptions(engine, self.streams)
        self.openai = OpenAIRoutes(config.model_name, tokenizer, self.require_engine, self.streams)

    # ----------------------------------------------------------------------------------- lifecycle

    def _usage(self) -> list[Any]:
        return self.engine.kv_usage() if self._info else []

    @property
    def ready(self) -> bool:
        return self._info is not None and self._failure is None and not self._draining

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[
            httpapi.openai_errors(lambda status: self.metrics.rejected.labels(str(status)).inc()),
            httpapi.pool_token_auth(self.config.credentials)])
        app.router.add_get("/healthz", httpapi.healthz(lambda: self._failure))
        app.router.add_get("/readyz", httpapi.readyz(self._not_ready))
        app.router.add_get("/metrics", httpapi.metrics(self.metrics.registry, self.metrics.refresh_gpu))
        self.openai.add_to(app)
        # Not under /internal: a speed profile is no secret (no prompt, no request), and a replay reads
        # it through the router without the pool token.
        app.router.add_get(SPEED_PROFILE_PATH, self._speed_profile)
        app.router.add_get(TOKENIZER_PATH, self._tokenizer)
        app.router.add_get("/internal/requests", self._internal_requests)
        app.router.add_post("/internal/requests/{request_id}/abort", self._internal_abort)
        app.router.add_post("/internal/requests/{request_id}/migrate", self._internal_migrate)
        app.router.add_get(httpapi.CONTINUATION_ROUTE, self.adoptions.stream)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app

    def _not_ready(self) -> str | None:
        if self.ready:
            return None
        return self._failure or ("draining" if self._draining else "loading the model")

    def require_engine(self) -> EngineInfo:
        """The engine's facts, or the 503 that says why this worker takes no request now."""
        if self._failure:
            raise APIError(503, self._failure, error_type="server_error")
        if self._info is None:
            raise APIError(503, "the model is still loading", error_type="server_error", code="model_loading")
        if self._draining:
            raise APIError(503, "this worker is shutting down", error_type="server_error", code="draining")
        return self._info

    async def _on_startup(self, _: web.Application) -> None:
        self._tasks.append(asyncio.create_task(self._start_engine()))

    async def _on_shutdown(self, _: web.Application) -> None:
        await self.drain()

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
            self._start_reporter(info, self._write_report)
        if self.config.credentials is not None:
            await self._start_migrations(self.config.credentials)
            self._tasks.append(asyncio.create_task(self.config.credentials.keep_fresh()))
        for run in self._when_ready:
            self._tasks.append(asyncio.create_task(run()))

    def run_when_ready(self, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs a background loop (the KVMigration watcher) once the engine is up, until shutdown."""
        self._when_ready.append(run)

    async def drain(self) -> None:
        """Stop taking requests, let running ones finish (bounded), then stop the engine."""
        self._draining = True
        active = self.streams.active
        log.info("shutting down: no new requests; waiting up to %.0f s for %d running", self.config.drain_timeout_s,
                 len(active))
        deadline = asyncio.get_running_loop().time() + self.config.drain_timeout_s
        while (active or self.streams.num_relays) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        if active:
            log.warning("aborting %d requests still running after %.0f s: %s", len(active),
                        self.config.drain_timeout_s, ", ".join(sorted(active)))
        if self.reporter is not None:
            await self.reporter.maybe_write()  # the last word on what this pod holds
        for task in self._tasks:
            task.cancel()
        if self._listener is not None:
            await self._listener.close()
        self.adoptions.cancel_all()
        if self.handovers is not None:
            self.handovers.cancel_all()
        await self.streams.close()
        await self.engine.stop()

    # ---------------------------------------------------------------------------- KV-load reports

    def _decode_step_s(self) -> float | None:
        """The engine's mean decode step period so far (its speed profile), or None unmeasured."""
        profile = self.engine.speed_profile()
        if profile is None or not profile.decode:
            return None
        samples = sum(p.samples for p in profile.decode)
        return sum(p.step_seconds * p.samples for p in profile.decode) / samples

    def _start_reporter(self, info: EngineInfo, write: WriteReport) -> None:
        async def counted(report: KVLoadReport) -> None:
            await write(report)
            self.metrics.report_writes.inc()

        elastic = self.engine.capabilities.elastic_memory
        self.reporter = LoadReporter(self._reported_usage, info.kv_capacity_bytes, counted,
                                     interval_s=self.config.report_interval_s, queued=self.engine.queued,
                                     measured=measured_from(self.metrics.registry),
                                     block_size_tokens=info.block_size_tokens, step_s=self._decode_step_s,
                                     memory=elastic.memory_state if elastic is not None else None,
                                     prefix_cache=self._cache_figures(info), distkv=self._distkv_figures(info),
                                     pd=self._pd_figures())
        self._tasks.append(asyncio.create_task(self.reporter.run()))

    def _pd_figures(self) -> Callable[[], PDFigures] | None:
        role = self.config.disaggregation.role
        if role is None:
            return None
        transfers = self.transfer_metrics

        def figures() -> PDFigures:
            queued = sum(r.tokens for r in self.engine.queued())
            return PDFigures(queued, transfers.count if role == "prefill" else None)

        return figures

    def _distkv_figures(self, info: EngineInfo) -> Callable[[], DistKVFigures] | None:
        lending, borrowing = self.engine.capabilities.lending, self.engine.capabilities.borrowing
        if lending is None and borrowing is None:
            return None
        block_bytes = info.block_size_tokens * info.kv_bytes_per_token

        def figures() -> DistKVFigures:
            return DistKVFigures(lending.cap_blocks * block_bytes if lending is not None else None,
                                 lending.lent_blocks() * block_bytes if lending is not None else 0,
                                 borrowing.borrowed_bytes() if borrowing is not None else {})

        return figures

    def _cache_figures(self, info: EngineInfo) -> Callable[[], CacheFigures] | None:
        cache = self.engine.capabilities.prefix_cache
        if cache is None:
            return None
        block_bytes = info.block_size_tokens * info.kv_bytes_per_token

        def figures() -> CacheFigures:
            stats = cache.prefix_cache_stats()
            evictable = stats.evictable_blocks
            return CacheFigures(evictable * block_bytes if evictable is not None else None, stats.cached_blocks)

        return figures

    def _reported_usage(self) -> list[Any]:
        # KV staged for a migration still in flight towards this worker is not the request's home yet:
        # reporting it would show the operator the request on two pods at once.
        return [r for r in self.engine.kv_usage() if r.request_id not in self._incoming]

    def nudge_reporter(self) -> None:
        if self.reporter is not None:
            self.reporter.nudge()

    # --------------------------------------------------------------------------------- migrations

    async def _start_migrations(self, credentials: PoolCredentials) -> None:
        transport = TCPTransport(credentials)
        self.executor = Executor(self, transport, self.migration_metrics, transfers=self.transfer_metrics)
        self.handovers = HandOvers(self.config.disaggregation, self.executor, None,
                                   self.config.migration_port or MIGRATION_PORT)
        self.openai.hand_over = self.handovers.start
        self.openai.prepare_hand_over = self.handovers.prepare
        self.openai.no_hand_over = self.handovers.forget
        borrowing = self.engine.capabilities.borrowing
        if borrowing is not None and self.config.creditors is not None:
            # Leases go over the same authenticated port as migrations (distkv/wire.py).
            borrowing.attach(functools.partial(RemoteLease, transport), self.config.creditors)
        if self.config.migration_port is None:
            return
        try:
            self._listener = await transport.listen(self.config.migration_host, self.config.migration_port,
                                                    self.executor.serve)
        except OSError as err:
            log.error("cannot listen for migrations on %s:%s: %s; this worker takes none in",
                      self.config.migration_host, self.config.migration_port, err)
        else:
            log.info("migrations come in on %s:%d", self.config.migration_host, self._listener.port)
            host = self.config.migration_host
            if host not in ("", "0.0.0.0", "::"):
                # Where a decode worker sends a finished request's KV back (PD-Caching-3): this pod's address.
                self.handovers.own_migration_address = f"{host}:{self._listener.port}"

    @property
    def migration_port(self) -> int | None:
        """The port migrations come in on (after start-up), or None."""
        return self._listener.port if self._listener is not None else None

    async def migrate(self, request_id: str, target: HandoffTarget, migration_address: str, mode: MoveMode,
                      kv_bytes_limit: int | None = None) -> MigrationResult:
        if self.executor is None:
            return MigrationResult(request_id, False, mode, message="this worker has no pool token: it cannot migrate")
        return await self.executor.migrate(request_id, target, migration_address, mode, kv_bytes_limit)

    # The migration executor's host (migration.executor.Host).

    def live_request(self, request_id: str) -> LiveRequest | None:
        return self.streams.live.get(request_id)

    def incoming(self, request_id: str, arriving: bool) -> None:
        if arriving:
            self._incoming.add(request_id)
        else:
            self._incoming.discard(request_id)

    def accepts_migrations(self) -> bool:
        return self.ready

    def adopt(self, handed: HandedRequest, stream: AsyncIterator[StepOutput]) -> Adopted:
        return self.adoptions.adopt(handed, stream)

    # ------------------------------------------------------------------------------------ speed

    async def _tokenizer(self, _: web.Request) -> web.Response:
        """The tokenizer, for the router's prompt tree (kvfleet.serving.tokens), with the engine's KV
        block: the tree's granularity, as the worker's cache keeps prefixes by whole blocks."""
        info = self._info
        if info is None:
            raise APIError(503, self._failure or "the model is still loading", error_type="server_error",
                           code="not_ready")
        if self._tokenizer_payload is None:
            self._tokenizer_payload = self.tokenizer.payload()
        return web.json_response({**self._tokenizer_payload, "blockSizeTokens": info.block_size_tokens})

    async def _speed_profile(self, _: web.Request) -> web.Response:
        """The engine's measured speed, named by the model clients know, with the migration
        executor's latest link measurement; 404 naming why there is none. A draining worker still
        answers: its numbers are as good as ever, and a replay wants the last of them."""
        info = self._info
        if info is None:
            raise APIError(404, self._failure or "the model is still loading: no step has run yet",
                           error_type="not_found_error", code="no_speed_profile")
        if not info.measures_speed:
            raise APIError(404, f"the {info.engine} engine does not measure its step speed",
                           error_type="not_found_error", code="speed_not_measured")
        profile = self.engine.speed_profile()
        if profile is None:
            raise APIError(404, f"the {info.engine} engine has run no step yet: nothing measured",
                           error_type="not_found_error", code="no_speed_profile")
        link = measured_from(self.metrics.registry)().link_bytes_per_s
        profile = profile.model_copy(update={"model": self.config.model_name, "link_bytes_per_second": link})
        return web.json_response(profile.model_dump(mode="json", by_alias=True))

    # ------------------------------------------------------------------------------------ internal

    async def _internal_requests(self, _: web.Request) -> web.Response:
        info = self.require_engine()
        return web.json_response({
            "capacityBytes": info.kv_capacity_bytes, "kvBytesPerToken": info.kv_bytes_per_token,
            "blockSizeTokens": info.block_size_tokens, "waiting": self.engine.num_waiting(),
            "requests": [{"id": r.request_id, "tokens": r.tokens, "kvBytes": r.kv_bytes} for r in self.engine.kv_usage()]})

    async def _internal_abort(self, request: web.Request) -> web.Response:
        self.require_engine()
        await self.engine.abort(request.match_info["request_id"])
        return web.json_response({"aborted": request.match_info["request_id"]})

    async def _internal_migrate(self, request: web.Request) -> web.Response:
        """Moves a request to another worker now: what the KVMigration watcher does, for tools and tests.

        Body: {"target": {"pod", "address": "ip:port" (HTTP), "migrationAddress" (default: the
        address's host on this worker's migration port)}, "mode": "kv" | "token" | "hybrid",
        "kvBytes": the KV bytes a hybrid move copies (optional; default all full blocks)}.
        """
        self.require_engine()
        raw = await httpapi.read_json(request)
        target = raw.get("target")
        mode = raw.get("mode", "kv")
        kv_bytes = raw.get("kvBytes")
        if kv_bytes is not None and (not isinstance(kv_bytes, int) or kv_bytes < 0):
            raise APIError(400, "kvBytes must be a non-negative integer", param="kvBytes")
        if not isinstance(target, dict) or not isinstance(target.get("pod"), str) or not isinstance(target.get("address"), str):
            raise APIError(400, "target must be {\"pod\": ..., \"address\": \"ip:port\"}", param="target")
        if parse_mode(mode) is None:
            raise APIError(400, f"mode must be one of {', '.join(MoveMode)}", param="mode")
        try:
            host, _ = split_address(target["address"])
        except ValueError as err:
            raise APIError(400, str(err), param="target.address") from None
        migration_address = target.get("migrationAddress") or f"{host}:{self.config.migration_port or MIGRATION_PORT}"
        result = await self.migrate(request.match_info["request_id"], HandoffTarget(target["pod"], target["address"]),
                                    str(migration_address), mode, kv_bytes_limit=kv_bytes)
        return web.json_response(result.to_json())
