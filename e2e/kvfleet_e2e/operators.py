"""The operator process of an e2e module, killed and restarted the way its Deployment would restart it.

test_operator.py kills it on purpose; test_chaos.py also lets it die by itself (it exits when it loses
its Lease, e.g. while the API server restarts) and counts every start, so both share this handle.
"""

from __future__ import annotations

import threading

from kvfleet.localcluster.cluster import Cluster, start_operator
from kvfleet.localcluster.controlplane import Process, free_port


class OperatorHandle:
    """One operator replica. `kill()` may be called from any thread; `check()` (main thread only)
    starts a new process after a kill, or, with `restart_exited`, after the process exited by itself."""

    def __init__(self, cluster: Cluster, name: str = "operator", restart_exited: bool = False) -> None:
        self.cluster = cluster
        self.name = name
        self.restart_exited = restart_exited
        self.lock = threading.Lock()
        self.killed = False
        self.num_starts = 0
        self.num_exits = 0  # exits the handle did not cause (a lost lease, a crash)
        self.proc = self.start()

    def start(self) -> Process:
        self.metrics_port = free_port()
        self.num_starts += 1
        return start_operator(self.cluster, self.name, self.metrics_port)

    def kill(self) -> None:
        """SIGKILL from any thread; the next check() on the main thread starts a new operator (a child
        started from another thread would die with that thread: PR_SET_PDEATHSIG is per thread)."""
        with self.lock:
            self.proc.popen.kill()
            self.proc.popen.wait(10)
            self.killed = True

    def check(self) -> None:
        with self.lock:
            if not self.killed and self.restart_exited and self.proc.popen.poll() is not None:
                self.num_exits += 1
                self.killed = True
            if self.killed:
                self.proc, self.killed = self.start(), False
            assert self.proc.popen.poll() is None, f"the operator died:\n{self.proc.tail(40)}"
