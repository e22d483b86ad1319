"""The Helm chart without a cluster or helm: its CRDs are the generated ones, its values schema refuses
unknown keys everywhere and matches values.yaml, and the RBAC call list (kvfleet_e2e.helm) is the
operator's code's own.

Rendering, installing and the RBAC on a real API server are e2e/test_helm.py's.
"""

from __future__ import annotations

import ast
import importlib
import json
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_e2e.helm import OPERATOR_CALLS, WITHHELD_CALLS, escalation_calls

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
OPERATOR_SOURCES = ROOT / "operator" / "kvfleet" / "operator"


def test_chart_crds_are_the_generated_crds() -> None:
    generated = {p.name: p.read_text() for p in (ROOT / "crds").glob("*.yaml")}
    in_chart = {p.name: p.read_text() for p in (CHART / "crds").glob("*.yaml")}
    assert generated, "no generated CRDs in crds/"
    drifted = sorted(set(generated) ^ set(in_chart) | {n for n in generated.keys() & in_chart.keys() if generated[n] != in_chart[n]})
    assert not drifted, f"charts/kvfleet/crds/ differs from crds/ in {drifted}: run `kvfleet crds && cp crds/*.yaml charts/kvfleet/crds/`"


def test_chart_app_version_is_the_project_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"], "Chart.yaml appVersion (the default image tag) must be the release's version"


# ------------------------------------------------------------------------------------------ schema


def resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/definitions/"), ref
        node = SCHEMA["definitions"][ref.removeprefix("#/definitions/")]
    return node


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    node = resolve(node)
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from schema_nodes(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")
    for alternative in node.get("oneOf", []):
        yield from schema_nodes(alternative, path)


def test_schema_refuses_unknown_keys_everywhere() -> None:
    loose = []
    for path, node in schema_nodes(SCHEMA):
        if node.get("type") != "object" or path == ".global":  # global: a parent chart's, never read
            continue
        extra = node.get("additionalProperties")
        if "properties" in node:
            if extra is not False:
                loose.append(f"{path or '(root)'}: has properties but does not refuse others")
        elif not isinstance(extra, dict) or "type" not in resolve(extra) and "oneOf" not in extra:
            loose.append(f"{path}: a map must say what its values are")
    assert not loose, "\n".join(loose)


JSON_TYPES = {"string": str, "integer": int, "boolean": bool, "array": list, "object": dict, "number": (int, float)}


def check_value(value: Any, node: dict[str, Any], path: str, problems: list[str]) -> None:
    node = resolve(node)
    if "oneOf" in node:
        return
    wanted = JSON_TYPES[node["type"]]
    if not isinstance(value, wanted) or (node["type"] == "integer" and isinstance(value, bool)):
        problems.append(f"{path}: {value!r} is not {node['type']}")
        return
    if "enum" in node and value not in node["enum"]:
        problems.append(f"{path}: {value!r} not in {node['enum']}")
    if isinstance(value, dict):
        props = node.get("properties")
        if props is not None:
            for key in value.keys() - props.keys():
                problems.append(f"{path}.{key}: not in the schema")
            for key, child in value.items():
                if key in props:
                    check_value(child, props[key], f"{path}.{key}", problems)
        elif isinstance(node.get("additionalProperties"), dict):
            for key, child in value.items():
                check_value(child, node["additionalProperties"], f"{path}.{key}", problems)
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        for index, item in enumerate(value):
            check_value(item, node["items"], f"{path}[{index}]", problems)


def property_paths(node: dict[str, Any], path: str = "") -> set[str]:
    """Every named key the schema knows (through $refs, not into maps or list items)."""
    node = resolve(node)
    paths = set()
    for key, child in node.get("properties", {}).items():
        paths.add(f"{path}.{key}")
        paths |= property_paths(child, f"{path}.{key}")
    return paths


def value_paths(value: Any, path: str = "", node: dict[str, Any] | None = None) -> set[str]:
    node = resolve(node or SCHEMA)
    paths = set()
    if isinstance(value, dict) and "properties" in node:
        for key, child in value.items():
            paths.add(f"{path}.{key}")
            paths |= value_paths(child, f"{path}.{key}", node["properties"].get(key, {}))
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            paths |= value_paths(item, path, node["items"])
    return paths


def test_values_yaml_is_exactly_what_the_schema_describes() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    problems: list[str] = []
    check_value(values, SCHEMA, "", problems)
    assert not problems, "\n".join(problems)
    top_level = set(SCHEMA["properties"]) - {"global"}
    assert set(values) == top_level, f"values.yaml and the schema disagree on {sorted(set(values) ^ top_level)}"


def test_full_values_set_every_value_the_schema_knows() -> None:
    full = yaml.safe_load((CHART / "ci" / "full-values.yaml").read_text())
    problems: list[str] = []
    check_value(full, SCHEMA, "", problems)
    assert not problems, "\n".join(problems)
    missing = sorted(property_paths(SCHEMA) - value_paths(full))
    assert not missing, f"charts/kvfleet/ci/full-values.yaml does not set {missing}"


@pytest.mark.parametrize(("values", "problem"), [
    ({"metrics": {"port": "9090"}}, ".metrics.port: '9090' is not integer"),
    ({"image": {"repository": "x", "repo": "y"}}, ".image.repo: not in the schema"),
    ({"logLevel": "trace"}, ".logLevel: 'trace' not in ['info', 'debug']"),
])
def test_the_schema_checker_of_these_tests_catches_what_helm_refuses(values: dict[str, Any], problem: str) -> None:
    problems: list[str] = []
    check_value(values, SCHEMA, "", problems)
    assert problems == [problem]


# -------------------------------------------------------------------------- the operator's calls

API_GROUPS = {"CoreV1Api": "", "RbacAuthorizationV1Api": "rbac.authorization.k8s.io", "AppsV1Api": "apps",
              "SchedulingV1Api": "scheduling.k8s.io", "CoordinationV1Api": "coordination.k8s.io", "CustomObjectsApi": None}
VERBS = {"read": "get", "get": "get", "list": "list", "create": "create", "patch": "patch", "replace": "update", "delete": "delete"}


def plural(snake: str) -> str:
    word = snake.replace("_", "")
    return word + ("es" if word.endswith("s") else "s")


def client_call(api_class: str, method: str, call: ast.Call | None, module: Any) -> tuple[str, str, str]:
    """(verb, group, resource) of one kubernetes-client method, as RBAC sees it (the call's arguments
    name the resource of a CustomObjectsApi method)."""
    prefix, _, rest = method.partition("_")
    verb = VERBS[prefix]
    rest = rest.replace("namespaced_", "").replace("_for_all_namespaces", "")
    status = rest.endswith("_status")
    rest = rest.removesuffix("_status")
    if API_GROUPS[api_class] is None:  # CustomObjectsApi: (group, version, [namespace,] plural, ...)
        assert call is not None, f"{method} is referenced, not called: its resource cannot be read from the code"
        group_arg, plural_arg = call.args[0], call.args[3 if "namespaced" in method else 2]
        group, resource = (arg.value if isinstance(arg, ast.Constant) else getattr(module, arg.id) for arg in (group_arg, plural_arg))
    else:
        group, resource = API_GROUPS[api_class], plural(rest)
    return verb, group, resource + ("/status" if status else "")


def code_calls() -> dict[tuple[str, str, str], str]:
    """Every Kubernetes API call in the operator's sources, read from the code: `self.X.method`
    (called, or kept in a table as Kube.create does) where `self.X = client.SomeApi()`, plus kopf's
    watches of the resources its handlers name."""
    found: dict[tuple[str, str, str], str] = {}
    for source in sorted(OPERATOR_SOURCES.glob("*.py")):
        module = importlib.import_module(f"kvfleet.operator.{source.stem}")
        tree = ast.parse(source.read_text())
        apis = {node.targets[0].attr: node.value.func.attr for node in ast.walk(tree)
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr in API_GROUPS}
        calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr in apis
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"):
                key = client_call(apis[node.value.attr], node.attr, calls.get(id(node)), module)
                found.setdefault(key, f"{source.name}:{node.lineno} {node.attr}")
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            # kopf handlers: @kopf.daemon(group, version, plural) / @kopf.on.event(...) watch (list+watch)
            # that resource; a daemon also puts kopf's finalizer on it (patch).
            name = ast.unparse(node.func)
            if name in ("kopf.daemon", "kopf.timer") or name.startswith("kopf.on."):
                if len(node.args) < 3 or name in ("kopf.on.startup", "kopf.on.cleanup", "kopf.on.probe"):
                    continue
                group, _, resource = (a.value if isinstance(a, ast.Constant) else getattr(module, a.id) for a in node.args[:3])
                for verb in ("list", "watch") + (("patch",) if name in ("kopf.daemon", "kopf.timer") else ()):
                    found.setdefault((verb, group, resource), f"{source.name}:{node.lineno} {name}")
    return found


def test_every_api_call_in_the_operators_code_is_in_the_rbac_call_list() -> None:
    listed = {c.key() for c in (*OPERATOR_CALLS, *WITHHELD_CALLS)}
    unlisted = [f"{verb} {group or 'core'}/{resource} at {where}" for (verb, group, resource), where in code_calls().items()
                if (verb, group, resource) not in listed]
    assert not unlisted, ("the operator makes calls kvfleet_e2e.helm.OPERATOR_CALLS does not list; add them there and a rule "
                          "to charts/kvfleet/templates/rbac.yaml:\n" + "\n".join(unlisted))


def test_the_call_list_names_no_call_the_code_no_longer_makes() -> None:
    made = code_calls()
    stale = [str(c) for c in (*OPERATOR_CALLS, *WITHHELD_CALLS)
             if c.who.startswith(("Kube", "LeaderElector")) and c.key() not in made]
    assert not stale, "kvfleet_e2e.helm lists calls the operator's code does not make:\n" + "\n".join(stale)


def test_the_workers_role_is_within_the_operators_calls() -> None:
    # The escalation calls come from resources.worker_rbac; the operator's own list covers the rest.
    keys = {c.key() for c in escalation_calls()}
    assert ("patch", "", "pods") in keys and ("patch", "kvfleet.dev", "kvmigrations/status") in keys
