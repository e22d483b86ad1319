"""Turn the pydantic models of `kvfleet.api.models` into CustomResourceDefinitions.

Pydantic emits JSON Schema (2020-12) with `$ref`s, `anyOf` for optional values, `exclusiveMinimum` as
a number and titles everywhere. The API server wants a *structural* OpenAPI v3.0 schema: every node
typed, no references, no `anyOf` alternatives of different types, boolean exclusive bounds. This
module does exactly that translation, plus the CRD envelope (printer columns, subresources, short
names), so the committed YAML is a pure function of the models.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from kvfleet.api.models import GROUP, VERSION, KVMigration, LLMPool
from kvfleet.api.reports import KVLoad

# Keys of pydantic's output that OpenAPI v3.0 structural schemas either forbid or do not need.
_DROP_KEYS = {"title", "$defs", "propertyNames"}


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        merged = dict(defs[name])
        merged.update({k: v for k, v in schema.items() if k != "$ref"})
        return merged
    return schema


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic schema node as a structural OpenAPI node (recursively)."""
    schema = _resolve(schema, defs)
    if "anyOf" in schema:
        # `X | None` arrives as anyOf [X, null]: optional in Kubernetes is simply "not required".
        branches = [b for b in schema["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union of several types in a structural schema: {schema}")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        absent_by_default = rest.get("default", ...) is None
        if absent_by_default:
            del rest["default"]
        merged = dict(_resolve(branches[0], defs))
        if absent_by_default and "properties" in merged:
            # `X | None = None`: the object's absence means something (status.distkv is there only
            # while DistKV is on), so the server must not fill it in from its fields' defaults.
            merged[_ABSENT_BY_DEFAULT] = True
        # Keep the outer description and CEL rules; the inner node's own ones stay too.
        for key, value in rest.items():
            if key == "x-kubernetes-validations":
                merged[key] = list(merged.get(key, [])) + list(value)
            else:
                merged[key] = value
        schema = merged
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROP_KEYS or key == _ABSENT_BY_DEFAULT:
            continue
        if key == "properties":
            out["properties"] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out["items"] = _structural(value, defs)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = _structural(value, defs)
        elif key == "additionalProperties":
            continue  # `extra="forbid"` yields false: the API server prunes unknown fields instead.
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "const":
            out["enum"] = [value]
        elif key == "required":
            out["required"] = sorted(value)
        else:
            out[key] = value
    if "properties" in out:
        out.setdefault("type", "object")
        absent = {name for name, sub in schema["properties"].items() if _resolve_optional(sub, defs)}
        # A nested object whose fields all have defaults gets them as its own default, so the server
        # fills them in when the user omits the object (CEL rules see the defaulted values).
        required = set(out.get("required", []))
        for name, prop in out["properties"].items():
            if (
                name not in required
                and prop.get("type") == "object"
                and "properties" in prop
                and "default" not in prop
                and not prop.get("required")
                and name not in _NO_DEFAULT_OBJECTS
                and name not in absent
            ):
                # Copies: a nested object's default is its own node's too, and YAML would write a shared
                # dict as an anchor and an alias.
                prop["default"] = {k: copy.deepcopy(v["default"]) for k, v in prop["properties"].items() if "default" in v}
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    return out


# A marker _structural puts on an optional object's node while it translates it (never emitted).
_ABSENT_BY_DEFAULT = "x-kvfleet-absent-by-default"


def _resolve_optional(schema: dict[str, Any], defs: dict[str, Any]) -> bool:
    """Whether a property is an object declared `X | None = None` (absent unless set)."""
    if "anyOf" not in schema or schema.get("default", ...) is not None:
        return False
    return any("properties" in _resolve(b, defs) for b in schema["anyOf"] if b.get("type") != "null")


# Optional objects that must stay absent unless the user sets them (their presence means something).
_NO_DEFAULT_OBJECTS = {"volume", "resources", "status", "persistentVolumeClaim", "hostPath"}


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of a whole custom resource (spec and status, apiVersion/kind/metadata)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    body = _structural(raw, defs)
    body["properties"] = {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        **body["properties"],
    }
    body.pop("description", None)
    body["description"] = (model.__doc__ or "").strip()
    return body


def _printer(name: str, json_path: str, type_: str, description: str, priority: int = 0) -> dict[str, Any]:
    column: dict[str, Any] = {"name": name, "type": type_, "jsonPath": json_path, "description": description}
    if priority:
        column["priority"] = priority
    return column


_LLMPOOL_COLUMNS = [
    _printer("Model", ".spec.model.name", "string", "Served model name"),
    _printer("Engine", ".spec.engine", "string", "Worker engine"),
    _printer("Policy", ".spec.scheduling.policy", "string", "Scheduling policy"),
    _printer("Desired", ".status.desiredWorkers", "integer", "Workers the scheduler wants (decode workers if disaggregated)"),
    _printer("Ready", ".status.readyWorkers", "integer", "Workers serving (decode workers if disaggregated)"),
    _printer("Prefill", ".status.readyPrefillWorkers", "integer", "Prefill workers serving (disaggregated pools)"),
    _printer("GPUs", ".status.gpusInUse", "integer", "GPUs holding KV cache"),
    _printer("Lower-Bound", ".status.lowerBoundGpus", "integer", "ceil(sum of KV / capacity)", priority=1),
    _printer("KV-Util%", ".status.kvUtilizationPercent", "integer", "KV cache utilization of active workers"),
    _printer("Migrating", ".status.migrationsInFlight", "integer", "KVMigrations not yet finished"),
    _printer("Transfers", ".status.kvTransfers", "integer", "KV hand-overs from prefill to decode workers", priority=1),
    _printer("Status", '.status.conditions[?(@.type=="Ready")].reason', "string", "Reason of the Ready condition"),
    _printer("Age", ".metadata.creationTimestamp", "date", "Age"),
]

# A worker's report: no status, it is all the worker's own statement (kvfleet.api.reports).
_KVLOAD_COLUMNS = [
    _printer("Used", ".report.usedBytes", "integer", "KV bytes the worker's requests hold"),
    _printer("Capacity", ".report.capacityBytes", "integer", "KV bytes the worker can hold now"),
    _printer("Sequence", ".report.sequence", "integer", "Reports the worker has written"),
    _printer("Age", ".metadata.creationTimestamp", "date", "Age"),
]

_KVMIGRATION_COLUMNS = [
    _printer("Pool", ".spec.pool", "string", "LLMPool"),
    _printer("Request", ".spec.requestId", "string", "Request id"),
    _printer("From", ".spec.sourcePod", "string", "Source worker pod"),
    _printer("To", ".spec.targetPod", "string", "Target worker pod"),
    _printer("Mode", ".spec.mode", "string", "kv, token or hybrid"),
    _printer("Phase", ".status.phase", "string", "Pending, Transferring, Succeeded or Failed"),
    _printer("Downtime", ".status.downtime", "string", "Time the request made no progress"),
    _printer("Reason", ".spec.reason", "string", "Scheduler operation that planned it", priority=1),
    _printer("Bytes", ".status.bytesMoved", "integer", "Bytes moved", priority=1),
    _printer("Age", ".metadata.creationTimestamp", "date", "Age"),
]


def _crd(model: type[BaseModel], columns: list[dict[str, Any]], scale: bool, status: bool = True) -> dict[str, Any]:
    plural: str = model.plural  # type: ignore[attr-defined]
    kind: str = model.kind  # type: ignore[attr-defined]
    subresources: dict[str, Any] = {"status": {}} if status else {}
    if scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.workers",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": list(model.short_names),  # type: ignore[attr-defined]
                "categories": ["kvfleet"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema(model)},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def all_crds() -> dict[str, dict[str, Any]]:
    """File name under crds/ -> CRD object."""
    return {
        "llmpools.yaml": _crd(LLMPool, _LLMPOOL_COLUMNS, scale=True),
        "kvmigrations.yaml": _crd(KVMigration, _KVMIGRATION_COLUMNS, scale=False),
        "kvloads.yaml": _crd(KVLoad, _KVLOAD_COLUMNS, scale=False, status=False),
    }
