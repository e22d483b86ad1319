"""The chart's NetworkPolicy: off by default; on, one per namespace where pools run, letting
only the pools' routers and workers (and the named metrics scrapers) reach a worker's API port, and
only workers its migration port."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_e2e.helm import render_chart


def policies(*args: str) -> list[dict[str, Any]]:
    objs = render_chart(*args)
    if objs is None:
        pytest.skip("the pinned helm is not built (make controlplane builds it)")
    return [o for o in objs if o["kind"] == "NetworkPolicy"]


def test_off_by_default_and_one_per_namespace_when_on() -> None:
    assert policies() == []
    on = policies("--set", "networkPolicy.enabled=true")
    assert [p["metadata"]["namespace"] for p in on] == ["ns"]  # the release's
    two = policies("--set", "networkPolicy.enabled=true", "--set", "networkPolicy.namespaces={llm-a,llm-b}")
    assert [p["metadata"]["namespace"] for p in two] == ["llm-a", "llm-b"]


def test_only_routers_and_workers_reach_the_api_and_only_workers_the_migration_port() -> None:
    (policy,) = policies("--set", "networkPolicy.enabled=true",
                         "--set", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    workers = {"matchExpressions": [{"key": "kvfleet.dev/pool", "operator": "Exists"},
                                    {"key": "app.kubernetes.io/component", "operator": "In", "values": ["worker"]}]}
    assert spec["podSelector"] == workers
    api, migration = spec["ingress"]
    assert api["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert api["from"] == [{"podSelector": {"matchExpressions": [{"key": "kvfleet.dev/router", "operator": "Exists"}]}},
                           {"podSelector": workers},
                           {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]
    assert migration == {"from": [{"podSelector": workers}], "ports": [{"port": 8001, "protocol": "TCP"}]}
