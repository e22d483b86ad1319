"""The prefix cache model of `kvfleet simulate --prefix-cache` on hand-made traces (MemServe §4.1-4.2).

Every expected number here is worked out by hand from the trace: which hash blocks a worker holds,
which it evicts, and when a request can decode once its prefill skips the blocks it found. A seeded
multi-turn workload checks what must hold everywhere (the free-memory bound, determinism).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.mell.models import Migration, Plan
from kvfleet.sim import run as simulator
from kvfleet.sim.hardware import A100_40GB, LLAMA2_13B
from kvfleet.sim.prefix_cache import GpuPrefixCache, PrefixCacheSpec
from kvfleet.sim.result import RunResult
from kvfleet.sim.run import simulate
from kvfleet.sim.speed_model import make_setup
from kvfleet.sim.traces import TraceError, TraceRequest, read_trace, slice_trace

SETUP = make_setup("13b-a100", LLAMA2_13B, A100_40GB)
BPT = SETUP.kv_bytes_per_token
SPEC = PrefixCacheSpec()  # Mooncake's 512-token hash blocks


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# r1 shares its first two hash blocks (1024 tokens) with r0, which finishes before r1 arrives; r2
# shares nothing. All three run, one after the other, on one worker.
THREE = [
    {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 2500, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 9]},
    {"timestamp": 2600, "input_length": 600, "output_length": 10, "hash_ids": [7, 8]},
]


# --- the reader -----------------------------------------------------------------------------------


def test_reader_keeps_hash_ids_in_prompt_order(tmp_path: Path) -> None:
    reqs = read_trace(write_jsonl(tmp_path / "t.jsonl", THREE))
    assert [r.hash_ids for r in reqs] == [(1, 2, 3), (1, 2, 9), (7, 8)]
    # A line without hash_ids has none; a window of the trace keeps them.
    plain = read_trace(write_jsonl(tmp_path / "p.jsonl", [{"timestamp": 0, "input_length": 5, "output_length": 1}]))
    assert plain[0].hash_ids == ()
    assert [r.hash_ids for r in slice_trace(reqs, 2.0, 1.0)] == [(1, 2, 9), (7, 8)]
    assert reqs[0].hashed_tokens(512) == 1200 and reqs[2].hashed_tokens(512) == 600


def test_csv_traces_have_no_hash_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("timestamp,prompt_tokens,output_tokens,hash_ids\n0,100,20,1\n")
    assert read_trace(path)[0].hash_ids == ()


@pytest.mark.parametrize(
    ("hash_ids", "message"),
    [
        ("[1, 2.5]", "t.jsonl:2: hash_ids must be a list of integers"),
        ("[1.0]", "t.jsonl:2: hash_ids must be a list of integers"),
        ("[true]", "t.jsonl:2: hash_ids must be a list of integers"),
        ('["1"]', "t.jsonl:2: hash_ids must be a list of integers"),
        ("7", "t.jsonl:2: hash_ids must be a list of integers"),
        ("null", "t.jsonl:2: hash_ids must be a list of integers"),
        # 1000 tokens are 2 blocks of 512: a third id names a block the prompt does not have.
        ("[1, 2, 3]", "t.jsonl:2: 3 hash_ids for a prompt of 1000 tokens, which has 2 blocks of 512 tokens"),
    ],
)
def test_reader_refuses_bad_hash_ids_naming_file_and_line(tmp_path: Path, hash_ids: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n'
                    f'{{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": {hash_ids}}}\n')
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_hash_block_size_is_a_parameter(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 1000, "output_length": 1,
                                               "hash_ids": [1, 2, 3, 4]}])
    with pytest.raises(TraceError, match="4 hash_ids for a prompt of 1000 tokens"):
        read_trace(path)
    assert read_trace(path, hash_block_tokens=250)[0].hash_ids == (1, 2, 3, 4)
    with pytest.raises(TraceError, match="must be positive"):
        read_trace(path, hash_block_tokens=0)


# --- one worker's cache -----------------------------------------------------------------------------


def test_match_is_the_longest_held_prefix_and_lru_evicts_a_prefix_from_its_end() -> None:
    cache = GpuPrefixCache(kv_bytes_per_token=2)
    cache.insert([1, 2, 3], SPEC.block_tokens(1200, 3))  # 512 + 512 + 176 tokens
    cache.insert([4, 5], SPEC.block_tokens(600, 2))  # 512 + 88
    # Least recently used first: each prompt's last block before its first, the older prompt first.
    assert cache.hash_ids() == [3, 2, 1, 5, 4]
    assert cache.cached_tokens == 1800 and cache.cached_bytes == 3600
    # Block 9 is not held, so block 3 after it cannot be used: a hit stops at the first miss.
    assert cache.match([1, 9, 3], [512, 512, 512]) == 512
    assert cache.hash_ids() == [3, 2, 5, 4, 1]
    # 1800 - 176 (block 3) - 512 (block 2) = 1112 tokens = 2224 bytes <= 2300.
    assert cache.evict_to(2300) == 2
    assert cache.hash_ids() == [5, 4, 1] and cache.cached_tokens == 1112
    assert cache.match([1, 2], [512, 512]) == 512
    assert cache.evict_to(0) == 3 and cache.cached_tokens == 0 and cache.hash_ids() == []


def test_a_hash_held_for_a_partial_block_hits_only_its_tokens() -> None:
    cache = GpuPrefixCache(kv_bytes_per_token=1)
    cache.insert([1, 2], SPEC.block_tokens(600, 2))  # block 2 holds 88 tokens
    assert cache.match([1, 2], [512, 512]) == 600
    cache.insert([1, 2], [512, 512])  # the same hashes, now as whole blocks
    assert cache.cached_tokens == 1024 and cache.match([1, 2], [512, 512]) == 1024


def test_a_host_tier_keeps_evicted_blocks_and_a_match_copies_them_back() -> None:
    # 1 byte a token; the GPU's cache gets 1024 bytes, the host tier 1100.
    cache = GpuPrefixCache(kv_bytes_per_token=1, host_bytes=1100)
    cache.insert([1, 2, 3], [512, 512, 512])
    # Blocks 3 and 2 (least recent first) go to the host tier; 1 stays on the GPU.
    assert cache.evict_to(512) == 2
    assert (cache.cached_tokens, cache.host_tokens) == (512, 1024)
    # A prefix runs on across tiers: 1 on the GPU, then 2 and 3 from the host.
    assert cache.peek([1, 2, 3], [512, 512, 512]) == 1536 and cache.host_tokens == 1024  # peek moves nothing
    assert cache.match([1, 2, 3], [512, 512, 512]) == 1536
    assert (cache.last_host_tokens, cache.cached_tokens, cache.host_tokens) == (1024, 1536, 0)
    # Evicting all three: the host tier keeps the two most recent that fit its 1100 bytes (3 is the
    # least recent, evicted first, and dropped when 1 comes).
    assert cache.evict_to(0) == 3
    assert (cache.cached_tokens, cache.host_tokens) == (0, 1024)
    assert cache.match([1, 2, 3], [512, 512, 512]) == 1024 and cache.last_host_tokens == 1024
    # Without a host tier an evicted block is gone.
    plain = GpuPrefixCache(kv_bytes_per_token=1)
    plain.insert([1], [512])
    plain.evict_to(0)
    assert plain.match([1], [512]) == 0 and plain.host_tokens == 0


# --- the replay -------------------------------------------------------------------------------------


def test_second_request_hits_the_two_blocks_it_shares(tmp_path: Path) -> None:
    reqs = read_trace(write_jsonl(tmp_path / "t.jsonl", THREE))
    r = simulate(reqs, SETUP, "mell", prefix_cache=SPEC)
    # One worker pod ran all three (r0's GPU was let go when it drained; r1 and r2 took its warm pod).
    assert r.peak_gpus == 1 and len(r.pod_lifetimes_s) == 1
    assert (r.prompt_tokens, r.prefix_hit_tokens, r.prefill_tokens_saved, r.num_prefix_hits) == (2900, 1024, 1024, 1)
    assert r.prefix_hit_ratio == 1024 / 2900
    assert r.num_prefix_evictions == 0  # three small prompts leave most of C free
    # Each request's wait is its epoch end less (arrival + prefill of what was not cached): r1
    # prefilled only its 76 uncached tokens, r0 and r2 their whole prompts.
    assert sorted(r.queue_delays_s) == sorted([1.0 - (0.0 + SETUP.prefill_s(1200)),
                                               3.0 - (2.5 + SETUP.prefill_s(1100 - 1024)),
                                               3.0 - (2.6 + SETUP.prefill_s(600))])


def test_a_prompt_tree_sends_a_request_to_the_gpu_holding_its_prefix() -> None:
    # C is 15,408 tokens. a (11,000 tokens, long) runs on gpu-0; b (5,000, 5 out) and d (5,000, long) do
    # not fit beside it and run on gpu-1, where b finishes and leaves blocks 1-10. c (2,000 tokens, blocks
    # 1-4) then fits both GPUs with growth room: by bytes it goes to the fuller gpu-0 (11,000 + 2,000 and
    # a's 1,540-token growth horizon <= C) and finds nothing; with the prompt tree to gpu-1, where its
    # whole prompt is cached (blocks 1-4 hold 512 x 3 + 464 of its tokens, the last cut at its end).
    reqs = [TraceRequest("a", 0.0, 11_000, 2000, tuple(range(100, 122))),
            TraceRequest("b", 1.2, 5000, 5, tuple(range(1, 11))),
            TraceRequest("d", 1.3, 5000, 2000, tuple(range(200, 210))),
            TraceRequest("c", 4.0, 2000, 5, (1, 2, 3, 4))]
    blind = simulate(reqs, SETUP, "mell", prefix_cache=SPEC)
    tree = simulate(reqs, SETUP, "mell", prefix_cache=replace(SPEC, prompt_tree=True))
    assert (blind.prefix_hit_tokens, blind.num_prefix_hits) == (0, 0)
    assert (tree.prefix_hit_tokens, tree.prefill_tokens_saved, tree.num_prefix_hits) == (2000, 1999, 1)
    assert blind.peak_gpus == tree.peak_gpus == 2 and blind.num_migrations == tree.num_migrations == 0
    # The baselines place by bytes alone, the tree or not.
    assert simulate(reqs, SETUP, "bf", prefix_cache=replace(SPEC, prompt_tree=True)).prefix_hit_tokens == 0
    with pytest.raises(ValueError, match="execution='plan' only"):
        simulate(reqs, SETUP, "mell", prefix_cache=replace(SPEC, prompt_tree=True), execution="operator")


def test_a_host_tier_hit_is_copied_back_instead_of_prefilled() -> None:
    # C = 4096 tokens. a (2048 tokens, blocks 1-4) finishes and is cached; b (3800 tokens of other
    # blocks) runs there and leaves under 512 tokens free: all of a's blocks leave GPU memory. c repeats a's prompt after b
    # finished: without a host tier it prefills all 2048 tokens; with one it finds them in host memory
    # and copies 2048 x 800 KiB back over the host link instead.
    small = replace(SETUP, capacity_bytes=4096 * BPT)
    reqs = [TraceRequest("a", 0.0, 2048, 5, (1, 2, 3, 4)), TraceRequest("b", 2.5, 3800, 5, (5, 6, 7, 8, 9, 10, 11, 12)),
            TraceRequest("c", 5.5, 2048, 5, (1, 2, 3, 4))]
    link = 25e9
    plain = simulate(reqs, small, "mell", prefix_cache=SPEC)
    tiered = simulate(reqs, small, "mell", prefix_cache=replace(SPEC, host_bytes=4096 * BPT, host_link_bytes_per_s=link))
    assert len(plain.pod_lifetimes_s) == len(tiered.pod_lifetimes_s) == 1
    assert (plain.prefix_hit_tokens, plain.prefix_host_hit_tokens) == (0, 0)
    assert (tiered.prefix_hit_tokens, tiered.prefix_host_hit_tokens, tiered.prefill_tokens_saved) == (2048, 2048, 2047)
    # c's queueing delay is its epoch end (6.0) less when it could decode: arrival + prefill + copy.
    assert plain.queue_delays_s[2] == pytest.approx(6.0 - (5.5 + SETUP.prefill_s(2048)))
    assert tiered.queue_delays_s[2] == pytest.approx(6.0 - (5.5 + SETUP.prefill_s(1) + 2048 * BPT / link))


def test_a_deleted_pod_takes_its_cache_with_it(tmp_path: Path) -> None:
    # With no scale-down delay r0's pod is deleted the moment its GPU drains: r1 finds nothing.
    reqs = read_trace(write_jsonl(tmp_path / "t.jsonl", THREE))
    r = simulate(reqs, SETUP, "mell", prefix_cache=SPEC, scale_down_delay_s=0.0)
    assert len(r.pod_lifetimes_s) == 2
    assert (r.prefix_hit_tokens, r.num_prefix_hits) == (0, 0)


def test_lru_eviction_gives_way_to_running_kv_from_the_end_of_a_prefix() -> None:
    # C = 4096 tokens. a (3 blocks, 1536 tokens) finishes: cached, LRU first [3, 2, 1]. b (6 blocks,
    # 3072 tokens) is placed there: 1536 cached + 3072 running > 4096, so block 3 goes (1024 cached +
    # 3072 running = C). b finishes: its 6 blocks join (4096 cached, nothing running). c (blocks
    # 1, 2, 3, 10) is placed: it finds 1 and 2 (block 3 is gone), 1024 tokens; then 2048 running
    # leave room for 2048 cached: b's 4 least recent blocks (9, 8, 7, 6) go. 1 + 4 = 5 evictions.
    small = replace(SETUP, capacity_bytes=4096 * BPT)
    reqs = [TraceRequest("a", 0.0, 1536, 5, (1, 2, 3)), TraceRequest("b", 2.5, 3072, 5, (4, 5, 6, 7, 8, 9)),
            TraceRequest("c", 5.5, 2048, 5, (1, 2, 3, 10))]
    r = simulate(reqs, small, "mell", prefix_cache=SPEC)
    assert len(r.pod_lifetimes_s) == 1
    assert (r.prefix_hit_tokens, r.num_prefix_hits, r.num_prefix_evictions) == (1024, 1, 5)
    # Evicting a prefix from its front instead would have left blocks 2 and 3 unusable: no hit at all.


def kv_at(r: RunResult, now_s: float) -> int:
    return r.kv_bytes[r.times_s.index(now_s)]


def test_saved_prefill_starts_decoding_earlier_by_exactly_the_skipped_tokens() -> None:
    # b arrives at 2.0, after a has finished there, and is placed at 3.0; its prefill (1.5 s or more)
    # runs past that, so it decodes from 2.0 + prefill: of 9216 tokens with the cache (2 blocks hit),
    # of all 10240 without. Alone on its GPU from 3.0 to 4.0 it decodes at step_s(1, its prompt).
    reqs = [TraceRequest("a", 0.0, 1024, 5, (1, 2)),
            TraceRequest("b", 2.0, 10_240, 1000, tuple(range(1, 21)))]
    step = SETUP.step_s(1, 10_240 * BPT)
    on = simulate(reqs, SETUP, "mell", prefix_cache=SPEC)
    off = simulate(reqs, SETUP, "mell")
    assert (on.prefix_hit_tokens, on.prefill_tokens_saved) == (1024, 1024)
    assert kv_at(on, 4.0) == int(10_240 + (4.0 - (2.0 + SETUP.prefill_s(9216))) / step) * BPT
    assert kv_at(off, 4.0) == int(10_240 + (4.0 - (2.0 + SETUP.prefill_s(10_240))) / step) * BPT
    assert kv_at(on, 4.0) > kv_at(off, 4.0)
    # Before b's prefill mattered (up to 3.0) the two runs are the same.
    assert on.kv_bytes[:3] == off.kv_bytes[:3] and on.gpus[:3] == off.gpus[:3]


def test_a_full_hit_still_prefills_one_token() -> None:
    reqs = [TraceRequest("a", 0.0, 1024, 5, (1, 2)), TraceRequest("b", 2.5, 1024, 5, (1, 2))]
    r = simulate(reqs, SETUP, "mell", prefix_cache=SPEC)
    assert (r.prefix_hit_tokens, r.prefill_tokens_saved, r.prefix_hit_ratio) == (1024, 1023, 0.5)
    assert sorted(r.queue_delays_s) == sorted([1.0 - SETUP.prefill_s(1024), 3.0 - (2.5 + SETUP.prefill_s(1))])


def test_without_hits_the_cache_model_changes_nothing_else() -> None:
    # No request shares a block: the replay is the one without the model, bar its own counters.
    reqs = [TraceRequest("a", 0.0, 1200, 40, (1, 2, 3)), TraceRequest("b", 0.3, 900, 60, (4, 5)),
            TraceRequest("c", 1.7, 3000, 20, (6, 7, 8, 9, 10, 11))]
    off = simulate(reqs, SETUP, "mell")
    on = simulate(reqs, SETUP, "mell", prefix_cache=SPEC)
    assert on.prompt_tokens == 5100 and on.prefix_hit_tokens == 0
    # The shared bound assumes every hashed block could be cached, so it is the only other change.
    assert on.shared_bound.kv_byte_seconds < off.shared_bound.kv_byte_seconds
    assert (on.shared_same_gpu_tokens, on.shared_pool_tokens) == (0, 0)
    assert replace(on, prefix_cache=False, prompt_tokens=0, running_prompt_tokens=0, shared_bound=off.shared_bound) == off


def test_the_replay_measures_what_counting_shared_blocks_once_would_save() -> None:
    # a and b share their first block (512 tokens) and run together: on one GPU when both fit (1024
    # tokens each), so every epoch 512 of their 2048 running prompt tokens are a second copy; on two GPUs
    # when neither fits beside the other (9000 tokens each, C is 15,408), so only the pool could share it.
    small = [TraceRequest("a", 0.0, 1024, 200, (1, 2)), TraceRequest("b", 0.0, 1024, 200, (1, 3))]
    r = simulate(small, SETUP, "mell", prefix_cache=SPEC)
    assert r.peak_gpus == 1
    epochs = r.running_prompt_tokens // 2048
    assert r.running_prompt_tokens == 2048 * epochs and epochs > 1
    assert r.shared_same_gpu_tokens == r.shared_pool_tokens == 512 * epochs
    assert r.shared_same_gpu_ratio == r.shared_pool_ratio == 0.25
    large = [TraceRequest("a", 0.0, 9000, 200, (1, *range(10, 27))), TraceRequest("b", 0.0, 9000, 200, (1, *range(30, 47)))]
    r = simulate(large, SETUP, "mell", prefix_cache=SPEC)
    assert r.peak_gpus == 2
    assert r.shared_same_gpu_tokens == 0 and r.shared_pool_ratio == 512 / 18_000


def test_off_ignores_hash_ids() -> None:
    reqs = [TraceRequest("a", 0.0, 1024, 5, (1, 2)), TraceRequest("b", 2.5, 1024, 5, (1, 2))]
    bare = [replace(r, hash_ids=()) for r in reqs]
    assert simulate(reqs, SETUP, "mell") == simulate(bare, SETUP, "mell")


# --- the command ------------------------------------------------------------------------------------


def simulate_json(capsys: pytest.CaptureFixture[str], trace: Path, *extra: str) -> dict[str, object]:
    code = main(["simulate", "--trace", str(trace), "--setup", "13b-a100", "--policies", "mell,bf", "--json",
                 "--no-progress", *extra])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert isinstance(payload, dict)
    policies = payload["policies"]
    assert isinstance(policies, dict)
    return policies


def test_cli_reports_hits_and_gpus_with_and_without_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", THREE)
    with_cache = simulate_json(capsys, trace, "--prefix-cache")
    without = simulate_json(capsys, trace)
    for policy in ("mell", "bf"):
        stats = with_cache[policy]
        assert isinstance(stats, dict)
        assert (stats["prompt_tokens"], stats["prefix_hit_tokens"], stats["prefill_tokens_saved"]) == (2900, 1024, 1024)
        assert stats["prefix_hit_ratio"] == round(1024 / 2900, 4)
        assert (stats["peak_gpus"], stats["mean_gpus"]) == (1, 0.5)
        plain = without[policy]
        assert isinstance(plain, dict)
        assert "prefix_hit_ratio" not in plain and (plain["peak_gpus"], plain["mean_gpus"]) == (1, 0.5)


def test_cli_off_output_is_the_same_with_or_without_hash_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hashed = write_jsonl(tmp_path / "h.jsonl", THREE)
    bare = write_jsonl(tmp_path / "b.jsonl", [{k: v for k, v in row.items() if k != "hash_ids"} for row in THREE])
    assert simulate_json(capsys, hashed) == simulate_json(capsys, bare)
    assert main(["simulate", "--trace", str(hashed), "--setup", "13b-a100", "--policies", "mell", "--no-progress"]) == 0
    assert "prefix_hit" not in capsys.readouterr().out


def test_cli_table_and_csv_show_the_hit_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", THREE)
    assert main(["simulate", "--trace", str(trace), "--setup", "13b-a100", "--policies", "mell", "--no-progress",
                 "--prefix-cache", "--csv", str(tmp_path / "out.csv")]) == 0
    header, _, row = capsys.readouterr().out.splitlines()
    assert header.split()[-2:] == ["prefix_hit", "prefill_saved_tokens"]
    assert row.split()[-2:] == [f"{1024 / 2900:.1%}", "1024"]
    lines = (tmp_path / "out.csv").read_text().splitlines()
    assert lines[0].endswith(",prefix_hit,prefill_saved_tokens")
    assert lines[1].endswith(f",{1024 / 2900:.4f},1024")


def test_cli_refuses_bad_prefix_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", THREE)
    base = ["simulate", "--trace", str(trace), "--setup", "13b-a100", "--policies", "mell", "--no-progress"]
    assert main([*base, "--prefix-cache", "--trace-length-scale", "2"]) == 2
    assert "--trace-length-scale cannot be used with --prefix-cache" in capsys.readouterr().err
    assert main([*base, "--hash-block-tokens", "0"]) == 2
    assert "--hash-block-tokens 0: must be positive" in capsys.readouterr().err
    assert main([*base, "--prefix-routing", "prompt-tree"]) == 2
    assert "--prefix-routing needs --prefix-cache" in capsys.readouterr().err
    assert main([*base, "--prefix-cache", "--prefix-routing", "prompt-tree", "--execution", "operator"]) == 2
    assert "--prefix-routing prompt-tree is modelled with --execution plan only" in capsys.readouterr().err
    assert main([*base, "--prefix-host-gib", "4"]) == 2
    assert "--prefix-host-gib needs --prefix-cache" in capsys.readouterr().err
    assert main([*base, "--prefix-cache", "--prefix-host-gib", "-1"]) == 2
    assert "--prefix-host-gib must be >= 0" in capsys.readouterr().err
    # With a host tier the JSON says what it held.
    stats = simulate_json(capsys, trace, "--prefix-cache", "--prefix-host-gib", "4")["mell"]
    assert isinstance(stats, dict) and stats["prefix_host_hit_tokens"] == 0 and stats["prefix_hit_tokens"] == 1024
    # With blocks of 256 tokens, 1200 tokens are 5 blocks: three ids still fit, and r1 then hits 512.
    stats = simulate_json(capsys, trace, "--prefix-cache", "--hash-block-tokens", "256")["mell"]
    assert isinstance(stats, dict) and stats["prefix_hit_tokens"] == 512


def sessions_workload(num_requests: int, seed: int) -> list[TraceRequest]:
    """Multi-turn sessions: every prompt starts with one of two system prompts (2 blocks), then its
    session's history (each turn's prompt extends the last), then a new block."""
    rng = random.Random(seed)
    next_id = 100
    histories: list[tuple[int, ...]] = []
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(num_requests):
        t += rng.expovariate(2.0)
        if not histories or rng.random() < 0.3:
            histories.append((rng.randrange(2) * 2, rng.randrange(2) * 2 + 1))  # system prompt 0,1 or 2,3
        k = rng.randrange(len(histories))
        hashes = histories[k] + (next_id,)
        next_id += 1
        histories[k] = hashes
        if len(hashes) > 8:  # the session ends
            histories.pop(k)
        out.append(TraceRequest(f"r{i}", t, 512 * len(hashes) - rng.randrange(256), rng.randrange(20, 300), hashes))
    return out


@pytest.mark.parametrize("policy", ["mell", "bf", "lb"])
def test_a_request_only_finds_blocks_kept_in_free_memory(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MemServe keeps history only where running requests leave memory free: whenever a request looks
    its prefix up, its worker's cached + running KV is within C (blocks that finished alongside running
    requests were already evicted), and so it is at every epoch end."""
    small = replace(SETUP, capacity_bytes=8192 * BPT)
    checked: list[int] = []

    def running_bytes(replay: simulator._Replay, gpu_id: str) -> int:
        return sum(int(replay.live[r].req.prompt_tokens + replay.live[r].generated)
                   for r in replay.on_gpu.get(gpu_id, {})) * BPT

    def check(replay: simulator._Replay) -> None:
        for gpu_id, pod in replay.pods.items():
            if pod.prefix_cache is not None and pod.prefix_cache.cached_bytes:
                assert pod.prefix_cache.cached_bytes + running_bytes(replay, gpu_id) <= small.capacity_bytes
                checked.append(pod.prefix_cache.cached_bytes)

    match = simulator._Replay._match_prefix
    record = simulator._Replay.record_epoch

    def checked_match(replay: simulator._Replay, m: simulator._Live, gpu_id: str) -> None:
        check(replay)
        match(replay, m, gpu_id)

    def checked_record(replay: simulator._Replay, plan: Plan, now_s: float, moves: tuple[Migration, ...] | None = None) -> None:
        check(replay)
        record(replay, plan, now_s, moves)

    monkeypatch.setattr(simulator._Replay, "_match_prefix", checked_match)
    monkeypatch.setattr(simulator._Replay, "record_epoch", checked_record)
    r = simulate(sessions_workload(200, seed=1), small, policy, prefix_cache=SPEC)
    assert checked and r.num_prefix_evictions > 0 and r.num_prefix_hits > 0


def test_the_cache_model_is_deterministic_across_hash_seeds() -> None:
    """Blocks enter a cache in the order requests finished, never in a set's order (which follows
    PYTHONHASHSEED): the same workload gives the same hits and evictions in every process."""
    code = ("from tests.sim.test_prefix_cache_sim import *\n"
            "r = simulate(sessions_workload(200, seed=1), replace(SETUP, capacity_bytes=8192 * BPT), 'mell', "
            "prefix_cache=SPEC)\n"
            "print(r.prefix_hit_tokens, r.num_prefix_evictions, r.queue_delays_s)\n")
    root = Path(__file__).resolve().parents[2]
    outs = {subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout for seed in ("1", "2", "3")}
    assert len(outs) == 1
