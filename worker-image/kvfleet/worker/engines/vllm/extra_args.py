"""kvfleet's entries in a vLLM request's `extra_args`: how kvfleet's logits processors (penalties.py,
structured.py) are told what a request carries, one key each, read back the same way by both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import SamplingParams as VLLMSamplingParams


def extra_entry(params: VLLMSamplingParams, key: str) -> Mapping[str, Any] | None:
    """The request's entry under `key`, None if it has none; ValueError if it is not a mapping (vLLM
    calls a processor's `validate_params` at admission and turns that into a refusal of the request)."""
    entry = (params.extra_args or {}).get(key)
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise ValueError(f"extra_args[{key!r}] must be a mapping")
    return entry
