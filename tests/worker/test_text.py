"""Stop strings and incremental detokenisation: the text a client sees, whatever the token boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet.serving.stops import StopStrings
from kvfleet.worker.text import Tokenizer


def feed_all(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    s = StopStrings(stops)
    out = []
    for piece in pieces:
        out.append(s.feed(piece))
        if s.stopped:
            return "".join(out), True
    out.append(s.finish())
    return "".join(out), False


def test_stop_string_split_over_pieces_is_cut_and_not_returned() -> None:
    assert feed_all(("END",), ["hello E", "N", "D and more"]) == ("hello ", True)
    assert feed_all(("\n\n", "###"), ["a\n", "b#", "#", "#c"]) == ("a\nb", True)
    assert feed_all(("xyz",), ["x", "y", "!"]) == ("xy!", False), "a near-miss is released whole"


@given(st.text(alphabet="abcE\nND", max_size=40), st.lists(st.integers(1, 5), max_size=20))
def test_stop_strings_match_the_whole_text_rule(text: str, cuts: list[int]) -> None:
    stops = ("END", "\n\n")
    pieces, i = [], 0
    for n in cuts:
        pieces.append(text[i:i + n])
        i += n
    pieces.append(text[i:])
    hits = [j for j in (text.find(s) for s in stops) if j >= 0]
    expected = (text[: min(hits)], True) if hits else (text, False)
    assert feed_all(stops, pieces) == expected


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def test_streamed_text_equals_decoding_everything_at_once(tokenizer: Tokenizer) -> None:
    text = "The scheduler packs KV caches — naïve “quotes”, émojis 🚀 and 漢字 — onto the fewest GPUs.\nDone."
    ids = tokenizer.encode(text)
    prompt, output = ids[:3], ids[3:]
    detok = tokenizer.detokenizer(prompt)
    streamed = "".join(detok.add([t]) for t in output) + detok.flush()
    assert streamed == tokenizer.decode(output)
    assert "\ufffd" not in streamed


def test_chat_template_renders_and_ends_ready_for_the_reply(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert len(ids) > 4
    assert "Hi" in tokenizer.decode(ids)
