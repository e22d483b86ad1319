"""Structured outputs on vLLM with kvfleet's own grammar, so that they survive a move and a resume.

vLLM's own structured outputs (`StructuredOutputsParams`, its structured-output manager in the
EngineCore's scheduler) advance a request's grammar over the tokens its scheduler samples only
(vllm/v1/core/sched/scheduler.py update_from_output): a request resumed on vLLM with output it brought
(a migration, its rollback, a router's resume: engine.py `continue_request`) would restart its
grammar after that output. kvfleet therefore does not hand vLLM the constraint: the engine puts it
in the request's `extra_args[EXTRA_KEY]` (`structured_extra_args`: the `StructuredOutput` and how many
of the prompt's last tokens are output the request brought, `carried`), and a custom logits processor
(loaded by its qualified name through `logits_processors`, as vllm/penalties.py is) applies it:

- when the request enters vLLM's batch, it builds the request's llguidance constraint with kvfleet's
  `Grammars` (engines/grammar.py, the builtin engine's) and advances it over the carried tokens and
  whatever vLLM generated already (a request re-added after a preemption);
- every step, it advances the constraint over the tokens vLLM appended since, then sets the logits
  of the tokens the grammar does not allow next to -inf;
- once the grammar is complete only EOS is allowed (llguidance's rule, as in vLLM), which the engine
  gives vLLM as a stop token: the request ends with finish_reason "stop", its EOS the last token.

The engine compiles the spec (and replays a resumed request's output) in the agent's process before
it submits the request, so that a bad spec or an output that breaks it is refused before anything is
streamed (engine.py `_check_structured`); the processor compiles again in the process that runs the
model (a cache hit in the common case of repeated specs). Should it fail there all the same, or a
sampled token break the grammar, the request is allowed EOS only from then on (llguidance's own rule
for a matcher in error, which vLLM's backend follows) and the error is logged.

Log-probabilities: vLLM computes a request's raw logprobs before its logits processors run (vllm/v1/
sample/sampler.py `Sampler.forward`), but after its own grammar bitmask (applied by the model runner
before the sampler). With the mask in a processor, a structured request's logprobs are the model's
unmasked distribution (its top-k may list tokens the grammar forbids, and the sampled token's logprob
is not renormalized over the allowed ones), as the builtin engine's are; they were masked when vLLM
applied the grammar.

Where it runs in vLLM's order: V1 applies custom processors after its min_tokens and logit_bias
processors and before the penalties (vllm/v1/sample/sampler.py `apply_logits_processors`); -inf stays
-inf through the penalties. vLLM's own grammar mask came before min_tokens and logit_bias; the two
orders give the same logits, but for one case: a complete grammar allows only EOS while min_tokens
holds EOS back, which leaves nothing to sample; there the grammar wins (its tokens get logit 0), as on
the builtin engine (builtin/sampling.py `_hold_stop_tokens`). V2 runs custom processors after its
bias, penalty, bad-words and grammar stages (vllm/v1/worker/gpu/sample/logits_processor/interface.py).
As for the penalties, `processor_name` names the class for the model runner a config uses.

Only tested on the V1 runner (CPU) inside vLLM; the V2 class is checked on CPU tensors, not on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from kvfleet.worker.engines.base import EngineError, StructuredKind, StructuredOutput
from kvfleet.worker.engines.grammar import GrammarConstraint, Grammars
from kvfleet.worker.engines.vllm.extra_args import extra_entry

if TYPE_CHECKING:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState

logger = logging.getLogger(__name__)

# The request's entry in vLLM's SamplingParams.extra_args.
EXTRA_KEY = "kvfleet_structured"
_KINDS: frozenset[str] = frozenset(get_args(StructuredKind))


@dataclass(frozen=True)
class StructuredRequest:
    """A request's constraint, and how many of its prompt's last tokens are output it brought."""

    spec: StructuredOutput
    carried: int


def structured_extra_args(spec: StructuredOutput, carried: int) -> dict[str, Any]:
    """The extra_args entry that hands a request's constraint to the processor."""
    return {EXTRA_KEY: {"kind": spec.kind, "spec": spec.spec, "any_whitespace": spec.any_whitespace, "carried": carried}}


def structured_request(params: VLLMSamplingParams) -> StructuredRequest | None:
    """The request's constraint, None if it has none; ValueError if the entry is malformed (vLLM calls
    `validate_params` at admission and turns that into a refusal of the request)."""
    entry = extra_entry(params, EXTRA_KEY)
    if entry is None:
        return None
    try:
        kind, spec, any_whitespace, carried = entry["kind"], entry["spec"], entry["any_whitespace"], entry["carried"]
    except KeyError as err:
        raise ValueError(f"extra_args[{EXTRA_KEY!r}] lacks {err}") from None
    if (kind not in _KINDS or not isinstance(spec, str) or not isinstance(any_whitespace, bool)
            or not isinstance(carried, int) or isinstance(carried, bool) or carried < 0):
        raise ValueError(f"extra_args[{EXTRA_KEY!r}] is malformed: {dict(entry)}")
    return StructuredRequest(StructuredOutput(kind, spec, any_whitespace), carried)


