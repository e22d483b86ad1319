"""DistKV's settings (Infinite-LLM §4.3), as an engine that lends or borrows KV blocks takes them.

The wire, the lender's service and the borrower's side (this package) serve whichever engine adapts
them, so their settings live here once; the builtin engine takes them today (engines/builtin/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistKVOptions:
    """What a worker lends to and borrows from other workers."""

    # Lend up to this many bytes of free KV blocks to requests of other workers (0: lend none).
    lend_cap_bytes: int = 0
    # Borrow for a request larger than this engine's whole cache (attention where the KV lives).
    borrow: bool = False
