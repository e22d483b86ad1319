"""Property tests of the scheduling core: MELL's theorems (§VII) and the invariants every plan keeps.

Examples are derandomized so CI is reproducible; each property runs a bounded number of examples.

Theorem 1 exceptions (docs/mell.md): on arrival-only sequences properties 1-3 hold except for at most
one GPU each (the newest M-, S- and T-GPU, still filling) and property 4 holds always. Property 5 is
not kept by Fig. 10 as written (see test_theorem1_property5_counterexample), and with departures
Depart case 1 ("the most recently activated GPU: just remove") leaves holes that later epochs do not
revisit, so the count is not bounded by a constant there; it is measured, not asserted.
"""

from __future__ import annotations

from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.mell import (
    Arrive,
    EventBatch,
    Finish,
    Grow,
    MellDefaultConfig,
    Plan,
    PolicyConfig,
    SizeClass,
    make_policy,
    plan_epoch,
)
from kvfleet.mell.cluster import ClusterPolicy
from kvfleet.mell.mell_paper import MellPaperConfig, MellPaperPolicy
from kvfleet.mell.state import ClusterSnapshot

C = 240
T, S, M, L = SizeClass.T, SizeClass.S, SizeClass.M, SizeClass.L
# mell-paper with the refinements these properties were stated for (T-GPU refill, draining refill source).
REFINED = MellPaperConfig(capacity_bytes=C, refill_underfilled_t=True, refill_source_max_fill=0.5)
PROFILE = settings(max_examples=200, derandomize=True, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])

sizes = st.one_of(
    st.integers(1, 30), st.integers(31, 60), st.integers(61, 80), st.integers(81, 120), st.integers(121, 240),
    st.integers(241, 700),
)
# An operation: (kind, size or growth, index into the live requests).
ops = st.lists(
    st.tuples(st.sampled_from(["arrive", "arrive", "finish", "grow", "epoch"]), sizes, st.integers(0, 10_000)),
    max_size=70,
)


def batches(operations: list[tuple[str, int, int]]) -> list[tuple[Arrive | Finish | Grow, ...]]:
    """Interpret operations against the live set, cutting an epoch at each 'epoch'."""
    live: dict[str, int] = {}
    out: list[tuple[Arrive | Finish | Grow, ...]] = []
    current: list[Arrive | Finish | Grow] = []
    touched: set[str] = set()
    n = 0
    for kind, size, index in operations:
        if kind == "epoch":
            out.append(tuple(current))
            current, touched = [], set()
            continue
        if kind == "arrive":
            rid = f"r{n}"
            n += 1
            live[rid] = size
            touched.add(rid)
            current.append(Arrive(rid, size))
            continue
        candidates = [r for r in live if r not in touched]
        if not candidates:
            continue
        rid = candidates[index % len(candidates)]
        touched.add(rid)
        if kind == "finish":
            del live[rid]
            current.append(Finish(rid))
        else:
            live[rid] += size // 4 + 1
            current.append(Grow(rid, live[rid]))
    out.append(tuple(current))
    return out


def run(policy_name: str, epochs: list[tuple[Arrive | Finish | Grow, ...]]) -> tuple[ClusterPolicy, list[Plan]]:
    pol = make_policy(policy_name, capacity_bytes=C)
    plans = [pol.schedule(EventBatch(float(k), events)) for k, events in enumerate(epochs)]
    return pol, plans


@PROFILE
@given(ops, st.sampled_from(["mell", "mell-paper", "bf", "wf", "lb"]))
def test_capacity_is_never_exceeded_and_loads_add_up(operations: list[tuple[str, int, int]], name: str) -> None:
    pol = make_policy(name, capacity_bytes=C)
    live: dict[str, int] = {}
    for k, events in enumerate(batches(operations)):
        pol.schedule(EventBatch(float(k), events))
        for ev in events:
            if isinstance(ev, Finish):
                del live[ev.request_id]
            else:
                live[ev.request_id] = ev.size_bytes
        loads = pol.loads()
        assert all(0 <= load <= C for load in loads.values()), loads
        assert sum(loads.values()) == sum(live.values())
        assert set(pol.item_of) == set(live)


@PROFILE
@given(ops)
def test_no_operation_causes_more_than_ten_migrations(operations: list[tuple[str, int, int]]) -> None:
    # MELL Theorem 3 (Fig. 10's; the default's consolidation may move a whole GPU's requests at once).
    # A multi-item counts as one item, as T-requests do in the proof.
    _, plans = run("mell-paper", batches(operations))
    assert max((n for p in plans for n in p.moves_per_operation), default=0) <= 10


@PROFILE
@given(ops, st.sampled_from(["mell", "mell-paper", "lb"]))
def test_plans_are_deterministic_and_pure(operations: list[tuple[str, int, int]], name: str) -> None:
    epochs = batches(operations)
    _, first = run(name, epochs)
    _, second = run(name, epochs)
    assert first == second
    # The pure form gives the same plans from snapshots.
    cfg = PolicyConfig(capacity_bytes=C)
    snap = ClusterSnapshot((), (), (), 0, 0)
    for k, events in enumerate(epochs):
        plan, snap = plan_epoch(name, cfg, snap, EventBatch(float(k), events))
        assert plan.migrations == first[k].migrations
        assert plan.placements == first[k].placements
        assert plan.activate_gpu_ids == first[k].activate_gpu_ids


