"""The builtin engine's sampling: one token per request from a step's logits, with vLLM's parameters, reproducibly.

Clients send vLLM's sampling parameters (base.SamplingParams), and a request must mean the same on
this engine as on vLLM, so the processing follows vLLM v1's sampler and logits processors, in its
order: the structured-output mask, min_tokens (no stop token yet), logit_bias, the penalties
(repetition over prompt and output, frequency and presence over the output), then greedy argmax at
temperature 0, else temperature, min_p, top_k and top_p, and one draw. Log-probabilities are vLLM's
default `raw_logprobs`: of the model's logits before any of that.

Migration needs a request's random stream to continue exactly on another engine, so a draw must
depend on nothing but the request and the token's place in it: it is one uniform draw from a
generator seeded by (request seed, position of the token in the sequence), turned into a token by
the inverse CDF of the processed distribution. Everything the processing reads is the request's own
tokens (prompt and output, for the penalties and min_tokens) and its grammar, which the engine
rebuilds from the output tokens (`TokenConstraint`), so nothing here is state to carry: a request
resumed elsewhere continues the same stream whether it arrives as prompt + output (a migration) or
as one longer prompt (the router's resume after a worker died: the position of its next token is the
same; what only counts output tokens, frequency and presence penalties and min_tokens, then counts
from the resume, as vLLM would for that prompt).

A step in which every request is greedy with nothing to process and no logprobs is one batched
argmax, as before these parameters existed (the benches' hot path).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvfleet.worker.engines.base import SamplingParams, StructuredOutput, TokenLogprobs

# vLLM's _SAMPLING_EPS: a temperature below it is greedy.
SAMPLING_EPS = 1e-5
NEG_INF = float("-inf")


class TokenConstraint(Protocol):
    """A structured-output constraint on one request (its grammar, engines/grammar.py), as
    sampling and the scheduler use it: which tokens may come next, and whether it is complete."""

    def allowed(self) -> torch.Tensor:
        """A bool tensor of the logits' width: True where the token may come next. While the constraint
        is not finished, at least one token is allowed."""
        ...

    def advance(self, token_id: int) -> None:
        """Take the token the request produced (one `allowed` said may come)."""
        ...

    @property
    def finished(self) -> bool:
        """The constraint is complete: the request ends now, finish_reason "stop"."""
        ...


# Builds a request's constraint from its spec and the output tokens generated already (replayed
# through it: a migrated or resumed request continues its grammar where it was).
MakeConstraint = Callable[[StructuredOutput, Sequence[int]], TokenConstraint]

# One row's result: the token, and its log-probabilities when the request asked for them.
Sampled = tuple[int, TokenLogprobs | None]


@dataclass(frozen=True)
class Sampling:
    """How one request's next token is chosen: its parameters and everything they read.

    `prompt` and `output` are the request's own lists, by reference (no copy a step): nothing appends
    to them while the step that reads them computes (the scheduler delivers tokens after it)."""

    params: SamplingParams
    seed: int
    position: int  # of the token chosen: tokens before it in prompt + output
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()
    # The tokens min_tokens holds back: the model's EOS ids and stop_token_ids (vLLM's
    # all_stop_token_ids, which holds EOS even with ignore_eos).
    stop_ids: Collection[int] = ()
    constraint: TokenConstraint | None = None

    @property
    def greedy(self) -> bool:
        return self.params.temperature < SAMPLING_EPS

    @property
    def holds_stop(self) -> bool:
        """min_tokens is not reached: the stop tokens may not come yet (vLLM's MinTokensLogitsProcessor)."""
        return len(self.output) < self.params.min_tokens and bool(self.stop_ids)

    @property
    def penalised(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    @property
    def processes(self) -> bool:
        """Its logits change before the choice (a mask, a bias or a penalty)."""
        return self.constraint is not None or self.holds_stop or bool(self.params.logit_bias) or self.penalised

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits, and nothing else to compute (the batched fast path)."""
        return self.greedy and self.params.logprobs is None and not self.processes


def _draw_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@torch.inference_mode()
def next_tokens(logits: torch.Tensor, samplings: Sequence[Sampling]) -> list[Sampled]:
    """A step's tokens, one per row of `logits` (the model's float logits), each with its
    log-probabilities when its request asked for them (else None)."""
    if all(s.plain_greedy for s in samplings):
        return [(int(t), None) for t in logits.argmax(dim=-1).tolist()]
    processed = logits.to(torch.float32, copy=True)
    process_logits(processed, samplings)
    tokens: list[int] = processed.argmax(dim=-1).tolist()
    drawn = [i for i, s in enumerate(samplings) if not s.greedy]
    if drawn:
        # One copy to the host for the step; each row is then drawn alone, on the CPU, so its token
        # does not depend on the batch it ran in (the reproducibility above).
        rows = processed[torch.tensor(drawn, device=processed.device)].cpu()
        for j, i in enumerate(drawn):
            tokens[i] = sample_token(rows[j], samplings[i])
    return list(zip(tokens, raw_logprobs(logits, samplings, tokens), strict=True))


def process_logits(logits: torch.Tensor, samplings: Sequence[Sampling]) -> None:
    """Apply each row's masks, bias and penalties to float32 `logits` in place, in vLLM v1's order
    (module docstring): what decides greedy's argmax as well as a draw."""
    allowed = {i: _allowed(s.constraint, logits.shape[-1]) for i, s in enumerate(samplings) if s.constraint is not None}
    _mask_structured(logits, allowed)
    _hold_stop_tokens(logits, samplings, allowed)
    _add_logit_bias(logits, samplings)
    _apply_penalties(logits, samplings)


def _allowed(constraint: TokenConstraint, width: int) -> torch.Tensor:
    mask = constraint.allowed()
    if mask.dtype != torch.bool or tuple(mask.shape) != (width,):
        raise ValueError(f"a token constraint's mask must be a bool tensor of shape ({width},), "
                         f"not {mask.dtype} of {tuple(mask.shape)}")
    return mask


def _rows(indices: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.long, device=device)


def _mask_structured(logits: torch.Tensor, allowed: dict[int, torch.Tensor]) -> None:
    """Structured outputs: tokens the grammar does not allow next get -inf (vLLM applies the
    grammar's bitmask to the logits before its sampler)."""
    if not allowed:
        return
    rows = _rows(list(allowed), logits.device)
    masks = torch.stack(list(allowed.values())).to(logits.device)
    logits[rows] = logits[rows].masked_fill(~masks, NEG_INF)


def _hold_stop_tokens(logits: torch.Tensor, samplings: Sequence[Sampling], allowed: dict[int, torch.Tensor]) -> None:
    """min_tokens: while the output is shorter, every stop token (EOS included, even with ignore_eos)
    gets -inf (vLLM v1's MinTokensLogitsProcessor over all_stop_token_ids)."""
    width = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(samplings):
        if not s.holds_stop:
            continue
        stops = [t for t in s.stop_ids if 0 <= t < width]  # an id past the vocabulary never comes anyway
        mask = allowed.get(i)
        if mask is not None and stops:
            # Where the grammar allows only stop tokens, it wins (vLLM would sample from nothing):
            # the output must parse, and min_tokens is a wish about its length.
            rest = mask.clone()
            rest[stops] = False
            if not bool(rest.any()):
                continue
        rows.extend([i] * len(stops))
        cols.extend(stops)
    if rows:
        logits[_rows(rows, logits.device), _rows(cols, logits.device)] = NEG_INF


def _add_logit_bias(logits: torch.Tensor, samplings: Sequence[Sampling]) -> None:
    """logit_bias: each listed token's bias added to its logit (vLLM v1's LogitBiasLogitsProcessor;
    the scheduler refused ids outside the vocabulary)."""
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, s in enumerate(samplings):
        for token, bias in s.params.logit_bias:
            rows.append(i)
            cols.append(token)
            biases.append(bias)
    if rows:
        device = logits.device
        logits.index_put_((_rows(rows, device), _rows(cols, device)),
                          torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def _apply_penalties(logits: torch.Tensor, samplings: Sequence[Sampling]) -> None:
    """vLLM's apply_penalties, batched over the rows that have any: the repetition penalty on every
    token seen in prompt or output (a positive logit divided by it, another multiplied), then the
    frequency penalty times the token's count in the output and the presence penalty once for a token
    in the output, both subtracted (OpenAI's definition)."""
    penalised = [i for i, s in enumerate(samplings) if s.penalised]
    if not penalised:
        return
    device = logits.device
    num_rows, width = len(penalised), logits.shape[-1]
    seen_rows: list[int] = []
    seen_cols: list[int] = []
    out_rows: list[int] = []
    out_cols: list[int] = []
    for j, i in enumerate(penalised):
        s = samplings[i]
        if s.params.repetition_penalty != 1.0:
            seen_rows.extend([j] * (len(s.prompt) + len(s.output)))
            seen_cols.extend(s.prompt)
            seen_cols.extend(s.output)
        if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0:
            out_rows.extend([j] * len(s.output))
            out_cols.extend(s.output)
    rows = _rows(penalised, device)
    x = logits[rows]
    if seen_rows:
        seen = torch.zeros((num_rows, width), dtype=torch.bool, device=device)
        seen[_rows(seen_rows, device), _rows(seen_cols, device)] = True
        rp = torch.tensor([samplings[i].params.repetition_penalty for i in penalised],
                          dtype=x.dtype, device=device)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if out_rows:
        counts = torch.zeros((num_rows, width), dtype=x.dtype, device=device)
        counts.index_put_((_rows(out_rows, device), _rows(out_cols, device)),
                          torch.ones(len(out_rows), dtype=x.dtype, device=device), accumulate=True)
        fp = torch.tensor([samplings[i].params.frequency_penalty for i in penalised], dtype=x.dtype, device=device)
        pp = torch.tensor([samplings[i].params.presence_penalty for i in penalised], dtype=x.dtype, device=device)
        x = x - fp[:, None] * counts
        x = x - pp[:, None] * (counts > 0)
    logits[rows] = x


def sample_token(logits: torch.Tensor, sampling: Sampling) -> int:
    """One token from a row of processed logits (`process_logits`): temperature, min_p, top_k, top_p,
    then a seeded uniform draw.

    Inverse-CDF over the sorted distribution rather than torch.multinomial, so the result depends
    only on the probabilities and the (seed, position) draw, not on a generator's internal use.
    """
    params = sampling.params
    scaled = logits.float().cpu() / params.temperature
    if not bool(torch.isfinite(scaled).any()):
        # Nothing may come (a constraint that allows no token): any token; the constraint's
        # `advance` refuses it and the request fails alone.
        return int(scaled.argmax().item())
    if params.min_p > 0:
        # vLLM v1's MinPLogitsProcessor, on the temperature's distribution.
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), NEG_INF)
    if 0 < params.top_k < scaled.numel():
        # vLLM's top-k keeps every token at least as likely as the k-th (ties with it too).
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, NEG_INF)
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = probs.sort(descending=True, stable=True)
    cumulative = sorted_probs.cumsum(0)
    # Keep the smallest prefix whose mass reaches top_p (the best token is always kept), of what
    # top_k and min_p left (vLLM's top-p over the renormalised top-k distribution).
    kept = (cumulative - sorted_probs) < params.top_p
    sorted_probs = sorted_probs * kept
    cumulative = sorted_probs.cumsum(0)
    generator = torch.Generator().manual_seed(_draw_seed(sampling.seed, sampling.position))
    draw = torch.rand((), generator=generator, dtype=torch.float64).item() * cumulative[-1].item()
    index = int(torch.searchsorted(cumulative, torch.tensor([draw], dtype=cumulative.dtype), right=True).item())
    # A draw rounded up to the whole mass lands on the last token that has any (never a masked one).
    index = min(index, int((sorted_probs > 0).sum().item()) - 1)
    return int(order[index].item())


