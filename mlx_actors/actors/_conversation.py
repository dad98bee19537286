"""A conversation its caller keeps (:meth:`Agent.respond`): checked as given, and continued
from the agent's own where the two say the same.

A caller that keeps its own copy (an HTTP client) sends back what it was shown: a reply's
text before its calls, and the calls parsed. The agent keeps what the model wrote (the
calls as text, in its own whitespace). Where the caller's message says what the agent's
says, the agent's form is kept, so that the conversation renders to the tokens its cache
holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import InvalidRequestError
from ._reply import Message
from ._tool_format import ToolFormat

ROLES = ("system", "user", "assistant", "tool")


def check_conversation(conversation: object, limit: int | None) -> tuple[Message, ...]:
    """``conversation`` as a tuple, if it is one :meth:`Agent.respond` can answer: messages
    of known roles, valid Unicode, no longer in all than ``limit`` characters, the last a
    user or tool message."""
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
        raise InvalidRequestError(f"a conversation is a list of Messages, got {conversation!r}")
    given = tuple(conversation)
    if not given:
        raise InvalidRequestError("the conversation is empty: it needs a message to answer")
    size = 0
    for i, message in enumerate(given):
        if not isinstance(message, Message):
            raise InvalidRequestError(f"message {i} is not a Message: {message!r}")
        if message.role not in ROLES:
            raise InvalidRequestError(
                f"message {i} has role {message.role!r}; the roles are {list(ROLES)}"
            )
        texts = [message.content, *(c.name for c in message.tool_calls)]
        for text in texts:
            if not isinstance(text, str):
                raise InvalidRequestError(f"message {i}'s content is not text: {text!r}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequestError(
                    f"message {i} is not valid Unicode (a lone surrogate at {exc.start})"
                ) from None
        size += len(message.content)
    if given[-1].role not in ("user", "tool"):
        raise InvalidRequestError(
            f"the conversation ends with a message of role {given[-1].role!r}; the last "
            "message to answer is a user's or a tool's"
        )
    if limit is not None and size > limit:
        raise InvalidRequestError(
            f"the conversation has {size:,} characters, more than any turn of this model "
            f"and pool can hold (at most {limit:,}, even at the longest tokens)"
        )
    return given


def continue_from(
    own: Sequence[Message], given: Sequence[Message], form: ToolFormat
) -> list[Message]:
    """``given``, its leading messages that say what ``own``'s say replaced by ``own``'s,
    and the rest as the model would have written them."""
    out: list[Message] = []
    same = True
    for i, message in enumerate(given):
        same = same and i < len(own) and says_same(own[i], message, form)
        out.append(own[i] if same else as_written(message, form))
    return out


def says_same(own: Message, given: Message, form: ToolFormat) -> bool:
    """Whether ``given`` is ``own`` as its caller was shown it (or exactly ``own``)."""
    if (own.role, own.tool_call_id) != (given.role, given.tool_call_id):
        return False
    if _calls(own) != _calls(given):
        return False
    shown = form.before_calls(own.content) if own.tool_calls else own.content
    return given.content in (shown, own.content)


def as_written(message: Message, form: ToolFormat) -> Message:
    """An assistant message with calls as the model writes it: with a template that
    does not render calls, its calls as text after its own."""
    if form.native or message.role != "assistant" or not message.tool_calls:
        return message
    if form.start in message.content:  # the calls' text is there already
        return message
    return Message(
        role=message.role,
        content=form.written(message.content, message.tool_calls),
        tool_calls=message.tool_calls,
    )


def _calls(message: Message) -> list[tuple[str, str, dict[str, object]]]:
    return [(c.id, c.name, dict(c.arguments)) for c in message.tool_calls if c.error is None]
