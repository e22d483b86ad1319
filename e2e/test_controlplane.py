"""The launcher itself: a control plane whose parent dies leaves no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from kvfleet.localcluster.cluster import wait_for

E2E = Path(__file__).parent


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_killing_the_launcher_leaves_no_orphans() -> None:
    env = {**os.environ, "PYTHONPATH": str(E2E)}
    launcher = subprocess.Popen([sys.executable, "-m", "kvfleet.localcluster.controlplane"], stdout=subprocess.PIPE, text=True, env=env)
    line = ""
    try:
        line = launcher.stdout.readline() if launcher.stdout else ""
        assert line.startswith("export KUBECONFIG="), line
        children = descendants(launcher.pid)
        names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in children}
        assert {"etcd", "kube-apiserver", "kube-scheduler"} <= names, names
        # SIGKILL gives the launcher no chance to clean up: only PR_SET_PDEATHSIG can.
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        wait_for(lambda: not any(running(pid) for pid in children), "the control plane processes to die", timeout_s=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if line.startswith("export KUBECONFIG="):  # the killed launcher could not remove its folder
            shutil.rmtree(Path(line.split("=", 1)[1].strip()).parent, ignore_errors=True)
