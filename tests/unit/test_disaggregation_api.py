"""spec.disaggregation, the status's prefill fields and the reports' new fields: the models refuse what
the API server's CEL rules refuse, with the same message naming the field (e2e/test_crds.py sends the
same manifests to a real API server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet.api.crdgen import all_crds
from kvfleet.api.models import (
    DISAGGREGATION_CACHING,
    ROLE_LABEL,
    DisaggregationSpec,
    LLMPoolSpec,
    LLMPoolStatus,
    PrefillWorkersSpec,
)
from kvfleet.api.reports import KVLoadReport

ROOT = Path(__file__).resolve().parents[2]


def spec(**overrides: Any) -> dict[str, Any]:
    """A valid disaggregated pool (builtin engine, prefix caching on), with `overrides` on top."""
    base: dict[str, Any] = {"model": {"name": "tiny", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "10Gi"},
                            "engine": "builtin", "prefixCaching": {"enabled": True}, "disaggregation": {"enabled": True}}
    base.update(overrides)
    return base


def test_colocated_is_the_default_and_the_defaults_are_memserves() -> None:
    pool = LLMPoolSpec.model_validate({"model": {"name": "tiny", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"}})
    assert pool.disaggregation == DisaggregationSpec(enabled=False, prefill_workers=PrefillWorkersSpec(min=1, max=4),
                                                     caching="full", layout="by-request-aggregated", choice="per-request")
    assert ROLE_LABEL == "kvfleet.dev/role"


def test_the_fields_are_camel_case_on_the_wire() -> None:
    wire = {"enabled": True, "prefillWorkers": {"min": 0, "max": 2}, "caching": "prefill", "layout": "by-request",
            "choice": "always"}
    parsed = LLMPoolSpec.model_validate(spec(disaggregation=wire)).disaggregation
    assert (parsed.prefill_workers.min, parsed.prefill_workers.max, parsed.caching, parsed.layout, parsed.choice) == (
        0, 2, "prefill", "by-request", "always")
    assert parsed.to_wire() == wire


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # (a) caching at P or D is the workers' prefix cache.
        ({"prefixCaching": {"enabled": False}}, "disaggregation.caching other than none needs prefixCaching.enabled: true"),
        ({"prefixCaching": {"enabled": False}, "disaggregation": {"enabled": True, "caching": "prefill"}},
         "disaggregation.caching other than none needs prefixCaching.enabled"),
        # (b) DistKV's spanning requests cannot be handed over.
        ({"distkv": {"enabled": True}}, "disaggregation.enabled cannot be combined with distkv.enabled: a request whose "
                                        "KV spans workers cannot be handed over"),
        # (c) vLLM, the default engine, serves PD-Basic only: its prefix cache takes in no KV from others.
        ({"engine": "vllm"}, "disaggregation.caching: a vllm pool serves only caching: none"),
        ({"engine": None}, "disaggregation.caching: a vllm pool serves only caching: none"),
        ({"engine": "vllm", "disaggregation": {"enabled": True, "caching": "prefill"}},
         "vLLM's prefix cache cannot take in KV another worker sends"),
        # (d) zero decode workers is impossible, as for any pool.
        ({"workers": {"max": 0}}, r"workers\.max\n.*greater than or equal to 1"),
        ({"disaggregation": {"enabled": True, "prefillWorkers": {"min": 3, "max": 2}}},
         "disaggregation.prefillWorkers.min must be less than or equal to disaggregation.prefillWorkers.max"),
        ({"disaggregation": {"enabled": True, "prefillWorkers": {"max": 0}}}, r"prefillWorkers\.max\n.*greater than or equal to 1"),
        ({"disaggregation": {"enabled": True, "prefillWorkers": {"min": -1}}}, r"prefillWorkers\.min\n.*greater than or equal to 0"),
        ({"disaggregation": {"enabled": True, "caching": "everything"}}, r"disaggregation\.caching"),
        ({"disaggregation": {"enabled": True, "layout": "by-block"}}, r"disaggregation\.layout"),
        ({"disaggregation": {"enabled": True, "choice": "never"}}, r"disaggregation\.choice"),
        ({"disaggregation": {"enabled": True, "role": "prefill"}}, "Extra inputs are not permitted"),
    ],
)
def test_a_disaggregated_spec_is_refused_naming_the_field(overrides: dict[str, Any], message: str) -> None:
    body = spec(**overrides)
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ValidationError, match=message):
        LLMPoolSpec.model_validate(body)


@pytest.mark.parametrize(
    "overrides",
    [
        {"disaggregation": {"enabled": True, "caching": "none"}, "prefixCaching": {"enabled": False}},  # PD-Basic
        {"disaggregation": {"enabled": False}, "engine": "builtin", "distkv": {"enabled": True}},  # rules only bind when on
        {"disaggregation": {"enabled": True, "prefillWorkers": {"min": 0, "max": 1}}},
    ],
)
def test_what_the_rules_allow(overrides: dict[str, Any]) -> None:
    LLMPoolSpec.model_validate(spec(**overrides))


def _cel_rules() -> dict[str, dict[str, Any]]:
    """The LLMPool spec's CEL rules of spec.disaggregation, by message, as the CRD carries them."""
    schema = all_crds()["llmpools.yaml"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = schema["properties"]["spec"]["x-kubernetes-validations"]
    return {r["message"]: r for r in rules if "disaggregation" in r["rule"]}


def _pydantic_message(overrides: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as err:
        LLMPoolSpec.model_validate(spec(**overrides))
    return str(err.value)


def test_each_pydantic_rule_has_a_cel_twin_with_its_message_and_field() -> None:
    """The three cross-field rules are CEL on the server with the very message pydantic raises here
    (the server's own verdicts are e2e/test_crds.py's)."""
    rules = _cel_rules()
    assert len(rules) == 3
    for overrides, field_path in [({"prefixCaching": {"enabled": False}}, ".disaggregation.caching"),
                                  ({"distkv": {"enabled": True}}, ".disaggregation.enabled"),
                                  ({"engine": "vllm"}, ".disaggregation.caching")]:
        message = _pydantic_message(overrides)
        twins = [rule for text, rule in rules.items() if text in message]
        assert len(twins) == 1, f"no CEL rule says what pydantic says: {message}"
        assert twins[0]["fieldPath"] == field_path
    prefill = all_crds()["llmpools.yaml"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["disaggregation"]["properties"]["prefillWorkers"]
    assert prefill["x-kubernetes-validations"] == [
        {"rule": "self.min <= self.max", "message": "min must be less than or equal to max", "fieldPath": ".min"}]


def test_the_engine_rule_is_one_table_to_lift() -> None:
    engine_rule = next(r for m, r in _cel_rules().items() if "vllm pool" in m)
    assert DISAGGREGATION_CACHING["vllm"] == ("none",)
    assert engine_rule["rule"].endswith("self.disaggregation.caching in ['none'])")
    assert engine_rule["fieldPath"] == ".disaggregation.caching"


def test_a_vllm_pool_disaggregates_without_caching() -> None:
    pool = LLMPoolSpec.model_validate(spec(engine="vllm", prefixCaching={"enabled": False},
                                           disaggregation={"enabled": True, "caching": "none"}))
    assert pool.disaggregation.enabled and pool.engine == "vllm"


def test_the_server_fills_in_the_disaggregation_defaults() -> None:
    schema = all_crds()["llmpools.yaml"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert schema["properties"]["disaggregation"]["default"] == {
        "enabled": False, "prefillWorkers": {"min": 1, "max": 4}, "caching": "full", "layout": "by-request-aggregated",
        "choice": "per-request"}


def test_the_crd_yaml_has_no_anchors() -> None:
    """A nested object's default appears twice in the schema; the YAML writes it twice, not as an alias."""
    text = (ROOT / "crds" / "llmpools.yaml").read_text()
    assert "&id0" not in text and "*id0" not in text


def test_printer_columns_show_prefill_workers_and_transfers_when_wide() -> None:
    columns = {c["name"]: c for c in all_crds()["llmpools.yaml"]["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Prefill"] == {"name": "Prefill", "type": "integer", "jsonPath": ".status.readyPrefillWorkers",
                                  "description": "Prefill workers serving (disaggregated pools)"}
    assert columns["Transfers"]["jsonPath"] == ".status.kvTransfers" and columns["Transfers"]["priority"] == 1
    assert "priority" not in columns["Prefill"]


def test_status_counts_prefill_workers_apart_and_transfers_are_never_negative() -> None:
    status = LLMPoolStatus.model_validate({"workers": 2, "prefillWorkers": 3, "readyPrefillWorkers": 2,
                                           "desiredPrefillWorkers": 3, "kvTransfers": 17})
    assert (status.prefill_workers, status.ready_prefill_workers, status.desired_prefill_workers, status.kv_transfers) == (
        3, 2, 3, 17)
    with pytest.raises(ValidationError, match="kvTransfers|kv_transfers"):
        LLMPoolStatus.model_validate({"kvTransfers": -1})


def test_reports_carry_queued_prefill_tokens_and_transfers_only_when_written() -> None:
    plain = KVLoadReport(capacity_bytes=1, used_bytes=0, sequence=1)
    assert "queuedPrefillTokens" not in plain.to_json() and "kvTransfers" not in plain.to_json()
    report = KVLoadReport.model_validate({"capacityBytes": 1, "usedBytes": 0, "sequence": 2, "queuedPrefillTokens": 4096,
                                          "kvTransfers": 12})
    assert (report.queued_prefill_tokens, report.kv_transfers) == (4096, 12)
    assert report.to_json()["queuedPrefillTokens"] == 4096
    for bad in ({"queuedPrefillTokens": -1}, {"kvTransfers": -1}, {"role": "prefill"}):
        with pytest.raises(ValidationError):
            KVLoadReport.model_validate({"capacityBytes": 1, "usedBytes": 0, "sequence": 2, **bad})


def test_the_disaggregated_example_parses() -> None:
    example = yaml.safe_load((ROOT / "examples" / "llmpool-disaggregated.yaml").read_text())
    pool = LLMPoolSpec.model_validate(example["spec"])
    assert pool.engine == "builtin" and pool.disaggregation.enabled and pool.prefix_caching.enabled
    assert pool.disaggregation.caching == "full" and pool.disaggregation.choice == "per-request"
