"""Text of one generating sequence: streamed in whole characters, cut at stop strings."""

from __future__ import annotations

from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

#: How a byte-level BPE vocabulary writes a space (GPT-2's byte-to-character map).
_BPE_SPACE = "\u0120"


class TextStream:
    """Feeds a sequence's tokens to a streaming detokenizer and hands out the text that
    is safe to show: never half a character, never the start of a possible stop string.
    The pieces handed out add up to :attr:`text` once :meth:`finish` has run.

    The text is what the tokens decode to, a leading space included: mlx-lm's BPE
    detokenizer drops the space a sequence's first token begins with (the tokenizer's
    own ``decode`` keeps it), and a reply without it renders, in the next turn, to
    other tokens than the ones the cache holds. (Its SentencePiece detokenizer drops
    such a space too, as SentencePiece's decode does; that one is left as it is.)"""

    def __init__(self, detokenizer: Any, stops: tuple[str, ...]) -> None:
        self._detokenizer = detokenizer
        self._stops = stops
        self._drops_space = isinstance(detokenizer, BPEStreamingDetokenizer)
        #: The space the detokenizer dropped (once the first token is known).
        self._lead: str | None = None
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
            if self._lead is None:
                self._lead = " " if self._dropped(token) else ""
            self._detokenizer.add_token(token)
        return self._advance(self._text(), final=False)

    def finish(self) -> tuple[str, bool]:
        """Flush what was held back (a detokenizer may hold text until the next token,
        mlx-lm's BPE one a lone space); returns the last piece and whether a stop string
        was completed only now, and sets :attr:`text`."""
        if self._end is None:
            self._detokenizer.finalize()
            piece, matched = self._advance(self._text(), final=True)
            self.text = self._text()[: self._emitted]
            return piece, matched
        return "", False

    def _dropped(self, first: int) -> bool:
        """Whether the detokenizer drops the space token ``first`` begins with."""
        if not self._drops_space:
            return False
        tokenmap = self._detokenizer.tokenmap
        return first < len(tokenmap) and str(tokenmap[first]).startswith(_BPE_SPACE)

    def _text(self) -> str:
        return (self._lead or "") + str(self._detokenizer.text)

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
