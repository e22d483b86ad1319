"""The builtin engine's sampling: one token per request from a step's logits, reproducibly.

Migration needs a request's random stream to continue exactly on another engine, so a draw must
depend on nothing but the request and the token's place in it. Greedy at temperature 0; otherwise
temperature, then top-p, then one uniform draw from a generator seeded by (request seed, position of
the token in the sequence). A request resumed elsewhere therefore continues the same stream, whether
it arrives as prompt + output (a migration) or as one longer prompt (the router's resume after a
worker died: the position of its next token is the same).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How one request's next token is drawn."""

    temperature: float
    top_p: float
    seed: int
    position: int  # of the token drawn: tokens before it in prompt + output


def _draw_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_token(logits: torch.Tensor, sampling: Sampling) -> int:
    """One token from a row of float32 logits: temperature, top-p, then a seeded uniform draw.

    Inverse-CDF over the sorted distribution rather than torch.multinomial, so the result depends
    only on the probabilities and the (seed, position) draw, not on a generator's internal use.
    """
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True, stable=True)
    cumulative = sorted_probs.cumsum(0)
    # Keep the smallest prefix whose mass reaches top_p (the best token is always kept).
    kept = (cumulative - sorted_probs) < sampling.top_p
    sorted_probs = sorted_probs * kept
    cumulative = sorted_probs.cumsum(0)
    generator = torch.Generator().manual_seed(_draw_seed(sampling.seed, sampling.position))
    draw = torch.rand((), generator=generator, dtype=torch.float64).item() * cumulative[-1].item()
    index = int(torch.searchsorted(cumulative, torch.tensor([draw], dtype=cumulative.dtype), right=True).item())
    index = min(index, int(kept.sum().item()) - 1)
    return int(order[index].item())


def next_tokens(logits: torch.Tensor, samplings: Sequence[Sampling]) -> list[int]:
    """A step's tokens, one per row of `logits`: one argmax for the whole batch, a draw where sampled."""
    greedy = logits.argmax(dim=-1).tolist()
    return [int(greedy[i]) if s.temperature == 0 else sample_token(logits[i], s) for i, s in enumerate(samplings)]
