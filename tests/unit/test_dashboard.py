"""The chart's Grafana dashboard reads only series kvfleet really exposes, and the chart ships it when asked.

A dashboard whose query names a metric nobody exports draws an empty panel without an error, so a
renamed metric would go unnoticed: every metric name in the dashboard's PromQL must be one of the
operator's (its metrics module), a worker's (a `WorkerMetrics` registry, the builtin case: the vLLM
names it emulates, which vLLM's own workers export too, with the migration executor's and the
hand-overs' metrics the agent registers beside them) or a router's (`RouterMetrics`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

import kvfleet.operator.metrics as operator_metrics
from kvfleet.router.metrics import RouterMetrics
from kvfleet.worker.gpu import GPUProbe
from kvfleet.worker.metrics import WorkerMetrics
from kvfleet.worker.migration.result import MigrationMetrics, TransferMetrics
from kvfleet_e2e.helm import render_chart

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
DASHBOARD = CHART / "dashboards" / "kvfleet.json"

# The series names each metric type exposes (prometheus_client's text format).
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",), "unknown": ("",)}


def series_names(families: Iterable[Metric]) -> set[str]:
    return {family.name + suffix for family in families for suffix in SUFFIXES[family.type]}


def exposed() -> dict[str, str]:
    """Every series name a running operator, worker or router exposes, with which of them does."""
    names: dict[str, str] = {}
    # The operator's metrics live in the global registry, which other imports (vLLM) share: take the
    # module's own metric objects, whatever has been recorded on them yet.
    operator = [m for m in vars(operator_metrics).values() if isinstance(m, MetricWrapperBase)]
    assert operator, "kvfleet.operator.metrics defines no metric"
    for name in series_names(f for m in operator for f in m.describe()):
        names[name] = "operator"
    worker = WorkerMetrics(lambda: 1024.0, lambda: 4096.0, lambda: 1.0, lambda: 0.0, GPUProbe(), model_name="m")
    meter = worker.request(0.0, num_prompt_tokens=3)  # fed once, as a served request feeds it
    meter.tokens(1)
    meter.finished("stop")
    # The agent registers its migration executor's and hand-overs' metrics on the same registry.
    MigrationMetrics(worker.registry)
    TransferMetrics(worker.registry).transfers.labels("by-request-aggregated", "transferred").inc()
    for name in series_names(worker.registry.collect()):
        names[name] = "worker"
    for name in series_names(RouterMetrics().registry.collect()):
        names[name] = "router"
    return names


# ------------------------------------------------------------------------------------------ PromQL

# Words of PromQL that are not metric names where an identifier may stand.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
            "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions (followed by
    "("), keywords, label names (inside {} and the lists after by/without/on/ignoring/group_*),
    strings, durations or Grafana variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # ranges and subqueries
    # Grouping and matching clauses with their label lists: `sum by (le) (x)` reads as the call `sum (x)`.
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\b\s*(\([^)]*\))?", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables outside those
    names = set()
    for match in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)", expr):
        name, rest = match.group(1), expr[match.end():]
        if name.lower() in KEYWORDS or rest.lstrip().startswith("("):
            continue
        names.add(name)
    return names


@pytest.mark.parametrize(("expr", "names"), [
    ('histogram_quantile(0.95, sum by (le, pool) (rate(vllm:time_to_first_token_seconds_bucket{pool=~"$pool"}[5m])))',
     {"vllm:time_to_first_token_seconds_bucket"}),
    ('kvfleet_pool_gpus_active{namespace="$namespace"} - on (pool) group_left kvfleet_pool_gpus_lower_bound',
     {"kvfleet_pool_gpus_active", "kvfleet_pool_gpus_lower_bound"}),
    ('sum without (engine) (rate(vllm:prompt_tokens_total[$__rate_interval])) > bool 1e3', {"vllm:prompt_tokens_total"}),
    ('label_values(kvfleet_pool_gpus_desired{namespace="a:b"}, pool)', {"kvfleet_pool_gpus_desired", "pool"}),
])
def test_the_extractor_finds_the_metric_names_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every panel's target, rows' panels included."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_every_metric_the_dashboard_reads_is_one_kvfleet_exposes() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    known = exposed()
    used: dict[str, str] = {}
    for title, expr in dashboard_exprs(dashboard):
        for name in metric_names(expr):
            used.setdefault(name, title)
    # The template variables' queries (label_values(metric, label)) read a metric too.
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            match = re.fullmatch(r"label_values\((\w+)(\{.*\})?,\s*(\w+)\)", query["query"])
            assert match, query
            used.setdefault(match.group(1), f"variable {variable['name']}")
    unknown = {name: title for name, title in used.items() if name not in known}
    assert not unknown, f"the dashboard reads series nothing exposes (panel by name): {unknown}"
    # The panels an operator of a pool needs (GPUs, workers, KV use, migrations, latency, queues), from each of the three.
    for name in ("kvfleet_pool_gpus_active", "kvfleet_pool_gpus_lower_bound", "kvfleet_pool_gpus_desired",
                 "kvfleet_pool_workers_ready", "kvfleet_pool_kv_utilization_ratio", "vllm:kv_cache_usage_perc",
                 "kvfleet_migrations_total", "kvfleet_migrations_planned_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
                 "kvfleet_router_time_to_first_token_seconds_bucket", "vllm:num_requests_waiting",
                 "kvfleet_router_held_requests", "kvfleet_router_hold_outcomes_total"):
        assert name in used, f"no panel reads {name}"
    assert {known[name] for name in used} == {"operator", "worker", "router"}


def test_every_panel_queries_the_chosen_pools_through_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for title, expr in dashboard_exprs(dashboard):
        # Each series selector is narrowed to the chosen namespace and pools, or a panel mixes pools.
        for name in metric_names(expr):
            for match in re.finditer(r"(?<![\w:])" + re.escape(name) + r"(?![\w:])(\{[^}]*\})?", expr):
                matchers = match.group(1) or ""
                assert 'namespace="$namespace"' in matchers and 'pool=~"$pool"' in matchers, (title, expr)
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    assert targets and all(t["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for t in targets)


# ----------------------------------------------------------------------------------------- the chart


def helm_template(*args: str) -> list[dict[str, Any]]:
    objs = render_chart(*args)
    if objs is None:
        pytest.skip("the pinned helm is not built (make controlplane builds it)")
    return objs


def test_the_chart_ships_the_dashboard_in_a_configmap_with_the_sidecars_label_only_when_enabled() -> None:
    assert not [o for o in helm_template() if o["kind"] == "ConfigMap"], "the dashboard is off by default"
    objs = helm_template("--set", "dashboard.enabled=true", "--set", "dashboard.annotations.grafana_folder=kvfleet")
    (configmap,) = [o for o in objs if o["kind"] == "ConfigMap"]
    meta = configmap["metadata"]
    assert meta["namespace"] == "ns" and meta["labels"]["grafana_dashboard"] == "1"
    assert meta["annotations"] == {"grafana_folder": "kvfleet"}
    (text,) = configmap["data"].values()
    assert json.loads(text) == json.loads(DASHBOARD.read_text())
    # The label is the chart user's: Helm merges maps with the defaults, so another sidecar's label
    # replaces the default one where that is set to null (values.yaml says so).
    objs = helm_template("--set", "dashboard.enabled=true", "--set", "dashboard.namespace=monitoring",
                         "--set", "dashboard.labels.grafana_dashboard=null", "--set-string",
                         "dashboard.labels.grafana_dashboards=yes")
    (configmap,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["labels"]["grafana_dashboards"] == "yes"
    assert "grafana_dashboard" not in configmap["metadata"]["labels"]


def test_the_dashboard_values_are_in_the_schema_and_off_by_default() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["dashboard"] == {"enabled": False, "labels": {"grafana_dashboard": "1"}, "annotations": {},
                                   "namespace": ""}
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["dashboard"]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(values["dashboard"])
    assert schema["properties"]["labels"]["additionalProperties"] == {"type": "string"}
