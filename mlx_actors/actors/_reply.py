"""What a turn gives back: the reply, and the stream of its text."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal, Protocol

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream

from ..errors import InvalidRequestError, MlxActorsError
from ..scheduler import Usage
from ._tools import ToolCall

FinishReason = Literal["stop", "length", "tool_calls"]


@attrs.frozen(kw_only=True)
class Message:
    """One entry of a conversation."""

    #: ``"system"``, ``"user"``, ``"assistant"`` or ``"tool"`` (a tool's result).
    role: str
    #: The text (an assistant's with the calls it wrote, as it wrote them).
    content: str
    #: An assistant's: the tool calls it wrote.
    tool_calls: tuple[ToolCall, ...] = ()
    #: A tool result's: the tool's name and the id of the call it answers.
    name: str | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates and agent records take it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Message:
        """The message :meth:`as_dict` gave (``ValueError`` if it is not one)."""
        calls = tuple(
            ToolCall(
                id=_text(c["id"]),
                name=_text(c["name"]),
                arguments=_object(c["arguments"]),
                error=None if c.get("error") is None else _text(c["error"]),
            )
            for c in data.get("tool_calls", ())
        )
        name, call_id = data.get("name"), data.get("tool_call_id")
        return cls(
            role=_text(data["role"]),
            content=_text(data["content"]),
            tool_calls=calls,
            name=None if name is None else _text(name),
            tool_call_id=None if call_id is None else _text(call_id),
        )


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not text")
    return value


def _object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{value!r} is not an object")
    return value


@attrs.frozen(kw_only=True)
class Reply:
    """An agent's answer to one turn. ``str(reply)`` is its text."""

    #: The generated text (no end-of-turn token, no matched stop string): what the
    #: tokens decode to, a leading space included.
    text: str
    #: The generated token ids.
    tokens: tuple[int, ...]
    #: ``"stop"`` (end of turn or a stop string), ``"length"`` (``max_tokens`` reached)
    #: or ``"tool_calls"`` (it called tools again after ``max_tool_rounds`` rounds of
    #: calls, or for :meth:`Agent.respond`: those calls did not run; ``pending_calls``).
    finish_reason: FinishReason
    #: Tokens prefilled, reused from the cache, and generated.
    usage: Usage
    #: Seconds from the agent taking up the turn to the first token.
    ttft_s: float
    #: Seconds from the agent taking up the turn to the reply.
    total_s: float
    #: With ``logprobs=True`` (or ``top_logprobs``): each token's log-probability.
    logprobs: tuple[float, ...] | None = None
    #: With ``top_logprobs=n``: at each step, the ``n`` most likely tokens as
    #: ``(token, logprob)`` pairs, most likely first.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    #: With ``schema=``: the reply's JSON value, parsed (a model instance for a pydantic
    #: model class).
    data: Any = None
    #: With tools: the calls the agent ran for this turn, in order, each with its
    #: ``result`` (or ``error``). ``text``, ``tokens`` and the log-probabilities are the
    #: final answer's; ``usage`` counts every round.
    tool_calls: tuple[ToolCall, ...] = ()
    #: The stop string (of ``stop``) that ended the reply, if one did.
    stop: str | None = None
    #: With ``finish_reason="tool_calls"``: the calls the final reply wrote, not run (by
    #: :meth:`Agent.respond`, whose caller runs them, or after ``max_tool_rounds``).
    pending_calls: tuple[ToolCall, ...] = ()

    def __str__(self) -> str:
        return self.text


class Request(Protocol):
    """What a stream reads of its turn's request (an agent's envelope)."""

    pieces: MemoryObjectReceiveStream[str] | None
    reply: Reply | None
    error: BaseException | None
    done: anyio.Event
    sent: bool

    async def send(self) -> None: ...

    async def outcome(self) -> Reply | None: ...

    async def abandon(self) -> None: ...

    def deadline_in(self) -> float | None: ...

    def timeout_error(self) -> Exception: ...


class TurnStream:
    """The text of one turn as it is generated; see :meth:`Agent.stream`.

    Iterate it with ``async for`` to get text pieces (never half a character); once
    it is exhausted, :attr:`reply` holds the whole :class:`Reply`. The turn is sent to
    the agent on entering ``async with`` (so several streams entered in a row arrive
    in that order), or else when iteration starts. Leaving the ``async with`` block
    before the turn has finished cancels it, and the agent is left as it was before
    it. A turn that has finished is kept, whether or not all its text was read: its
    pieces wait in the stream, and :attr:`reply` holds it. The ``timeout`` covers the
    turn, not the reading of pieces it has already made.
    """

    def __init__(self, envelope: Request) -> None:
        self._envelope = envelope
        self._pieces = envelope.pieces

    @property
    def reply(self) -> Reply:
        """The turn's reply. Raises :class:`InvalidRequestError` before the turn has
        finished, and the turn's error if it failed or was cancelled (the stream left
        before it finished)."""
        envelope = self._envelope
        if envelope.reply is not None:
            return envelope.reply
        if envelope.done.is_set() and envelope.error is not None:
            raise envelope.error
        if envelope.done.is_set():
            raise MlxActorsError("the turn was cancelled: the stream was left before it finished")
        raise InvalidRequestError("the turn has not finished: read the stream to its end first")

    def __aiter__(self) -> TurnStream:
        return self

    async def __anext__(self) -> str:
        envelope = self._envelope
        if not envelope.sent:
            await envelope.send()
        assert self._pieces is not None
        try:
            # Once the turn has finished, its pieces are all here: no deadline.
            deadline = None if envelope.done.is_set() else envelope.deadline_in()
            with anyio.fail_after(deadline):
                return await self._pieces.receive()
        except anyio.EndOfStream:
            await envelope.outcome()
            raise StopAsyncIteration from None
        except BaseException as exc:
            await envelope.abandon()
            if isinstance(exc, TimeoutError):
                if envelope.reply is not None:  # it finished in time after all: kept
                    return await self.__anext__()
                raise envelope.timeout_error() from None
            raise

    async def __aenter__(self) -> TurnStream:
        if not self._envelope.sent:
            await self._envelope.send()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel the turn if it has not finished (a finished one is kept)."""
        if self._envelope.sent and not self._envelope.done.is_set():
            await self._envelope.abandon()
