"""A measured speed profile as the simulator's speed: interpolation, the loader's errors, the CLI flag.

Step periods and sizes are powers of two (or sums of few) so that every expected value is exact in
floating point: the assertions are equalities, not tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.api.speed import DecodePoint, PrefillPoint, SpeedProfile
from kvfleet.cli import main
from kvfleet.sim.profile import ProfileError, ProfileSpeed, load_profile
from kvfleet.sim.run import simulate
from kvfleet.sim.speed_model import INTER_NODE_BYTES_PER_S, profile_setup, tpot_load_cap
from kvfleet.sim.traces import TraceRequest

BPT = 1024  # KV bytes per token: context c tokens is c x 1024 bytes


def make_profile(decode: list[tuple[int, float, float]], prefill: list[tuple[float, float]],
                 **fields: object) -> SpeedProfile:
    """(batch, context tokens, seconds) decode and (tokens, seconds) prefill points, one sample each."""
    return SpeedProfile.model_validate({
        "engine": "builtin", "model": "tiny", "kvBytesPerToken": BPT, "capacityBytes": 4096 * BPT,
        "decode": [DecodePoint(batch=b, context_tokens=c, step_seconds=s, samples=1) for b, c, s in decode],
        "prefill": [PrefillPoint(tokens=t, step_seconds=s, samples=1) for t, s in prefill],
        **fields,
    })


def speed(decode: list[tuple[int, float, float]], prefill: list[tuple[float, float]] | None = None) -> ProfileSpeed:
    return ProfileSpeed.from_profile(make_profile(decode, prefill or [(128, 0.25)]))


# Batch 1 through three contexts, batch 5 through two.
GRID = speed([(1, 0, 0.25), (1, 1024, 0.5), (1, 2048, 1.0), (5, 0, 0.5), (5, 2048, 1.5)],
             [(128, 0.25), (256, 0.5)])


@pytest.mark.parametrize(
    ("batch", "context_tokens", "expected_s"),
    [
        (1, 0, 0.25), (1, 1024, 0.5), (1, 2048, 1.0), (5, 0, 0.5), (5, 2048, 1.5),  # at the points
        (1, 512, 0.375), (1, 1536, 0.75), (5, 1024, 1.0),  # between contexts of one batch
        (3, 0, 0.375), (3, 2048, 1.25), (3, 1024, 0.75),  # between batches 1 and 5 (batch 1 at 1024 is 0.5)
        (1, 3072, 1.5),  # beyond the last context: the last segment extended (0.5 s per 1024 tokens)
        (9, 0, 0.75),  # beyond the largest batch: the edge pair extended (0.0625 s per request)
    ],
)
def test_decode_interpolates_linearly(batch: int, context_tokens: int, expected_s: float) -> None:
    assert GRID.step_s(batch, context_tokens * BPT) == expected_s


def test_extrapolation_never_goes_below_the_smallest_measured_period() -> None:
    # Below the first context the extended segment would reach 0 at context 0: the floor is 0.5.
    rising = speed([(1, 1024, 0.5), (1, 2048, 1.0)])
    assert rising.step_s(1, 0) == 0.5 and rising.step_s(1, 1536 * BPT) == 0.75
    # A noisy slope that falls with context would turn negative: the floor holds it at 0.25.
    falling = speed([(1, 0, 0.5), (1, 1024, 0.25)])
    assert falling.step_s(1, 512 * BPT) == 0.375
    assert falling.step_s(1, 4096 * BPT) == 0.25
    # Across batch sizes the floor is the nearer edge size's smallest period.
    paced = speed([(4, 0, 0.5), (8, 0, 1.0)])
    assert paced.step_s(1, 0) == 0.5  # the line gives 0.125; batch 4's floor is 0.5
    assert paced.step_s(12, 0) == 1.5
    shrinking = speed([(2, 0, 0.5), (4, 0, 0.25)])
    assert shrinking.step_s(8, 0) == 0.25  # the line gives -0.25


def test_one_point_stands_for_every_size() -> None:
    one = speed([(2, 100, 0.125)], [(64, 0.375)])
    for batch, context_tokens in ((1, 0), (2, 100), (7, 100_000)):
        assert one.step_s(batch, context_tokens * BPT) == 0.125
    for tokens in (0, 1, 64, 100_000):
        assert one.prefill_s(tokens) == 0.375
    # One batch size measured at several contexts: its curve for every batch.
    assert speed([(2, 0, 0.25), (2, 1024, 0.5)]).step_s(9, 512 * BPT) == 0.375


def test_prefill_is_linear_in_tokens_with_a_floor_and_no_zero_point() -> None:
    assert GRID.prefill_s(128) == 0.25 and GRID.prefill_s(256) == 0.5
    assert GRID.prefill_s(192) == 0.375
    assert GRID.prefill_s(512) == 1.0  # extended
    assert GRID.prefill_s(64) == 0.25 and GRID.prefill_s(0) == 0.25  # floored, not 0 s for 0 tokens


def test_points_at_one_size_count_once_by_samples() -> None:
    profile = make_profile([(1, 0, 0.25), (1, 1024, 0.5)], [(128, 0.25)])
    doubled = profile.model_copy(update={"decode": [
        *profile.decode, DecodePoint(batch=1, context_tokens=0, step_seconds=0.5, samples=3)]})
    assert ProfileSpeed.from_profile(doubled).step_s(1, 0) == (0.25 + 3 * 0.5) / 4


def test_tpot_cap_from_the_least_squares_line() -> None:
    # The points lie on step = 0.5 + 0.25 x batch + kv_bytes / 2^20: the fit finds that line, read as
    # bandwidth 2^20 B/s, weights 0.5 x 2^20 B and 0.25 s per sequence; the core's cap at 2 s is then
    # 2 x 2^20 - 2^19 bytes of load and 0.25 x 2^20 per request.
    setup = profile_setup(make_profile([(1, 0, 0.75), (1, 1024, 1.75), (2, 0, 1.0), (2, 2048, 3.0)], [(128, 0.25)]))
    assert tpot_load_cap(setup, 2.0) == (3 * 2**19, 2**18)
    flat = profile_setup(make_profile([(1, 0, 0.5), (1, 1024, 0.25)], [(128, 0.25)]))
    with pytest.raises(ValueError, match="profile-tiny: .*do not grow with KV"):
        tpot_load_cap(flat, 1.0)
    one_context = profile_setup(make_profile([(1, 0, 0.5), (2, 0, 0.75)], [(128, 0.25)]))
    with pytest.raises(ValueError, match="one context"):
        tpot_load_cap(one_context, 1.0)


def test_profile_setup_takes_c_and_links_from_the_profile() -> None:
    profile = make_profile([(1, 0, 0.25)], [(128, 0.25)])
    setup = profile_setup(profile)
    assert (setup.name, setup.capacity_bytes, setup.kv_bytes_per_token) == ("profile-tiny", 4096 * BPT, BPT)
    assert setup.capacity is None and setup.inter_node_bytes_per_s == INTER_NODE_BYTES_PER_S
    linked = profile_setup(profile.model_copy(update={"link_bytes_per_second": 3e9}))
    assert linked.intra_node_bytes_per_s == linked.inter_node_bytes_per_s == 3e9


@pytest.mark.parametrize(
    ("step_s", "epoch_s", "output_tokens", "finish_s", "queue_s"),
    [
        # Prefill ends (0 + 0.5) after the plan placed it (0.25): it decodes from 0.5, 4 x 0.5 s.
        (0.5, 0.25, 4, 0.5 + 4 * 0.5, 0.0),
        # Prefill ends (0.25) before the first plan (1.0): it waits 0.75 s, then decodes 8 x 0.25 s.
        (0.25, 1.0, 8, 1.0 + 8 * 0.25, 0.75),
    ],
)
def test_a_request_takes_prefill_then_output_steps(step_s: float, epoch_s: float, output_tokens: int,
                                                   finish_s: float, queue_s: float) -> None:
    """Every step S seconds: a request arriving at 0 starts decoding at max(its prefill S, the
    epoch end at which it is placed) and writes one token per S (sim/run.py's admit_arrivals and
    decode_epoch), so it finishes N x S later. S and the epoch are powers of two and the finishes
    fall on epoch ends, so the replay's arithmetic is exact."""
    profile = make_profile([(1, 0, step_s), (1, 4096, step_s), (4, 0, step_s)], [(16, step_s), (4096, step_s)])
    prompt_tokens = 100
    result = simulate([TraceRequest("r", 0.0, prompt_tokens, output_tokens)], profile_setup(profile), "mell",
                      epoch_s, scale_down_delay_s=0.0)
    assert result.tpots_s == [step_s] and result.queue_delays_s == [queue_s]
    # The last epoch is the one it finished at: it held KV until then, none after.
    assert result.times_s[-1] == finish_s
    # It arrived at 0: its job took until its finish, the last one's; its first token came one step in.
    assert result.jcts_s == [finish_s] and result.last_finish_s == finish_s and result.jct_s(99) == finish_s
    assert result.ttft_s(50) == finish_s - (output_tokens - 1) * step_s
    assert result.kv_bytes[-1] == 0 < result.kv_bytes[-2]
    assert result.peak_gpus == 1 and result.num_migrations == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON: "),
        ("[1, 2]", "expected a JSON object"),
        ('{"kind": "LLMPool"}', "kind 'LLMPool' is not a SpeedProfile"),
        ('{"engine": "builtin", "model": "m", "kvBytesPerToken": 1024, "capacityBytes": 1,'
         ' "decode": [{"batch": 1, "contextTokens": 0, "stepSeconds": 0, "samples": 1}]}', "decode.0.stepSeconds: "),
        ('{"engine": "builtin", "kvBytesPerToken": 1024, "capacityBytes": 1}', "model: Field required"),
        ('{"engine": "builtin", "model": "m", "kvBytesPerToken": 1024, "capacityBytes": 1,'
         ' "prefill": [{"tokens": 16, "stepSeconds": 0.1, "samples": 1}]}', "no decode points"),
        ('{"engine": "builtin", "model": "m", "kvBytesPerToken": 1024, "capacityBytes": 1,'
         ' "decode": [{"batch": 1, "contextTokens": 0, "stepSeconds": 0.1, "samples": 1}]}', "no prefill points"),
    ],
)
def test_loader_refuses_bad_files_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_loader_reads_what_the_schema_writes(tmp_path: Path) -> None:
    profile = make_profile([(1, 0, 0.25)], [(128, 0.25)], linkBytesPerSecond=1e9)
    path = tmp_path / "p.json"
    path.write_text(profile.model_dump_json(by_alias=True))
    assert load_profile(path) == profile
    with pytest.raises(ProfileError, match="cannot read the speed profile"):
        load_profile(tmp_path / "missing.json")


