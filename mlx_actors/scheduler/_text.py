"""Text of one generating sequence: streamed in whole characters, cut at stop strings."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Feeds a sequence's tokens to a streaming detokenizer and hands out the text that
    is safe to show: never half a character, never the start of a possible stop string.
    The pieces handed out add up to :attr:`text` once :meth:`finish` has run."""

    def __init__(self, detokenizer: Any, stops: tuple[str, ...]) -> None:
        self._detokenizer = detokenizer
        self._stops = stops
        self._emitted = 0
        self._end: int | None = None
        #: The final text, set by :meth:`finish`.
        self.text = ""
        #: The stop string that ended the text, once one has.
        self.stop: str | None = None

    def add(self, token: int, *, eos: bool) -> tuple[str, bool]:
        """Take one token (an end-of-sequence token adds no text).

        Returns the newly printable text and whether a stop string was completed.
        """
        if self._end is not None:
            return "", True
        if not eos:
            self._detokenizer.add_token(token)
        return self._advance(str(self._detokenizer.text), final=False)

    def finish(self) -> tuple[str, bool]:
        """Flush what was held back (a detokenizer may hold text until the next token,
        mlx-lm's BPE one a lone space); returns the last piece and whether a stop string
        was completed only now, and sets :attr:`text`."""
        if self._end is None:
            self._detokenizer.finalize()
            piece, matched = self._advance(str(self._detokenizer.text), final=True)
            self.text = str(self._detokenizer.text)[: self._emitted]
            return piece, matched
        return "", False

    def _advance(self, text: str, *, final: bool) -> tuple[str, bool]:
        start = self._emitted
        hits = [(i, s) for s in self._stops if (i := text.find(s, start)) >= 0]
        if hits:
            end, self.stop = min(hits, key=lambda hit: hit[0])
            self._end = self._emitted = end
            self.text = text[:end]
            return text[start:end], True
        safe = len(text) if final else len(text) - self._held_back(text)
        safe = max(safe, start)
        self._emitted = safe
        return text[start:safe], False

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` (not yet emitted) that begins some stop
        string. Each stop costs a search for its first character in the last few
        characters, so many or long stops stay cheap."""
        n, longest = len(text), 0
        for stop in self._stops:
            i = text.find(stop[0], max(self._emitted, n - len(stop) + 1))
            while i != -1 and n - i > longest:
                if stop.startswith(text[i:]):
                    longest = n - i
                    break
                i = text.find(stop[0], i + 1)
        return longest
