"""A request to an agent, checked at the boundary and made an envelope: its text or
conversation, settings, tools and schema; the agent still open; the caller on the
runtime's event loop, and not inside the agent's own turn (by a tool)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import anyio

from ..errors import InvalidRequestError
from ..scheduler import Scheduler, schema_grammar
from ._conversation import check_conversation
from ._envelope import Addressee, Envelope, running
from ._mailbox import Mailbox
from ._reply import Message
from ._settings import TurnOptions, check_text, check_timeout
from ._tools import Tool, as_tools, check_tool_choice
from ._transaction import AgentState


class Asked(Addressee, Protocol):
    """What the requests need of their agent (an :class:`Agent`, which imports this
    module: not the other way round)."""

    @property
    def options(self) -> TurnOptions:
        """The agent's default settings, which a request's settings override."""
        ...


class Requests:
    """Checks the requests made of one agent and makes their envelopes."""

    def __init__(
        self, agent: Asked, scheduler: Scheduler, mailbox: Mailbox, state: AgentState
    ) -> None:
        self._agent = agent
        self._scheduler = scheduler
        self._mailbox = mailbox
        self._state = state

    def envelope(
        self,
        text: object,
        timeout: float | None,
        settings: Mapping[str, Any],
        kind: Literal["ask", "fork", "tell"] = "ask",
        schema: Any = None,
    ) -> Envelope:
        """An ask, a fork (``text``: its name) or a tell."""
        self.check_open()
        text = check_text("text", text, self._scheduler.max_text_chars)
        options = self._agent.options.override(**settings)
        if kind in ("ask", "fork"):
            check_tool_choice(options.tool_choice, self._state.tools)
        return Envelope(
            agent=self._agent,
            kind=kind,
            text=text,
            options=options,
            timeout=check_timeout(timeout),
            schema=schema,
            grammar=schema_grammar(schema) if schema is not None else None,
        )

    def respond_envelope(
        self,
        conversation: Sequence[Message],
        system: str | None,
        tools: Sequence[Tool],
        timeout: float | None,
        settings: Mapping[str, Any],
        schema: Any,
    ) -> Envelope:
        """An answer to a whole conversation, as its caller keeps it."""
        self.check_open()
        limit = self._scheduler.max_text_chars
        given = check_conversation(conversation, limit)
        if system is not None and system != "":
            check_text("system", system, limit)
        made = as_tools(tools)
        options = self._agent.options.override(**settings)
        check_tool_choice(options.tool_choice, made)
        return Envelope(
            agent=self._agent,
            kind="respond",
            conversation=given,
            system=system or None,
            tools=made,
            options=options,
            timeout=check_timeout(timeout),
            schema=schema,
            grammar=schema_grammar(schema) if schema is not None else None,
        )

    def check_open(self) -> None:
        """Refuse a request once the agent is closing, or from another event loop."""
        if self._mailbox.closing is not None:
            raise self._mailbox.closed_error()
        self.check_loop()

    def check_loop(self) -> None:
        """Refuse a call from another event loop than the runtime's: its wake-ups would
        never reach the caller's loop."""
        try:
            here = anyio.lowlevel.current_token()
        except Exception:
            here = None
        if here != self._scheduler.token:
            raise InvalidRequestError(
                f"agent {self._agent.name!r} was called from another event loop (or "
                "thread) than its Runtime's; call it from the runtime's loop, for "
                "instance with anyio.from_thread.run(agent.ask, text, token=...) from a "
                "worker thread"
            )

    def check_outside(self) -> tuple[Envelope, ...]:
        """The requests still running that this call comes from (by a tool); refused
        if one of them is this agent's: it takes one request at a time, so it would
        wait for itself."""
        senders = running()
        agents = [e.agent for e in senders]
        agent = self._agent
        if agent in agents:
            via = " -> ".join(repr(a.name) for a in (*agents[agents.index(agent) :], agent))
            raise InvalidRequestError(
                f"agent {agent.name!r} was sent a request (or closed) from inside its own "
                f"turn, by a tool ({via}): an agent takes one request at a time, so it "
                "would wait for itself; ask another agent, or do it after the turn"
            )
        return senders
