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
releases the GIL). A machine with no compiler (the worker image keeps build tools out of its final
stage) loads a portable build made ahead of time (`python -m kvfleet.kernels.cpu_native --prebuild`,
in the image's build stage) when one matches this source and CPU. Where there is neither, `dispatch`
keeps the torch backend and `status()` says why; KVFLEET_CPU_DECODE=torch chooses the torch backend
outright (benchmarks compare the two with it).
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
# Builds made ahead of time (a container image's build stage: `python -m kvfleet.kernels.cpu_native
# --prebuild`), for machines that have no compiler at run time.
PREBUILT = Path(__file__).with_name("prebuilt")
# -fopenmp: the library needs libgomp.so.1, which resolves to the copy torch loaded (cpu_decode.c says why).
# -fassociative-math (which needs the two after it) lets a dot product's lanes add as a tree: summed in
# order they made a 15-add dependency chain per key, and the kernel 2.5x slower. Infinities and NaNs
# keep their meaning (no -ffinite-math-only): empty parts are -inf.
COMMON_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
                "-shared", "-fPIC")
FLAGS = ("-march=native", *COMMON_FLAGS)
# Prebuilt targets, best first, with the CPU flags each needs (x86-64-v3: AVX2 and FMA, 2013 on; v2 runs
# on any x86-64 server CPU of the last fifteen years). Other architectures get one generic build.
PORTABLE = {"x86_64": (("x86-64-v3", ("avx2", "fma", "bmi2", "movbe")), ("x86-64-v2", ("sse4_2", "popcnt")))}
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


def _cpu_flags() -> set[str]:
    try:
        line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        line = ""
    return set(line.partition(":")[2].split())


def _source_digest(*parts: str) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in parts:
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> Path:
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed: processes that build at once each finish a whole file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, "-o", str(built), str(SOURCE), "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def _build(compiler: str) -> Path:
    """This machine's build in the cache: -march=native, so the name carries the CPU's flags too (a
    cache shared between machines must not mix their builds)."""
    name = _source_digest(" ".join(FLAGS), compiler, platform.machine(), " ".join(sorted(_cpu_flags())))
    return _compile(compiler, FLAGS, cache_dir() / f"cpu_decode-{name}.so")


def _portable_targets() -> list[tuple[str, tuple[str, ...]]]:
    return list(PORTABLE.get(platform.machine(), (("", ()),)))


def _prebuilt_name(march: str) -> str:
    return f"cpu_decode-{_source_digest(march, *COMMON_FLAGS)}-{march or 'generic'}.so"


def prebuild(compiler: str, into: Path = PREBUILT) -> list[Path]:
    """Portable builds of this source for this architecture (every target of PORTABLE) into `into`."""
    return [_compile(compiler, (f"-march={march}",) * bool(march) + COMMON_FLAGS, into / _prebuilt_name(march))
            for march, _ in _portable_targets()]


def _prebuilt() -> Path | None:
    """The best prebuilt library of this source this CPU runs, if any (KVFLEET_KERNEL_PREBUILT names
    another folder than the package's)."""
    into = Path(os.environ.get("KVFLEET_KERNEL_PREBUILT") or PREBUILT)
    flags = _cpu_flags()
    for march, needs in _portable_targets():
        path = into / _prebuilt_name(march)
        if path.exists() and set(needs) <= flags:
            return path
    return None


def _open(path: Path) -> ctypes.CDLL:
    global _limits
    library = ctypes.CDLL(str(path))
    fn = library.kvfleet_paged_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64,
                   ctypes.c_float, ctypes.c_int, ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    library.kvfleet_decode_limits.argtypes = [i64]
    library.kvfleet_decode_limits.restype = i64
    _limits = (library.kvfleet_decode_limits(0), library.kvfleet_decode_limits(1), library.kvfleet_decode_limits(2))
    return library


def _load() -> ctypes.CDLL | None:
    """The library, built on first call (or prebuilt); None (with `_why_not` set) where there is none."""
    global _library, _why_not
    with _lock:
        if _library is not None or _why_not is not None:
            return _library
        if os.environ.get("KVFLEET_CPU_DECODE", "native") == "torch":
            _why_not = "KVFLEET_CPU_DECODE=torch"
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        failure = None
        if compiler is not None:
            try:
                _library = _open(_build(compiler))
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                failure = f"building {SOURCE.name} failed: {err}"
        if _library is None:
            prebuilt = _prebuilt()
            if prebuilt is not None:
                try:
                    _library = _open(prebuilt)
                except OSError as err:
                    failure = f"loading {prebuilt.name} failed: {err}"
        if _library is None:
            _why_not = failure or (f"no C compiler (cc, gcc or $CC) on this machine and no build of this source "
                                   f"for its CPU in {PREBUILT}")
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


def main(argv: list[str] | None = None) -> None:
    """`python -m kvfleet.kernels.cpu_native --prebuild [DIR]`: the portable builds for machines without
    a compiler (the worker image's build stage)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--prebuild", nargs="?", const=str(PREBUILT), metavar="DIR", required=True,
                        help=f"write the portable builds for this architecture into DIR (default {PREBUILT})")
    args = parser.parse_args(argv)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        parser.error("no C compiler (cc, gcc or $CC)")
    for path in prebuild(compiler, Path(args.prebuild)):
        print(path)


if __name__ == "__main__":
    main()
