"""Registers kvfleet's attention backend (attention.py) in every vLLM process that is asked for it.

vLLM builds the model in its EngineCore process (and its worker processes), not where the engine was
created, and resolves a layer's attention backend there through its registry
(`vllm.v1.attention.backends.registry`). The one hook that runs in each of those processes before
the model is built is a `vllm.general_plugins` entry point (pyproject.toml names `register`). It
acts only when KVFLEET_VLLM_ATTENTION=distattention, which engine.py sets around the start of an
engine that asked for DistAttention (and a user may set for `vllm serve`), so every other vLLM
process in the environment keeps vLLM's own attention.

On CUDA the backend is vLLM's CUSTOM one, which the engine selects (`attention_config.backend`). The
CPU platform resolves CPU_ATTN whatever is selected, so there the backend is registered under that
name as well: in a process asked for DistAttention, CPU_ATTN is kvfleet's.

The same hook makes an EngineCore process exit without the interpreter's last full garbage
collection: once vLLM's own teardown has run, that scan of the whole heap (torch, vLLM, the model)
took 2 s of every engine stop here (2 cores), and the process's exit gives the memory back anyway.
vLLM does the same on ROCm (`gc.freeze()` at the end of `run_engine_core`, vllm/v1/engine/core.py).
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "KVFLEET_VLLM_ATTENTION"
# "1" in an engine whose requests may be longer than its KV cache (borrowing.py): vLLM's start-up check
# that one request of max_model_len fits the cache is skipped in its EngineCore.
BORROW_ENV = "KVFLEET_VLLM_BORROW"
DISTATTENTION = "distattention"
BACKEND_PATH = "kvfleet.worker.engines.vllm.attention.KvfleetAttentionBackend"


def register() -> None:
    """The entry point: called by vLLM in each of its processes (more than once is harmless)."""
    if multiprocessing.current_process().name.startswith("EngineCore"):
        # atexit runs before the interpreter's final collection; a frozen heap is not scanned by it.
        atexit.unregister(gc.freeze)
        atexit.register(gc.freeze)
    if os.environ.get(ENV) == DISTATTENTION:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        for member in (AttentionBackendEnum.CUSTOM, AttentionBackendEnum.CPU_ATTN):
            register_backend(member, BACKEND_PATH)
        if os.environ.get(BORROW_ENV) == "1":
            from kvfleet.worker.engines.vllm import internals

            internals.allow_contexts_beyond_cache()


def entry_point_installed() -> bool:
    """Whether vLLM will find `register` (an install without this project's entry points would not)."""
    from importlib.metadata import entry_points

    return any(ep.value == f"{__name__}:register" for ep in entry_points(group="vllm.general_plugins"))


@contextmanager
def asked(attention: str, borrow: bool = False) -> Iterator[None]:
    """KVFLEET_VLLM_ATTENTION (and KVFLEET_VLLM_BORROW) for the processes an engine start spawns: set
    while the block runs, then back to what they were."""
    before = {name: os.environ.get(name) for name in (ENV, BORROW_ENV)}
    os.environ[ENV] = attention
    os.environ[BORROW_ENV] = "1" if borrow else "0"
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
