"""Whole stacks in the simulator (`kvfleet simulate --stack`): the capacity each gives a GPU, and the CLI."""

from __future__ import annotations

import json

import pytest

from kvfleet.cli import main
from kvfleet.sim import bundled
from kvfleet.sim.hardware import A100_40GB, GIB, LLAMA2_7B, LLAMA2_13B, RTX4090_24GB, step_activation_bytes
from kvfleet.sim.stacks import STACKS, activation_reserve_bytes, capacity_setup, parse_stacks, prepare

CONV = bundled.trace_dir() / "AzureLLMInferenceTrace_conv.csv"


def test_activations_are_the_vllm_workers_model() -> None:
    """The simulator sizes a step's activations as the elastic vLLM worker charges them (its ActivationModel)."""
    elastic = pytest.importorskip("kvfleet.worker.engines.vllm.elastic")
    for model in (LLAMA2_7B, LLAMA2_13B):
        worker = elastic.ActivationModel.of_config(model.hidden_size, model.intermediate_size, model.num_heads,
                                                   model.num_kv_heads, model.head_dim, model.vocab_size,
                                                   model.dtype_bytes)
        for tokens, sequences in ((1, 1), (256, 256), (2048, 256)):
            assert step_activation_bytes(model, tokens, sequences) == worker.charge(tokens, sequences)


def test_vllm_static_split_reserves_its_profiling_step_and_elastic_only_a_decode_step() -> None:
    # LLaMA-2-13B: 175,104 B a token and 32,000 x 6 B a sequence (by hand from the formula).
    assert step_activation_bytes(LLAMA2_13B, 1, 0) == 175_104
    assert step_activation_bytes(LLAMA2_13B, 0, 1) == 192_000
    static = activation_reserve_bytes(LLAMA2_13B, A100_40GB, "static")
    elastic = activation_reserve_bytes(LLAMA2_13B, A100_40GB, "elastic")
    assert static == 4 * GIB + 2048 * 175_104 + 256 * 192_000
    assert elastic == 4 * GIB + 256 * 175_104 + 256 * 192_000
    for model, gpu in ((LLAMA2_13B, A100_40GB), (LLAMA2_7B, RTX4090_24GB)):
        c_static = capacity_setup("s", model, gpu, "static").capacity_bytes
        c_elastic = capacity_setup("s", model, gpu, "elastic").capacity_bytes
        assert c_static < c_elastic
        block = 16 * model.kv_bytes_per_token
        # What elastic memory adds is the profiling step's activations less a decode step's, in whole blocks.
        assert abs((c_elastic - c_static) - step_activation_bytes(model, 2048 - 256, 0)) < block
    with pytest.raises(ValueError):
        activation_reserve_bytes(LLAMA2_13B, A100_40GB, "dynamic")


def test_stacks_parse_and_prepare() -> None:
    assert [s.name for s in parse_stacks("today, kvfleet,today")] == ["today", "kvfleet"]
    with pytest.raises(ValueError, match="unknown stack nope"):
        parse_stacks("today,nope")
    today = prepare(STACKS["today"], "13b-a100", LLAMA2_13B, A100_40GB, scale_down_delay_s=60, hpa_target=0.7)
    # Today's replica goes once drained; its HPA waits the pool's delay before scaling down.
    assert today.scale_down_delay_s == 0 and today.config.stabilization_s == 60  # type: ignore[attr-defined]
    assert today.config.target_utilization == 0.7  # type: ignore[attr-defined]
    kvfleet = prepare(STACKS["kvfleet"], "13b-a100", LLAMA2_13B, A100_40GB, scale_down_delay_s=60, tpot_ms=60)
    assert kvfleet.scale_down_delay_s == 60 and kvfleet.config.max_load_bytes is not None  # type: ignore[attr-defined]
    # kvfleet runs its policy as a live operator does (no output budgets); kvfleet+budgets as the default has it.
    assert kvfleet.config.growth_estimate == "pool"  # type: ignore[attr-defined]
    budgets = prepare(STACKS["kvfleet+budgets"], "13b-a100", LLAMA2_13B, A100_40GB, scale_down_delay_s=60)
    assert budgets.config.growth_estimate == "per-request"  # type: ignore[attr-defined]
    assert kvfleet.setup.capacity_bytes > today.setup.capacity_bytes


def test_simulate_stacks_names_each_result_after_its_stack(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--trace", str(CONV), "--window", "600:120", "--setup", "13b-a100", "--json",
                 "--no-progress", "--stack", "today,kvfleet-static,kvfleet"])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    stacks = payload["policies"]
    assert list(stacks) == ["today", "kvfleet-static", "kvfleet"]
    assert stacks["today"]["migrations_per_s"] == 0  # today never migrates
    assert stacks["kvfleet"]["scale_down_delay_s"] == 60 and stacks["today"]["scale_down_delay_s"] == 0
    for figures in stacks.values():
        assert figures["billed_gpu_hours"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--stack", "today", "--policies", "mell"], "drop --policies"),
    (["--stack", "today", "--paper-strict"], "drop --paper-strict"),
    (["--stack", "yesterday"], "unknown stack yesterday"),
    (["--stack", "today", "--hpa-target", "1.2"], "--hpa-target must be in (0, 1]"),
])
def test_bad_stack_flags_are_refused(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["simulate", "--no-progress", "--trace", str(CONV), "--window", "0:10", *args]) == 2
    assert message in capsys.readouterr().err
