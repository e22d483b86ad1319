"""The target's end of a migration hand-off: run a request handed over to this worker, and serve its rest.

The migration executor hands a request in (`Adoptions.adopt`, the executor's `Host.adopt`); it runs
at once, its outputs buffered, until whoever reads its stream (the router, or the source's relay for
a direct client) attaches at `GET /internal/requests/{id}/stream?after=n` (docs/migration.md). A
request nobody attaches to within HANDOFF_ATTACH_TIMEOUT_S is aborted, so its KV does not linger.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from kvfleet.serving.httpapi import SSE_DONE, SSE_HEADERS, sse_data
from kvfleet.serving.openai_api import APIError
from kvfleet.worker.engines.base import Engine, StepOutput
from kvfleet.worker.migration.handoff import HANDOFF_ATTACH_TIMEOUT_S, Adopted, HandedRequest, Moved, RequestMoved
from kvfleet.worker.streams import Job, RequestStreams, Resumed

log = logging.getLogger(__name__)


class Adoptions:
    """The requests handed over to this worker whose stream has not been read to its end yet."""

    def __init__(self, engine: Engine, streams: RequestStreams) -> None:
        self.engine = engine
        self.streams = streams
        self.adopted: dict[str, Adopted] = {}

    def adopt(self, handed: HandedRequest, stream: AsyncIterator[StepOutput]) -> Adopted:
        """Runs a request handed over to this worker, buffering its outputs until a reader attaches."""
        adopted = Adopted(handed)
        job = Job(handed.request_id, list(handed.prompt_token_ids), handed.params, handed.stops, handed.model,
                  handed.created, include_stop=handed.include_stop)

        async def drive() -> None:
            moved: Moved | None = None
            iterated = False
            try:
                async for delta in self.streams.deltas(job, follow_moves=False, resumed=Resumed(stream, handed)):
                    iterated = True
                    adopted.add(delta.text, delta.finish_reason, delta.token_ids, delta.logprobs)
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
        self.adopted[handed.request_id] = adopted
        asyncio.get_running_loop().call_later(HANDOFF_ATTACH_TIMEOUT_S, self._attach_deadline, adopted)
        return adopted

    def _attach_deadline(self, adopted: Adopted) -> None:
        if adopted.ever_attached:
            return
        request_id = adopted.handed.request_id
        log.warning("no reader attached to %s (handed over here) within %.0f s: aborting it and freeing its KV",
                    request_id, HANDOFF_ATTACH_TIMEOUT_S)
        if self.adopted.get(request_id) is adopted:
            del self.adopted[request_id]
        if adopted.task is not None:
            adopted.task.cancel()

    def cancel_all(self) -> None:
        """Shutting down: every adopted request still running is aborted."""
        for adopted in list(self.adopted.values()):
            if adopted.task is not None:
                adopted.task.cancel()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """GET /internal/requests/{request_id}/stream: the continuation of a request handed over here."""
        request_id = request.match_info["request_id"]
        adopted = self.adopted.get(request_id)
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
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            async for item in adopted.read(after):
                if isinstance(item, Moved):
                    await response.write(item.event())
                    break
                await response.write(sse_data(adopted.chunk(item)))
            else:
                await response.write(SSE_DONE)
            complete = True
        finally:
            adopted.reader_attached = False
            if complete:
                self.adopted.pop(request_id, None)
            elif not adopted.ended and adopted.task is not None:
                log.info("the reader of %s (handed over here) went away; aborting it", request_id)
                adopted.task.cancel()
        return response
