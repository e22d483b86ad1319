"""Property tests of the §V migration planner: budgets hold, every move is accounted for once, and a
move is split (hybrid) only when neither bin holds it whole.

Derandomized, as the other property tests, so CI is reproducible.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.mell.migration import Boundaries, MoveMode, link_of, plan_migrations
from kvfleet.mell.models import Location, Migration

PROFILE = settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GPUS = [f"g{i}" for i in range(5)]
LOC = {g: Location(f"n{i % 2}", "z0") for i, g in enumerate(GPUS)}

moves = st.lists(
    st.tuples(st.sampled_from(GPUS), st.sampled_from(GPUS), st.integers(1, 400)).filter(lambda t: t[0] != t[1]),
    max_size=14,
)
budgets = st.tuples(st.integers(0, 600), st.integers(0, 600), st.integers(0, 60))


@PROFILE
@given(moves, budgets, st.integers(1, 16), st.one_of(st.none(), st.integers(1, 12)),
       st.sampled_from(["first-fit", "best-fit"]),
       st.dictionaries(st.sampled_from(["intra:n0", "intra:n1", "inter:n0->n1", "inter:n1->n0"]), st.integers(0, 600)),
       st.dictionaries(st.sampled_from(GPUS), st.integers(0, 60)))
def test_budgets_hold_and_every_move_is_planned_once(
    raw: list[tuple[str, str, int]], caps: tuple[int, int, int], bpt: int, block: int | None, strategy: str,
    measured_link: dict[str, int], measured_prefill: dict[str, int],
) -> None:
    migs = [Migration(f"r{i}", s, t, size, "test") for i, (s, t, size) in enumerate(raw)]
    bounds = Boundaries(*caps)
    plan = plan_migrations(migs, LOC.__getitem__, bpt, bounds, strategy, block_size_tokens=block,
                           measured_link_bytes=measured_link, measured_prefill_tokens=measured_prefill)
    assert plan == plan_migrations(migs[::-1], LOC.__getitem__, bpt, bounds, strategy, block_size_tokens=block,
                                   measured_link_bytes=measured_link, measured_prefill_tokens=measured_prefill)

    ids = [c.migration.request_id for c in plan.scheduled] + [m.request_id for m in plan.deferred]
    assert sorted(ids) == sorted(m.request_id for m in migs)

    link_used: dict[str, int] = {}
    prefill_used: dict[str, int] = {}
    for c in plan.scheduled:
        assert c.kv_bytes >= 0 and c.prefill_tokens >= 0
        link_used[c.link_id] = link_used.get(c.link_id, 0) + c.kv_bytes
        prefill_used[c.migration.target_gpu_id] = prefill_used.get(c.migration.target_gpu_id, 0) + c.prefill_tokens
    for link, used in link_used.items():
        cap = bounds.intra_node_link_bytes if link.startswith("intra:") else bounds.inter_node_link_bytes
        assert used <= min(cap, measured_link.get(link, cap))
    for gpu, used in prefill_used.items():
        assert used <= min(bounds.instance_prefill_tokens, measured_prefill.get(gpu, bounds.instance_prefill_tokens))

    for c in plan.hybrid:
        assert c.mode is MoveMode.HYBRID and block is not None
        assert c.kv_tokens > 0 and c.kv_tokens % block == 0 and c.prefill_tokens > 0
        assert c.kv_tokens + c.prefill_tokens == c.num_tokens and c.kv_bytes == c.kv_tokens * bpt
        assert c.link_id == link_of(LOC[c.migration.source_gpu_id], LOC[c.migration.target_gpu_id])
    assert all(c.mode is MoveMode.KV for c in plan.kv) and all(c.mode is MoveMode.TOKEN for c in plan.token)


@PROFILE
@given(moves, budgets, st.integers(1, 16), st.integers(1, 12))
def test_hybrid_only_when_neither_pure_mode_fits(raw: list[tuple[str, str, int]], caps: tuple[int, int, int],
                                                 bpt: int, block: int) -> None:
    """Replays the plan in its largest-first order: at each hybrid move, what its bins had left then
    holds it neither as KV nor as tokens."""
    migs = [Migration(f"r{i}", s, t, size, "test") for i, (s, t, size) in enumerate(raw)]
    bounds = Boundaries(*caps)
    plan = plan_migrations(migs, LOC.__getitem__, bpt, bounds, block_size_tokens=block)
    by_id = {c.migration.request_id: c for c in plan.scheduled}
    link_left: dict[str, int] = {}
    prefill_left: dict[str, int] = {}
    for mig in sorted(migs, key=lambda m: (-m.size_bytes, m.request_id)):
        link = link_of(LOC[mig.source_gpu_id], LOC[mig.target_gpu_id])
        link_left.setdefault(link, bounds.intra_node_link_bytes if link.startswith("intra:")
                             else bounds.inter_node_link_bytes)
        prefill_left.setdefault(mig.target_gpu_id, bounds.instance_prefill_tokens)
        c = by_id.get(mig.request_id)
        if c is None:
            continue
        if c.mode is MoveMode.HYBRID:
            assert mig.size_bytes > link_left[link] and c.num_tokens > prefill_left[mig.target_gpu_id]
        link_left[link] -= c.kv_bytes
        prefill_left[mig.target_gpu_id] -= c.prefill_tokens
