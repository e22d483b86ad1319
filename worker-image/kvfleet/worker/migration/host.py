"""The worker a migration runs in, as both sides of the executor see it.

The executor is not the agent: it needs a handful of the agent's powers (its engine, its hand-offs,
adopting a request that arrives) and takes them through `Host`, so that it can be read, and tested,
without the HTTP server around it. `continue_on` is the one way both sides restart a handed-over
request on their engine: the destination when it commits, the source when it rolls back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Protocol

from kvfleet.worker.engines.base import Engine, SamplingParams, StepOutput
from kvfleet.worker.engines.capabilities import MigrationError
from kvfleet.worker.migration.handoff import Adopted, HandedRequest, Handoffs, LiveRequest


class Host(Protocol):
    """What the executor needs from the agent it runs in."""

    @property
    def engine(self) -> Engine: ...

    @property
    def handoffs(self) -> Handoffs: ...

    def live_request(self, request_id: str) -> LiveRequest | None: ...

    def adopt(self, handed: HandedRequest, stream: AsyncIterator[StepOutput]) -> Adopted: ...

    def incoming(self, request_id: str, arriving: bool) -> None:
        """A migration towards this worker starts (True) or ends (False): keep it out of the reports."""
        ...

    def nudge_reporter(self) -> None: ...

    def accepts_migrations(self) -> bool:
        """False while loading or draining: a worker about to stop takes no request in."""
        ...


def continue_on(engine: Engine, handed: HandedRequest) -> AsyncIterator[StepOutput]:
    """The request's continuation on this engine (`continue_request`)."""
    return continue_request(engine, handed.request_id, handed.prompt_token_ids, handed.output_token_ids, handed.params)


def continue_request(engine: Engine, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                     params: SamplingParams) -> AsyncIterator[StepOutput]:
    """A request's continuation on this engine after `output_token_ids`: from KV held here (KV migration
    capability), else by re-prefill; what depends on the output (penalties, min_tokens, a grammar, the
    budget) counts the output it brings, as far as the engine can (engines/base.py, SamplingParams).

    An engine without the capability has no resume: the request goes in as a new one whose prompt is
    prompt + output so far, with the rest of the output budget, which under greedy decoding gives the
    same tokens.
    """
    migration = engine.capabilities.migration
    if migration is not None:
        return migration.resume(request_id, prompt_token_ids, output_token_ids, params)
    remaining = params.max_tokens - len(output_token_ids)
    if remaining < 1:
        raise MigrationError(f"request {request_id!r} already has all its {params.max_tokens} tokens")
    return engine.generate(request_id, [*prompt_token_ids, *output_token_ids], replace(params, max_tokens=remaining))
