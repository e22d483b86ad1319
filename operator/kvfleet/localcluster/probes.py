"""Readiness and liveness probes (httpGet, tcpSocket, exec) with Kubernetes' thresholds and periods.

Probes run on a small thread pool so that a slow one never stalls the agent's loop; the loop advances
each probe once a tick and acts only when a threshold is crossed.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import socket
import subprocess
import time
from typing import Any

from kvfleet.localcluster.images import expand_env_refs, local_python
from kvfleet.localcluster.podenv import PodEnvironment
from kvfleet.localcluster.records import ContainerRuntime, PodRuntime, Probe


class Prober:
    def __init__(self, env: PodEnvironment) -> None:
        self.env = env
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")

    def run_probe(self, runtime: PodRuntime, cont: ContainerRuntime, spec: dict[str, Any]) -> bool:
        timeout_s = float(spec.get("timeoutSeconds", 1))
        ports = {p.get("name"): p["containerPort"] for p in cont.spec.get("ports") or [] if p.get("name")}
        if "httpGet" in spec:
            get = spec["httpGet"]
            port = ports.get(get["port"], get["port"])
            host = get.get("host") or runtime.ip
            conn_cls = http.client.HTTPSConnection if get.get("scheme") == "HTTPS" else http.client.HTTPConnection
            conn = conn_cls(host, int(port), timeout=timeout_s)
            try:
                conn.request("GET", get.get("path", "/"))
                return 200 <= conn.getresponse().status < 400
            except OSError:
                return False
            finally:
                conn.close()
        if "tcpSocket" in spec:
            port = ports.get(spec["tcpSocket"]["port"], spec["tcpSocket"]["port"])
            try:
                with socket.create_connection((runtime.ip, int(port)), timeout=timeout_s):
                    return True
            except OSError:
                return False
        if "exec" in spec:
            env = self.env.pod_env(runtime, cont.spec)
            argv = local_python([expand_env_refs(a, env) for a in spec["exec"]["command"]])
            try:
                return subprocess.run(argv, env=env, cwd=str(runtime.directory), capture_output=True, timeout=timeout_s).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                return False
        return True

    def step_probe(self, runtime: PodRuntime, cont: ContainerRuntime, probe: Probe) -> bool | None:
        """Advance one probe; returns the new verdict when a threshold is crossed, else None."""
        now = time.monotonic()
        if probe.pending is not None:
            if not probe.pending.done():
                return None
            ok = probe.pending.result()
            probe.pending = None
            if ok:
                probe.successes, probe.failures = probe.successes + 1, 0
                if probe.successes >= int(probe.spec.get("successThreshold", 1)):
                    return True
            else:
                probe.successes, probe.failures = 0, probe.failures + 1
                if probe.failures >= int(probe.spec.get("failureThreshold", 3)):
                    return False
            return None
        if now >= probe.next_at:
            probe.next_at = now + probe.period_s
            probe.pending = self.pool.submit(self.run_probe, runtime, cont, probe.spec)
        return None

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