def write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    profile = make_profile([(1, 0, 0.03125), (1, 2048, 0.0625), (4, 0, 0.0625), (4, 2048, 0.125)],
                           [(64, 0.0625), (1024, 0.25)])
    profile_path = tmp_path / "p.json"
    profile_path.write_text(profile.model_dump_json(by_alias=True))
    trace_path = tmp_path / "t.csv"
    trace_path.write_text("timestamp,prompt,output\n0,100,20\n0.5,200,10\n1.0,1500,30\n2.5,800,40\n")
    return profile_path, trace_path


def test_cli_replays_a_trace_at_the_profile_speed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile_path, trace_path = write_inputs(tmp_path)
    code = main(["simulate", "--speed-profile", str(profile_path), "--trace", str(trace_path), "--policies", "mell,bf",
                 "--epoch-s", "1", "--scale-down-delay-s", "3", "--json", "--no-progress"])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert (payload["setup"], payload["capacity_bytes"], payload["num_requests"]) == ("profile-tiny", 4096 * BPT, 4)
    policies = payload["policies"]
    assert set(policies) == {"mell", "bf"}
    for stats in policies.values():
        assert stats["billed_gpu_hours"] > 0 and isinstance(stats["num_migrations"], int)
        assert stats["capacity_violations"] == 0 and stats["scale_down_delay_s"] == 3.0

    # Without --json the capacity line says where C and the speed came from.
    assert main(["simulate", "--speed-profile", str(profile_path), "--trace", str(trace_path), "--policies", "bf",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"# profile-tiny: C = 0.00 GiB from the speed profile = 4096 tokens of {BPT} B" in err
    assert "over 6 samples" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--setup", "13b-a100"], "--speed-profile replaces --setup"),
        (["--activation-reserve-gib", "2"], "--activation-reserve-gib does not apply"),
        (["--tpot-ms", "0.001"], "below one request's decode step"),
    ],
)
def test_cli_refuses_what_a_profile_run_cannot_do(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  extra: list[str], message: str) -> None:
    profile_path, trace_path = write_inputs(tmp_path)
    assert main(["simulate", "--speed-profile", str(profile_path), "--trace", str(trace_path), "--no-progress",
                 *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfleet simulate: error: ") and message in err


def test_cli_names_a_bad_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, trace_path = write_inputs(tmp_path)
    missing = tmp_path / "nope.json"
    assert main(["simulate", "--speed-profile", str(missing), "--trace", str(trace_path), "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith(f"kvfleet simulate: error: {missing}: cannot read the speed profile")


def test_a_measured_setups_reprefill_budget_is_its_fastest_prefill() -> None:
    from kvfleet.api.speed import DecodePoint, PrefillPoint, SpeedProfile
    from kvfleet.sim.run import migration_boundaries
    from kvfleet.sim.speed_model import profile_setup

    # A paced engine: 40 tokens in 40 ms, 200 in 80 ms. One token costs a whole step (40 ms), but a
    # re-prefill runs at up to 2,500 tokens a second; a tenth of an epoch's worth is the §V budget.
    profile = SpeedProfile(engine="builtin", model="tiny", kv_bytes_per_token=2048, capacity_bytes=1 << 20,
                           decode=[DecodePoint(batch=1, context_tokens=10, step_seconds=0.03, samples=1)],
                           prefill=[PrefillPoint(tokens=40, step_seconds=0.04, samples=1),
                                    PrefillPoint(tokens=200, step_seconds=0.08, samples=1)])
    assert migration_boundaries(profile_setup(profile), 1.0).instance_prefill_tokens == 250
