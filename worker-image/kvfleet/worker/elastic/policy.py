"""eLLM's scheduling decisions as pure functions: which requests a step runs, and how big the CPU buffer is.

The builtin engine's elastic scheduler (engines/builtin/elastic.py) asks these functions what to do
and then does it (maps chunks, moves KV); the vLLM engine's connector (engines/vllm/elastic.py) asks
Algorithm 2's for its CPU buffer (vLLM schedules its own batch, so Algorithm 1 is applied there
through the connector's seams instead). Keeping the decisions apart from the doing lets them be
tested exactly, on numbers, as the paper states them ("eLLM: Elastic Memory Management Framework for
Efficient LLM Serving", Xu et al.):

- `plan_batch` is Algorithm 1 (§4.4.1, "Scheduling with Elastic Memory"): a request joins the
  step's batch only if the whole step (KV and activations of every request in it) leaves at least
  the threshold θ of the unified pool free, so no step ever waits on memory another holds (the
  paper removes "hold and wait"); in the prefill phase a request whose KV does not fit may still be
  admitted with its KV offloaded to the CPU buffer, if the buffer can take it; the balloon then moves
  chunks between the KV and the activation side (inflation > 0: activation -> KV).
- `scale_logical_buffer` is Algorithm 2 (§4.4.2): the CPU buffer's logical size halves on a TPOT
  violation event (fewer offloaded prefills, so decodes run sooner) and doubles on a TTFT event.
- `SloWindow` decides when a violation *event* happens: three violations within five iterations
  (§4.4.2's empirical setting).

Units: every amount is bytes (the paper counts chunks; bytes let KV be counted by the block, the
granularity it is really allocated in, and the engine converts to chunks when it maps).

One deviation, on purpose: the paper's engine (vLLM 0.5.5) runs a step either as a prefill phase or
as a decoding phase. The builtin engine batches continuously (vLLM v1 style), so one step runs both
loops: the decoding loop first (requests already running keep their place), then the prefill loop
over the waiting requests, starting from what the decoding batch took. With no running request it is
the paper's prefill phase; with no waiting request, its decoding phase.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Demand:
    """One request's memory for the step: its KV after the step and its share of the activations."""

    kv_bytes: int
    activation_bytes: int
    # Whether its KV may go to the CPU buffer instead (a fresh prefill; not one resuming cached KV).
    offloadable: bool = True


class Admission(Enum):
    GPU = "gpu"              # KV on the GPU (in the unified pool)
    OFFLOADED = "offloaded"  # prefilled with its KV sent to the CPU buffer (Algorithm 1, lines 8-11)


@dataclass(frozen=True)
class PoolState:
    """Algorithm 1's inputs about memory, in bytes."""

    total_bytes: int            # P_T: the unified pool
    kv_bytes: int               # P_kv: what the KV side holds now (mapped KV chunks)
    activation_bytes: int       # P_act: what the activation side holds, idle chunks included
    threshold_bytes: int        # θ: kept free at all times
    buffer_available_bytes: int  # P_B: what the CPU buffer may still take (its logical size less what it holds)


@dataclass(frozen=True)
class BatchPlan:
    """Algorithm 1's outputs: the decoding requests that run (a prefix of those offered), the prefills
    admitted (a prefix) and how, and the balloon's move (> 0: act -> kv)."""

    num_decodes: int
    prefills: tuple[Admission, ...]
    inflation_bytes: int
    kv_bytes: int          # M_kv
    activation_bytes: int  # M_act


