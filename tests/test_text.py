"""Streamed text: whole characters only, stop strings cut, pieces add up to the text."""

from __future__ import annotations

import pytest

from mlx_actors.scheduler._text import TextStream

from .conftest import Loaded

TEXT = "Grüße, 世界! 🙂 naïve café — ok"


def stream_of(tiny: Loaded, text: str, stops: tuple[str, ...] = ()) -> tuple[list[str], str]:
    stream = TextStream(tiny.tokenizer.detokenizer, stops)
    pieces = []
    for token in tiny.tokenizer.encode(text):  # one token per byte: characters arrive in parts
        piece, matched = stream.add(token, eos=False)
        pieces.append(piece)
        if matched:
            break
    pieces.append(stream.finish())
    return pieces, stream.text


def test_multibyte_characters_are_never_split(tiny: Loaded) -> None:
    pieces, text = stream_of(tiny, TEXT)
    assert text == TEXT
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)
    assert len(tiny.tokenizer.encode("🙂")) == 4  # the emoji really came in four tokens


@pytest.mark.parametrize(
    ("stops", "expected"), [(("世界",), "Grüße, "), (("ok", "🙂"), "Grüße, 世界! ")]
)
def test_stop_strings_cut_the_text_and_are_never_shown(
    tiny: Loaded, stops: tuple[str, ...], expected: str
) -> None:
    pieces, text = stream_of(tiny, TEXT, stops)
    assert text == expected
    assert "".join(pieces) == expected


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot(tiny: Loaded) -> None:
    stream = TextStream(tiny.tokenizer.detokenizer, ("END",))
    shown = [stream.add(t, eos=False)[0] for t in tiny.tokenizer.encode("abEN")]
    assert "".join(shown) == "ab"  # "EN" could still become "END"
    assert stream.add(tiny.tokenizer.encode("x")[0], eos=False) == ("ENx", False)
    assert stream.finish() == ""
    assert stream.text == "abENx"


def test_an_end_of_sequence_token_adds_no_text(tiny: Loaded) -> None:
    stream = TextStream(tiny.tokenizer.detokenizer, ())
    for t in tiny.tokenizer.encode("hi"):
        stream.add(t, eos=False)
    (eos,) = tiny.tokenizer.eos_token_ids
    stream.add(eos, eos=True)
    stream.finish()
    assert stream.text == "hi"
