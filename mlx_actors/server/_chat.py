"""A chat request as a session's turn, whichever API it came in, and what its client is
shown of the reply: the text before the model's calls, and the calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..actors import Message, Reply, Tool, ToolCall
from ..actors._tool_format import ToolFormat


@attrs.frozen(kw_only=True)
class Chat:
    """One request of either API, parsed: the turn it asks of its session."""

    #: The conversation to answer (the system prompt apart).
    conversation: tuple[Message, ...]
    system: str | None = None
    #: Tools the client runs (no functions here).
    tools: tuple[Tool, ...] = ()
    #: :class:`~mlx_actors.TurnSettings` of the turn.
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    #: A JSON schema the reply must follow.
    schema: Any = None
    stream: bool = False
    #: The session the client named (``None``: the longest live prefix is found).
    session: str | None = None
    #: Whether the reply may carry several calls (else the first is kept).
    parallel_calls: bool = True


@attrs.frozen(kw_only=True)
class Shown:
    """A reply as its client sees it."""

    #: The text before the calls (all of it, without calls).
    content: str
    calls: tuple[ToolCall, ...]
    #: ``"stop"``, ``"length"`` or ``"tool_calls"``.
    finish_reason: str


def shown(reply: Reply, form: ToolFormat, chat: Chat) -> Shown:
    """What ``reply`` shows its client."""
    calls = reply.pending_calls if chat.parallel_calls else reply.pending_calls[:1]
    content = form.before_calls(reply.text) if calls else reply.text
    return Shown(content=content, calls=calls, finish_reason=reply.finish_reason)


class ShownText:
    """A streamed reply's text as its client sees it: everything up to the first call's
    marker, less the whitespace before it. Text that may still become the marker, or
    that may end up before it, is held back until it cannot."""

    def __init__(self, marker: str | None) -> None:
        self._marker = marker
        self._text = ""
        self._sent = 0
        self._cut = False

    def feed(self, piece: str) -> str:
        """The newly shown text after ``piece``."""
        self._text += piece
        if self._cut:
            return ""
        if self._marker is None:
            return self._show(len(self._text))
        at = self._text.find(self._marker, max(0, self._sent - len(self._marker)))
        if at >= 0:
            self._cut = True
            return self._show(len(self._text[:at].rstrip()))
        held = _overlap(self._text, self._marker)
        return self._show(len(self._text[: len(self._text) - held].rstrip()))

    def finish(self, calls: bool) -> str:
        """What is left to show once the reply is whole (``calls``: it called tools)."""
        if calls:
            return ""
        self._cut = True  # no call after all: the marker was text
        return self._show(len(self._text))

    def _show(self, end: int) -> str:
        piece = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return piece


def _overlap(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