def plan_batch(state: PoolState, decodes: Sequence[Demand], prefills: Sequence[Demand],
               base_activation_bytes: int = 0, base_kv_bytes: int = 0, park_for_prefill: bool = True) -> BatchPlan:
    """Algorithm 1 (§4.4.1) over the decoding queue, then the prefill queue (see the module docstring).

    `decodes` are the requests to decode in queue order (running, then those whose KV waits in the
    CPU buffer: line 17, "fetching KV cache if swapped out"); `prefills` the waiting requests in
    arrival order. `base_activation_bytes` is what any step needs whatever its batch, counted in
    M_act from the start, and `base_kv_bytes` the KV held by no request of either queue (blocks a
    migration has imported for a request not resumed yet), counted in M_kv.

    `park_for_prefill` is this engine's reading of the paper's prefill phase in a continuously
    batched step. In the paper a prefill iteration runs no decode, so a prefill's activations may take
    the chunks decoding requests' KV held (deflation, its KV sent to the CPU buffer and fetched back
    "when their corresponding request's decoding is scheduled", §4.3.2). Here, when the head of the
    prefill queue does not fit beside the decoding batch, the newest decodes leave the batch with
    their KV parked in the buffer (within what the buffer may take, so Algorithm 2 bounds it as it
    bounds offloaded prefills) until it fits. Without it (False) a decoding batch that fills the pool
    holds prefills off until it shrinks, and elastic memory cannot hold a larger batch than a static
    split of the same memory (bench/elastic.py measures both).
    """
    total, theta = state.total_bytes, state.threshold_bytes
    m_kv, m_act = base_kv_bytes, base_activation_bytes
    num_decodes = 0
    # Lines 14-22: decoding phase; a request joins only with its KV on the GPU.
    for demand in decodes:
        if total - (m_kv + m_act + demand.kv_bytes + demand.activation_bytes) >= theta:
            num_decodes += 1
            m_kv += demand.kv_bytes
            m_act += demand.activation_bytes
        else:
            break
    admitted: list[Admission] = []
    buffer_bytes = state.buffer_available_bytes
    # Lines 2-13: prefill phase; a request whose KV does not fit may go with its KV offloaded.
    for demand in prefills:
        if park_for_prefill and not admitted and total - (m_kv + m_act + demand.activation_bytes) < theta:
            # Park the newest decodes until the head prefill's activations fit (docstring); kept
            # only if the prefill is then admitted one way or the other.
            parked_kv = parked_act = parked = 0
            while (parked < num_decodes and total - (m_kv - parked_kv + m_act - parked_act + demand.activation_bytes) < theta
                   and parked_kv + decodes[num_decodes - parked - 1].kv_bytes <= buffer_bytes):
                parked_kv += decodes[num_decodes - parked - 1].kv_bytes
                parked_act += decodes[num_decodes - parked - 1].activation_bytes
                parked += 1
            left = buffer_bytes - parked_kv
            fits_gpu = total - (m_kv - parked_kv + m_act - parked_act + demand.kv_bytes + demand.activation_bytes) >= theta
            fits_offloaded = (demand.offloadable and demand.kv_bytes <= left
                              and total - (m_kv - parked_kv + m_act - parked_act + demand.activation_bytes) >= theta)
            if parked and (fits_gpu or fits_offloaded):
                num_decodes -= parked
                m_kv, m_act, buffer_bytes = m_kv - parked_kv, m_act - parked_act, left
        if total - (m_kv + m_act + demand.kv_bytes + demand.activation_bytes) >= theta:
            admitted.append(Admission.GPU)
            m_kv += demand.kv_bytes
            m_act += demand.activation_bytes
        elif (demand.offloadable and total - (m_kv + m_act + demand.activation_bytes) >= theta
              and demand.kv_bytes <= buffer_bytes):
            admitted.append(Admission.OFFLOADED)
            m_act += demand.activation_bytes
            buffer_bytes -= demand.kv_bytes  # line 11: offloading
        else:
            break
    # Lines 23-27: memory ballooning. P_kv and P_act are what each side holds; a side short of what
    # the batch needs borrows from the other if that one holds more than it needs.
    p_kv, p_act = state.kv_bytes, state.activation_bytes
    inflation = 0
    if p_kv < m_kv and p_act > m_act:
        inflation = m_kv - p_kv        # line 25: inflation, act -> kv
    elif p_act < m_act and p_kv > m_kv:
        inflation = p_act - m_act      # line 27: deflation, kv -> act (negative)
    return BatchPlan(num_decodes, tuple(admitted), inflation, m_kv, m_act)


def scale_logical_buffer(logical_bytes: int, *, ttft_event: bool, tpot_event: bool, max_bytes: int,
                         min_bytes: int, alpha: float = 2.0) -> int:
    """Algorithm 2 (§4.4.2): shrink the logical CPU buffer on a TPOT event, grow it on a TTFT event.

    The paper's floor is 1 (a unit of the buffer; here `min_bytes`, one chunk) and its line 4 reads
    min(B_logic * α, B_logic), which could never grow: the text says the size grows within the
    buffer's fixed capacity, so the cap is B_max (`max_bytes`), as implemented. TPOT wins when both
    fire (line 1 is tested first).
    """
    if tpot_event:
        return max(int(logical_bytes / alpha), min_bytes)
    if ttft_event:
        return min(int(logical_bytes * alpha), max_bytes)
    return logical_bytes


class SloWindow:
    """Violation events as §4.4.2 defines them: an objective missed `threshold` times within the
    last `window` iterations (3 and 5 in the paper). After an event the window starts afresh, so one
    burst of misses is one event, not three."""

    def __init__(self, window_iterations: int = 5, threshold: int = 3) -> None:
        self.threshold = threshold
        self._ttft: deque[int] = deque(maxlen=window_iterations)
        self._tpot: deque[int] = deque(maxlen=window_iterations)

    def observe(self, ttft_misses: int, tpot_misses: int) -> tuple[bool, bool]:
        """One iteration's misses in; (TTFT event, TPOT event) out."""
        self._ttft.append(ttft_misses)
        self._tpot.append(tpot_misses)
        ttft_event = sum(self._ttft) >= self.threshold
        tpot_event = sum(self._tpot) >= self.threshold
        if ttft_event:
            self._ttft.clear()
        if tpot_event:
            self._tpot.clear()
        return ttft_event, tpot_event
