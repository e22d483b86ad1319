"""The node agent's records of the pods it runs as processes: one per pod, container and probe.

Plain mutable records, owned by the agent's single event loop thread (probes run on a pool, but only
their futures are stored here).
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The name the agent signs node conditions and events with.
AGENT = "kvfleet-node-agent"


def as_body(obj: dict[str, Any]) -> Any:
    """A request body for the Kubernetes client. It serialises plain dicts exactly as its model classes
    (the agent speaks the API's JSON, as a kubelet does), but its type hints name only the models."""
    return obj


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Probe:
    """One readiness or liveness probe of a container, with its counters."""

    spec: dict[str, Any]
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0
    pending: concurrent.futures.Future[bool] | None = None

    @property
    def period_s(self) -> float:
        return float(self.spec.get("periodSeconds", 10))


@dataclass
class ContainerRuntime:
    name: str
    spec: dict[str, Any]
    popen: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restart_count: int = 0
    ready: bool = False
    last_terminated: dict[str, Any] | None = None
    terminated: dict[str, Any] | None = None
    restart_at: float | None = None
    readiness: Probe | None = None
    liveness: Probe | None = None
    started_monotonic: float = 0.0


@dataclass
class PodRuntime:
    uid: str
    namespace: str
    name: str
    node: str
    ip: str
    directory: Path
    body: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    containers: dict[str, ContainerRuntime] = field(default_factory=dict)
    start_time: str = ""
    kill_deadline: float | None = None
    last_status: dict[str, Any] | None = None
    finished: bool = False
