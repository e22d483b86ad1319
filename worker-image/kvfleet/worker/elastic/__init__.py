"""Elastic memory's physical layer (eLLM §4.2): a pool of chunks, virtual tensors over it, backends.

chunks.py keeps who owns each chunk, memory.py the backends' protocol (host.py: memfd and mmap;
cuda.py: CUDA's VMM), etensor.py the virtual tensors that map chunks on demand, policy.py eLLM's
Algorithms 1 and 2 as pure functions. Their users are the builtin engine's elastic scheduler
(engines/builtin/elastic.py) and the vLLM engine's connector (engines/vllm/elastic.py);
docs/elastic-memory.md says why.
"""

from kvfleet.worker.elastic.chunks import ChunkPool, Owner, OwnershipError, PoolExhausted
from kvfleet.worker.elastic.etensor import ETensor
from kvfleet.worker.elastic.memory import (
    Fence,
    MapError,
    PhysicalMemory,
    QueueFence,
    VirtualRange,
    granularity_bytes,
    open_memory,
    record_marker,
)

__all__ = ["ChunkPool", "ETensor", "Fence", "MapError", "Owner", "OwnershipError", "PhysicalMemory", "PoolExhausted",
           "QueueFence", "VirtualRange", "granularity_bytes", "open_memory", "record_marker"]
