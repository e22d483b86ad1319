"""What the e2e tests read of the workers' KV-load reports: each worker's, as the operator merges them
(kvfleet.api.reports.pool_reports: its KVLoad, else its pod's annotation)."""

from __future__ import annotations

from kvfleet.api.models import POOL_LABEL
from kvfleet.api.reports import KVLoadReport, pool_reports
from kvfleet.localcluster.cluster import Cluster


def worker_reports(cluster: Cluster, namespace: str, pool: str) -> dict[str, KVLoadReport]:
    """Worker pod name -> its report, for the pool's pods that have one yet."""
    pods = cluster.get_json("pods", "-n", namespace, "-l", f"{POOL_LABEL}={pool}")["items"]
    kvloads = cluster.get_json("kvloads", "-n", namespace, "-l", f"{POOL_LABEL}={pool}")["items"]
    return pool_reports(kvloads, pods)


def worker_report(cluster: Cluster, namespace: str, pod_name: str) -> KVLoadReport | None:
    """One worker's report, None before its first."""
    pod = cluster.get_json("pod", pod_name, "-n", namespace)
    kvload = cluster.get_json("kvload", pod_name, "-n", namespace, check=False)
    return pool_reports([kvload] if kvload else [], [pod]).get(pod_name)
