"""One request's token stream from the workers, kept whole across migrations and worker deaths.

The router always asks a worker for its router-mode stream (`X-Kvfleet-Stream: tokens`): every chunk
carries the index in the request's whole output it starts at and the token ids it covers (and their
log-probabilities, when asked for), and the first one the prompt's ids.
With those the router knows exactly which tokens its client has seen, which is what makes both
continuations exact:

- a migration: the source's stream ends with `event: kvfleet.migrated` naming the target; the router
  reads the rest from the target (`/internal/requests/{id}/stream?after=n`). Chunks repeating an index
  already relayed are dropped; a gap is a broken continuation and handled like a dead worker.
- a dead worker (connection error, timeout, end of stream without `[DONE]`, an aborted request): the
  router has another worker continue the request after the output tokens whose text the client has
  already received (`POST /internal/resume`: prompt + those tokens re-prefilled, the rest of the budget,
  every sampling field; MELL §V's token migration, done by the router because the source cannot take
  part). Greedy output equals the unbroken run.

Text comes from the workers' detokenizers, which hold back the tokens of a half-written character. A
chunk with text means every token up to it has been shown, so a resume starts after the last such
chunk (`clean`), and the held-back tokens are generated again with their text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kvfleet.router.placement import NoRoute, RouteChoice
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.serving.httpapi import (
    MIGRATED_EVENT,
    REQUEST_ID_HEADER,
    RESUME_PATH,
    TOKEN_STREAM_HEADER,
    TOKEN_STREAM_MODE,
    DecodeTarget,
    Migrated,
    bearer,
    continuation_path,
    header_of,
    sse_events,
)
from kvfleet.serving.openai_api import TokenLogprob

log = logging.getLogger(__name__)

# Pause before trying again a worker the request just failed on, times the failures so far.
RETRY_BACKOFF_S = 0.5

# The router's hooks: a worker for the request, failed workers excluded; and the pod now serving it,
# with the prompt's token ids once a worker has told them.
Place = Callable[[frozenset[str]], RouteChoice | NoRoute]
OnWorker = Callable[[str, list[int] | None], None]


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    # Until the worker's first chunk (it answers after the first decoding step): queueing + prefill.
    first_token_s: float = 120.0
    # Between two chunks of a running stream.
    idle_s: float = 30.0


@dataclass(frozen=True)
class Step:
    """Text the client has not seen yet, the finish reason on the last step, and the log-probabilities
    of the tokens this text completes (when the request asked for them)."""

    text: str
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] = ()


class WorkerRefused(Exception):
    """The worker answered the request itself with an error (a 4xx): the client gets it as it is."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"worker answered {status}")
        self.status = status
        self.body = body


class Unplaceable(Exception):
    def __init__(self, why: NoRoute) -> None:
        super().__init__(why.message)
        self.why = why


class RelayFailed(Exception):
    """The request could not be completed after every retry; the message says why."""


class _Broken(Exception):
    """This worker's stream cannot continue (it died, stalled, or broke the index sequence)."""


@dataclass
class _Source:
    pod_name: str
    address: str
    kind: str  # "placed" (POST), "resumed" (POST), "migrated" (GET the target's stream)
    # A disaggregated pool's decode worker, which this worker hands the request to once prefilled: its
    # stream then ends with the hand-off event, followed like a migration's.
    decode: tuple[DecodeTarget, ...] = ()