def raw_logprobs(logits: torch.Tensor, samplings: Sequence[Sampling], tokens: Sequence[int]) -> list[TokenLogprobs | None]:
    """Each chosen token's log-probability under the model's raw logits, its rank and the
    `params.logprobs` most likely tokens (vLLM v1's default raw_logprobs: log_softmax before any
    processing; rank is its `batched_count_greater_than`, the tokens at least as likely, itself
    included, so 1 for the most likely); None for a request that did not ask."""
    wanted = [i for i, s in enumerate(samplings) if s.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(samplings)
    if not wanted:
        return out
    device = logits.device
    logprobs = torch.log_softmax(logits[_rows(wanted, device)].float(), dim=-1)
    chosen = logprobs.gather(1, _rows([tokens[i] for i in wanted], device)[:, None])
    ranks: list[int] = (logprobs >= chosen).sum(dim=-1).tolist()
    chosen_values: list[float] = chosen[:, 0].tolist()
    most = min(max(samplings[i].params.logprobs or 0 for i in wanted), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if most > 0:
        values, ids = logprobs.topk(most, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(wanted):
        k = samplings[i].params.logprobs or 0
        out[i] = TokenLogprobs(tokens[i], chosen_values[j], ranks[j], tuple(zip(top_ids[j][:k], top_values[j][:k], strict=True)))
    return out
