"""eLLM's Algorithms 1 and 2 (elastic/policy.py), exactly, on small numbers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfleet.worker.elastic.policy import (
    Admission,
    Demand,
    PoolState,
    SloWindow,
    plan_batch,
    scale_logical_buffer,
)


def state(total: int = 100, kv: int = 50, theta: int = 0, buffer: int = 0) -> PoolState:
    return PoolState(total_bytes=total, kv_bytes=kv, activation_bytes=total - kv, threshold_bytes=theta,
                     buffer_available_bytes=buffer)


def test_decoding_phase_takes_requests_in_order_until_one_does_not_fit() -> None:
    # 30 + 30 + 30 = 90 <= 100 - 10; the fourth (and the small fifth after it) wait: the loop breaks.
    plan = plan_batch(state(theta=10), [Demand(25, 5)] * 3 + [Demand(5, 1), Demand(1, 0)], [])
    assert plan.num_decodes == 3
    assert (plan.kv_bytes, plan.activation_bytes) == (75, 15)


def test_threshold_is_kept_free() -> None:
    assert plan_batch(state(theta=10), [Demand(80, 10)], []).num_decodes == 1
    assert plan_batch(state(theta=11), [Demand(80, 10)], []).num_decodes == 0


def test_prefill_offloads_kv_when_only_activations_fit_and_the_buffer_has_room() -> None:
    # After the decode (40 + 10), a prefill needing 40 KV + 20 act does not fit (110 > 100): its KV goes
    # to the buffer (line 8-11) if the buffer takes 40; the next prefill then finds the buffer at 5.
    plan = plan_batch(state(buffer=45), [Demand(40, 10)], [Demand(40, 20), Demand(40, 20)], park_for_prefill=False)
    assert plan.num_decodes == 1
    assert plan.prefills == (Admission.OFFLOADED,)
    assert (plan.kv_bytes, plan.activation_bytes) == (40, 30)


def test_prefill_on_the_gpu_when_it_fits_and_not_offloadable_without_the_flag() -> None:
    plan = plan_batch(state(buffer=1000), [], [Demand(30, 10), Demand(30, 10), Demand(50, 10, offloadable=False)])
    assert plan.prefills == (Admission.GPU, Admission.GPU)


def test_the_newest_decodes_park_for_a_prefill_that_fits_no_other_way() -> None:
    decodes = [Demand(30, 5)] * 3  # 105 of 100 - 0: the third waits (the loop breaks)
    # The head prefill needs 40 of activations: parking the second decode (30 KV to the buffer) makes
    # room for it, KV and all (100 - (30 + 5 + 20 + 40) >= 0).
    plan = plan_batch(state(buffer=60), decodes, [Demand(20, 40)])
    assert (plan.num_decodes, plan.prefills) == (1, (Admission.GPU,))
    assert (plan.kv_bytes, plan.activation_bytes) == (50, 45)
    # With more KV, parking one still leaves no room for it on the GPU: it goes offloaded (30 + 40 <= 70).
    plan = plan_batch(state(buffer=70), decodes, [Demand(40, 40)])
    assert (plan.num_decodes, plan.prefills, plan.kv_bytes) == (1, (Admission.OFFLOADED,), 30)
    # The paper's strict loop: the decoding batch keeps its place and the prefill waits.
    assert plan_batch(state(buffer=60), decodes, [Demand(20, 40)], park_for_prefill=False).prefills == ()
    # A buffer that cannot take the parked KV: nothing parks, nothing is admitted.
    plan = plan_batch(state(buffer=20), decodes, [Demand(20, 40)])
    assert (plan.num_decodes, plan.prefills) == (2, ())


def test_balloon_inflates_and_deflates() -> None:
    # KV holds 50, the batch needs 70 KV and 10 act: act -> kv by 20 (line 25).
    assert plan_batch(state(kv=50), [Demand(70, 10)], []).inflation_bytes == 20
    # KV holds 90 but needs 20; act holds 10 and needs 40: kv -> act by 30, negative (line 27).
    assert plan_batch(state(kv=90), [Demand(20, 38)], [], base_activation_bytes=2).inflation_bytes == -30
    # Both sides have enough: nothing moves.
    assert plan_batch(state(kv=50), [Demand(20, 10)], []).inflation_bytes == 0


def test_base_bytes_count_from_the_start() -> None:
    assert plan_batch(state(), [Demand(50, 0)], [], base_activation_bytes=30, base_kv_bytes=30).num_decodes == 0
    assert plan_batch(state(), [Demand(40, 0)], [], base_activation_bytes=30, base_kv_bytes=30).num_decodes == 1


@given(st.integers(1, 10_000), st.integers(0, 100), st.integers(0, 5_000),
       st.lists(st.tuples(st.integers(0, 500), st.integers(0, 200)), max_size=12),
       st.lists(st.tuples(st.integers(0, 500), st.integers(0, 200), st.booleans()), max_size=12))
def test_a_plan_never_overcommits_the_pool_or_the_buffer(total: int, theta: int, buffer: int,
                                                        decodes: list[tuple[int, int]],
                                                        prefills: list[tuple[int, int, bool]]) -> None:
    plan = plan_batch(state(total=total, kv=total // 2, theta=theta, buffer=buffer),
                      [Demand(k, a) for k, a in decodes], [Demand(k, a, o) for k, a, o in prefills])
    assert plan.num_decodes <= len(decodes) and len(plan.prefills) <= len(prefills)
    if plan.num_decodes or plan.prefills:
        assert total - plan.kv_bytes - plan.activation_bytes >= theta
    offloaded = sum(prefills[i][0] for i, how in enumerate(plan.prefills) if how is Admission.OFFLOADED)
    assert offloaded <= buffer
    assert all(prefills[i][2] for i, how in enumerate(plan.prefills) if how is Admission.OFFLOADED)


def test_logical_buffer_halves_on_tpot_doubles_on_ttft_within_bounds() -> None:
    kwargs = {"max_bytes": 64, "min_bytes": 1}
    assert scale_logical_buffer(8, ttft_event=False, tpot_event=True, **kwargs) == 4
    assert scale_logical_buffer(8, ttft_event=True, tpot_event=False, **kwargs) == 16
    assert scale_logical_buffer(8, ttft_event=True, tpot_event=True, **kwargs) == 4  # TPOT first (line 1)
    assert scale_logical_buffer(1, ttft_event=False, tpot_event=True, **kwargs) == 1
    assert scale_logical_buffer(48, ttft_event=True, tpot_event=False, **kwargs) == 64
    assert scale_logical_buffer(8, ttft_event=False, tpot_event=False, **kwargs) == 8
    assert scale_logical_buffer(9, ttft_event=False, tpot_event=True, alpha=3, **kwargs) == 3


def test_violation_event_is_three_misses_in_five_iterations_then_starts_afresh() -> None:
    window = SloWindow()
    assert window.observe(1, 0) == (False, False)
    assert window.observe(0, 0) == (False, False)
    assert window.observe(1, 2) == (False, False)
    assert window.observe(1, 1) == (True, True)       # 3 TTFT misses, 3 TPOT misses within 5
    assert window.observe(2, 0) == (False, False)     # the window started afresh
    for _ in range(4):
        window.observe(0, 0)
    assert window.observe(1, 0) == (False, False)     # the 2 misses fell out of the last five
