"""A conversation to token ids exactly as mlx-lm makes them, tokenising only what changed.

mlx-lm reads a chat as ``tokenizer.apply_chat_template(conversation,
add_generation_prompt=True)``: the template renders the whole conversation to text, and
the tokenizer encodes that text. An agent does the same each turn, so that templates
which rewrite earlier turns (trimming, dropping old reasoning) are followed exactly. The
template is cheap; encoding the whole text again each turn is not (on a small CPU, about
80 ms for 50K tokens). This module owns the shortcut: :class:`Renderer` keeps the last
text and its tokens, and encodes only from the last *cut* the new text shares with it.

A cut is where the tokenizer's pipeline splits the text on its own. Hugging Face
tokenizers first split the text on its added tokens (``<|im_start|>`` and the like),
matched leftmost-longest on the raw text, then normalise, pre-tokenise and encode each
piece on its own. So where an added token starts that the tokenizer matched there, the
tokens before it are those of the text before it, whatever follows. A cut is used only
if, in the new text,

- the added token is there in full, inside the text shared with the last rendering;
- no added token's text overlaps the cut from the left (so the matcher reaches it);
- the token does not take in the whitespace before it (``lstrip``), need word
  boundaries (``single_word``), match only after normalising, or begin with whitespace.

Anything else (a slow tokenizer, ``split_special_tokens``, no cut) encodes the whole
text, as mlx-lm does; the tests compare both ways on many conversations and tokenizers.

The earlier rendering is the agent's own; an agent with none yet (new, reset, or back
from disk) starts from the recent rendering of any agent that shares the most text with
its own (:class:`RecentRenderings`: a brief or tool list many agents share, a
conversation a client sends again for a new session), so only what differs is encoded.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..scheduler.kv._tokens import common_prefix


@attrs.frozen
class Rendering:
    """A conversation's text, its tokens, and the cuts in it: ``(character, token)``
    pairs, ascending, where the text may be split without changing its tokens."""

    text: str
    tokens: tuple[int, ...]
    cuts: tuple[tuple[int, int], ...] = ()
    #: Leading tokens taken from the earlier rendering instead of encoded again.
    reused: int = 0


class RecentRenderings:
    """The last few long renderings of any agent: where an agent with no rendering of
    its own starts from. Not thread-safe: use it under the tokenizer's lock."""

    #: Renderings kept, and the shortest text worth keeping (shorter ones encode in
    #: about a millisecond).
    SIZE = 8
    MIN_CHARS = 4_000

    def __init__(self) -> None:
        self._kept: deque[Rendering] = deque(maxlen=self.SIZE)

    def closest(self, text: str) -> Rendering | None:
        """The kept rendering that shares the longest start with ``text``, if one
        shares at least :data:`MIN_CHARS` characters."""
        best, shared = None, self.MIN_CHARS - 1
        for rendering in self._kept:
            n = common_prefix(rendering.text, text)
            if n > shared:
                best, shared = rendering, n
        return best

    def add(self, rendering: Rendering) -> None:
        """Keep ``rendering`` if it is long and has cuts (the oldest goes)."""
        if len(rendering.text) >= self.MIN_CHARS and rendering.cuts:
            self._kept.append(rendering)


