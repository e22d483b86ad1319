"""Where a request goes in a disaggregated pool: a prefill worker, and the decode worker it hands to.

"MemServe: Flexible Mem Pool for Building Disaggregated LLM Serving with Caching" §5 runs every request
on a prefill worker P and then a decode worker D, and §6 keeps a global prompt tree per role. Here:

- D is MELL's: the decode workers are the GPUs the operator packs, scales and drains, so the decode
  side is placed exactly as a colocated pool's request is (placement.place over the decode workers,
  the routing table included), with the prompt tree's preference for a worker caching more of the
  prompt (PD-Caching-2 and -3 cache on D).
- P is chosen by §6's lookup and equation 1 over the prefill workers: the least predicted time to the
  first token, the prefills queued there plus this prompt's past the prefix it caches there.
- The prompt tree is one tree whose nodes name workers; a worker's role makes its part the prefill
  tree or the decode tree (§6's per-role trees), so matching over one role's workers is matching in
  that role's tree.

Beyond the paper (kept selectable: `choice: always` is MemServe's): with `per-request` a request is
prefilled on its decode worker, with no hand-over, when that is predicted cheaper. The comparison
is the request's time to its first token plus what the prefill costs the requests decoding on D (each
is stalled for the prefill's length, the interference disaggregation exists to avoid):

    local = queued(D) + exec(x, y_D) + running(D) * exec(x, y_D)
    split = queued(P) + exec(x, y_P) + transfer(x - cached at D)

so a short uncached prompt on a quiet decode worker stays there, and a long one, or one on a busy
decode worker, is disaggregated.

When a role is short: no Ready prefill worker, the request is prefilled where it decodes; no decode
worker with room, it decodes where it was prefilled (a prefill worker is a GPU like any other), and
the next epoch's MELL sees its KV there and plans for it. Both are counted by rule in the router's
placement metrics. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvfleet.router.locality import LocalityInput, PrefillCost, predicted_s
from kvfleet.router.placement import NoRoute, PDSettings, PoolSnapshot, Reservation, RouteChoice, place
from kvfleet.serving.httpapi import MAX_DECODE_TARGETS, DecodeTarget

PREFILL, DECODE = "prefill", "decode"


def caches(role: str | None, caching: str) -> bool:
    """Whether a worker of this role runs a prefix cache under the pool's milestone: prefill workers
    from PD-Caching-1 on, decode workers from PD-Caching-2 on (the operator's pod environment)."""
    if role == PREFILL:
        return caching != "none"
    return caching in ("decode", "full")


def of_role(snapshot: PoolSnapshot, role: str) -> PoolSnapshot:
    """The pool as one role's placement sees it: that role's workers (and the routing table, which
    names decode workers only)."""
    return dataclasses.replace(snapshot, workers=tuple(w for w in snapshot.workers if w.role == role))


def transfer_s(tokens: int, kv_bytes_per_token: int, pd: PDSettings) -> float:
    """Seconds to send `tokens` tokens' KV over the pool's link."""
    return tokens * kv_bytes_per_token / pd.link_bytes_per_s if pd.link_bytes_per_s > 0 else 0.0


def place_disaggregated(snapshot: PoolSnapshot, pd: PDSettings, reservations: Sequence[Reservation], kv_bytes: int, *,
                        default_capacity_bytes: int, exclude: frozenset[str] = frozenset(),
                        locality: LocalityInput | None = None, kv_bytes_per_token: int = 0) -> RouteChoice | NoRoute:
    """The prefill worker, carrying its decode worker, for a new request (module docstring); or a lone
    worker when one role cannot serve it or (per-request) when prefilling on D is cheaper."""
    decode_pool = of_role(snapshot, DECODE)
    decode = place(decode_pool, reservations, kv_bytes, default_capacity_bytes=default_capacity_bytes,
                   exclude=exclude, locality=locality)
    prefill = choose_prefill(of_role(snapshot, PREFILL), reservations, exclude, locality)
    if isinstance(decode, NoRoute):
        return prefill if isinstance(prefill, NoRoute) else dataclasses.replace(prefill, rule="pd:no-decode-worker")
    if isinstance(prefill, NoRoute):
        return dataclasses.replace(decode, rule="pd:no-prefill-worker")
    if decode.rule.startswith("queued"):
        # No decode worker has room: it decodes where it is prefilled (and MELL plans for it there).
        return dataclasses.replace(prefill, rule="pd:no-decode-room")
    if pd.choice == "per-request" and _local_is_cheaper(snapshot, reservations, decode.pod_name, prefill.pod_name,
                                                        pd, locality, kv_bytes_per_token):
        return dataclasses.replace(decode, rule="pd:local")
    return dataclasses.replace(prefill, rule=f"pd:{prefill.rule}",
                               decode=decode_targets(decode_pool, reservations, kv_bytes, decode.pod_name,
                                                     default_capacity_bytes, exclude))


def decode_targets(decode_pool: PoolSnapshot, reservations: Sequence[Reservation], kv_bytes: int, first: str,
                   default_capacity_bytes: int, exclude: frozenset[str]) -> tuple[DecodeTarget, ...]:
    """MELL's decode worker, then the ones MELL would choose were it gone, that have room, over the
    decode workers (`of_role`): a prefill worker whose hand-over is refused (no room when the KV
    arrives, gone) tries the next."""
    chosen = [first]
    while len(chosen) < MAX_DECODE_TARGETS:
        nxt = place(decode_pool, reservations, kv_bytes, default_capacity_bytes=default_capacity_bytes,
                    exclude=exclude | frozenset(chosen))
        if isinstance(nxt, NoRoute) or nxt.rule.startswith("queued") or nxt.pod_name in chosen:
            break
        chosen.append(nxt.pod_name)
    by_name = {w.pod_name: w for w in decode_pool.workers}
    return tuple(DecodeTarget(name, by_name[name].address, by_name[name].migration_address) for name in chosen)


def choose_prefill(prefill: PoolSnapshot, reservations: Sequence[Reservation], exclude: frozenset[str],
                   locality: LocalityInput | None) -> RouteChoice | NoRoute:
    """The prefill worker with the least predicted time to the request's first token (MemServe §6's
    lookup, equation 1: prefill queued there plus this prompt's past the prefix it caches); without a
    prompt tree, the one with the fewest requests in hand. A prefill worker holds a request's KV only
    until its hand-over, so MELL's packing has nothing to say here."""
    # A request that failed on every prefill worker is prefilled where it decodes (the caller's
    # fallback); the relay asks again without exclusions when no worker at all is left.
    ready = [w for w in prefill.ready_workers() if w.pod_name not in exclude]
    if not ready:
        return NoRoute("no-ready-worker", "the pool has no Ready prefill worker it has not failed on")

    def in_hand(pod_name: str) -> int:
        worker = next(w for w in ready if w.pod_name == pod_name)
        return len(worker.reported) + sum(1 for r in reservations if r.pod_name == pod_name)

    if locality is not None and locality.session_pod is None:
        best = min(ready, key=lambda w: (predicted_s(locality, w.pod_name), -locality.cached_tokens.get(w.pod_name, 0),
                                         in_hand(w.pod_name), w.pod_name))
        rule = "prefix" if locality.cached_tokens.get(best.pod_name, 0) else "least-queued"
    else:
        best = min(ready, key=lambda w: (in_hand(w.pod_name), w.pod_name))
        rule = "least-loaded"
    return RouteChoice(best.pod_name, best.address, rule)


def _local_is_cheaper(snapshot: PoolSnapshot, reservations: Sequence[Reservation], decode_pod: str, prefill_pod: str,
                      pd: PDSettings, locality: LocalityInput | None, kv_bytes_per_token: int) -> bool:
    if locality is None:
        return False  # nothing to weigh with (no prompt ids, no cost model): MemServe's choice
    cost: PrefillCost = locality.cost
    cached_d = locality.cached_tokens.get(decode_pod, 0)
    worker = next(w for w in snapshot.workers if w.pod_name == decode_pod)
    running = len(worker.reported) + sum(1 for r in reservations if r.pod_name == decode_pod)
    prefill_here_s = cost.exec_s(locality.prompt_tokens, cached_d)
    local_s = locality.queued_s.get(decode_pod, 0.0) + prefill_here_s * (1 + running)
    split_s = predicted_s(locality, prefill_pod) + transfer_s(max(0, locality.prompt_tokens - cached_d),
                                                             kv_bytes_per_token, pd)
    return local_s <= split_s