class EngineGrammars:
    """The model's `Grammars` in the process that runs it, made at the first structured request (loading
    the tokenizer and building llguidance's view of it takes a moment that a worker serving no
    structured output need not spend)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        model_config = vllm_config.model_config
        self._tokenizer_path = Path(model_config.tokenizer)
        self._vocab_size = int(model_config.get_vocab_size())
        self._grammars: Grammars | None = None

    def get(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self._tokenizer_path, self._vocab_size)
        return self._grammars


class RequestGrammar:
    """One request's grammar inside vLLM: the output it has taken, and the mask for its next token.

    `take` is handed the request's output tokens (the carried ones first) from where it last took
    them; a constraint that fails (a spec that does not compile here, a token it refuses) is dropped
    and the request is allowed EOS only from then on."""

    def __init__(self, grammars: Grammars, request: StructuredRequest, label: str) -> None:
        self._grammars = grammars
        self._spec = request.spec
        self._label = label
        self._constraint: GrammarConstraint | None = None
        self._started = False
        # Output tokens (carried ones included) the constraint has taken.
        self.taken = 0

    def take(self, tokens: Sequence[int]) -> None:
        """Advance over the request's next output tokens (the first call: all it has so far)."""
        tokens = [int(t) for t in tokens]
        self.taken += len(tokens)
        try:
            if not self._started:
                self._started = True
                self._constraint = self._grammars.constraint(self._spec, tokens)
            elif self._constraint is None or not tokens:
                return
            elif len(tokens) == 1:
                # The mask the last step computed decides, without a second llguidance call.
                self._constraint.advance(tokens[0])
            else:
                self._constraint.replay(tokens)
        except EngineError as err:
            # Once: a dropped constraint takes nothing more.
            self.fail(str(err))

    def fail(self, reason: str) -> None:
        """Drop the constraint: EOS only from now on."""
        logger.error("structured output of %s: %s; only EOS may follow", self._label, reason)
        self._started, self._constraint = True, None

    def restart(self) -> None:
        """Forget what was taken (vLLM's output list shrank: tokens discarded after a failed KV load)."""
        self._started, self._constraint, self.taken = False, None, 0

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size] on the host: the tokens that may come next."""
        if self._constraint is not None:
            return self._constraint.allowed()
        allowed = torch.zeros(self._grammars.vocab_size, dtype=torch.bool)
        allowed[[t for t in self._grammars.eos_token_ids if t < self._grammars.vocab_size]] = True
        return allowed


def mask_rows(logits: torch.Tensor, rows: Sequence[int], masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Logits of the tokens a row's grammar does not allow get -inf; a row left with nothing (min_tokens
    holding back the EOS a complete grammar wants) gets 0 at its allowed tokens (module docstring)."""
    if not rows:
        return logits
    width = logits.shape[-1]
    allowed = torch.zeros((len(masks), width), dtype=torch.bool)
    for i, mask in enumerate(masks):
        n = min(width, mask.shape[0])
        allowed[i, :n] = mask[:n]
    allowed = allowed.to(logits.device, non_blocking=True)
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    empty = ~(masked > float("-inf")).any(dim=-1, keepdim=True)
    logits[index] = torch.where(empty & allowed, torch.zeros_like(masked), masked)
    return logits


@dataclass
class _V1Request:
    grammar: RequestGrammar
    # The prompt's last tokens that are output the request brought, and vLLM's live list of the rest.
    carried: list[int]
    output_ids: list[int]