@PROFILE
@given(ops, st.integers(20, 400))
def test_the_default_moves_no_more_over_a_link_than_its_epoch_budget(operations: list[tuple[str, int, int]],
                                                                     budget: int) -> None:
    """The default policy plans within the §V communication boundary, so its moves are never deferred:
    per epoch, the bytes its migrations send over each link stay within that link's budget."""
    from kvfleet.mell.migration import link_of

    cfg = MellDefaultConfig(capacity_bytes=C, gpus_per_node=2, intra_node_move_budget_bytes=budget,
                            inter_node_move_budget_bytes=budget // 2)
    pol = make_policy("mell", cfg)
    for k, events in enumerate(batches(operations)):
        where = {gid: g.location for gid, g in pol.gpus.items()}
        plan = pol.schedule(EventBatch(float(k), events))
        where.update({gid: g.location for gid, g in pol.gpus.items()})
        sent: dict[str, int] = {}
        for m in plan.migrations:
            link = link_of(where[m.source_gpu_id], where[m.target_gpu_id])
            sent[link] = sent.get(link, 0) + m.size_bytes
        for link, size in sent.items():
            assert size <= (budget if link.startswith("intra:") else budget // 2), (link, size, plan.migrations)


def theorem1_exceptions(pol: ClusterPolicy) -> dict[int, int]:
    """GPUs violating each property of Theorem 1."""
    out = {1: 0, 2: 0, 3: 0, 4: 0, 5: 0}
    gpus = [g for g in pol.gpus.values() if not g.idle and g.span_owner is None]
    sm_items = [it for g in gpus if g.category in (S, M) for it in g.items.values() if it.cls in (S, M)]
    has_t_gpu = any(g.category == T for g in gpus)
    for g in gpus:
        classes = [it.cls for it in g.items.values()]
        if g.category == M and not (classes.count(M) == 2 and classes.count(T) <= 1):
            out[1] += 1
        if g.category == S and classes.count(S) != 3:
            out[2] += 1
        if g.category == T and 4 * g.load_bytes < 3 * C:
            out[3] += 1
        if g.category == L and not any(c in (S, M) for c in classes):
            l_size = max(it.size_bytes for it in g.items.values() if it.cls == L)
            if any(it.size_bytes + l_size < C for it in sm_items):
                out[4] += 1
        if has_t_gpu and g.category in (L, M) and 4 * g.load_bytes < 3 * C:
            out[5] += 1
    return out


@PROFILE
@given(st.lists(st.lists(st.integers(31, 240), max_size=6), max_size=12))
def test_theorem1_on_arrivals_holds_but_for_the_newest_gpu_of_each_class(epochs: list[list[int]]) -> None:
    pol = MellPaperPolicy(REFINED)
    n = 0
    for k, arrivals in enumerate(epochs):
        events = []
        for size in arrivals:
            events.append(Arrive(f"r{n}", size))
            n += 1
        pol.schedule(EventBatch(float(k), tuple(events)))
        exc = theorem1_exceptions(pol)
        assert exc[1] <= 1 and exc[2] <= 1 and exc[3] <= 1, exc
        assert exc[4] == 0, exc


def test_theorem1_property5_counterexample() -> None:
    """Property 5 (T-GPUs exist only if L/M-GPUs are 3/4 full) is not kept by Fig. 10 as stated:
    an L-request that arrives after a T-GPU exists gets a new GPU (Allocate case 3) and only S/M
    requests are pulled into it, so the T-GPU and a 54%-full L-GPU coexist."""
    pol = MellPaperPolicy(REFINED)
    pol.schedule(EventBatch(0.0, (Arrive("t", 40),)))
    pol.schedule(EventBatch(1.0, (Arrive("big", 130),)))
    assert theorem1_exceptions(pol)[5] == 1


def optimum(items: list[int]) -> int:
    """Exact bin packing by DP over subsets (small instances only)."""
    n = len(items)
    fits = [sum(items[i] for i in range(n) if mask >> i & 1) <= C for mask in range(1 << n)]

    @cache
    def best(mask: int) -> int:
        if mask == 0:
            return 0
        low = mask & -mask
        result = n
        sub = mask
        while sub:
            if sub & low and fits[sub]:
                result = min(result, 1 + best(mask ^ sub))
            sub = (sub - 1) & mask
        return result

    return best((1 << n) - 1)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(st.lists(st.integers(1, 240), min_size=1, max_size=9))
def test_gpus_within_four_thirds_of_optimum_plus_constant(items: list[int]) -> None:
    # Theorem 2 with c = 3: one still-filling GPU per class T, S, M. Measured worst over 3,000 random
    # instances: 4/3 OPT + 1.67 ([61, 13, 77, 83]: 3 GPUs, OPT 1).
    pol = MellPaperPolicy(REFINED)
    for i, size in enumerate(items):
        pol.schedule(EventBatch(float(i), (Arrive(f"r{i}", size),)))
    assert pol.num_gpus() <= 4 / 3 * optimum(items) + 3
