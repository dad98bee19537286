"""What a streaming client is shown of a reply that may call tools: the text before the
first call's marker, never a piece of the marker, and all of the text when no call came."""

from __future__ import annotations

import pytest

from mlx_actors.server._chat import ShownText

MARKER = "<tool_call>"


def shown(pieces: list[str], calls: bool, marker: str | None = MARKER) -> list[str]:
    text = ShownText(marker)
    out = [text.feed(piece) for piece in pieces]
    return [*out, text.finish(calls)]


def test_text_before_a_call_is_shown_and_the_call_is_not() -> None:
    out = shown(["Let me ", "check. <to", "ol_ca", 'll>\n{"name": "f"}', "\n</tool_call>"], True)
    assert out == ["Let me", " check.", "", "", "", ""]
    assert "".join(out) == "Let me check."  # the whitespace before the call is not shown


def test_what_looked_like_a_marker_is_shown_once_it_is_not() -> None:
    out = shown(["a <to", "y> and ", "<tool", "box>"], False)
    assert out == ["a", " <toy> and", "", " <toolbox>", ""]
    assert "".join(out) == "a <toy> and <toolbox>"


def test_a_marker_in_a_reply_without_calls_is_text_after_all() -> None:
    """An answer under a schema may mention the marker: no call was read, so the client
    is shown the whole reply, as it is without streaming."""
    pieces = ['{"note": "write ', "<tool_call>", ' first"}']
    assert "".join(shown(pieces, calls=False)) == "".join(pieces)


@pytest.mark.parametrize("pieces", [["plain ", "text "], ["<tool_call>", "x"]])
def test_without_tools_everything_is_shown_as_it_comes(pieces: list[str]) -> None:
    assert shown(pieces, False, marker=None) == [*pieces, ""]
