"""The pydantic models of the CRDs: the committed YAML is theirs, and they refuse what the server refuses."""

from __future__ import annotations

import argparse
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet.api import generate
from kvfleet.api.models import KVMigrationSpec, LLMPoolSpec
from kvfleet.api.quantity import format_bytes, parse_quantity, quantity_bytes

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crds_match_the_models(capsys: pytest.CaptureFixture[str]) -> None:
    code = generate.run(argparse.Namespace(dir=ROOT / "crds", check=True))
    assert code == 0, "crds/ is stale: run `kvfleet crds`\n" + capsys.readouterr().out


def test_check_reports_a_hand_edit(tmp_path: Path) -> None:
    assert generate.run(argparse.Namespace(dir=tmp_path, check=False)) == 0
    path = tmp_path / "llmpools.yaml"
    path.write_text(path.read_text().replace("maximum: 16", "maximum: 17"))
    assert generate.run(argparse.Namespace(dir=tmp_path, check=True)) == 1


@pytest.mark.parametrize(
    ("text", "value"),
    [("40Gi", Decimal(40 * 2**30)), ("500M", Decimal(500 * 10**6)), ("1.5G", Decimal(15 * 10**8)), ("100m", Decimal("0.1")),
     ("1e3", Decimal(1000)), ("7", Decimal(7)), (3, Decimal(3))],
)
def test_parse_quantity(text: str | int, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["fast", "10 Gi", "Gi", "1.2.3G", "10GB", ""])
def test_parse_quantity_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


def test_bytes_round_up_and_format() -> None:
    assert quantity_bytes("1500m") == 2
    assert format_bytes(10 * 2**30) == "10Gi"
    assert format_bytes(1000) == "1000"


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": {"name": "tiny", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "10Gi"}}
    base.update(overrides)
    return base


def test_example_parses_and_derives_capacity() -> None:
    example = yaml.safe_load((ROOT / "examples" / "llmpool.yaml").read_text())
    pool = LLMPoolSpec.model_validate(example["spec"])
    # 40Gi x (1 - 0.1) - 26Gi, as the example's comment says.
    assert pool.kv_capacity_per_worker_bytes() == int(40 * 2**30 * 0.9) - 26 * 2**30
    assert pool.scheduling.policy == "mell" and pool.workers.max == 8


def test_given_capacity_wins() -> None:
    assert LLMPoolSpec.model_validate(spec()).kv_capacity_per_worker_bytes() == 10 * 2**30


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"workers": {"min": 5, "max": 2}}, "workers.min must be less than or equal to workers.max"),
        ({"replicas": 9}, "replicas must not exceed workers.max"),
        ({"capacity": {"gpuMemory": "24Gi"}}, "set capacity.kvCapacityPerWorker"),
        ({"capacity": {"gpuMemory": "24Gi", "modelWeights": "23Gi"}}, "leave no room"),
        ({"capacity": {"gpuMemory": "24Gi", "kvCapacityPerWorker": "30Gi"}}, "exceeds capacity.gpuMemory"),
        ({"capacity": {"kvCapacityPerWorker": "-1Gi"}}, "must be a positive quantity"),
        ({"engine": "tensorrt"}, "engine"),
        ({"model": {"name": "tiny", "path": "relative"}}, "path"),
        ({"model": {"name": "t", "path": "/m", "volume": {}}}, "exactly one of persistentVolumeClaim or hostPath"),
        ({"surprise": 1}, "Extra inputs are not permitted"),
        ({"slo": {"tpotMilliseconds": 30}}, "needs slo.gpuMemoryBandwidth and capacity.modelWeights"),
        ({"capacity": {"gpuMemory": "40Gi", "modelWeights": "26G"}, "scheduling": {"policy": "best-fit"},
          "slo": {"tpotMilliseconds": 30, "gpuMemoryBandwidth": "1555G"}}, "kept by the default policy"),
        ({"capacity": {"gpuMemory": "40Gi", "modelWeights": "26G"},
          "slo": {"tpotMilliseconds": 10, "gpuMemoryBandwidth": "1555G"}}, "below one request's decode step"),
        ({"slo": {"tpotMilliseconds": 0}}, "greater than 0"),
    ],
)
def test_spec_refuses_what_the_api_server_refuses(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        LLMPoolSpec.model_validate(spec(**overrides))


def test_a_tpot_objective_becomes_the_default_policys_load_cap() -> None:
    from kvfleet.api.scheduling import scheduler_config

    pool = LLMPoolSpec.model_validate(spec(capacity={"gpuMemory": "40Gi", "modelWeights": "26G"},
                                           slo={"tpotMilliseconds": 30, "gpuMemoryBandwidth": "1555G"}))
    config = scheduler_config(pool)
    # step = (26e9 + KV) / (1555e9 x 0.8) + 200 us x n <= 30 ms  <=>  KV + n x 248.8e6 <= 11.32e9.
    assert (config.max_load_bytes, config.load_bytes_per_request) == (11_320_000_000, 248_800_000)
    assert scheduler_config(LLMPoolSpec.model_validate(spec())).max_load_bytes is None


def test_migration_needs_two_pods() -> None:
    base = {"pool": "p", "requestId": "r", "sourcePod": "a", "targetPod": "b", "mode": "kv", "reason": "Depart"}
    assert KVMigrationSpec.model_validate(base).target_pod == "b"
    with pytest.raises(ValidationError, match="targetPod must differ"):
        KVMigrationSpec.model_validate(base | {"targetPod": "a"})


@pytest.mark.parametrize("mode", ["kv", "token", "hybrid"])
def test_migration_modes_include_hybrid(mode: str) -> None:
    base = {"pool": "p", "requestId": "r", "sourcePod": "a", "targetPod": "b", "mode": mode, "reason": "Update"}
    assert KVMigrationSpec.model_validate(base).mode == mode
    with pytest.raises(ValidationError):
        KVMigrationSpec.model_validate(base | {"mode": "adaptive"})  # the pool chooses; a migration is one mode


def test_move_modes_have_one_definition_and_the_pool_policy_forces_one_of_them() -> None:
    from typing import get_args

    from kvfleet.api.models import MovePolicy
    from kvfleet.mell.migration import MoveMode

    base = {"pool": "p", "requestId": "r", "sourcePod": "a", "targetPod": "b", "mode": "hybrid", "reason": "Update"}
    parsed = KVMigrationSpec.model_validate(base)
    assert parsed.mode is MoveMode.HYBRID and parsed.model_dump(mode="json", by_alias=True)["mode"] == "hybrid"
    assert set(get_args(MovePolicy)) - {"adaptive"} <= {m.value for m in MoveMode}
