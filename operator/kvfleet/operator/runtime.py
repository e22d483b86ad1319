"""What one operator process keeps between kopf's handler calls: one `Operator` object, in kopf's memo.

The process holds three things across handler calls: its API client (`KubeApi`; the real one carries
the leader's write fence), each pool's scheduler (`reconcile.PoolStates`), and the change handlers'
memory of what they last saw, with each pool's wake-up (`Wakeups`). They are one object, not module
globals, so that a test or a benchmark makes a fresh operator instead of clearing a module's dicts,
and two operators in one process (the tests') share nothing.

`python -m kvfleet.operator` makes it and hands it to kopf as the operator's memo
(`kopf.run(memo=...)`); kopf passes every handler a shallow copy of that memo, so every handler of
every pool sees the same `Operator`. A process that starts the handlers some other way (`kopf run`)
gets one from the startup handler, without a write fence.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator.kube import KubeApi
from kvfleet.operator.reconcile import PoolStates

# The memo key the Operator is kept under.
MEMO_KEY = "operator"

PoolKey = tuple[str | None, str]  # (namespace, name)
# A worker pod's lifecycle as the pod handler last saw it: (phase, ready, being deleted).
Lifecycle = tuple[str, bool, bool]


class Wakeups:
    """Each pool's wake-up Event, and what the change handlers last saw of each pool and worker pod.

    Mutable and shared by threads: the pool daemons wait on their Events while kopf's handlers set
    them (the Events are made under a lock). The two dicts are written only by kopf's event handlers,
    which kopf runs one at a time per object.
    """

    def __init__(self) -> None:
        self._events: dict[PoolKey, threading.Event] = {}
        self._lock = threading.Lock()
        # The pool's (generation, held-requests annotation, being deleted) at its last wake-up.
        self.pool_seen: dict[PoolKey, tuple[object, ...]] = {}
        # Worker pod uid -> its lifecycle at the last event that reached the pod handler.
        self.pod_lifecycle: dict[str, Lifecycle] = {}

    def event(self, namespace: str | None, name: str) -> threading.Event:
        """The pool's wake-up: set by a change, waited on (and cleared) by the pool's daemon."""
        with self._lock:
            return self._events.setdefault((namespace, name), threading.Event())


@dataclass(frozen=True)
class Operator:
    """The state of one operator process (see the module's docstring)."""

    api: KubeApi
    pools: PoolStates = field(default_factory=PoolStates)
    wakeups: Wakeups = field(default_factory=Wakeups)


def operator_of(memo: Any) -> Operator:
    """The Operator in kopf's memo (put there by `python -m kvfleet.operator` or the startup handler)."""
    operator = memo.get(MEMO_KEY) if isinstance(memo, Mapping) else getattr(memo, MEMO_KEY, None)
    if not isinstance(operator, Operator):
        raise RuntimeError("kopf's memo holds no kvfleet Operator: start the operator with `python -m kvfleet.operator`")
    return operator
