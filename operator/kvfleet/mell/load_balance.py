"""The `lb` baseline (MELL §VIII-B): WF dispatch plus Llumnix-style load balancing.

GPUs are paired most-loaded with least-loaded and a request moves across a pair while that narrows
the pair's gap; the only baseline that migrates, and so the only one with a knob of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvfleet.mell.cluster import PolicyConfig
from kvfleet.mell.size_classes import SizeClass
from kvfleet.mell.state import Item
from kvfleet.mell.worst_fit import WorstFitPolicy


@dataclass(frozen=True)
class LoadBalanceConfig(PolicyConfig):
    """Knobs of `lb`."""

    # Migrate only while the pair's gap exceeds this share of C.
    gap_fraction: float = 0.1


class LoadBalancePolicy(WorstFitPolicy):
    """Llumnix-style: WF dispatch, then migrations from the most to the least loaded GPUs."""

    name = "lb"
    config_type: ClassVar[type[PolicyConfig]] = LoadBalanceConfig

    def __init__(self, config: LoadBalanceConfig) -> None:
        super().__init__(config)
        self.cfg: LoadBalanceConfig = config

    def after_batch(self) -> None:
        gap_min = self.cfg.gap_fraction * self.capacity_bytes
        gpus = sorted((g for g in self.gpus.values() if not g.idle and g.category is not SizeClass.X),
                      key=lambda g: (-g.load_bytes, g.seq))
        for k in range(len(gpus) // 2):
            heavy = gpus[k]
            light = gpus[len(gpus) - 1 - k]
            # Llumnix pairs instances by load and migrates one request at a time while the pair's gap
            # narrows; the smallest request that narrows it moves first (least to copy).
            while heavy.load_bytes - light.load_bytes > gap_min:
                gap = heavy.load_bytes - light.load_bytes
                best: Item | None = None
                for it in heavy.items.values():
                    if 2 * it.size_bytes <= gap and light.load_bytes + it.size_bytes <= self.capacity_bytes:
                        if best is None or it.size_bytes < best.size_bytes:
                            best = it
                if best is None:
                    break
                self._move(best, light, "balance")
