"""Presence and frequency penalties that count the output a resumed request brought with it.

vLLM counts presence and frequency penalties over a request's OUTPUT tokens only, the repetition
penalty over prompt and output (V1 model runner: vllm/v1/sample/sampler.py `apply_penalties` ->
vllm/model_executor/layers/utils.py `apply_penalties`, whose `output_bin_counts` come from the
request's output token list; V2 model runner: vllm/v1/worker/gpu/sample/penalties.py, whose
`_bincount_kernel` counts the tokens from `prompt_len` on). A request resumed on vLLM (a migration,
or its rollback: engine.py `continue_request`) goes in with prompt + output so far as its prompt, so
vLLM alone would forget the output it had before the move: the repetition penalty (prompt ∪ output
is the same set) is unchanged, presence and frequency are not.

vLLM's public extension point here is a custom logits processor (`logits_processors`, loaded by its
qualified name in the process that runs the model; no patch to vLLM). For a resumed request with a
presence or frequency penalty the engine gives vLLM neutral penalties, so that vLLM's own stage
leaves the request's logits alone, and names the real ones with the number of output tokens it
brought in `extra_args[EXTRA_KEY]` (`carried_extra_args`). The processor then applies vLLM's formula
with those tokens counted as output:

    repetition: logits > 0 divided by it, others multiplied, for tokens in prompt or output;
    logits -= frequency x (times the token is in the output, carried tokens included);
    logits -= presence x (whether it is).

It runs where vLLM's penalties would for the request: V1 applies custom processors after its builtin
min_tokens and logit_bias processors and just before the penalties (vllm/v1/sample/logits_processor/
__init__.py `build_logitsprocs` chains them after the builtins; vllm/v1/sample/sampler.py
`apply_logits_processors`); V2 after logit bias, (here neutral) penalties and bad words (vllm/v1/
worker/gpu/sample/sampler.py `Sampler.__init__`). The grammar mask (kvfleet's own processor, loaded after
this one: vllm/structured.py) and bad words set logits to -inf, which the penalties keep at -inf, so
the order against them does not matter. vLLM's two model
runners take two processor interfaces: `processor_name` names the class for the runner a config uses
(V2 is vLLM 0.32's default where Triton runs, that is on CUDA; the CPU build runs V1).

Only tested on the V1 runner (CPU) against vLLM itself; the V2 class is checked against the same
formula on CPU tensors, not on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from kvfleet.worker.engines.vllm.extra_args import extra_entry

if TYPE_CHECKING:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState

# The request's entry in vLLM's SamplingParams.extra_args.
EXTRA_KEY = "kvfleet_carried_penalties"


@dataclass(frozen=True)
class CarriedPenalties:
    """A resumed request's penalties, and how many of its prompt's last tokens are output it brought."""

    carried: int
    presence: float
    frequency: float
    repetition: float

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """One request's row of logits (V1's per-request processor, `AdapterLogitsProcessor`).

        `output_ids` is vLLM's live list of the tokens it generated (placeholders of -1 may close it
        under async scheduling, as vllm/v1/sample/ops/penalties.py says: they are not tokens yet)."""
        vocab = logits.shape[-1]
        first_output = len(prompt_ids) - self.carried
        outputs = [t for t in (*prompt_ids[first_output:], *output_ids) if 0 <= t < vocab]
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=vocab)
        in_prompt = torch.zeros(vocab, dtype=torch.bool)
        in_prompt[torch.tensor(prompt_ids[:first_output], dtype=torch.long)] = True
        return self.apply(logits, in_prompt.to(logits.device), counts.to(logits.device))

    def apply(self, logits: torch.Tensor, in_prompt: torch.Tensor, output_counts: torch.Tensor) -> torch.Tensor:
        """vLLM's penalties on one row, in its order and arithmetic (float32, as its sampler keeps logits)."""
        counts = output_counts.to(torch.float32)
        in_output = output_counts > 0
        if self.repetition != 1.0:
            # vllm/_custom_ops.py apply_repetition_penalties_torch (the CUDA op computes the same).
            scale = torch.where(in_prompt | in_output, self.repetition, 1.0)
            logits = logits * torch.where(logits > 0, 1.0 / scale, scale)
        return logits - self.frequency * counts - self.presence * in_output.to(torch.float32)