class Relay:
    """Relays one request; `steps()` yields the client's text as the workers produce it."""

    def __init__(self, session: aiohttp.ClientSession, request_id: str, path: str, body: dict[str, Any], *,
                 resume: dict[str, Any], place: Place, credentials: PoolCredentials | None, timeouts: Timeouts,
                 max_attempts: int = 4,
                 on_worker: OnWorker = lambda pod, prompt: None,
                 on_event: Callable[[str], None] = lambda kind: None) -> None:
        self.session = session
        self.request_id = request_id
        self.path = path
        self.body = {**body, "stream": True}
        self.body.pop("stream_options", None)
        # The sample's fields for a resume on another worker (openai_api.resume_fields, its seed included).
        self.resume = resume
        self.place = place
        self.credentials = credentials
        self.timeouts = timeouts
        self.max_attempts = max_attempts
        self.on_worker = on_worker  # (pod now serving it, prompt ids once known): the router's bookkeeping
        self.on_event = on_event  # "resume", "migration": metrics
        self.prompt_token_ids: list[int] | None = None
        self.output_token_ids: list[int] = []
        self.clean = 0  # outputs whose text the client has been given
        # Log-probabilities of the outputs after `clean`: given to the client with their text, dropped
        # with their tokens when a resume generates them again.
        self.pending_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.workers: list[str] = []

    # ------------------------------------------------------------------------------------- driving

    async def steps(self) -> AsyncGenerator[Step, None]:
        failed: set[str] = set()
        source = self._placed(failed, "placed")
        failures = 0
        while True:
            self.workers.append(source.pod_name)
            self.on_worker(source.pod_name, self.prompt_token_ids)
            try:
                async for step in self._read(source):
                    yield step
                    if self.finish_reason is not None:
                        return
                raise _Broken("the stream ended without [DONE]")
            except _Migrated as moved:
                self.on_event("migration")
                source = _Source(moved.pod_name, moved.address, "migrated")
                continue
            except (_Broken, aiohttp.ClientError, TimeoutError, ConnectionError) as err:
                failures += 1
                failed.add(source.pod_name)
                log.warning("%s: worker %s failed (%s: %s); %s", self.request_id, source.pod_name, type(err).__name__, err,
                            "giving up" if failures >= self.max_attempts else "resuming elsewhere")
                if failures >= self.max_attempts:
                    raise RelayFailed(f"the request failed on {failures} workers ({', '.join(self.workers)}): {err}") from err
                if self.prompt_token_ids is None:
                    source = self._placed(failed, "placed")  # nothing was generated: start afresh
                else:
                    self.on_event("resume")
                    del self.output_token_ids[self.clean:]
                    self.pending_logprobs.clear()
                    source = self._placed(failed, "resumed")
                if source.pod_name in failed:
                    # Back to a worker that just failed (no other has room): give it, or the pool view
                    # that still shows it, a moment rather than spending every attempt at once.
                    await asyncio.sleep(RETRY_BACKOFF_S * failures)

    def _placed(self, failed: set[str], kind: str) -> _Source:
        choice = self.place(frozenset(failed))
        if isinstance(choice, NoRoute) and failed:
            choice = self.place(frozenset())  # every other worker is gone: the failed one may be back
        if isinstance(choice, NoRoute):
            raise Unplaceable(choice)
        return _Source(choice.pod_name, choice.address, kind, choice.decode)

    # ------------------------------------------------------------------------------------ one hop

    def _headers(self, internal: bool, decode: tuple[DecodeTarget, ...] = ()) -> dict[str, str]:
        headers = {TOKEN_STREAM_HEADER: TOKEN_STREAM_MODE, REQUEST_ID_HEADER: self.request_id}
        if decode and self.credentials is not None:
            headers.update(header_of(decode))  # honoured with the pool token only
            internal = True
        if internal and self.credentials is not None:
            headers.update(bearer(self.credentials.token))
        return headers

    async def _resume_body(self, source: _Source) -> dict[str, Any]:
        """The request continued on another worker: its prompt's ids then the output the client has,
        with what is left of its budget (the worker's POST /internal/resume)."""
        assert self.prompt_token_ids is not None
        done = len(self.output_token_ids)
        budget = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        if budget is None and self.path.endswith("/chat/completions"):
            # Chat's default budget is the rest of the context; a completion's default is 16, so say it.
            async with self.session.get(f"http://{source.address}/v1/models") as resp:
                budget = int((await resp.json())["data"][0]["max_model_len"]) - len(self.prompt_token_ids)
        if budget is None:
            budget = 16
        min_tokens = int(self.resume.get("min_tokens") or 0)
        return {**self.resume, "prompt": self.prompt_token_ids + self.output_token_ids,
                "max_tokens": max(1, int(budget) - done), "min_tokens": max(0, min_tokens - done), "stream": True}

    async def _open(self, source: _Source) -> aiohttp.ClientResponse:
        url = f"http://{source.address}"
        if source.kind == "migrated":
            after = len(self.output_token_ids)
            request = self.session.get(f"{url}{continuation_path(self.request_id)}", params={"after": str(after)},
                                       headers=self._headers(True))
        elif source.kind == "resumed" and self.output_token_ids:
            # Continued after its output (penalties, min_tokens and a grammar count it): pool token needed.
            request = self.session.post(f"{url}{RESUME_PATH}", params={"output": str(len(self.output_token_ids))},
                                        json=await self._resume_body(source), headers=self._headers(True, source.decode))
        elif source.kind == "resumed":
            request = self.session.post(f"{url}/v1/completions", json=await self._resume_body(source),
                                        headers=self._headers(False, source.decode))
        else:
            request = self.session.post(f"{url}{self.path}", json=self.body, headers=self._headers(False, source.decode))
        try:
            response = await asyncio.wait_for(request, self.timeouts.first_token_s)
        except aiohttp.ConnectionTimeoutError:  # a TimeoutError too: the connect timeout, not the first token's
            raise _Broken(f"no connection within {self.timeouts.connect_s:g} s") from None
        except TimeoutError:
            raise _Broken(f"no first token within {self.timeouts.first_token_s:.0f} s") from None
        if response.status != 200:
            try:
                payload = await response.json(content_type=None)
            except (ValueError, aiohttp.ClientError):
                payload = {"error": {"message": f"worker answered {response.status}", "type": "server_error",
                                     "param": None, "code": None}}
            finally:
                response.release()
            # The client's own mistakes come back to it. A worker loading, draining or failing, or one
            # that no longer holds a migrated request, is this worker's problem: try another.
            if 400 <= response.status < 500 and response.status not in (404, 408, 409, 429) and source.kind == "placed":
                raise WorkerRefused(response.status, payload)
            if response.status == 404 and source.kind == "placed":
                raise WorkerRefused(response.status, payload)
            raise _Broken(f"worker answered {response.status}: {payload}")
        return response

    async def _read(self, source: _Source) -> AsyncIterator[Step]:
        response = await self._open(source)
        try:
            async for event, data in sse_events(response.content, self.timeouts.idle_s):
                if event == MIGRATED_EVENT:
                    migrated = Migrated.parse(data)
                    raise _Migrated(migrated.target_pod, migrated.target_address)
                if data == "[DONE]":
                    if self.finish_reason is None:
                        raise _Broken("[DONE] before a finish reason")
                    return
                step = self._chunk(source, orjson.loads(data))
                if step is not None:
                    yield step
        except TimeoutError as err:  # the worker went quiet (sse_events' idle limit)
            raise _Broken(str(err)) from None
        finally:
            response.close()

    def _chunk(self, source: _Source, chunk: dict[str, Any]) -> Step | None:
        if "error" in chunk:
            raise _Broken(f"worker sent an error: {chunk['error']}")
        meta = chunk.get("kvfleet")
        if meta is None:
            return None  # a usage chunk or a chunk of a worker not in router mode: nothing to relay
        if self.prompt_token_ids is None and meta.get("prompt_token_ids") is not None:
            self.prompt_token_ids = [int(t) for t in meta["prompt_token_ids"]]
            self.on_worker(source.pod_name, self.prompt_token_ids)
        ids = [int(t) for t in meta.get("token_ids", [])]
        start = int(meta.get("index", 0))
        have = len(self.output_token_ids)
        if start > have:
            raise _Broken(f"tokens {have}..{start - 1} are missing from the stream")
        if ids and start + len(ids) <= have:
            return None  # already relayed (a continuation repeating what the source sent)
        if ids and start < have:
            raise _Broken(f"a chunk overlaps tokens already relayed ({start}..{have - 1})")
        choice = (chunk.get("choices") or [{}])[0]
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content") or ""
        finish = choice.get("finish_reason")
        if finish == "abort":
            raise _Broken("the worker aborted the request")
        self.output_token_ids.extend(ids)
        self.pending_logprobs.extend(TokenLogprob.from_wire(e) for e in meta.get("logprobs", ()))
        if text:
            self.clean = len(self.output_token_ids)
        if finish is not None:
            self.finish_reason = finish
            self.clean = len(self.output_token_ids)
        if not text and finish is None:
            return None
        logprobs = tuple(self.pending_logprobs)
        self.pending_logprobs.clear()
        return Step(text, finish, logprobs)


class _Migrated(Exception):
    def __init__(self, pod_name: str, address: str) -> None:
        super().__init__(f"migrated to {pod_name or address}")
        self.pod_name = pod_name or address
        self.address = address