class StructuredOutputsV1(LogitsProcessor):
    """The processor for vLLM's V1 model runner: one `RequestGrammar` per structured request in the batch,
    fed from vLLM's live output-token list (placeholders of -1 may close it under async scheduling until
    the runner fills them in, which it does before the processors run when any custom one is loaded:
    vllm/v1/worker/gpu_input_batch.py `update_async_output_token_ids`)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._grammars = EngineGrammars(vllm_config)
        # Batch index -> the structured request there.
        self._requests: dict[int, _V1Request] = {}

    @classmethod
    def validate_params(cls, sampling_params: VLLMSamplingParams) -> None:
        structured_request(sampling_params)

    def is_argmax_invariant(self) -> bool:
        # A mask changes which token is most likely: V1 must run it for greedy requests too.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._requests, batch_update, self._new_state)

    def _new_state(self, params: VLLMSamplingParams, prompt_ids: list[int] | None,
                   output_ids: list[int]) -> _V1Request | None:
        request = structured_request(params)
        if request is None:
            return None
        prompt = prompt_ids or []
        carried = list(prompt[len(prompt) - request.carried:]) if request.carried else []
        state = _V1Request(RequestGrammar(self._grammars.get(), request, _label(params)), carried, output_ids)
        if len(carried) != request.carried:
            state.grammar.fail(f"its prompt holds {len(prompt)} tokens, fewer than the {request.carried} carried")
        # Built now, over the output it has (a request re-added after a preemption has some).
        state.grammar.take([*carried, *_committed(output_ids, 0)])
        return state

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._requests:
            return logits
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        for index, state in self._requests.items():
            grammar, output_ids = state.grammar, state.output_ids
            done = grammar.taken - len(state.carried)
            if len(output_ids) < done:
                # vLLM dropped output tokens it had (discarded after a failed KV load): start again.
                grammar.restart()
                grammar.take([*state.carried, *_committed(output_ids, 0)])
            else:
                grammar.take(_committed(output_ids, done))
            rows.append(index)
            masks.append(grammar.allowed())
        return mask_rows(logits, rows, masks)


def _label(params: VLLMSamplingParams) -> str:
    """The request's kvfleet id for the log, from the entry that names it to kvfleet's KV connector."""
    entry = (params.extra_args or {}).get("kv_transfer_params")
    kvfleet = entry.get("kvfleet") if isinstance(entry, Mapping) else None
    return f"request {kvfleet.get('id')!r}" if isinstance(kvfleet, Mapping) else "a request"


def _committed(output_ids: Sequence[int], start: int) -> list[int]:
    """The output tokens from `start` on, up to the first placeholder (-1) if any."""
    tokens = list(output_ids[start:])
    for i, token in enumerate(tokens):
        if token < 0:
            return tokens[:i]
    return tokens


class StructuredOutputsV2(V2LogitsProcessor):
    """The processor for vLLM's V2 model runner, which keeps every request's tokens on the device.

    A request's tokens are `all_token_ids[slot, :total_len]` (the prompt vLLM was given, then what it
    generated: vllm/v1/worker/gpu/input_batch.py `_post_update_kernel` appends each sampled token
    before the next step). `add_request` comes before the runner writes a new request's tokens to the
    device, so the grammar is built at the request's first `apply`; each step then reads the tokens
    added since (a host sync per structured request and step: the grammar runs on the host)."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        if vllm_config.speculative_config is not None:
            # A request would own several logits rows per step; kvfleet never runs speculative decoding.
            raise ValueError("kvfleet's structured outputs do not support speculative decoding")
        self._states = req_states
        self._grammars = EngineGrammars(vllm_config)
        # Slot -> a request added, its grammar built at its first apply.
        self._added: dict[int, tuple[StructuredRequest, str]] = {}
        # Slot -> (the request's grammar, the token position in all_token_ids it has taken up to).
        self._requests: dict[int, tuple[RequestGrammar, int]] = {}

    @classmethod
    def validate_params(cls, sampling_params: VLLMSamplingParams) -> None:
        structured_request(sampling_params)

    def add_request(self, req_idx: int, sampling_params: VLLMSamplingParams) -> bool:
        # Slots are recycled: every new occupant overwrites (or clears) what the slot held.
        self._requests.pop(req_idx, None)
        self._added.pop(req_idx, None)
        request = structured_request(sampling_params)
        if request is None:
            return False
        self._added[req_idx] = (request, _label(sampling_params))
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self._requests and not self._added:
            return logits
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        slots: Sequence[int] = ctx.idx_mapping_np.tolist()
        for row, slot in enumerate(slots):
            if slot not in self._requests and slot not in self._added:
                continue
            end = int(self._states.total_len.gpu[slot])
            added = self._added.pop(slot, None)
            if added is not None:
                request, label = added
                # Its output so far: the carried tokens at the prompt's end, then what vLLM generated.
                start = int(self._states.prompt_len.np[slot]) - request.carried
                grammar = RequestGrammar(self._grammars.get(), request, label)
                if start < 0:
                    grammar.fail(f"its prompt holds fewer tokens than the {request.carried} carried")
                    start = 0
            else:
                grammar, start = self._requests[slot]
            if end > start or added is not None:
                grammar.take(self._tokens(slot, start, end))
            self._requests[slot] = (grammar, max(start, end))
            rows.append(row)
            masks.append(grammar.allowed())
        return mask_rows(logits, rows, masks)

    def _tokens(self, slot: int, start: int, end: int) -> list[int]:
        if end <= start:
            return []
        tokens: list[int] = self._states.all_token_ids.gpu[slot, start:end].tolist()
        return tokens


def processor_name(use_v2_model_runner: bool) -> str:
    """The qualified name vLLM loads the processor by (`logits_processors`), for the runner it uses."""
    cls: type[Any] = StructuredOutputsV2 if use_v2_model_runner else StructuredOutputsV1
    return f"{__name__}:{cls.__name__}"
