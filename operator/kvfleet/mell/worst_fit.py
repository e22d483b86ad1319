"""The `wf` baseline (MELL §VIII-B): each incoming request to the GPU with the most free memory; no
migration (no_migration.py). Also the dispatch of the load-balance baseline (load_balance.py)."""

from __future__ import annotations

from kvfleet.mell.no_migration import NoMigrationPolicy
from kvfleet.mell.state import Gpu


class WorstFitPolicy(NoMigrationPolicy):
    name = "wf"

    def choose(self, size_bytes: int, exclude: Gpu | None) -> Gpu | None:
        index = self._sync_free_index()
        pos = len(index) - 1
        while pos >= 0 and index[pos][0] >= size_bytes:
            gpu = self.gpus[index[pos][2]]
            if self._usable(gpu, exclude):
                return gpu
            pos -= 1
        return None
