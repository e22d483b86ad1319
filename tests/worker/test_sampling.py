"""The builtin engine's sampling (builtin/sampling.py) on hand-made logits: each of vLLM's processors'
exact effect and their order, the draws' reproducibility, raw logprobs, and the structured-output hook.

Expected values are written out by hand (vLLM v1's definitions, cited in sampling.py), so a change of
meaning fails here before an engine test could notice it.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from worker_testing import Sequenced  # noqa: E402

from kvfleet.worker.engines.base import SamplingParams, TokenLogprobs  # noqa: E402
from kvfleet.worker.engines.builtin import sampling  # noqa: E402
from kvfleet.worker.engines.builtin.sampling import (  # noqa: E402
    Sampling,
    TokenConstraint,
    next_tokens,
    process_logits,
    sample_token,
)

INF = float("inf")
ROW = [2.0, -1.0, 3.0, -2.0, 0.5]


def params(**kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 16)
    return SamplingParams(**kw)


def processed(row: list[float], s: Sampling) -> list[float]:
    logits = torch.tensor([row])
    process_logits(logits, [s])
    return list(logits[0].tolist())


def test_a_plain_greedy_batch_is_one_argmax_with_nothing_processed(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_processing(*_: object) -> None:
        raise AssertionError("a plain greedy step must not process logits")

    monkeypatch.setattr(sampling, "process_logits", no_processing)
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    samplings = [Sampling(params(), seed=i, position=3, prompt=[1, 2], output=[7]) for i in range(5)]
    assert next_tokens(logits, samplings) == [(t, None) for t in logits.argmax(dim=-1).tolist()]
    # top_k/top_p/min_p mean nothing to greedy (vLLM): still the fast path.
    plain = Sampling(params(top_k=3, top_p=0.5, min_p=0.2), seed=0, position=0)
    assert plain.plain_greedy and next_tokens(logits[:1], [plain]) == [(int(logits[0].argmax()), None)]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    s = Sampling(params(repetition_penalty=2.0), 0, 2, prompt=[0], output=[1])
    assert processed(ROW, s) == [1.0, -2.0, 3.0, -2.0, 0.5]
    # A penalty below 1 rewards what was seen; 1.0 changes nothing.
    s = Sampling(params(repetition_penalty=0.5), 0, 3, prompt=[0, 3], output=[])
    assert processed(ROW, s) == [4.0, -1.0, 3.0, -1.0, 0.5]
    assert processed(ROW, Sampling(params(repetition_penalty=1.0), 0, 2, prompt=[0], output=[1])) == ROW


def test_frequency_and_presence_penalties_subtract_exact_amounts_for_output_tokens_only() -> None:
    s = Sampling(params(frequency_penalty=0.5, presence_penalty=0.25), 0, 4, prompt=[0], output=[1, 1, 4])
    # token 1: twice in the output (2 x 0.5 + 0.25); token 4 once (0.5 + 0.25); token 0 only in the prompt.
    assert processed(ROW, s) == [2.0, -1.0 - 1.0 - 0.25, 3.0, -2.0, 0.5 - 0.5 - 0.25]
    # Negative penalties reward repeats.
    s = Sampling(params(frequency_penalty=-1.0), 0, 3, prompt=[], output=[2, 2])
    assert processed(ROW, s) == [2.0, -1.0, 5.0, -2.0, 0.5]


def test_logit_bias_is_added_to_the_listed_tokens() -> None:
    s = Sampling(params(logit_bias=((1, 5.0), (4, -1.5))), 0, 0)
    assert processed(ROW, s) == [2.0, 4.0, 3.0, -2.0, -1.0]


def test_min_tokens_masks_every_stop_token_until_reached() -> None:
    # EOS (3) is held back as well as stop_token_ids (4), with ignore_eos too (vLLM's all_stop_token_ids).
    p = params(min_tokens=2, stop_token_ids=(4,), ignore_eos=True)
    held = processed(ROW, Sampling(p, 0, 5, prompt=[0], output=[1], stop_ids=frozenset({3, 4})))
    assert held == [2.0, -1.0, 3.0, -INF, -INF]
    assert processed(ROW, Sampling(p, 0, 6, prompt=[0], output=[1, 2], stop_ids=frozenset({3, 4}))) == ROW
    # Held back, a stop token that would win greedy does not.
    logits = torch.tensor([[0.0, 1.0, 0.0, 9.0, 0.0]])
    assert next_tokens(logits, [Sampling(p, 0, 1, output=[], stop_ids={3})]) == [(1, None)]


def test_the_processors_run_in_vllms_order() -> None:
    # logit_bias before the repetition penalty: (1.0 - 3.0) * 2 = -4.0, not 1.0 / 2 - 3.0.
    s = Sampling(params(logit_bias=((0, -3.0),), repetition_penalty=2.0), 0, 1, prompt=[0])
    assert processed([1.0, 0.0], s)[0] == -4.0
    # The structured mask and min_tokens before the bias: a masked token stays masked.
    width = len(ROW)
    s = Sampling(params(logit_bias=((1, 100.0), (3, 100.0)), min_tokens=1), 0, 0, stop_ids={3},
                 constraint=Sequenced([2], width))
    assert processed(ROW, s) == [-INF, -INF, 3.0, -INF, -INF]


def test_top_k_one_is_greedy_and_top_k_keeps_ties() -> None:
    logits = torch.tensor([0.5, 2.0, 1.9, -1.0, 1.0])
    for position in range(50):
        assert sample_token(logits, Sampling(params(temperature=2.0, top_k=1), 11, position)) == 1
    # vLLM keeps every token at least as likely as the k-th: three tied tokens under top_k=2.
    tied = torch.tensor([1.0, 1.0, 1.0, 0.0])
    kept = {sample_token(tied, Sampling(params(temperature=1.0, top_k=2), 3, position)) for position in range(200)}
    assert kept == {0, 1, 2}


def test_min_p_drops_tokens_below_its_share_of_the_most_likely() -> None:
    logits = torch.tensor([2.0, 1.9, 0.0, -5.0])  # probabilities ~0.50, 0.45, 0.07, 0.0003
    drawn = {sample_token(logits, Sampling(params(temperature=1.0, min_p=0.2), 5, position)) for position in range(300)}
    assert drawn == {0, 1}
    drawn = {sample_token(logits, Sampling(params(temperature=1.0, min_p=0.1), 5, position)) for position in range(300)}
    assert drawn == {0, 1, 2}


def test_sample_token_follows_the_distribution_and_top_p() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    counts = torch.zeros(4)
    for position in range(2000):
        counts[sample_token(logits, Sampling(params(temperature=1.0), 7, position))] += 1
    assert torch.allclose(counts / counts.sum(), torch.softmax(logits, 0), atol=0.03)
    # top_p 0.7 keeps the two best (0.64 mass before the second), never the others.
    assert {sample_token(logits, Sampling(params(temperature=1.0, top_p=0.7), 7, p)) for p in range(300)} == {0, 1}


def test_seeded_draws_depend_on_seed_and_position_only() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=generator)
    p = params(temperature=1.0, top_p=0.9, repetition_penalty=1.2)
    target = Sampling(p, seed=99, position=17, prompt=[1, 2, 3], output=[4])
    alone = next_tokens(logits[2:3], [target])
    # In another batch, beside greedy and other sampled rows: the same token.
    others = [Sampling(params(), 0, 5)] * 2 + [target] + [Sampling(params(temperature=0.7), s, 9) for s in range(3)]
    assert next_tokens(logits, others)[2] == alone[0]
    assert next_tokens(logits[2:3], [target]) == alone  # and again
    # Another position (or seed) draws anew: over positions, several tokens come.
    drawn = {next_tokens(logits[2:3], [Sampling(p, 99, position, [1, 2, 3], [4])])[0][0] for position in range(40)}
    assert len(drawn) > 3


def test_logprobs_are_the_raw_distributions_with_vllms_rank_and_top() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0],
                           [0.0, 1.0, 4.0, 2.0, -3.0],
                           [1.0, 1.0, 0.0, 0.0, 0.0]])
    raw = torch.log_softmax(logits, dim=-1)
    samplings = [
        # Forced to the 4th most likely by a bias: its logprob and rank are still the raw model's.
        Sampling(params(logprobs=3, logit_bias=((3, 10.0),)), 0, 0),
        Sampling(params(logprobs=0, temperature=1.0, repetition_penalty=3.0), 4, 2, prompt=[2, 3]),
        # Tied with token 1: vLLM's rank counts the tokens at least as likely (2, not 1).
        Sampling(params(logprobs=1), 0, 0),
    ]
    out = next_tokens(logits, samplings)
    first, second, third = (lp for _, lp in out)
    assert out[0][0] == 3 and first == TokenLogprobs(3, float(raw[0, 3]), 4, ((0, float(raw[0, 0])), (1, float(raw[0, 1])),
                                                                          (2, float(raw[0, 2]))))
    token = out[1][0]
    assert second == TokenLogprobs(token, float(raw[1, token]), int((raw[1] >= raw[1, token]).sum()), ())
    assert out[2][0] == 0 and third is not None and third.rank == 2 and third.logprob == float(raw[2, 0])
    assert len(third.top) == 1 and third.top[0][1] == float(raw[2, 0])
    # Without logprobs a row has none, beside rows that asked.
    mixed = next_tokens(logits, [samplings[0], Sampling(params(), 0, 0), Sampling(params(temperature=1.0), 1, 0)])
    assert mixed[0] == out[0] and mixed[1][1] is None and mixed[2][1] is None


def test_a_constraint_restricts_greedy_and_sampled_choices() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    sequence = [5, 17, 2, 29]
    greedy: TokenConstraint = Sequenced(sequence, 30)
    drawn: TokenConstraint = Sequenced(sequence, 30)
    for position, expected in enumerate(sequence):
        out = next_tokens(logits, [Sampling(params(), 0, position, constraint=greedy),
                                   Sampling(params(temperature=1.5, top_k=5), 8, position, constraint=drawn)])
        assert [token for token, _ in out] == [expected, expected]
        greedy.advance(expected)
        drawn.advance(expected)
    assert greedy.finished and drawn.finished
    # A grammar that allows only a stop token wins over min_tokens (the output must parse).
    only_eos = Sampling(params(min_tokens=4), 0, 0, stop_ids={2}, constraint=Sequenced([2], 30))
    assert next_tokens(logits[:1], [only_eos])[0][0] == 2
    # A mask of the wrong width is refused.
    with pytest.raises(ValueError, match="bool tensor"):
        next_tokens(logits[:1, :20], [Sampling(params(), 0, 0, constraint=Sequenced([1], 30))])
