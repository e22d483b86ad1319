"""The contract both engines share (EngineConfig) and each engine's own options: a vLLM worker is never
handed a setting it would ignore, neither through `load_engine` nor through the worker's flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.worker.__main__ import builtin_options, parse_args, vllm_options
from kvfleet.worker.distkv.options import DistKVOptions
from kvfleet.worker.elastic.options import DEFAULT_CHUNK_BYTES, MemoryOptions
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import EngineError
from kvfleet.worker.engines.builtin.options import BuiltinOptions
from kvfleet.worker.engines.vllm.options import VLLMOptions


@pytest.mark.parametrize("options", [BuiltinOptions(memory=MemoryOptions(budget_bytes=2**26, elastic=True)),
                                     BuiltinOptions(memory=MemoryOptions(budget_bytes=2**26, cpu_buffer_bytes=2**26)),
                                     BuiltinOptions(attention="distattention"),
                                     BuiltinOptions(distkv=DistKVOptions(lend_cap_bytes=2**20))])
def test_the_vllm_engine_refuses_the_builtin_engines_settings_with_the_reason(options: BuiltinOptions) -> None:
    with pytest.raises(EngineError, match="need the builtin engine"):
        load_engine("vllm", EngineConfig(model_path=Path("/nonexistent")), options)


def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize(("flags", "named"), [
    (["--lend-cap-bytes", "4096"], "--lend-cap-bytes needs --attention distattention"),
    (["--attention", "distattention", "--lend-cap-bytes", "4096", "--elastic-memory", "--memory-budget-bytes", "8388608"],
     "DistKV lending and borrowing need a static"),
    (["--attention", "distattention", "--distkv", "--prefix-caching"], "never shared prefix blocks")])
def test_the_worker_refuses_what_vllm_workers_do_not_run_with_the_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), *flags])
    assert named in capsys.readouterr().err


def test_a_vllm_worker_lends_with_distattention(tmp_path: Path) -> None:
    args = parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), "--attention", "distattention",
                       "--lend-cap-bytes", "4096"])
    assert vllm_options(args) == VLLMOptions(attention="distattention", distkv=DistKVOptions(lend_cap_bytes=4096))
    borrowing = parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), "--attention", "distattention",
                            "--distkv", "--lend-cap-bytes", "4096"])
    assert vllm_options(borrowing).distkv == DistKVOptions(lend_cap_bytes=4096, borrow=True)


def test_the_worker_runs_vllm_with_distattention_when_asked(tmp_path: Path) -> None:
    base = ["--engine", "vllm", "--model-path", str(model_dir(tmp_path))]
    assert vllm_options(parse_args(base)).attention == "vllm"
    assert vllm_options(parse_args([*base, "--attention", "sdpa"])).attention == "vllm"
    assert vllm_options(parse_args([*base, "--attention", "distattention"])).attention == "distattention"


def test_vllm_options_refuse_an_unknown_attention() -> None:
    with pytest.raises(ValueError, match="attention must be one of vllm, distattention"):
        VLLMOptions(attention="flash")  # type: ignore[arg-type]


@pytest.mark.parametrize("flags", [["--cpu-buffer-bytes", "4096"], ["--ttft-slo-ms", "500"], ["--tpot-slo-ms", "50"]])
def test_the_worker_takes_a_cpu_buffer_and_its_objectives_with_elastic_vllm_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), "--memory-budget-bytes", "8388608", *flags])
    assert f"{flags[0]} needs --elastic-memory" in capsys.readouterr().err
    args = parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), "--memory-budget-bytes", "8388608",
                       "--elastic-memory", "--cpu-buffer-bytes", "4096", *flags])
    memory = vllm_options(args).memory
    assert memory is not None and memory.elastic and memory.cpu_buffer_bytes == 4096
    assert (memory.ttft_slo_s, memory.tpot_slo_s) == ((0.5 if "--ttft-slo-ms" in flags else None),
                                                      (0.05 if "--tpot-slo-ms" in flags else None))


def test_the_worker_refuses_a_kv_capacity_and_a_memory_budget_together_with_the_vllm_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), "--memory-budget-bytes", "8388608",
                    "--kv-capacity-bytes", "4194304"])
    assert "--kv-capacity-bytes and --memory-budget-bytes" in capsys.readouterr().err
    # The builtin engine takes both (its budget holds the KV cache it is given).
    parse_args(["--engine", "builtin", "--model-path", str(model_dir(tmp_path)), "--memory-budget-bytes", "8388608",
                "--kv-capacity-bytes", "4194304"])


def test_the_vllm_engines_memory_flags_become_its_options(tmp_path: Path) -> None:
    args = parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), "--memory-budget-bytes", "8388608",
                       "--elastic-memory", "--memory-chunk-bytes", "4194304"])
    assert vllm_options(args) == VLLMOptions(
        memory=MemoryOptions(budget_bytes=8388608, elastic=True, chunk_bytes=4194304))
    static = parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), "--memory-budget-bytes", "8388608"])
    assert vllm_options(static) == VLLMOptions(
        memory=MemoryOptions(budget_bytes=8388608, elastic=False, chunk_bytes=DEFAULT_CHUNK_BYTES))
    plain = parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path))])
    assert vllm_options(plain) == VLLMOptions()


def test_the_worker_still_needs_a_budget_for_elastic_memory_with_the_vllm_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), "--elastic-memory"])
    assert "--elastic-memory needs --memory-budget-bytes" in capsys.readouterr().err


def test_the_builtin_engines_flags_become_its_options(tmp_path: Path) -> None:
    args = parse_args(["--engine", "builtin", "--model-path", str(model_dir(tmp_path)), "--memory-budget-bytes", "8388608",
                       "--elastic-memory", "--cpu-buffer-bytes", "4096", "--tpot-slo-ms", "50",
                       "--attention", "distattention", "--lend-cap-bytes", "2048"])
    assert builtin_options(args) == BuiltinOptions(
        attention="distattention",
        memory=MemoryOptions(budget_bytes=8388608, elastic=True, chunk_bytes=DEFAULT_CHUNK_BYTES, cpu_buffer_bytes=4096,
                             tpot_slo_s=0.05),
        distkv=DistKVOptions(lend_cap_bytes=2048))
    plain = parse_args(["--model-path", str(model_dir(tmp_path))])
    assert builtin_options(plain) == BuiltinOptions()
