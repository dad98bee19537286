"""What a caller may give an agent, checked at the boundary: its name, a text, a
timeout, and a turn's generation settings (:class:`TurnSettings`, made into
:class:`TurnOptions`)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from typing_extensions import TypedDict

from ..errors import InvalidRequestError
from ..scheduler import Sampling, check_stops

NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def check_name(name: object) -> str:
    """Agent names name files, so they are plain identifiers: a letter, then up to 63
    letters, digits, ``_`` or ``-``."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequestError(
            f"agent names must be a letter followed by up to 63 letters, digits, '_' or "
            f"'-' (they name files); got {name!r}"
        )
    return name


class TurnSettings(TypedDict, total=False):
    """Generation settings a turn takes (``spawn`` sets an agent's defaults; ``ask``,
    ``stream`` and ``fork`` override them; ``None`` keeps the default). The defaults
    give greedy decoding: mlx-lm's most likely token at every step."""

    #: Most tokens to generate (default 256).
    max_tokens: int
    #: 0 (the default) is greedy; higher flattens the choice.
    temperature: float
    #: With a temperature: nucleus sampling (1: off), the ``top_k`` most likely tokens
    #: only (0: off), tokens at least ``min_p`` times as likely as the best only (0: off).
    top_p: float
    top_k: int
    min_p: float
    #: Penalties on the ids of the last ``repetition_context_size`` tokens of the
    #: conversation (default 20): multiplicative (1: off), and subtracted once per
    #: id or once per use (0: off). These change greedy replies too.
    repetition_penalty: float
    repetition_context_size: int
    presence_penalty: float
    frequency_penalty: float
    #: Added to the logits of these token ids.
    logit_bias: Mapping[int, float]
    #: Record each generated token's log-probability (``Reply.logprobs``), and the
    #: ``top_logprobs`` most likely tokens' at each step (``Reply.top_logprobs``).
    logprobs: bool
    top_logprobs: int
    #: Seed of the turn's random stream (each of the agent's turns then gets its own).
    seed: int | None
    #: Strings that end the reply (not part of it).
    stop: str | Sequence[str]
    #: With tools: ``"auto"`` (the model decides), ``"required"`` (the turn's first
    #: reply must be a call, decoding is constrained to one), ``"none"`` (calls the
    #: model writes are not run), or a tool's name (the first reply calls it).
    tool_choice: str
    #: Most rounds of tool calls one turn runs (default 8); a reply that still calls
    #: tools then ends the turn with ``finish_reason="tool_calls"``.
    max_tool_rounds: int


@attrs.frozen(kw_only=True)
class TurnOptions(Sampling):
    """Generation settings of one turn (an agent's defaults, overridden per ask): the
    fields of :class:`TurnSettings`, the engine's :class:`Sampling` and these."""

    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    tool_choice: str = "auto"
    max_tool_rounds: int = 8

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        n = self.max_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise InvalidRequestError(f"max_tokens must be an int > 0, got {n!r}")
        if not isinstance(self.tool_choice, str) or not self.tool_choice:
            raise InvalidRequestError(
                "tool_choice must be 'auto', 'required', 'none' or a tool's name, got "
                f"{self.tool_choice!r}"
            )
        r = self.max_tool_rounds
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 64:
            raise InvalidRequestError(f"max_tool_rounds must be an int in [0, 64], got {r!r}")
        if not isinstance(self.stop, tuple) or check_stops(self.stop) != self.stop:
            raise InvalidRequestError(f"stop must be a tuple of strings, got {self.stop!r}")

    def sampling(self, seed: int | None) -> Sampling:
        """The engine's sampling settings for a turn with ``seed``."""
        fields = {a.name: getattr(self, a.name) for a in attrs.fields(Sampling)}
        return Sampling(**{**fields, "seed": seed})

    def override(self, **changes: Any) -> TurnOptions:
        unknown = sorted(set(changes) - _SETTINGS)
        if unknown:
            raise InvalidRequestError(
                f"unknown settings {unknown}; a turn takes {sorted(_SETTINGS)}"
            )
        changes = {k: v for k, v in changes.items() if v is not None}
        if "stop" in changes:
            changes["stop"] = check_stops(changes["stop"])
        return attrs.evolve(self, **changes) if changes else self


_SETTINGS = frozenset(TurnSettings.__annotations__)


def check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < math.inf
    ):
        raise InvalidRequestError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return timeout


def check_text(what: str, text: object, limit: int | None = None, *, blank: bool = False) -> str:
    """``text`` if it is a non-empty string a model can read (with ``blank``, empty or
    only whitespace too: a reply a model wrote), and no longer than ``limit``
    characters (checked before anything tokenises it)."""
    if not isinstance(text, str) or not (blank or text.strip()):
        shown = repr(text)
        shown = shown if len(shown) <= 80 else f"{shown[:77]}..."
        raise InvalidRequestError(f"{what} must be a non-empty string, got {shown}")
    if limit is not None and len(text) > limit:
        raise InvalidRequestError(
            f"{what} has {len(text):,} characters, more than any turn of this model and "
            f"pool can hold (at most {limit:,}, even at the longest tokens)"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{what} is not valid Unicode (a lone surrogate at {exc.start}); a model reads "
            "only text that encodes as UTF-8"
        ) from None
    return text
