"""The DistAttention ops for serving: Triton kernels for CUDA tensors, the CPU's otherwise.

An engine calls these and never chooses a backend itself. Each op checks its inputs once, by the
rules of the backend the tensors' device selects (_checks.py: the one validator per op, whose
signature and docstring these functions take), and hands the checked record to that backend, which
checks nothing again. The Triton launchers are imported only when a CUDA tensor arrives, so a CPU
worker neither loads triton nor needs it installed, and CPU tensors never reach the Triton
interpreter, which is for tests (tests/kernels), not for serving. On the CPU, decode runs the C
kernel (cpu_native.py) where this machine could build it, and everything else the torch backend. Tuning knobs of one backend
(split counts, tile sizes) stay with that backend; hints for one (max_q_len for Triton,
max_logits_bytes for torch) are part of the contract and ignored by the other.
"""

from __future__ import annotations

from kvfleet.kernels import _checks, cpu_native, torch_backend
from kvfleet.kernels._checks import Partial, entry_point


def _decode(inputs: _checks.PagedAttention) -> Partial:
    if inputs.triton:
        from kvfleet.kernels.micro_attention_decode_launcher import launch_decode

        return launch_decode(inputs)
    if cpu_native.takes(inputs):
        return cpu_native.decode(inputs)
    return torch_backend.decode(inputs)


def _prefill(inputs: _checks.PagedPrefill) -> Partial:
    if inputs.triton:
        from kvfleet.kernels.micro_attention_prefill_launcher import launch_prefill

        return launch_prefill(inputs)
    return torch_backend.prefill(inputs)


def _merge(inputs: _checks.Merge) -> Partial:
    if inputs.triton:
        from kvfleet.kernels.scale_reduce_launcher import launch_merge

        return launch_merge(inputs)
    return torch_backend.merge(inputs)


def _merge_pair(inputs: _checks.PairMerge) -> Partial:
    if inputs.triton:
        from kvfleet.kernels.scale_reduce_launcher import launch_pair

        return launch_pair(inputs)
    return torch_backend.merge_pair(inputs)


micro_attention_decode = entry_point(_checks.micro_attention_decode_inputs, "by_device", _decode)
micro_attention_prefill = entry_point(_checks.micro_attention_prefill_inputs, "by_device", _prefill)
scale_reduce = entry_point(_checks.scale_reduce_inputs, "by_device", _merge)
scale_reduce_varlen = entry_point(_checks.scale_reduce_varlen_inputs, "by_device", _merge)
scale_reduce_pair = entry_point(_checks.scale_reduce_pair_inputs, "by_device", _merge_pair)
