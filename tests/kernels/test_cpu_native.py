"""The CPU's C decode kernel (kvfleet.kernels.cpu_native) against the fp64 reference, on the shapes that
break paged attention: random block tables, GQA, every dtype, empty sequences, tokens past a table's
row (test_torch_backend.py, through dispatch), K and V interleaved in one row (vLLM's NHD layout) and
block-major views, one thread and many; and `dispatch`'s choice between it and the torch backend."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_testing import assert_close, make_paged

from kvfleet.kernels import cpu_native, dispatch
from kvfleet.kernels._checks import micro_attention_decode_inputs
from kvfleet.kernels.micro_attention_decode_reference import micro_attention_decode_reference

HEAD_DIM = 24

pytestmark = pytest.mark.skipif(cpu_native.status() != "native", reason=f"the C kernel is not built: {cpu_native.status()}")


def _paged(lens: list[int], q_heads: int, kv_heads: int, dtype: torch.dtype, block_size: int,
           seed: int, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lens]
    k_cache, v_cache, table, seq_lens = make_paged(keys, values, block_size=block_size, num_spare_blocks=3, generator=g)
    q = torch.randn(len(lens), q_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, table, seq_lens


def _native(*args: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = micro_attention_decode_inputs("torch", *args, **kwargs)  # type: ignore[arg-type]
    assert cpu_native.takes(inputs)
    return cpu_native.decode(inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_matches_reference(dtype: torch.dtype, q_heads: int, kv_heads: int, block_size: int) -> None:
    lens = [0, 1, 17, 130, 33]
    q, k_cache, v_cache, table, seq_lens = _paged(lens, q_heads, kv_heads, dtype, block_size, q_heads * 7 + block_size)
    out, lse = _native(q, k_cache, v_cache, table, seq_lens)
    ref_out, ref_lse = micro_attention_decode_reference(q, k_cache, v_cache, table, seq_lens)
    assert out.dtype == lse.dtype == torch.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(8, 8), (32, 4), (128, 8)])
def test_the_head_dims_compiled_apart_match_reference(head_dim: int, q_heads: int, kv_heads: int) -> None:
    """head_dim 64 and 128 run loops compiled for them; a batch of one splits its KV heads over items,
    and a large group (128 query heads) takes fewer KV heads per item."""
    for lens in ([300, 0, 129], [700]):
        q, k_cache, v_cache, table, seq_lens = _paged(lens, q_heads, kv_heads, torch.float32, 16, head_dim, head_dim)
        out, lse = _native(q, k_cache, v_cache, table, seq_lens)
        ref_out, ref_lse = micro_attention_decode_reference(q, k_cache, v_cache, table, seq_lens)
        assert_close(out, ref_out, torch.float32)
        assert_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_the_work_and_agree(threads: int) -> None:
    """The (sequence, kv head) items split over threads, whatever their number: long enough contexts
    that the kernel starts more than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k_cache, v_cache, table, seq_lens = _paged([700, 300, 1, 900], 8, 2, torch.float32, 16, 5)
        out, lse = _native(q, k_cache, v_cache, table, seq_lens)
    finally:
        torch.set_num_threads(before)
    ref_out, ref_lse = micro_attention_decode_reference(q, k_cache, v_cache, table, seq_lens)
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


def test_reads_k_and_v_interleaved_in_one_row() -> None:
    """vLLM's NHD layout as kvfleet's vLLM backend keeps it: [blocks, block_size, kv_heads, 2 x head_dim],
    K the first half of each row and V the second; and a block-major view (elastic memory's)."""
    q, k_cache, v_cache, table, seq_lens = _paged([40, 9, 0], 4, 2, torch.bfloat16, 8, 3)
    rows = torch.cat((k_cache, v_cache), dim=-1)
    ref_out, ref_lse = micro_attention_decode_reference(q, k_cache, v_cache, table, seq_lens)
    out, lse = _native(q, rows[..., :HEAD_DIM], rows[..., HEAD_DIM:], table, seq_lens)
    assert_close(out, ref_out, torch.bfloat16)
    assert_close(lse, ref_lse, torch.bfloat16)
    both = torch.stack((k_cache, v_cache), dim=1)
    out, lse = _native(q, both[:, 0], both[:, 1], table, seq_lens)
    assert_close(out, ref_out, torch.bfloat16)


def test_what_it_does_not_take_goes_to_the_torch_backend() -> None:
    """A GQA group above the kernel's limit, or a cache whose K and V differ in strides."""
    q, k_cache, v_cache, table, seq_lens = _paged([12], 17 * 2, 2, torch.float32, 4, 9)
    big_group = micro_attention_decode_inputs("torch", q, k_cache, v_cache, table, seq_lens)
    assert not cpu_native.takes(big_group)
    out, lse = dispatch.micro_attention_decode(q, k_cache, v_cache, table, seq_lens)
    ref_out, _ = micro_attention_decode_reference(q, k_cache, v_cache, table, seq_lens)
    assert_close(out, ref_out, torch.float32)
    q, k_cache, v_cache, table, seq_lens = _paged([12], 4, 2, torch.float32, 4, 9)
    wider = torch.cat((v_cache, v_cache), dim=-1)[..., :HEAD_DIM]
    assert not cpu_native.takes(micro_attention_decode_inputs("torch", q, k_cache, wider, table, seq_lens))


def test_the_torch_backend_can_be_chosen_outright() -> None:
    code = ("from kvfleet.kernels import cpu_native; import sys; s = cpu_native.status(); print(s); "
            "sys.exit(0 if s == 'torch (KVFLEET_CPU_DECODE=torch)' else 1)")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVFLEET_CPU_DECODE": "torch"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_machine_without_a_compiler_loads_a_prebuilt_portable_build(tmp_path: Path) -> None:
    """The worker image's build stage prebuilds; its final stage has no compiler. Here the compiler
    fails, the cache is empty, and the prebuilt folder holds this source's portable builds."""
    compiler = os.environ.get("CC") or shutil.which("cc") or "gcc"
    built = cpu_native.prebuild(compiler, tmp_path / "prebuilt")
    assert built and all(p.exists() for p in built)
    code = """
import torch, sys
sys.path.insert(0, sys.argv[1])
from kernel_testing import make_paged
from kvfleet.kernels import cpu_native
from kvfleet.kernels._checks import micro_attention_decode_inputs
from kvfleet.kernels.micro_attention_decode_reference import micro_attention_decode_reference
assert cpu_native.status() == "native", cpu_native.status()
g = torch.Generator().manual_seed(4)
keys = [torch.randn(n, 2, 64, generator=g) for n in (70, 3)]
values = [torch.randn(n, 2, 64, generator=g) for n in (70, 3)]
k, v, table, lens = make_paged(keys, values, block_size=16, num_spare_blocks=1, generator=g)
q = torch.randn(2, 4, 64, generator=g)
out, lse = cpu_native.decode(micro_attention_decode_inputs("torch", q, k, v, table, lens))
ref, _ = micro_attention_decode_reference(q, k, v, table, lens)
assert (out.double() - ref).abs().max() < 1e-4
print(cpu_native._prebuilt().name)
"""
    env = {**os.environ, "CC": "/bin/false", "KVFLEET_KERNEL_CACHE": str(tmp_path / "cache"),
           "KVFLEET_KERNEL_PREBUILT": str(tmp_path / "prebuilt")}
    result = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() in {p.name for p in built}
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir()), "nothing was built"
