"""GPU memory and utilisation for the worker's /metrics, from NVML when a GPU is present.

nvidia-ml-py talks to the driver, not to CUDA, so it reads the whole device as `nvidia-smi` does
(memory used by every process, not only this engine). Without a driver the worker runs on the CPU
and the GPU metrics are simply absent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPUSample:
    index: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int


class GPUProbe:
    """Opens NVML once; `sample()` is empty when there is no NVIDIA driver."""

    def __init__(self) -> None:
        self._nvml = None
        try:
            import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no types

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._count = int(pynvml.nvmlDeviceGetCount())
        except Exception as err:  # no driver, no library, no device: a CPU worker
            log.info("no GPU metrics: %s", err)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def sample(self) -> list[GPUSample]:
        if self._nvml is None:
            return []
        nvml = self._nvml
        out = []
        for index in range(self._count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
            out.append(GPUSample(index, int(memory.used), int(memory.total), int(rates.gpu)))
        return out
