"""The package imports cheaply (no torch, triton or GPU at import) and exports the launchers."""

from __future__ import annotations

import subprocess
import sys

import kvfleet.kernels


def test_import_loads_neither_torch_nor_triton() -> None:
    code = "import sys, kvfleet.kernels; sys.exit(int('torch' in sys.modules or 'triton' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_launchers_are_exported() -> None:
    from kvfleet.kernels import (  # noqa: F401
        micro_attention_decode,
        micro_attention_prefill,
        scale_reduce,
        scale_reduce_pair,
        scale_reduce_varlen,
    )

    assert all(callable(getattr(kvfleet.kernels, name)) for name in kvfleet.kernels.__all__)
