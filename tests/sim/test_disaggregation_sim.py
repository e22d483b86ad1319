"""Disaggregated prefill/decode pools (`kvfleet simulate --disaggregation`, MemServe §5-§6).

The exact cases are worked out by hand from the setup's speed model: one request's TTFT, a queue on
one prefill GPU, and a conversation's second turn under each caching mode (what the prefill GPU
finds, what the decode GPU is sent, what comes back). Hypothesis checks what must hold on any small
workload, and the command runs a slice of a bundled trace.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.cli import main
from kvfleet.sim import bundled
from kvfleet.sim.disaggregation import (
    DEFAULT_LINK_GBPS,
    PdCaching,
    PdSplit,
    answer_blocks,
    context_blocks,
    simulate_disaggregated,
)
from kvfleet.sim.hardware import A100_40GB, LLAMA2_13B
from kvfleet.sim.prefix_cache import PrefixCacheSpec
from kvfleet.sim.speed_model import make_setup
from kvfleet.sim.traces import TraceRequest

SETUP = make_setup("13b-a100", LLAMA2_13B, A100_40GB)
BPT = SETUP.kv_bytes_per_token
LINK = DEFAULT_LINK_GBPS * 1e9 / 8  # 25 GB/s
SPEC = PrefixCacheSpec()  # 512-token hash blocks
CONV = bundled.trace_dir() / "AzureLLMInferenceTrace_conv.csv"


def test_splits_parse_and_refuse() -> None:
    assert PdSplit.parse("1P2D") == PdSplit(1, 2)
    assert PdSplit.parse(" 3p12d ").name == "3P12D" and PdSplit(3, 12).total_gpus == 15
    for bad in ("1P", "P2D", "1D2P", "x"):
        with pytest.raises(ValueError, match="is not a split like 1P2D"):
            PdSplit.parse(bad)
    with pytest.raises(ValueError, match="at least one prefill and one decode GPU"):
        PdSplit.parse("0P2D")


# --- one request, a queue --------------------------------------------------------------------------


def test_one_request_ttft_is_prefill_plus_transfer_plus_one_step() -> None:
    # The epoch ends exactly when the prefill does, so the decode GPU is picked at once: the prompt's
    # KV then crosses the link and the first decode step runs on a GPU holding only that prompt.
    prefill_s = SETUP.prefill_s(1000)
    r = simulate_disaggregated([TraceRequest("a", 0.0, 1000, 10)], SETUP, PdSplit(1, 1), epoch_s=prefill_s)
    transfer_s = 1000 * BPT / LINK
    assert r.ttfts_s == (prefill_s + transfer_s + SETUP.step_s(1, 1000 * BPT),)
    assert (r.transfer_bytes, r.mean_transfer_bytes, r.return_bytes) == (1000 * BPT, 1000 * BPT, 0)
    assert r.prefill_busy_s == prefill_s and r.decode_waits_s == (0.0,)
    assert (r.decode_gpus_peak, r.decode_over_cap_epochs, r.decode_preemptions, r.capacity_violations) == (1, 0, 0, 0)
    assert r.held_gpu_s == 2 * r.duration_s
    assert r.busy_gpu_s == prefill_s + sum(r.decode_gpus) * prefill_s


def test_one_token_answer_ends_with_its_first_step_and_the_epoch_wait_counts() -> None:
    # Arriving at 0.25 with a 1 s epoch, the request is placed on a decode GPU at 1.0 (the epoch's
    # plan), well after its prefill ended: TTFT = 0.75 + transfer + one step, and JCT = TTFT.
    r = simulate_disaggregated([TraceRequest("a", 0.25, 2000, 1)], SETUP, PdSplit(1, 1), link_bytes_per_s=1e9)
    assert r.ttfts_s == ((1.0 - 0.25) + 2000 * BPT / 1e9 + SETUP.step_s(1, 2000 * BPT),)
    assert r.jcts_s == r.ttfts_s
    assert r.decode_waits_s == (1.0 - (0.25 + SETUP.prefill_s(2000)),)


def test_one_prefill_gpu_is_a_queue_and_two_share_the_work() -> None:
    reqs = [TraceRequest("a", 0.0, 2000, 1), TraceRequest("b", 0.0, 2000, 1)]
    one = simulate_disaggregated(reqs, SETUP, PdSplit(1, 1))
    two = simulate_disaggregated(reqs, SETUP, PdSplit(2, 1))
    p = SETUP.prefill_s(2000)  # a third of a second: both end within the first epoch
    # b waits for a's prefill on the one GPU; with two, both end at p. Both pools computed 2p.
    assert sorted(one.decode_waits_s) == [1.0 - 2 * p, 1.0 - p]
    assert two.decode_waits_s == (1.0 - p, 1.0 - p)
    assert one.prefill_busy_s == two.prefill_busy_s == 2 * p
    assert one.prefill_utilization == 2 * p / one.duration_s
    assert two.prefill_utilization == 2 * p / (2 * two.duration_s)


# --- a conversation's second turn under each caching mode ----------------------------------------------

# Turn 1: a 1024-token prompt (blocks 1, 2) and a 512-token answer. Turn 2, long after: the same
# prompt, the answer (block 3) and a new message (block 4). One prefill and one decode GPU.
TURNS = [TraceRequest("t1", 0.0, 1024, 512, (1, 2)), TraceRequest("t2", 60.0, 2048, 10, (1, 2, 3, 4))]


def test_the_next_turn_names_the_answer_blocks() -> None:
    assert answer_blocks(TURNS, SPEC) == {"t1": (3,)}
    assert context_blocks(TURNS[0], SPEC, (3,)) == ((1, 2, 3), (512, 512, 512))


@pytest.mark.parametrize(
    ("mode", "prefill_hit", "decode_hit", "sent_tokens", "returned_tokens"),
    [
        # PD-Basic: nothing cached, both prompts sent whole.
        (PdCaching.NONE, 0, 0, 1024 + 2048, 0),
        # PD-Caching-1: the prefill GPU kept turn 1's prompt (1024 hit), the decode GPU still gets all.
        (PdCaching.PREFILL, 1024, 0, 1024 + 2048, 0),
        # PD-Caching-2: the decode GPU kept turn 1's prompt and answer (1536): only block 4 is sent;
        # the prefill GPU never saw the answer, so it recomputes it.
        (PdCaching.DECODE, 1024, 1536, 1024 + 512, 0),
        # PD-Caching-3: the answers came back (512 + 10 tokens), so turn 2 prefills only its new 512.
        (PdCaching.FULL, 1536, 1536, 1024 + 512, 512 + 10),
    ],
)
def test_second_turn_under_each_mode(mode: PdCaching, prefill_hit: int, decode_hit: int, sent_tokens: int,
                                     returned_tokens: int) -> None:
    r = simulate_disaggregated(TURNS, SETUP, PdSplit(1, 1), mode)
    assert (r.prefill_hit_tokens, r.decode_hit_tokens) == (prefill_hit, decode_hit)
    assert (r.transfer_bytes, r.return_bytes) == (sent_tokens * BPT, returned_tokens * BPT)
    assert r.prefill_busy_s == SETUP.prefill_s(1024) + SETUP.prefill_s(2048 - prefill_hit)
    assert r.prompt_tokens == 1024 + 2048 and len(r.jcts_s) == 2


def test_full_caching_prefills_the_second_turn_sooner() -> None:
    # Turn 2 arrives at 60.0 and is placed at 61.0: its TTFT is the epoch wait, its transfer and one
    # step whatever the mode; what full caching changes is how long the prefill GPU worked.
    none = simulate_disaggregated(TURNS, SETUP, PdSplit(1, 1), PdCaching.NONE)
    full = simulate_disaggregated(TURNS, SETUP, PdSplit(1, 1), PdCaching.FULL)
    assert full.prefill_busy_s == none.prefill_busy_s - SETUP.prefill_s(2048) + SETUP.prefill_s(512)
    ttft_t2 = 1.0 + 512 * BPT / LINK + SETUP.step_s(1, 2048 * BPT)
    assert full.ttfts_s[1] == pytest.approx(ttft_t2, abs=1e-12)


def test_a_repeated_prefix_goes_to_the_gpu_that_holds_it() -> None:
    # a fills GPU 0's cache; b, sharing a's two blocks, goes there (its cost is lower) although GPU 1
    # is as idle; c shares nothing and takes the lowest index among equals (GPU 0, idle again).
    reqs = [TraceRequest("a", 0.0, 1024, 1, (1, 2)), TraceRequest("b", 5.0, 1100, 1, (1, 2, 3)),
            TraceRequest("c", 10.0, 600, 1, (7, 8))]
    r = simulate_disaggregated(reqs, SETUP, PdSplit(2, 1), PdCaching.PREFILL)
    assert r.prefill_hit_tokens == 1024
    # b's hit is what shows the choice: on GPU 1 it would have prefilled all 1100 tokens.
    assert r.prefill_busy_s == SETUP.prefill_s(1024) + SETUP.prefill_s(76) + SETUP.prefill_s(600)


# --- answer blocks ---------------------------------------------------------------------------------


def test_answer_blocks_need_a_later_prompt_that_holds_the_whole_context() -> None:
    a = TraceRequest("a", 0.0, 1100, 600, (1, 2, 3))  # 2 whole blocks and 76 tokens; context 1700 = 3 whole
    too_short = TraceRequest("b", 1.0, 1600, 5, (1, 2, 5, 6))  # 1600 < 1700: not a's next turn
    repeat = TraceRequest("c", 2.0, 1800, 5, (1, 2, 3, 9))  # block 3 as a's partial one: the same text again
    nxt = TraceRequest("d", 3.0, 2000, 5, (1, 2, 8, 9))
    later = TraceRequest("e", 4.0, 2000, 5, (1, 2, 10, 11))
    assert answer_blocks([a, too_short, repeat, nxt, later], SPEC)["a"] == (8,)
    # Only later prompts count, and a request without a whole prompt block names nothing.
    assert "a" not in answer_blocks([nxt, replace(a, arrival_s=5.0)], SPEC)
    assert answer_blocks([TraceRequest("s", 0.0, 300, 900, (1,)), TraceRequest("t", 1.0, 1500, 1, (2, 3, 4))],
                         SPEC) == {}
    # An answer that completes no block has none.
    assert answer_blocks([TraceRequest("s", 0.0, 1024, 100, (1, 2)), nxt], SPEC) == {}


def test_a_shared_system_prompt_is_taken_for_a_conversation() -> None:
    # The documented limit: a prompt whose whole blocks are only a shared system prompt (blocks 1, 2)
    # cannot be told from the start of another conversation, and the first later one is taken.
    a = TraceRequest("a", 0.0, 1100, 600, (1, 2, 3))
    other = TraceRequest("x", 1.0, 3000, 5, (1, 2, 40, 41, 42, 43))
    assert answer_blocks([a, other], SPEC) == {"a": (40,)}


# --- a full decode pool ------------------------------------------------------------------------------


def test_a_full_decode_pool_queues_and_preempts_but_never_passes_d() -> None:
    # Eight 6000-token prompts at once: C holds 15,408 tokens, so one decode GPU takes two of them
    # at a time (the others wait with their KV at P), and two 3000-token answers outgrow it: preemptions.
    reqs = [TraceRequest(f"r{i}", 0.1 * i, 6000, 3000) for i in range(8)]
    r = simulate_disaggregated(reqs, SETUP, PdSplit(2, 1))
    assert r.decode_gpus_peak == 1 and r.decode_over_cap_epochs == 0
    assert r.decode_preemptions > 0 and len(r.jcts_s) == 8 and r.capacity_violations == 0
    assert max(r.decode_waits_s) > 60  # the last ones waited for the first to finish
    roomy = simulate_disaggregated(reqs, SETUP, PdSplit(2, 8))
    assert roomy.decode_preemptions == 0 and roomy.jct_p99_s < r.jct_p99_s


def test_a_request_larger_than_the_pool_still_runs() -> None:
    r = simulate_disaggregated([TraceRequest("big", 0.0, 40_000, 5)], SETUP, PdSplit(1, 1))
    assert len(r.jcts_s) == 1 and r.decode_gpus_peak == 3 and r.decode_over_cap_epochs > 0


# --- invariants ----------------------------------------------------------------------------------------


def conversations(num_sessions: int, seed: int, rate: float = 0.5) -> list[TraceRequest]:
    """Sessions of 1-3 turns after a shared 2-block system prompt: each turn's prompt repeats the
    previous prompt and answer and adds a message; a block's id names its session, index and tokens
    (a partial block grows into another id), as a hash of the tokens would."""
    rng = random.Random(seed)
    ids: dict[tuple[object, ...], int] = {}
    out: list[TraceRequest] = []
    start = 0.0
    for s in range(num_sessions):
        start += rng.expovariate(rate)
        stream, t = 1024, start
        for turn in range(rng.randint(1, 3)):
            stream += rng.randint(20, 900)
            blocks = -(-stream // 512)
            hashes = tuple(ids.setdefault(("sys", i) if i < 2 else (s, i, min(512, stream - 512 * i)), len(ids))
                           for i in range(blocks))
            output = rng.randint(1, 700)
            out.append(TraceRequest(f"s{s}t{turn}", t, stream, output, hashes))
            stream += output
            t += rng.uniform(2.0, 40.0)
    return sorted(out, key=lambda r: (r.arrival_s, r.request_id))


workloads = st.builds(conversations, st.integers(1, 12), st.integers(0, 10_000), st.sampled_from([0.2, 1.0, 5.0]))
splits = st.builds(PdSplit, st.integers(1, 2), st.integers(1, 3))


@settings(max_examples=25, deadline=None)
@given(reqs=workloads, split=splits)
def test_every_mode_serves_every_request_within_the_pool(reqs: list[TraceRequest], split: PdSplit) -> None:
    """What holds for any workload (no request here is larger than C): every request finishes once;
    the decode pool never holds more than D GPUs; a mode that does not cache at a role hits nothing
    there; KV sent is the prompts less the decode GPUs' hits, so none == prefill == all prompts >=
    decode, full; full mode sends every answer back; the prefill side of `decode` is that of `prefill`
    exactly (D's cache changes nothing at P); and TTFT is at least one step after a one-token prefill.

    What does not hold: full <= decode in KV sent, or full >= decode in prefill hits. The modes
    change when requests reach the decode GPUs and what the caches evict, so placement differs: a few
    of several hundred seeded workloads send more under full (4 of 450 of `conversations`, seeds 0-149)."""
    prompt_bytes = sum(r.prompt_tokens for r in reqs) * BPT
    runs = {mode: simulate_disaggregated(reqs, SETUP, split, mode) for mode in PdCaching}
    prefill, decode = runs[PdCaching.PREFILL], runs[PdCaching.DECODE]
    assert (decode.prefill_hit_tokens, decode.prefill_busy_s, decode.prefill_evictions) == \
        (prefill.prefill_hit_tokens, prefill.prefill_busy_s, prefill.prefill_evictions)
    for mode, r in runs.items():
        assert len(r.jcts_s) == len(r.ttfts_s) == len(reqs) == r.num_requests
        assert r.decode_gpus_peak <= split.decode_gpus and r.decode_over_cap_epochs == 0
        assert r.capacity_violations == 0
        assert r.prompt_tokens == sum(x.prompt_tokens for x in reqs)
        assert 0 <= r.prefill_hit_tokens <= r.prompt_tokens and 0 <= r.decode_hit_tokens <= r.prompt_tokens
        if not mode.caches_at_prefill:
            assert r.prefill_hit_tokens == 0
        if not mode.caches_at_decode:
            assert r.decode_hit_tokens == 0 and r.transfer_bytes == prompt_bytes
        else:
            assert r.transfer_bytes == prompt_bytes - r.decode_hit_tokens * BPT
        assert r.return_bytes == (sum(x.output_tokens for x in reqs) * BPT if mode.returns_decode_kv else 0)
        floor = SETUP.prefill_s(1) + SETUP.step_s(1, 0)
        assert all(t >= floor for t in r.ttfts_s)
        assert all(jct >= ttft for jct, ttft in zip(r.jcts_s, r.ttfts_s, strict=True))
        assert min(r.decode_waits_s) >= 0.0


@settings(max_examples=10, deadline=None)
@given(reqs=workloads, split=splits)
def test_without_hash_ids_every_mode_is_pd_basic(reqs: list[TraceRequest], split: PdSplit) -> None:
    bare = [replace(r, hash_ids=()) for r in reqs]
    basic = simulate_disaggregated(bare, SETUP, split, PdCaching.NONE)
    assert basic.prefill_busy_s == pytest.approx(sum(SETUP.prefill_s(r.prompt_tokens) for r in reqs))
    for mode in PdCaching:
        assert replace(simulate_disaggregated(bare, SETUP, split, mode), caching=PdCaching.NONE) == basic


def test_the_same_workload_gives_the_same_result() -> None:
    reqs = conversations(30, seed=3, rate=1.0)
    assert simulate_disaggregated(reqs, SETUP, PdSplit(2, 2), PdCaching.FULL) == \
        simulate_disaggregated(reqs, SETUP, PdSplit(2, 2), PdCaching.FULL)


# --- the command -------------------------------------------------------------------------------------


def run_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    code = main(["simulate", "--trace", str(CONV), "--window", "600:20", "--setup", "13b-a100", "--json",
                 "--no-progress", *extra])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    payload = json.loads(out)
    assert isinstance(payload, dict)
    return payload


def test_cli_runs_a_bundled_trace_beside_colocated_serving(capsys: pytest.CaptureFixture[str]) -> None:
    payload = run_json(capsys, "--disaggregation", "1P2D,2P2D", "--pd-caching", "all")
    assert payload["setup"] == "13b-a100" and payload["workload"] == "azure-conv"
    colocated = payload["colocated"]
    assert isinstance(colocated, dict) and set(colocated) == {"none", "prefix"}
    assert colocated["none"]["policy"] == "mell"
    runs = payload["disaggregated"]
    assert isinstance(runs, list)
    assert [(d["split"], d["caching"]) for d in runs] == [(s, m) for s in ("1P2D", "2P2D")
                                                         for m in ("none", "prefill", "decode", "full")]
    for d in runs:
        assert d["link_bytes_per_s"] == 25e9 and d["decode_gpus_peak"] <= d["decode_gpus"]
        # The Azure traces carry no hash_ids: every mode is PD-Basic, each prompt sent whole.
        assert d["prefill_hit_tokens"] == d["decode_hit_tokens"] == d["return_bytes"] == 0
        assert d["transfer_bytes"] == d["prompt_tokens"] * BPT
        assert d["ttft_p99_s"] >= d["ttft_mean_s"] > 0 and d["jct_mean_s"] >= d["ttft_mean_s"]
    comparisons = payload["comparisons"]
    assert isinstance(comparisons, list) and len(comparisons) == 1 and isinstance(payload["num_requests"], int)
    assert payload["num_requests"] > 0


def test_cli_table_and_link_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(CONV), "--window", "600:20", "--setup", "13b-a100", "--no-progress",
                 "--disaggregation", "1P2D", "--link-gbps", "8", "--csv", str(tmp_path / "pd.csv")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["setup", "workload", "serving", "caching", "gpus"]
    assert [line.split()[2:4] for line in lines[2:]] == [["colocated", "none"], ["1P2D", "none"]]
    assert lines[3].split()[4] == "3"  # P + D GPUs
    csv_lines = (tmp_path / "pd.csv").read_text().splitlines()
    assert csv_lines[0].startswith("setup,workload,serving,caching,gpus,") and len(csv_lines) == 3
    slow = run_json(capsys, "--disaggregation", "1P2D", "--link-gbps", "8")["disaggregated"]
    fast = run_json(capsys, "--disaggregation", "1P2D")["disaggregated"]
    assert isinstance(slow, list) and isinstance(fast, list)
    assert slow[0]["link_bytes_per_s"] == 1e9 and slow[0]["ttft_mean_s"] > fast[0]["ttft_mean_s"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--disaggregation", "1P"], "--disaggregation: '1P' is not a split like 1P2D"),
        (["--disaggregation", "0P1D"], "at least one prefill and one decode GPU"),
        (["--pd-caching", "full"], "--pd-caching needs --disaggregation"),
        (["--link-gbps", "100"], "--link-gbps needs --disaggregation"),
        (["--disaggregation", "1P1D", "--link-gbps", "0"], "--link-gbps must be positive"),
        (["--disaggregation", "1P1D", "--policies", "mell,bf"], "one policy"),
        (["--disaggregation", "1P1D", "--prefix-cache"], "--prefix-cache cannot be used with --disaggregation"),
        (["--disaggregation", "1P1D", "--no-batching"], "--no-batching cannot be used with --disaggregation"),
        (["--disaggregation", "1P1D", "--pd-caching", "full", "--trace-length-scale", "2"],
         "--trace-length-scale cannot be used with --pd-caching"),
    ],
)
def test_cli_refuses_bad_disaggregation_flags(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(CONV), "--window", "600:5", "--setup", "13b-a100", "--no-progress",
                 *flags]) == 2
    assert message in capsys.readouterr().err
