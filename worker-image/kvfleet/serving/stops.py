"""OpenAI stop strings over a stream of text deltas, shared by the worker and the router.

Both cut a completion at a stop string that may arrive split over several deltas: the worker for its
own clients, the router because it re-applies stops across a resume on another worker. This module
imports nothing heavy (the router does not load tokenizers), so both can use the one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopStrings:
    """Holds back text that might be the start of a stop string, and cuts the output at one.

    OpenAI semantics: the stop string itself is not returned (unless `include`, vLLM's
    include_stop_str_in_output), and generation ends at its first occurrence, even across token
    boundaries.
    """

    stops: tuple[str, ...]
    pending: str = ""
    stopped: bool = False
    include: bool = False

    def feed(self, text: str) -> str:
        """Text safe to send now; sets `stopped` when a stop string appeared."""
        if not self.stops:
            return text
        self.pending += text
        hits = [(i, i + len(s)) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            start, end = min(hits)
            out, self.pending = self.pending[: end if self.include else start], ""
            return out
        keep = max(len(s) for s in self.stops) - 1
        cut = max(0, len(self.pending) - keep)
        # Only hold back a tail that really is a prefix of some stop string.
        while cut < len(self.pending) and not any(s.startswith(self.pending[cut:]) for s in self.stops):
            cut += 1
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def finish(self) -> str:
        out, self.pending = self.pending, ""
        return out
