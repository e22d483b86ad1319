"""Structured outputs (engines/grammar.py, shared by the builtin and vLLM engines) on the tiny local model.

Each kind is driven as the engine drives it, but with random logits instead of the model's: a seeded
torch.randn per step, the best allowed token taken, until the constraint says it is finished. Random
logits reach far more of the grammar than the tiny model's greedy output would, and whatever comes
out must still parse as the constraint says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvfleet.worker.engines.base import EngineError, StructuredOutput
from kvfleet.worker.engines.grammar import GrammarConstraint, Grammars

# Wider than the tiny tokenizer's 2048 tokens, as models pad their logits: ids past it are never allowed.
VOCAB_SIZE = 2100
# A random walk through a grammar ends with probability 1, not within a bound; this is far above
# what the seeds below take, and a failure here means the constraint never finished.
MAX_STEPS = 3000


@pytest.fixture(scope="module")
def grammars(tiny_model_dir: Path) -> Grammars:
    return Grammars(tiny_model_dir, VOCAB_SIZE)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    return tok


def drive(constraint: GrammarConstraint, seed: int) -> list[int]:
    """Random logits, greedy over the allowed tokens, until the constraint is finished."""
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        if constraint.finished:
            return tokens
        allowed = constraint.allowed()
        assert allowed.shape == (VOCAB_SIZE,) and allowed.dtype == torch.bool
        assert allowed.any()
        logits = torch.randn(VOCAB_SIZE, generator=generator)
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax().item())
        constraint.advance(token)
        tokens.append(token)
    raise AssertionError(f"not finished after {MAX_STEPS} tokens")


def text_of(tokens: list[int], tokenizer: PreTrainedTokenizerBase) -> str:
    # The EOS a complete grammar allows may end the output; it is no part of the text.
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_parses_to_a_dict(grammars: Grammars, tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    text = text_of(drive(grammars.constraint(StructuredOutput("json_object")), seed), tokenizer)
    assert isinstance(json.loads(text), dict), text


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
    },
    "required": ["name", "color"],
    # Without it any other property may follow, with any JSON value: still valid, but a random
    # walk through arbitrary JSON takes long to close.
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_validates(grammars: Grammars, tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    text = text_of(drive(grammars.constraint(StructuredOutput("json_schema", json.dumps(SCHEMA))), seed), tokenizer)
    value = json.loads(text)
    assert isinstance(value, dict), text
    assert set(value) <= {"name", "color", "count"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 8, text
    assert value["color"] in ("red", "green", "blue"), text
    if "count" in value:
        assert isinstance(value["count"], int) and not isinstance(value["count"], bool), text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_output_fullmatches(grammars: Grammars, tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    pattern = "[0-9]{3}-[a-z]{2}"
    text = text_of(drive(grammars.constraint(StructuredOutput("regex", pattern)), seed), tokenizer)
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("seed", range(6))
def test_choice_output_is_one_of_them(grammars: Grammars, tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    text = text_of(drive(grammars.constraint(StructuredOutput("choice", '["yes", "no", "maybe"]')), seed), tokenizer)
    assert text in ("yes", "no", "maybe")


def test_grammar_output_follows_the_lark_grammar(grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    lark = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[a-z]{2,5}/\n'
    for seed in range(3):
        text = text_of(drive(grammars.constraint(StructuredOutput("grammar", lark)), seed), tokenizer)
        assert re.fullmatch("(hi|hello) [a-z]{2,5}", text), text


def test_eos_is_allowed_once_the_grammar_is_complete(grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    # "[0-9]{3}[a-z]*" is complete after three digits but may go on: EOS is one choice among letters.
    constraint = grammars.constraint(StructuredOutput("regex", "[0-9]{3}[a-z]*"))
    for token in tokenizer.encode("123", add_special_tokens=False):
        assert not constraint.allowed()[tokenizer.eos_token_id]
        constraint.advance(token)
    allowed = constraint.allowed()
    assert allowed[tokenizer.eos_token_id] and allowed.sum() > 1
    assert not constraint.finished
    constraint.advance(tokenizer.eos_token_id)
    assert constraint.finished


def test_eos_after_a_stopped_grammar_is_accepted_and_replayed(grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    # An engine may sample the EOS that the mask of a finished grammar allows; a request moved after
    # that brings it in its output.
    spec = StructuredOutput("choice", '["yes", "no"]')
    tokens = tokenizer.encode("yes", add_special_tokens=False)
    constraint = grammars.constraint(spec, tokens)
    assert constraint.finished
    assert constraint.allowed().nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    constraint.advance(tokenizer.eos_token_id)
    assert constraint.finished
    assert grammars.constraint(spec, [*tokens, tokenizer.eos_token_id]).finished
    with pytest.raises(EngineError, match="does not follow"):
        grammars.constraint(spec, [*tokens, *tokens])


def test_replaying_the_output_gives_the_same_mask(grammars: Grammars) -> None:
    """A request moved from another engine rebuilds its grammar from its output: the next mask must
    be the one the original constraint would have given."""
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    original = grammars.constraint(spec)
    generator = torch.Generator().manual_seed(7)
    tokens: list[int] = []
    while not original.finished and len(tokens) < MAX_STEPS:
        allowed = original.allowed()
        # Every prefix, not just one: the state must match wherever the move happens.
        assert torch.equal(grammars.constraint(spec, tokens).allowed(), allowed), tokens
        token = int(torch.randn(VOCAB_SIZE, generator=generator).masked_fill(~allowed, float("-inf")).argmax().item())
        original.advance(token)
        tokens.append(token)
    assert original.finished
    resumed = grammars.constraint(spec, tokens)
    assert resumed.finished
    assert torch.equal(resumed.allowed(), original.allowed())


def test_replaying_an_output_that_breaks_the_grammar_fails(grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(EngineError, match="does not follow"):
        grammars.constraint(StructuredOutput("regex", "[0-9]{3}"), tokenizer.encode("12a", add_special_tokens=False))


@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", '{"type": "object", "properties": '),  # not JSON
    StructuredOutput("json_schema", '{"type": "no-such-type"}'),
    StructuredOutput("json_schema", "[1, 2]"),
    StructuredOutput("regex", "[0-9"),
    StructuredOutput("choice", "[]"),
    StructuredOutput("choice", '["yes", 2]'),
    StructuredOutput("choice", "yes"),
    StructuredOutput("grammar", "start: undefined_rule\n"),
])
def test_invalid_specs_raise_engine_error(grammars: Grammars, spec: StructuredOutput) -> None:
    with pytest.raises(EngineError):
        grammars.constraint(spec)
    # The error is cached with the spec; asking again gives it again.
    with pytest.raises(EngineError):
        grammars.constraint(spec)


def test_a_disallowed_token_raises_engine_error(grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    constraint = grammars.constraint(StructuredOutput("regex", "[0-9]{3}"))
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    assert not constraint.allowed()[letter]
    with pytest.raises(EngineError):
        constraint.advance(letter)
    with pytest.raises(EngineError):
        constraint.advance(tokenizer.eos_token_id)  # not complete yet
    with pytest.raises(EngineError):
        constraint.advance(VOCAB_SIZE)
    # A refused token leaves the constraint as it was.
    digits = tokenizer.encode("123", add_special_tokens=False)
    for token in digits:
        constraint.advance(token)
    assert constraint.finished


def test_tokens_past_the_tokenizer_are_never_allowed(grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    num_tokens = len(tokenizer)
    assert num_tokens < VOCAB_SIZE
    # Wide masks, so that "none past the tokenizer" means something; and json_object's narrow one.
    for spec, least in ((StructuredOutput("regex", "(.|\n)*"), 1000), (StructuredOutput("grammar", "start: /[^x]*/\n"), 1000),
                        (StructuredOutput("json_object"), 1)):
        constraint = grammars.constraint(spec)
        allowed = constraint.allowed()
        assert allowed[:num_tokens].sum() >= least
        assert not allowed[num_tokens:].any()
        with pytest.raises(EngineError):
            constraint.advance(num_tokens)
