"""The `bf` baseline (MELL §VIII-B): each incoming request to the GPU with the least free memory that
still fits it; no migration (no_migration.py). Its own module so that the policy's name finds it."""

from __future__ import annotations

from bisect import bisect_left

from kvfleet.mell.no_migration import NoMigrationPolicy
from kvfleet.mell.state import Gpu


class BestFitPolicy(NoMigrationPolicy):
    name = "bf"

    def choose(self, size_bytes: int, exclude: Gpu | None) -> Gpu | None:
        index = self._sync_free_index()
        pos = bisect_left(index, (size_bytes, -1, ""))
        while pos < len(index):
            gpu = self.gpus[index[pos][2]]
            if self._usable(gpu, exclude):
                return gpu
            pos += 1
        return None
