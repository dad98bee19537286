"""Streamed text: whole characters only, stop strings cut, pieces add up to the text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mlx_actors import Runtime
from mlx_actors.scheduler.engine import TextStream

from ..conftest import Loaded

TEXT = "Grüße, 世界! 🙂 naïve café — ok"


def stream_of(
    tiny: Loaded, text: str, stops: tuple[str, ...] = ()
) -> tuple[list[str], str, str | None]:
    stream = TextStream(tiny.tokenizer.detokenizer, stops)
    pieces = []
    for token in tiny.tokenizer.encode(text):  # one token per byte: characters arrive in parts
        piece, matched = stream.add(token, eos=False)
        pieces.append(piece)
        if matched:
            break
    pieces.append(stream.finish()[0])
    return pieces, stream.text, stream.stop


def test_multibyte_characters_are_never_split(tiny: Loaded) -> None:
    pieces, text, stop = stream_of(tiny, TEXT)
    assert text == TEXT and stop is None
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)
    assert len(tiny.tokenizer.encode("🙂")) == 4  # the emoji really came in four tokens


@pytest.mark.parametrize(
    ("stops", "expected", "stop"),
    [(("世界",), "Grüße, ", "世界"), (("ok", "🙂"), "Grüße, 世界! ", "🙂")],
)
def test_stop_strings_cut_the_text_and_are_never_shown(
    tiny: Loaded, stops: tuple[str, ...], expected: str, stop: str
) -> None:
    pieces, text, matched = stream_of(tiny, TEXT, stops)
    assert text == expected and matched == stop
    assert "".join(pieces) == expected


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot(tiny: Loaded) -> None:
    stream = TextStream(tiny.tokenizer.detokenizer, ("END",))
    shown = [stream.add(t, eos=False)[0] for t in tiny.tokenizer.encode("abEN")]
    assert "".join(shown) == "ab"  # "EN" could still become "END"
    assert stream.add(tiny.tokenizer.encode("x")[0], eos=False) == ("ENx", False)
    assert stream.finish() == ("", False)
    assert stream.text == "abENx"


def test_a_stop_completed_by_text_the_detokenizer_held_back_is_a_stop(tiny: Loaded) -> None:
    """mlx-lm's BPE detokenizer holds a lone space until the next token: a stop ending
    in one is found only when the stream is flushed (the engine then says "stop", not
    "length", for a turn its ``max_tokens`` ended there)."""
    stream = TextStream(tiny.tokenizer.detokenizer, ("x ",))
    shown = [stream.add(t, eos=False) for t in tiny.tokenizer.encode("ab x ")]
    assert shown[-1] == ("", False)  # the space is held by the detokenizer
    assert stream.finish() == ("", True)
    assert stream.text == "ab "


def test_an_end_of_sequence_token_adds_no_text(tiny: Loaded) -> None:
    stream = TextStream(tiny.tokenizer.detokenizer, ())
    for t in tiny.tokenizer.encode("hi"):
        stream.add(t, eos=False)
    (eos,) = tiny.tokenizer.eos_token_ids
    stream.add(eos, eos=True)
    stream.finish()
    assert stream.text == "hi"


@pytest.mark.anyio
async def test_a_turn_whose_last_token_completes_a_stop_ends_with_stop(tiny_dir: Path) -> None:
    bias = {ord("x"): 50.0, ord(" "): 50.0}  # the model writes only "x" and " "
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        agent = await rt.spawn("a", logit_bias=bias)
        free = await agent.ask("Hello", max_tokens=40)
        n = bytes(free.tokens).find(b"x ") + 2  # one token per byte
        assert n >= 2, free.text
        await agent.reset()
        reply = await agent.ask("Hello", stop="x ", max_tokens=n)  # its last token: " "
        assert reply.tokens == free.tokens[:n]
        assert (reply.text, reply.finish_reason) == (free.text[: free.text.find("x ")], "stop")


@pytest.mark.parametrize("text", [" Hello", "  Hello", " ", " x y"])
def test_a_reply_that_begins_with_a_space_keeps_it(tiny: Loaded, text: str) -> None:
    """mlx-lm's BPE detokenizer drops it; the tokenizer's decode keeps it, and so must
    the reply, or the next turn renders it to other tokens than the cache holds."""
    pieces, streamed, _ = stream_of(tiny, text)
    assert streamed == text == tiny.tokenizer.decode(tiny.tokenizer.encode(text))
    assert "".join(pieces) == text


@pytest.mark.anyio
async def test_the_next_turn_reuses_a_reply_that_began_with_a_space(tiny_dir: Path) -> None:
    """The reply's text renders back to the tokens the model wrote, the first one's
    space included, so the next turn reuses the whole of it from the cache."""
    # a space first, then "x" and " " in turn: each is barred right after itself
    spaced = dict(logit_bias={32: 30.0, ord("x"): 28.0}, presence_penalty=60.0)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        agent = await rt.spawn("a", max_tokens=6)
        first = await agent.ask("Hello", repetition_context_size=1, **spaced)
        assert first.text == " x x x"
        second = await agent.ask("And then?")
        cached = first.usage.prompt_tokens + first.usage.generated_tokens
        assert second.usage.reusable_tokens == second.usage.cached_tokens == cached


def test_the_stop_matcher_agrees_with_the_obvious_one() -> None:
    rng = random.Random(5)

    def obvious(text: str, emitted: int, stops: list[str]) -> int:
        longest = 0
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text) - emitted), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    for _ in range(3000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 12)))
        stream = TextStream(None, tuple(stops))
        stream._emitted = rng.randint(0, len(text))
        assert stream._held_back(text) == obvious(text, stream._emitted, stops)