def carried_extra_args(carried: int, presence: float, frequency: float, repetition: float) -> dict[str, Any]:
    """The extra_args entry that hands a resumed request's penalties to the processor."""
    return {EXTRA_KEY: {"carried": carried, "presence": presence, "frequency": frequency, "repetition": repetition}}


def carried_penalties(params: VLLMSamplingParams) -> CarriedPenalties | None:
    """The request's carried penalties, None if it has none; ValueError if the entry is malformed
    (vLLM calls `validate_params` at admission and turns that into a refusal of the request)."""
    entry = extra_entry(params, EXTRA_KEY)
    if entry is None:
        return None
    try:
        penalties = CarriedPenalties(int(entry["carried"]), float(entry["presence"]), float(entry["frequency"]),
                                     float(entry["repetition"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"extra_args[{EXTRA_KEY!r}] is malformed: {err}") from None
    if penalties.carried < 0 or penalties.repetition <= 0:
        raise ValueError(f"extra_args[{EXTRA_KEY!r}] is out of range: {entry}")
    return penalties


class CarriedPenaltiesV1(AdapterLogitsProcessor):
    """The processor for vLLM's V1 model runner: one `CarriedPenalties` per request that has some."""

    @classmethod
    def validate_params(cls, sampling_params: VLLMSamplingParams) -> None:
        carried_penalties(sampling_params)

    def is_argmax_invariant(self) -> bool:
        # Penalties change which token is most likely: V1 must run it for greedy requests too.
        return False

    def new_req_logits_processor(self, params: VLLMSamplingParams) -> CarriedPenalties | None:
        # Three parameters: vLLM hands it the prompt and its live output list (AdapterLogitsProcessor._new_state).
        return carried_penalties(params)


class CarriedPenaltiesV2(V2LogitsProcessor):
    """The processor for vLLM's V2 model runner, which keeps every request's tokens on the device.

    A request's tokens are `all_token_ids[slot, :total_len]` (the prompt vLLM was given, then what it
    generated: vllm/v1/worker/gpu/input_batch.py `_post_update_kernel` appends each sampled token
    before the next step), read on the device without a host sync."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        if vllm_config.speculative_config is not None:
            # A request would own several logits rows per step; kvfleet never runs speculative decoding.
            raise ValueError("kvfleet's carried penalties do not support speculative decoding")
        self._states = req_states
        self._requests: dict[int, CarriedPenalties] = {}

    @classmethod
    def validate_params(cls, sampling_params: VLLMSamplingParams) -> None:
        carried_penalties(sampling_params)

    def add_request(self, req_idx: int, sampling_params: VLLMSamplingParams) -> bool:
        # Slots are recycled: every new occupant overwrites (or clears) what the slot held.
        penalties = carried_penalties(sampling_params)
        if penalties is None:
            self._requests.pop(req_idx, None)
            return False
        self._requests[req_idx] = penalties
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self._requests:
            return logits
        slots: Sequence[int] = ctx.idx_mapping_np.tolist()
        for row, slot in enumerate(slots):
            penalties = self._requests.get(slot)
            if penalties is not None:
                logits[row] = self._penalize(logits[row], slot, penalties)
        return logits

    def _penalize(self, logits: torch.Tensor, slot: int, penalties: CarriedPenalties) -> torch.Tensor:
        vocab = logits.shape[-1]
        tokens = self._states.all_token_ids.gpu[slot].long().clamp(0, vocab - 1)
        positions = torch.arange(tokens.shape[0], device=tokens.device)
        first_output = int(self._states.prompt_len.np[slot]) - penalties.carried
        in_prompt_pos = positions < first_output
        in_output_pos = ~in_prompt_pos & (positions < self._states.total_len.gpu[slot])
        prompt_counts = torch.zeros(vocab, dtype=torch.int32, device=tokens.device)
        prompt_counts.scatter_add_(0, tokens, in_prompt_pos.to(torch.int32))
        output_counts = torch.zeros(vocab, dtype=torch.int32, device=tokens.device)
        output_counts.scatter_add_(0, tokens, in_output_pos.to(torch.int32))
        return penalties.apply(logits, prompt_counts > 0, output_counts)


def processor_name(use_v2_model_runner: bool) -> str:
    """The qualified name vLLM loads the processor by (`logits_processors`), for the runner it uses."""
    cls = CarriedPenaltiesV2 if use_v2_model_runner else CarriedPenaltiesV1
    return f"{__name__}:{cls.__name__}"
