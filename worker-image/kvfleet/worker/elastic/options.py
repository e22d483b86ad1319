"""Elastic memory's settings (eLLM), as an engine that runs the chunk pool takes them.

The pool, its backends and its virtual tensors (this package) serve whichever engine adapts them, so
their settings live here once rather than in one engine's options; the builtin engine takes them
today (engines/builtin/options.py), the vLLM engine may take the same ones when it runs the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class MemoryOptions:
    """One memory budget for KV cache and activations (eLLM §4.2.2), split statically or elastically."""

    # The pool's size: KV cache and activations together.
    budget_bytes: int
    # False splits the budget statically (an activation reserve sized for the longest prefill, as vLLM
    # does); True lets each side take what the step needs (eLLM §4.3.1).
    elastic: bool = False
    # The pool's unit (rounded up to a multiple of the backend's granularity and of one KV block).
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # Host memory that holds the KV of waiting or preempted requests instead of recomputing it (eLLM
    # §4.3.2); 0 disables the buffer (preemption recomputes, as vLLM v1 does). Elastic only.
    cpu_buffer_bytes: int = 0
    # Park the newest decodes' KV to make room for a prefill that fits no other way (True), or keep
    # eLLM's Algorithm 1 strictly, where a full decoding batch holds prefills off.
    park_decodes_for_prefill: bool = True
    # Latency objectives that steer the buffer's logical size (Algorithm 2); None: no objective.
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    # eLLM §5.1: map the KV chunks the next decode step needs while the current step computes, and
    # unmap deflated slots behind a fence instead of synchronizing the device on the step's path. Off
    # by default because an H200 measured it slower (docs/gpu.md): its driver calls run in Python on
    # the event loop while the executor's Python launches the step's kernels, and they take the
    # interpreter the launches need (low-load TPOT 12.3 ms against 11.7 ms without).
    overlap_mapping: bool = False
