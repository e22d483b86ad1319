"""The `hpa` baseline: what a platform team runs today, a load-balancing router over vLLM replicas that a
HorizontalPodAutoscaler scales on their mean KV-cache usage. Simulator only (`kvfleet simulate --stack
today`); no LLMPool runs it.

The MELL baselines (best_fit.py, worst_fit.py, load_balance.py) start a GPU the moment a request fits
on none, as if the autoscaler knew every request's size in advance. A real deployment has no such
autoscaler: it sets a utilization target on a metric the replicas export (vLLM's
`vllm:kv_cache_usage_perc`, through KEDA or the Prometheus adapter) and the HPA controller sizes the
Deployment to it. This policy is that, as Kubernetes' HPA documents its algorithm ("Horizontal Pod
Autoscaling", kubernetes.io, "Algorithm details" and "Configurable scaling behavior"):

- every `sync_s` (the controller's --horizontal-pod-autoscaler-sync-period, 15 s) the desired replica
  count is ceil(replicas x mean usage / target) = ceil(KV held / (target x C)), unchanged while the
  ratio of usage to target is within `tolerance` of 1 (10%);
- it scales down only to the highest recommendation of the last `stabilization_s` (the scale-down
  stabilization window; the HPA's default is 300 s, the stack comparison uses the pool's own
  scale-down delay so both stacks wait as long), and up by at most max(100%, 4 pods) per sync (the
  default scale-up policies);
- a replica being scaled down gets no new request and goes once its requests finish (a vLLM pod's
  graceful drain); the least loaded go first;
- the router sends each request to the replica with the most free KV (worst-fit, what a least-loaded
  router does); no request ever moves, and a replica whose requests outgrow it preempts the newest,
  which is recomputed on another (vLLM's recompute preemption, no_migration.py);
- where no replica has room, a replica starts at once for the request. A real HPA would leave it
  queued until the next sync and a pod start: this favours today's stack, and is argued in
  docs/simulator.md ("Two stacks").

Its autoscaler state (recommendations, replicas draining) is not in a snapshot: the policy runs in
one simulator replay from start to end, never restored from worker reports.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from kvfleet.mell.cluster import PolicyConfig
from kvfleet.mell.models import EventBatch, Plan
from kvfleet.mell.state import Gpu
from kvfleet.mell.worst_fit import WorstFitPolicy


@dataclass(frozen=True)
class KvAutoscalerConfig(PolicyConfig):
    """The HPA's knobs, at Kubernetes' defaults except the target, which a team picks."""

    # Mean KV-cache usage the HPA keeps the replicas at (the metric target, 0 < target <= 1).
    target_utilization: float = 0.8
    sync_s: float = 15.0
    tolerance: float = 0.1
    stabilization_s: float = 300.0
    min_replicas: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization {self.target_utilization} must be in (0, 1]")
        if self.sync_s <= 0 or self.tolerance < 0 or self.stabilization_s < 0 or self.min_replicas < 0:
            raise ValueError("sync_s must be positive; tolerance, stabilization_s and min_replicas >= 0")


class KvAutoscalerPolicy(WorstFitPolicy):
    """Worst-fit dispatch without migration, replicas sized by an HPA on mean KV usage (module docstring)."""

    name = "hpa"
    config_type: ClassVar[type[PolicyConfig]] = KvAutoscalerConfig

    def __init__(self, config: KvAutoscalerConfig) -> None:
        super().__init__(config)
        self.hpa = config
        self._now_s = 0.0
        self._next_sync_s = 0.0
        self._recommendations: deque[tuple[float, int]] = deque()  # (when, replicas), the stabilization window
        self.desired_replicas = config.min_replicas
        self._draining: set[str] = set()

    def schedule(self, batch: EventBatch, *, end_of_epoch: bool = True) -> Plan:
        self._now_s = batch.now_s
        return super().schedule(batch, end_of_epoch=end_of_epoch)

    @property
    def draining(self) -> frozenset[str]:
        return frozenset(self._draining)

    def _usable(self, gpu: Gpu, exclude: Gpu | None) -> bool:
        return super()._usable(gpu, exclude) and gpu.gpu_id not in self._draining

    def _serving(self) -> list[Gpu]:
        return [g for g in self.gpus.values() if not g.idle and g.gpu_id not in self._draining]

    def _activate(self, near: Gpu | None = None) -> Gpu:
        gpu = super()._activate(near)
        # A replica started for a request that fit nowhere is as if the HPA had asked for it now: its
        # scale-down waits out the stabilization window like any other (else a burst's replicas would
        # come and go between two syncs, unseen and unbilled by any real autoscaler).
        # It counts with the replicas holding something, not with emptied ones kept for the window
        # (those would otherwise raise the next recommendation, and the next, without load behind them).
        wanted = sum(1 for g in self._serving() if g.items or g.span_owner is not None) + 1
        if wanted > self.desired_replicas:
            self.desired_replicas = wanted
            self._recommendations.append((self._now_s, wanted))
        return gpu

    def _maybe_idle(self, gpu: Gpu) -> None:
        # An emptied replica stays while the HPA wants as many as serve; a draining one goes.
        if gpu.items or gpu.idle:
            return
        if gpu.gpu_id in self._draining or len(self._serving()) > self.desired_replicas:
            self._draining.discard(gpu.gpu_id)
            super()._maybe_idle(gpu)

    def after_batch(self) -> None:
        if self._now_s + 1e-9 < self._next_sync_s:
            return
        self._next_sync_s = self._now_s + self.hpa.sync_s
        serving = self._serving()
        load_bytes = sum(g.load_bytes for g in self.gpus.values() if not g.idle)
        current = len(serving)
        wanted = math.ceil(load_bytes / (self.hpa.target_utilization * self.capacity_bytes))
        if current > 0:
            usage_ratio = load_bytes / (current * self.capacity_bytes) / self.hpa.target_utilization
            if abs(usage_ratio - 1.0) <= self.hpa.tolerance:
                wanted = current
        wanted = max(wanted, self.hpa.min_replicas)
        window = self._recommendations
        window.append((self._now_s, wanted))
        while window and window[0][0] < self._now_s - self.hpa.stabilization_s:
            window.popleft()
        desired = max(r for _, r in window) if wanted < current else wanted
        desired = min(desired, max(2 * current, current + 4))
        self.desired_replicas = desired
        if desired > current:
            self._scale_up(desired - current)
        elif desired < current:
            self._scale_down(serving, current - desired)

    def _scale_up(self, count: int) -> None:
        # Replicas still draining are the cheapest to get back: they are running.
        for gpu_id in sorted(self._draining, key=lambda g: -self.gpus[g].load_bytes)[:count]:
            self._draining.discard(gpu_id)
            count -= 1
        for _ in range(count):
            self._activate()

    def _scale_down(self, serving: list[Gpu], count: int) -> None:
        victims = sorted(serving, key=lambda g: (g.load_bytes, -g.seq))[:count]
        for gpu in victims:
            self._draining.add(gpu.gpu_id)
            if not gpu.items:
                self._draining.discard(gpu.gpu_id)
                super()._maybe_idle(gpu)
