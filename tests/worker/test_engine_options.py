"""The contract both engines share (EngineConfig) and the builtin engine's own options: a vLLM worker is
never handed a setting it would ignore, neither through `load_engine` nor through the worker's flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.worker.__main__ import builtin_options, parse_args
from kvfleet.worker.distkv.options import DistKVOptions
from kvfleet.worker.elastic.options import DEFAULT_CHUNK_BYTES, MemoryOptions
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import EngineError
from kvfleet.worker.engines.builtin.options import BuiltinOptions


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


@pytest.mark.parametrize(("flags", "named"), [(["--elastic-memory", "--memory-budget-bytes", "1000000"], "--elastic-memory"),
                                              (["--cpu-buffer-bytes", "4096"], "--cpu-buffer-bytes"),
                                              (["--attention", "distattention"], "--attention distattention"),
                                              (["--lend-cap-bytes", "4096"], "--lend-cap-bytes")])
def test_the_worker_refuses_builtin_flags_with_the_vllm_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               flags: list[str], named: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--engine", "vllm", "--model-path", str(model_dir(tmp_path)), *flags])
    assert named in capsys.readouterr().err


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
