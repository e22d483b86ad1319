"""Worker pods as the local cluster runs them, as processes: found and signalled by the e2e tests that
kill or freeze a worker at the worst moment (chaos, disaggregation)."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any


def worker_pid(pod: dict[str, Any]) -> int:
    """The worker's process (the node agent's containerID is process://PID, its own process group)."""
    container_id = pod["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("process://"), container_id
    return int(container_id.removeprefix("process://"))


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
