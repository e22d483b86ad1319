"""The replay's clients: one streamed completion per trace request, timed and checked for wholeness.

A replay is only evidence if every request's stream is accounted for: how long it waited for its
first token, how fast the rest came, and whether it ended whole (exactly the tokens asked for, no
error), through every migration the pool made meanwhile. Prompts are token ids, so the trace's
prompt lengths are sent exactly whatever the tokenizer; `ignore_eos` makes outputs exactly as long
as the trace says.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvfleet.sim.traces import TraceRequest

# Prompt token ids are drawn below this: inside any tokenizer's vocabulary, the tiny model's included.
PROMPT_ID_LIMIT = 1900
STREAM_TIMEOUT_S = 300.0


@dataclass
class Stream:
    """One client of the router: its request, what came back, and when."""

    request: TraceRequest
    max_tokens: int
    sent_s: float = 0.0  # on the replay's clock (seconds since it began)
    first_token_s: float | None = None
    ended_s: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def whole(self) -> bool:
        return self.error is None and self.finish_reason == "length" and self.tokens == self.max_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def per_token_s(self) -> float | None:
        """Time per output token after the first (TPOT), or None for a stream of one token or none."""
        if self.first_token_s is None or self.ended_s is None or self.tokens < 2:
            return None
        return (self.ended_s - self.first_token_s) / (self.tokens - 1)


def prompt_ids(request: TraceRequest) -> list[int]:
    """The same prompt every run for the same request: a BOS-like 1, then seeded random ids."""
    rng = random.Random(request.request_id)
    return [1] + [rng.randrange(3, PROMPT_ID_LIMIT) for _ in range(request.prompt_tokens - 1)]


def run_stream(router_url: str, model: str, stream: Stream, clock: Clock) -> None:
    """Send the stream's request and read its server-sent events to the end (on its own thread)."""
    url = urlsplit(router_url)
    body = {"model": model, "prompt": prompt_ids(stream.request), "max_tokens": stream.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    stream.sent_s = clock.now_s()
    try:
        conn_type = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = conn_type(url.hostname or "127.0.0.1", url.port, timeout=STREAM_TIMEOUT_S)
        conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json", "X-Request-Id": f"replay-{stream.request.request_id}"})
        response = conn.getresponse()
        if response.status != 200:
            stream.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk:
                stream.error = chunk["error"].get("message", "error")
            if chunk.get("usage"):
                stream.tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if stream.first_token_s is None:  # a token chunk (its text may be empty: a partial character)
                    stream.first_token_s = clock.now_s()
                stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    except Exception as err:  # counted in the record; the replay goes on
        stream.error = f"{type(err).__name__}: {err}"
    finally:
        stream.ended_s = clock.now_s()
        stream.done.set()


class Clock:
    """The replay's one time base: seconds since it began, and the wall time it began at."""

    def __init__(self) -> None:
        self.started_wall_s = time.time()
        self._started = time.monotonic()

    def now_s(self) -> float:
        return time.monotonic() - self._started

    def at_wall_s(self, wall_s: float) -> float:
        """A wall-clock time (such as an API server timestamp) on the replay's clock."""
        return wall_s - self.started_wall_s
