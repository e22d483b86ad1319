"""What every worker of the pool shares (one model), asked of a Ready worker once, not per request.

The router needs the model's name and context for `/v1/models` and a request's budget, and its KV
bytes per token and the workers' capacity to place requests by their KV (placement.py). The last
two come from `/internal/requests`, which needs the pool token; without it the router keeps what
`/v1/models` told and places every request as a small one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kvfleet.router.pool import PoolView
from kvfleet.serving.credentials import PoolCredentials
from kvfleet.serving.httpapi import bearer

log = logging.getLogger(__name__)

# How often the router asks a worker again for model facts it could not read (KV bytes per token).
INFO_RETRY_S = 10.0


@dataclass(frozen=True)
class ModelInfo:
    """What every worker of the pool shares (one model): read once from a worker, not per request."""

    model_name: str
    max_model_len: int
    kv_bytes_per_token: int | None  # from /internal/requests, which needs the pool token
    capacity_bytes: int | None


class ModelInfoSource:
    """The pool's model, asked of a Ready worker the first time it is needed (then kept)."""

    def __init__(self, view: PoolView, session: Callable[[], aiohttp.ClientSession], credentials: PoolCredentials | None) -> None:
        self.view = view
        self.session = session  # the router's, once its app has started
        self.credentials = credentials
        self.info: ModelInfo | None = None
        self._asked_s = float("-inf")
        self._lock = asyncio.Lock()

    async def get(self) -> ModelInfo | None:
        if self.info is not None and self.info.kv_bytes_per_token is not None:
            return self.info
        if self.info is not None and time.monotonic() - self._asked_s < INFO_RETRY_S:
            return self.info  # partial (no pool token, or /internal refused): not asked again per request
        async with self._lock:
            if self.info is not None and (self.info.kv_bytes_per_token is not None or self.credentials is None):
                return self.info
            self._asked_s = time.monotonic()
            for worker in self.view.snapshot().ready_workers():
                try:
                    self.info = await self._ask(worker.address)
                    return self.info
                except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as err:
                    log.info("model information from %s not available yet: %s", worker.pod_name, err)
            return self.info

    async def _ask(self, address: str) -> ModelInfo:
        session = self.session()
        async with session.get(f"http://{address}/v1/models") as resp:
            model = (await resp.json())["data"][0]
        per_token = capacity = None
        if self.credentials is not None:
            async with session.get(f"http://{address}/internal/requests", headers=bearer(self.credentials.token)) as resp:
                if resp.status == 200:
                    internal = await resp.json()
                    per_token, capacity = int(internal["kvBytesPerToken"]), int(internal["capacityBytes"])
        return ModelInfo(str(model["id"]), int(model["max_model_len"]), per_token, capacity)
