"""Test-only: in the pytest process, vLLM's EngineCore processes start as forks of a server that has
already imported vLLM, instead of as fresh interpreters.

Why: vLLM's CPU platform forces the `spawn` start method (vllm/platforms/cpu.py sets
VLLM_WORKER_MULTIPROC_METHOD=spawn), so every engine start imports torch, vLLM and the model's code
again in a new interpreter: 9-11 s of CPU each on a 2-core machine, and the worker tests start
about 17 engines. Here vLLM gets a multiprocessing forkserver context instead (the name
vllm/v1/engine/utils.py imports `get_mp_context` under, which CoreEngineProcManager calls to start
the EngineCore; with kvfleet's VLLM_ENABLE_V1_MULTIPROCESSING=0 on small CPUs the model worker runs
inside the EngineCore, so no other process is started). The forkserver imports `PRELOAD` once, the
first time an engine starts; each start after that is a fork of it.

What stays as under spawn:
- the environment and stdout/stderr: a forkserver's child would inherit the server's (those of the
  first start), but tests and kvfleet set variables per engine that its EngineCore reads (kvfleet's
  plugin.asked(), VLLM_PLUGINS, the elastic tests' map failures). `EnvProcess` takes the parent's as
  they are at start() and sets them in the child before it unpickles anything else.
- plugins: vLLM loads its general plugins (kvfleet's plugin.register) in EngineCore.__init__, in the
  child; the server only imports modules, and importing them loads none (vllm.plugins.plugins_loaded
  stays False there) and enables no cache of vLLM's environment variables (vllm.envs).
- a clean start: each child is a fork of the server, never of an earlier engine. The server runs no
  torch op and starts no thread of its own while importing (a fork of a process with an OpenMP pool
  or other threads is not safe); the only threads there are the idle pools OpenBLAS starts when numpy
  and OpenCV load it, which OpenBLAS itself shuts down before every fork (pthread_atfork).
Different: the child's parent is the server, which lives as long as this process (tests that look
for processes that outlive an engine leave its pid out, as they do multiprocessing's resource
tracker's), and a child ends with os._exit as any forked multiprocessing child, so the
interpreter's exit handlers do not run there (vLLM's teardown runs before, in run_engine_core).

Why test-only: it leans on vLLM's internals (where get_mp_context is looked up), and a worker starts
one engine, so the product gains nothing; the product path stays vLLM's own spawn, which the e2e
worker pods and the bench subprocesses keep exercising. KVFLEET_TEST_VLLM_SPAWN=1 turns this off, so
the tests run that path too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import multiprocessing.context
import multiprocessing.forkserver
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import reduction
from types import ModuleType
from typing import Any

DISABLE_ENV = "KVFLEET_TEST_VLLM_SPAWN"
# The module whose `get_mp_context` (imported by name from vllm.utils.system_utils) starts EngineCores.
TARGET = "vllm.v1.engine.utils"
# What an EngineCore start imports (vLLM's core and CPU worker, the tiny model's architecture, kvfleet's
# connector, plugin, attention backend and logits processors), imported once by the server: what a
# child still imports after the fork takes ~0.1 s.
PRELOAD = [
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.models.llama",
    "compressed_tensors",
    "kvfleet.worker.engines.vllm.connector",
    "kvfleet.worker.engines.vllm.plugin",
    "kvfleet.worker.engines.vllm.attention",
    "kvfleet.worker.engines.vllm.penalties",
    "kvfleet.worker.engines.vllm.structured",
]

GetContext = Callable[[], multiprocessing.context.BaseContext]


def _adopt(environ: dict[str, str], stdout: Any, stderr: Any) -> None:
    """In the child, as its process object is unpickled: the parent's environment and stdio at start()."""
    try:
        # vLLM names its processes with setproctitle, which finds the process's argv just before the
        # C environment's first string, and sets itself up at its first call: before that moves.
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(environ)
    for target, inherited in ((1, stdout), (2, stderr)):
        if inherited is not None:
            stream = sys.stdout if target == 1 else sys.stderr
            if stream is not None:
                stream.flush()
            fd = inherited.detach()
            os.dup2(fd, target)
            os.close(fd)


def _for_child(fd: int) -> Any:
    """`fd`, sent to the child with the process (None where this process has it closed)."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


class _ParentState:
    """Pickled as a call of `_adopt` with the environment and stdio of the moment it is pickled, which
    is in start(); it unpickles to None."""

    def __reduce__(self) -> tuple[Callable[..., None], tuple[Any, ...]]:
        return _adopt, (dict(os.environ), _for_child(1), _for_child(2))


class EnvProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver process that starts with its parent's environment and stdio, as a spawned one does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set first, so that it is the first of the process's state to be pickled and unpickled: the
        # child takes the environment before it unpickles (and imports for) the target's arguments.
        self._parent_state: _ParentState | None = _ParentState()
        super().__init__(*args, **kwargs)


class EnvForkServerContext(multiprocessing.context.ForkServerContext):
    Process = EnvProcess


CONTEXT = EnvForkServerContext()


def _patch(module: ModuleType) -> None:
    original: GetContext = module.get_mp_context

    def get_mp_context() -> multiprocessing.context.BaseContext:
        # vLLM's own first (it forces spawn and syncs device variables as it would); the forkserver
        # only where that is spawn.
        context = original()
        return CONTEXT if context.get_start_method() == "spawn" else context

    get_mp_context.__wrapped__ = original  # type: ignore[attr-defined]
    vars(module)["get_mp_context"] = get_mp_context


def _unpatch(module: ModuleType) -> None:
    original = getattr(module.get_mp_context, "__wrapped__", None)
    if original is not None:
        vars(module)["get_mp_context"] = original


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches TARGET as soon as it is imported, so that a session that starts no vLLM engine does
    not import vLLM for this: finds the module with the other finders and runs it with their loader."""

    def __init__(self) -> None:
        self._loader: importlib.abc.Loader | None = None

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is None:
                    return None
                self._loader = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        assert self._loader is not None
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        loader = self._loader
        assert loader is not None
        # The module as its own loader would leave it (tracebacks and inspect read through __loader__).
        module.__loader__ = loader
        if module.__spec__ is not None:
            module.__spec__.loader = loader
        loader.exec_module(module)
        _patch(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)


@contextmanager
def installed() -> Iterator[bool]:
    """vLLM's EngineCores start from the forkserver while the block runs (yields whether they do: not
    where vLLM is missing or KVFLEET_TEST_VLLM_SPAWN=1)."""
    if os.environ.get(DISABLE_ENV) == "1" or importlib.util.find_spec("vllm") is None:
        yield False
        return
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    hook: _PatchOnImport | None = None
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    else:
        hook = _PatchOnImport()
        sys.meta_path.insert(0, hook)
    try:
        yield True
    finally:
        if hook is not None and hook in sys.meta_path:
            sys.meta_path.remove(hook)
        if TARGET in sys.modules:
            _unpatch(sys.modules[TARGET])


def forkserver_pid() -> int | None:
    """The forkserver's process id (None before its first start): it lives as long as this process."""
    pid: int | None = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    return pid
