"""Trace readers: the Azure CSV, generic CSV, JSONL, the synthetic Poisson workloads, and bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from pathlib import Path

import pytest

from kvfleet.sim import bundled
from kvfleet.sim.traces import TraceError, long_context_workload, poisson_workload, read_trace, slice_trace

TRACES = bundled.trace_dir()


def test_reads_the_azure_conversation_trace() -> None:
    reqs = read_trace(TRACES / "AzureLLMInferenceTrace_conv.csv")
    assert len(reqs) == 19_366
    assert reqs[0].arrival_s == 0.0 and (reqs[0].prompt_tokens, reqs[0].output_tokens) == (374, 44)
    assert reqs[1].arrival_s == pytest.approx(4.3145790, abs=1e-5)  # 18:15:50.9951690 - 18:15:46.6805900
    assert 3400 < reqs[-1].arrival_s < 3600  # 58 minutes
    window = slice_trace(reqs, 60.0, 30.0)
    assert window and all(0 <= r.arrival_s < 30 for r in window)


def test_reads_jsonl_in_milliseconds(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 2500, "input_length": 10, "output_length": 3},
            {"timestamp": 1000, "input_length": 7, "output_length": 9}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = read_trace(path)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [(0.0, 7, 9), (1.5, 10, 3)]


def test_reads_a_generic_csv(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("timestamp,prompt_tokens,output_tokens\n0.5,100,20\n2,50,5\n")
    reqs = read_trace(path)
    assert [(r.arrival_s, r.prompt_tokens) for r in reqs] == [(0.0, 100), (1.5, 50)]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.csv", "", "empty file"),
        ("b.csv", "when,prompt,output\n1,2,3\n", "no timestamp column"),
        ("c.csv", "timestamp,prompt,output\n1,lots,3\n", "c.csv:2: prompt 'lots' is not a number"),
        ("d.csv", "timestamp,prompt,output\nyesterday,1,3\n", "cannot read timestamp"),
        ("e.csv", "timestamp,prompt,output\n1,2\n", "e.csv:2: expected 3 fields"),
        ("f.csv", "timestamp,prompt,output\n", "no requests"),
        ("g.jsonl", '{"timestamp": 1, "input_length": 2}\n', "g.jsonl:1: missing field 'output_length'"),
        ("h.jsonl", "{not json\n", "h.jsonl:1: not JSON"),
        ("i.jsonl", '{"timestamp": "soon", "input_length": 2, "output_length": 1}\n', "timestamp must be a number"),
        ("j.jsonl", '{"timestamp": 1, "input_length": -2, "output_length": 1}\n', "whole number >= 0"),
    ],
)
def test_bad_files_are_refused_with_file_and_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_trace(path)


def test_missing_file() -> None:
    with pytest.raises(TraceError, match="no such file"):
        read_trace(Path("/nonexistent/trace.csv"))


def test_poisson_workload_is_seeded_and_scaled() -> None:
    a = poisson_workload(1.1, 600, seed=3)
    assert a == poisson_workload(1.1, 600, seed=3)
    assert a != poisson_workload(1.1, 600, seed=4)
    assert 500 < len(a) < 820  # about 660 arrivals
    assert all(r.prompt_tokens + r.output_tokens <= 40_960 for r in a)  # 4096-token context x10
    lmsys = poisson_workload(2.0, 2000, lengths="lmsys", scale=1.0, seed=1)
    mean_out = sum(r.output_tokens for r in lmsys) / len(lmsys)
    assert 150 < mean_out < 280  # LMSYS-Chat-1M: 214.5
    with pytest.raises(ValueError):
        poisson_workload(1.0, 10, lengths="reddit")


def test_unsorted_and_duplicate_timestamps_are_replayed_in_time_order(tmp_path: Path) -> None:
    # Documented handling, not an error: time order, ties in the file's order, extra columns ignored.
    path = tmp_path / "t.csv"
    path.write_text("timestamp,prompt,output,user\n3,30,1,x\n1,10,1,y\n3,31,1,z\n1,11,1,w\n")
    reqs = read_trace(path)
    assert [(r.arrival_s, r.prompt_tokens) for r in reqs] == [(0.0, 10), (0.0, 11), (2.0, 30), (2.0, 31)]


def test_a_request_longer_than_the_models_context_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 3000, "output_length": 96, "extra": [1]},
            {"timestamp": 5, "input_length": 4000, "output_length": 97}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert len(read_trace(path)) == 2  # no limit by default: requests larger than C span GPUs
    assert len(read_trace(path, max_context_tokens=4097)) == 2
    with pytest.raises(TraceError, match=r"t.jsonl:2: prompt 4000 \+ output 97 tokens exceed the model's context of 4096"):
        read_trace(path, max_context_tokens=4096)
    # Lengths are checked as replayed: a prompt of 0 counts as 1 token (and is reported so).
    empty_prompt = tmp_path / "e.jsonl"
    empty_prompt.write_text(json.dumps({"timestamp": 0, "input_length": 0, "output_length": 4096}) + "\n")
    with pytest.raises(TraceError, match=r"e.jsonl:1: prompt 1 \+ output 4096"):
        read_trace(empty_prompt, max_context_tokens=4096)


def test_long_context_workload_matches_its_stated_shape() -> None:
    reqs = long_context_workload(3.0, 2000.0, seed=1)
    assert reqs == long_context_workload(3.0, 2000.0, seed=1)
    assert 5400 < len(reqs) < 6600  # about 6000 arrivals
    prompts = sorted(r.prompt_tokens for r in reqs)
    mean = sum(prompts) / len(prompts)
    p99 = prompts[int(0.99 * len(prompts))]
    assert 10_500 < mean < 13_500 and 65_000 < p99 < 105_000  # mean 12K, p99 85K
    assert 300 < sum(r.output_tokens for r in reqs) / len(reqs) < 400  # mean 350
    # About a quarter of the prompts alone exceed C of LLaMA-2-13B on an A100-40GB (15,408 tokens).
    assert 0.18 < sum(p > 15_408 for p in prompts) / len(prompts) < 0.30


def test_the_shipped_azure_traces_are_the_datasets_bytes() -> None:
    """kvfleet ships the two Azure traces (CC BY 4.0, attribution beside them) so a plain clone or a
    wheel runs `kvfleet simulate` and the demo; an edited or truncated copy fails here."""
    for name in bundled.AZURE_TRACES:
        path = bundled.bundled_dir() / name
        assert bundled.sha256_of(path) == bundled.SHA256[name], name
    assert "CC BY 4.0" in (bundled.bundled_dir() / "README.md").read_text()
    assert len(read_trace(bundled.bundled_dir() / bundled.CODE)) == 8819


# sha256 of the release's conversation_trace.jsonl (traces_data/README.md): the .gz holds it unchanged.
MOONCAKE_JSONL_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def test_the_shipped_mooncake_trace_is_the_releases_bytes() -> None:
    """The Mooncake conversation trace ships gzip-compressed (Apache 2.0, licence beside it); the .gz
    and the bytes inside it are the ones traces_data/README.md names."""
    path = bundled.mooncake_conversation()
    assert path == bundled.bundled_dir() / bundled.MOONCAKE_CONV
    assert bundled.sha256_of(path) == bundled.SHA256[bundled.MOONCAKE_CONV]
    assert hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest() == MOONCAKE_JSONL_SHA256
    assert "Apache License" in (bundled.bundled_dir() / "LICENSE-Mooncake-Apache-2.0.txt").read_text()
    readme = (bundled.bundled_dir() / "README.md").read_text()
    assert MOONCAKE_JSONL_SHA256 in readme and bundled.SHA256[bundled.MOONCAKE_CONV] in readme


def test_reads_the_mooncake_conversation_trace() -> None:
    reqs = read_trace(bundled.mooncake_conversation())
    assert len(reqs) == 12_031
    assert reqs[0].arrival_s == 0.0 and 3400 < reqs[-1].arrival_s < 3600  # one hour
    assert all(r.hash_ids for r in reqs)
    first = reqs[0]  # {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, ..., 13]}
    assert (first.prompt_tokens, first.output_tokens, first.hash_ids) == (6758, 500, tuple(range(14)))
    assert len(first.hash_ids) == math.ceil(first.prompt_tokens / 512)


def test_mooncake_trace_ignores_kvfleet_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_TRACES", str(tmp_path))
    assert bundled.mooncake_conversation() == bundled.bundled_dir() / bundled.MOONCAKE_CONV


@pytest.mark.parametrize("suffix", [".jsonl", ".ndjson", ".json", ".JSONL"])
def test_gzip_jsonl_reads_like_its_uncompressed_twin(tmp_path: Path, suffix: str) -> None:
    text = "\n".join(json.dumps(r) for r in [
        {"timestamp": 2500, "input_length": 1030, "output_length": 3, "hash_ids": [7, 8, 9]},
        {"timestamp": 1000, "input_length": 7, "output_length": 9},
        {"timestamp": 1000, "input_length": 600, "output_length": 1, "hash_ids": [7]},
    ]) + "\n\n"
    plain, packed = tmp_path / f"t{suffix}", tmp_path / f"t{suffix}.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    expected = read_trace(plain)
    assert read_trace(packed) == expected and len(expected) == 3
    assert [r.hash_ids for r in expected] == [(), (7,), (7, 8, 9)]


def test_gzip_errors_name_the_file(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(b"not gzip at all\n")
    with pytest.raises(TraceError, match=r"corrupt\.jsonl\.gz: not a readable gzip file"):
        read_trace(corrupt)
    truncated = tmp_path / "truncated.jsonl.gz"
    truncated.write_bytes(gzip.compress(b'{"timestamp": 0, "input_length": 1, "output_length": 1}\n' * 50)[:-12])
    with pytest.raises(TraceError, match=r"truncated\.jsonl\.gz: not a readable gzip file"):
        read_trace(truncated)
    # A line's error inside a gzip still names the file and line.
    bad_line = tmp_path / "bad.jsonl.gz"
    bad_line.write_bytes(gzip.compress(b'{"timestamp": 0, "input_length": 1, "output_length": 1}\n{not json\n'))
    with pytest.raises(TraceError, match=r"bad\.jsonl\.gz:2: not JSON"):
        read_trace(bad_line)
    csv_gz = tmp_path / "t.csv.gz"
    csv_gz.write_bytes(gzip.compress(b"timestamp,prompt,output\n0,1,1\n"))
    with pytest.raises(TraceError, match=r"t\.csv\.gz: only JSONL traces may be gzip-compressed"):
        read_trace(csv_gz)


def test_kvfleet_traces_names_another_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_TRACES", str(tmp_path))
    assert bundled.trace_dir() == tmp_path and bundled.trace_path() == tmp_path / bundled.CONV
    monkeypatch.delenv("KVFLEET_TRACES")
    assert bundled.trace_dir() == bundled.bundled_dir()
