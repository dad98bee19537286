"""The registry: a runtime's live agents by name, the names taken while an agent is made
or closed, and the checks a new agent's name and arguments pass."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import anyio

from ..actors import (
    Agent,
    Message,
    Tool,
    TurnOptions,
    TurnSettings,
    as_tools,
    check_name,
    check_text,
    check_tool_choice,
)
from ..errors import InvalidRequestError, UnknownAgentError


class Registry:
    """A runtime's agents by name. Names ignore case (they name files); one is taken by a
    live agent, by an agent being made (:meth:`claim`), and by one being closed until
    its files are gone (:meth:`closing` until :meth:`closed`)."""

    def __init__(self, *, check_running: Callable[[], None], log: Any) -> None:
        self._check_running = check_running
        self._log = log
        self._agents: dict[str, Agent] = {}
        #: Names of agents being made (a fork, an adoption), not yet in ``_agents``.
        self._claimed: set[str] = set()
        #: Names (case-folded) of agents being closed: taken until their files are gone.
        self._closing: dict[str, anyio.Event] = {}

    @property
    def agents(self) -> Mapping[str, Agent]:
        """The live agents by name (a read-only view)."""
        return MappingProxyType(self._agents)

    def agent(self, name: str) -> Agent:
        """The live agent called ``name`` (raises :class:`UnknownAgentError`)."""
        try:
            return self._agents[name]
        except KeyError:
            raise UnknownAgentError(f"no live agent is called {name!r}") from None

    def add(self, agent: Agent) -> None:
        self._agents[agent.name] = agent

    def remove(self, agent: Agent) -> bool:
        """Forget ``agent`` if it is the live agent of its name; whether it was."""
        if self._agents.get(agent.name) is agent:
            del self._agents[agent.name]
            return True
        return False

    def stopped(self, agent: Agent) -> None:
        """An agent's task ended (its ``on_stopped``)."""
        if self.remove(agent):
            self._log.info("agent.closed", agent=agent.name)

    # -- names ----------------------------------------------------------------------------

    def check_new_name(self, name: str) -> None:
        """Raise unless a new agent may be called ``name``."""
        self._check_running()
        check_name(name)
        for other in [*self._agents, *self._claimed]:
            if other.casefold() == name.casefold():
                raise InvalidRequestError(
                    f"an agent named {other!r} already exists (names ignore case: they name files)"
                )

    async def check_free(self, name: str) -> None:
        """Wait until no agent called ``name`` is being closed, then
        :meth:`check_new_name`."""
        while (closing := self._closing.get(str(name).casefold())) is not None:
            await closing.wait()
        self.check_new_name(name)

    @contextlib.contextmanager
    def claim(self, name: str) -> Iterator[None]:
        """Hold ``name`` (just checked free) while its agent is made."""
        self._claimed.add(name)
        try:
            yield
        finally:
            self._claimed.discard(name)

    def closing(self, agent: Agent) -> None:
        """``agent.close()`` began: its name stays taken until :meth:`closed`."""
        self._closing.setdefault(agent.name.casefold(), anyio.Event())

    def closed(self, agent: Agent) -> None:
        """The closed agent's files are gone: a new agent may take its name."""
        done = self._closing.pop(agent.name.casefold(), None)
        if done is not None:
            done.set()


def check_spawn(
    name: str,
    *,
    system: str | None,
    mailbox_size: int | None,
    tools: Sequence[Callable[..., Any] | Tool] | None,
    history: Sequence[Message | Mapping[str, str]],
    settings: TurnSettings,
    limit: int | None,
) -> tuple[TurnOptions, tuple[Tool, ...], list[Message]]:
    """Check :meth:`Runtime.spawn`'s arguments (texts of at most ``limit`` characters);
    the new agent's options, tools and conversation."""
    check_name(name)
    if system is not None and system != "":
        check_text("system", system, limit)
    if mailbox_size is not None and (
        isinstance(mailbox_size, bool) or not isinstance(mailbox_size, int) or mailbox_size <= 0
    ):
        raise InvalidRequestError(f"mailbox_size must be a positive int, got {mailbox_size!r}")
    options = TurnOptions().override(**settings)
    agent_tools = as_tools(tools)
    check_tool_choice(options.tool_choice, agent_tools)
    return options, agent_tools, [_seed_message(m, limit) for m in history]


def _seed_message(message: Message | Mapping[str, str], limit: int | None) -> Message:
    if isinstance(message, Message):
        role, content = message.role, message.content
    elif isinstance(message, Mapping) and set(message) == {"role", "content"}:
        role, content = message["role"], message["content"]
    else:
        raise InvalidRequestError(
            f"history takes Messages or {{'role': ..., 'content': ...}}, got {message!r}"
        )
    if role not in ("user", "assistant"):
        raise InvalidRequestError(f"history roles are 'user' or 'assistant', got {role!r}")
    # A model's reply may be empty or only whitespace; a user's text may not.
    blank = role == "assistant"
    return Message(role=role, content=check_text("content", content, limit, blank=blank))
