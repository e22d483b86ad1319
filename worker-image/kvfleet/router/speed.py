"""The pool's measured speed: every worker's `GET /kvfleet/speed-profile`, gathered by the router.

`kvfleet replay` records the speed of the pool it drives so that `kvfleet simulate --speed-profile`
can replay the trace at that speed (kvfleet.api.speed). Only the router knows the pool's workers
without an API server, so it asks them all, in parallel and each with a short timeout: one slow or
dead worker costs the answer its profile, not the answer. The client polls and keeps each worker's
latest, because a worker scaled down takes its numbers with it; the answer therefore lists each
worker's own profile, not only their merge.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError

from kvfleet.api.speed import SPEED_PROFILE_PATH, SpeedProfile, merge_profiles
from kvfleet.router.placement import WorkerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """One worker's answer: its profile, or why it has none (reachable) or nothing (unreachable)."""

    pod_name: str
    profile: SpeedProfile | None = None
    unmeasured: str | None = None  # the worker answered, without a profile: its reason
    unreachable: bool = False


async def _ask(session: aiohttp.ClientSession, worker: WorkerState, timeout_s: float) -> Answer:
    if not worker.address:
        return Answer(worker.pod_name, unreachable=True)  # no pod IP yet
    try:
        async with session.get(f"http://{worker.address}{SPEED_PROFILE_PATH}",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.json(content_type=None)
            if resp.status != 200:
                message = ((body or {}).get("error") or {}).get("message") if isinstance(body, dict) else None
                return Answer(worker.pod_name, unmeasured=str(message or f"HTTP {resp.status}"))
            return Answer(worker.pod_name, profile=SpeedProfile.model_validate(body))
    except (aiohttp.ClientError, TimeoutError) as err:
        log.info("no speed profile from %s (%s): %s", worker.pod_name, worker.address, err or type(err).__name__)
        return Answer(worker.pod_name, unreachable=True)
    except (ValueError, ValidationError) as err:  # not JSON, or not a SpeedProfile: a worker of another version
        return Answer(worker.pod_name, unmeasured=f"not a speed profile: {err}")


async def gather_profiles(session: aiohttp.ClientSession, workers: tuple[WorkerState, ...],
                          timeout_s: float) -> dict[str, Any]:
    """The answer of `GET /kvfleet/speed-profile` (camelCase JSON, as the schema dumps it):

    {"workers": {pod: profile}, "merged": profile or null, "unreachable": [pod, ...],
     "unmeasured": {pod: why}}. `merged` is null without profiles, or when the workers' engine,
    model or capacity differ (a rolling change of the pool: no one speed describes it).
    """
    answers = await asyncio.gather(*(_ask(session, w, timeout_s) for w in workers))
    profiles = {a.pod_name: a.profile for a in answers if a.profile is not None}
    merged: SpeedProfile | None = None
    if profiles:
        try:
            merged = merge_profiles(profiles[name] for name in sorted(profiles))
        except ValueError as err:
            log.warning("the workers' speed profiles do not merge: %s", err)
    return {
        "workers": {name: p.model_dump(mode="json", by_alias=True) for name, p in sorted(profiles.items())},
        "merged": merged.model_dump(mode="json", by_alias=True) if merged is not None else None,
        "unreachable": sorted(a.pod_name for a in answers if a.unreachable),
        "unmeasured": {a.pod_name: a.unmeasured for a in sorted(answers, key=lambda a: a.pod_name)
                       if a.unmeasured is not None},
    }
