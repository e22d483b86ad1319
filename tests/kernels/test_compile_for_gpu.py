"""Every kernel configuration the launchers use on a GPU compiles for sm_90 (H100/H200) on this CPU.

The interpreter cannot tell whether Triton's compiler accepts a kernel; compile_for_gpu.py asks the
compiler itself, in a separate process because this one runs with TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(
    os.environ.get("KVFLEET_KERNELS_ON_GPU", "0") == "1",
    reason="on a GPU the other tests compile and run the kernels for real; this ahead-of-time check "
    "(which works with Triton 3.6 and 3.7) only repeats them",
)
def test_all_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a cache
    script = Path(__file__).with_name("compile_for_gpu.py")
    result = subprocess.run(
        [sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(compiled) == 11, result.stdout
    # Shared memory must fit an H100 SM (228 KB, 227 KB usable per block).
    assert max(c["shared_bytes"] for c in compiled) <= 227 * 1024
