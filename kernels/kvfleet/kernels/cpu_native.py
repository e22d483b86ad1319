"""The CPU's decode micro-attention in C (cpu_decode.c), built with the machine's C compiler at first use.

The torch backend's decode gathers every block of the context into a head-major copy before its two
matmuls: at batch 16 and 2,048 tokens that is two copies of 32 MB a layer, and vLLM's CPU kernel,
which reads each row once where it lies, attends 20x faster. The decode step is the one every
running request takes every step, so the CPU gets a kernel of its own for it: cpu_decode.c, the same
contract (`micro_attention_decode`, _checks.py) in one pass with an online softmax, threads over
(sequence, kv head). Prefill stays with the torch backend, whose per-sequence matmuls are already
compute-bound.

It is plain C with no Python or torch headers, so it compiles in well under a second: `cc` (or $CC)
builds it once per source, flags and CPU into the cache folder (KVFLEET_KERNEL_CACHE, else
$XDG_CACHE_HOME/kvfleet/kernels, else ~/.cache/kvfleet/kernels), and ctypes loads it (a foreign call
releases the GIL). Where there is no compiler, or the build fails, `dispatch` keeps the torch backend
and `status()` says why; KVFLEET_CPU_DECODE=torch chooses the torch backend outright (benchmarks
compare the two with it).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kvfleet.kernels._checks import PagedAttention, Partial

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
# -fopenmp: the library needs libgomp.so.1, which resolves to the copy torch loaded (cpu_decode.c says why).
# -fassociative-math (which needs the two after it) lets a dot product's lanes add as a tree: summed in
# order they made a 15-add dependency chain per key, and the kernel 2.5x slower. Infinities and NaNs
# keep their meaning (no -ffinite-math-only): empty parts are -inf.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-shared", "-fPIC")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Below this many (sequence, kv head, token) reads one thread is quicker than starting others.
_THREAD_MIN_WORK = 8192

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_why_not: str | None = None
_limits: tuple[int, int, int] = (0, 0, 0)


def cache_dir() -> Path:
    if os.environ.get("KVFLEET_KERNEL_CACHE"):
        return Path(os.environ["KVFLEET_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvfleet" / "kernels"


def _cpu_signature() -> str:
    """-march=native builds for this CPU: a cache shared between machines must not mix their builds."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build(compiler: str) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), _cpu_signature().encode()):
        digest.update(part)
    target = cache_dir() / f"cpu_decode-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed: processes that build at once each finish a whole file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def _load() -> ctypes.CDLL | None:
    """The library, built on first call; None (with `_why_not` set) where it cannot be."""
    global _library, _why_not, _limits
    with _lock:
        if _library is not None or _why_not is not None:
            return _library
        if os.environ.get("KVFLEET_CPU_DECODE", "native") == "torch":
            _why_not = "KVFLEET_CPU_DECODE=torch"
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            _why_not = "no C compiler (cc, gcc or $CC) on this machine"
        else:
            try:
                library = ctypes.CDLL(str(_build(compiler)))
                fn = library.kvfleet_paged_decode
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64,
                               ctypes.c_float, ctypes.c_int, ptr, ptr, ctypes.c_int]
                fn.restype = ctypes.c_int
                library.kvfleet_decode_limits.argtypes = [i64]
                library.kvfleet_decode_limits.restype = i64
                _limits = (library.kvfleet_decode_limits(0), library.kvfleet_decode_limits(1),
                           library.kvfleet_decode_limits(2))
                _library = library
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _why_not = f"building {SOURCE.name} failed: {err}"
        if _why_not is not None:
            log.warning("CPU decode attention runs on the torch backend: %s", _why_not)
        return _library


def status() -> str:
    """'native', or why the torch backend decodes on the CPU."""
    return "native" if _load() is not None else f"torch ({_why_not})"


def takes(inputs: PagedAttention) -> bool:
    """Whether the C kernel computes these checked inputs (else the torch backend does): built here,
    CPU tensors of a dtype it reads, a GQA group, head_dim and block within its limits, and unit
    strides where it assumes them (it takes the others)."""
    if inputs.triton or inputs.q.device.type != "cpu" or inputs.q.dtype not in _DTYPES or _load() is None:
        return False
    max_group, max_dim, max_block = _limits
    q, k, v = inputs.q, inputs.k_cache, inputs.v_cache
    return (inputs.num_q_heads // inputs.num_kv_heads <= max_group and inputs.head_dim <= max_dim
            and inputs.block_size <= max_block and q.stride(2) == 1 and k.stride(3) == 1 and k.stride() == v.stride()
            and inputs.block_table.stride(1) == 1 and inputs.lens.is_contiguous() and inputs.out.is_contiguous()
            and inputs.out_lse.is_contiguous())


def decode(inputs: PagedAttention) -> Partial:
    """`micro_attention_decode` on inputs `takes` accepted."""
    library = _load()
    assert library is not None
    q, k, v, table, out, lse = inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_table, inputs.out, inputs.out_lse
    seqs = q.shape[0]
    if seqs == 0:
        return out, lse
    items = seqs * inputs.num_kv_heads
    threads = torch.get_num_threads() if items * inputs.max_num_tokens >= _THREAD_MIN_WORK else 1
    library.kvfleet_paged_decode(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        table.data_ptr(), table.stride(0), table.shape[1], inputs.lens.data_ptr(), seqs, inputs.num_q_heads,
        inputs.num_kv_heads, inputs.head_dim, inputs.block_size, inputs.scale, _DTYPES[q.dtype], out.data_ptr(),
        lse.data_ptr(), min(threads, items))
    return out, lse