class Renderer:
    """Renders conversations with ``tokenizer``'s chat template (an mlx-lm tokenizer),
    reusing the tokens of an earlier rendering up to their last usable cut, and keeps
    the recent ones (:attr:`recent`). Not thread-safe: call it under the tokenizer's
    lock."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        #: Recent renderings of every agent that shares them (:meth:`render`).
        self.recent = RecentRenderings()
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._hf = hf
        added: Mapping[int, Any] = getattr(hf, "added_tokens_decoder", None) or {}
        fast = getattr(hf, "backend_tokenizer", None) is not None
        self.incremental = (
            fast
            and not getattr(hf, "split_special_tokens", False)
            and all(isinstance(getattr(t, "content", None), str) for t in added.values())
        )
        #: Added tokens a cut may start at: token id -> its text.
        self._cut_at: dict[int, str] = {
            i: t.content
            for i, t in added.items()
            if t.content
            and not t.content[0].isspace()
            and not t.lstrip
            and not t.single_word
            and not t.normalized
        }
        contents = sorted({t.content for t in added.values() if t.content}, key=len, reverse=True)
        # The longest added token that starts at a position (alternatives in order).
        self._any_added = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._longest = len(contents[0]) if contents else 0
        self.incremental = self.incremental and bool(self._cut_at)

    def render(
        self,
        conversation: Sequence[Mapping[str, Any]],
        previous: Rendering | None = None,
        *,
        share: bool = False,
        **template_args: Any,
    ) -> Rendering:
        """The conversation with the generation prompt, as mlx-lm reads it (with
        ``template_args`` for the chat template, such as ``tools``). ``share``: with no
        ``previous``, start from the closest of :attr:`recent`, and add this rendering
        to them."""
        if not self.incremental:
            tokens = self._tokenizer.apply_chat_template(
                list(conversation), add_generation_prompt=True, tokenize=True, **template_args
            )
            return Rendering("", tuple(int(t) for t in tokens))
        text = self._tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=True, tokenize=False, **template_args
        )
        if not isinstance(text, str):  # a template that tokenises by itself
            raise TypeError(f"the chat template gave {type(text).__name__}, not text")
        if previous is None and share:
            previous = self.recent.closest(text)
        at, index, kept = self._resume(text, previous)
        assert previous is not None or at == 0
        head = previous.tokens[:index] if previous is not None else ()
        tokens, cuts = self._encode(text, at, index)
        rendering = Rendering(text, head + tokens, kept + cuts, index)
        if share:
            self.recent.add(rendering)
        return rendering

    def _resume(
        self, text: str, previous: Rendering | None
    ) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """Where to start encoding ``text``: the last usable cut of ``previous`` (its
        character and token), and the cuts before it; ``(0, 0, ())`` if none."""
        if previous is None or not previous.cuts:
            return 0, 0, ()
        shared = common_prefix(previous.text, text)
        cuts = previous.cuts
        # The last cut whose added token lies inside the shared text.
        n = len(cuts)
        while n and cuts[n - 1][0] >= shared:
            n -= 1
        for i in range(n - 1, max(-1, n - 8), -1):  # a few tries, then from scratch
            at, index = cuts[i]
            content = self._cut_at.get(previous.tokens[index])
            if (
                content is not None
                and text.startswith(content, at)
                and not self._overlapped(text, at)
            ):
                return at, index, cuts[:i]
        return 0, 0, ()

    def _overlapped(self, text: str, at: int) -> bool:
        """Whether an added token's text starts before ``at`` and ends after it."""
        assert self._any_added is not None
        for start in range(max(0, at - self._longest + 1), at):
            match = self._any_added.match(text, start)
            if match is not None and match.end() > at:
                return True
        return False

    def _encode(
        self, text: str, at: int, index: int
    ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """Encode ``text`` from character ``at`` (token ``index``) and find the cuts
        there: added tokens the tokenizer matched, that no other overlaps."""
        piece = text[at:]
        encoded = self._hf(piece, add_special_tokens=False, return_offsets_mapping=True)
        ids = tuple(int(t) for t in encoded["input_ids"])
        cuts = []
        for i, (token, (start, end)) in enumerate(zip(ids, encoded["offset_mapping"], strict=True)):
            content = self._cut_at.get(token)
            if (
                content is not None
                and piece[start:end] == content
                and not self._overlapped(text, at + start)
            ):
                cuts.append((at + start, index + i))
        return ids, tuple(cuts)


_renderers: weakref.WeakKeyDictionary[Any, Renderer] = weakref.WeakKeyDictionary()
_renderers_lock = threading.Lock()


def renderer_for(tokenizer: Any) -> Renderer:
    """The :class:`Renderer` of ``tokenizer`` (one per tokenizer: it holds no state of
    a conversation)."""
    with _renderers_lock:
        renderer = _renderers.get(tokenizer)
        if renderer is None:
            renderer = _renderers[tokenizer] = Renderer(tokenizer)
        return renderer
