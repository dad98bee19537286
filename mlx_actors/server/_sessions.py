"""Sessions: which agent answers a request. A named session is one agent for good (its
name made from the client's); a request with no name goes to the idle anonymous agent
whose conversation it continues, or to a new one. This module owns the server's agents:
their names, which are busy, the least recently used, and closing those past the limit
or idle too long."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Sequence

import anyio

from ..actors import Agent, Message
from ..actors._conversation import says_same
from ..actors._tool_format import ToolFormat
from ..runtime import Runtime
from ._chat import Chat
from ._errors import ApiError

#: Agent names of the server's sessions: named ones, anonymous ones.
NAMED, ANONYMOUS = "s-", "a-"
MAX_SESSION_NAME = 1024


def session_agent(session: str) -> str:
    """The agent of the session the client calls ``session`` (the same in every process,
    so that a state directory brings it back)."""
    return NAMED + hashlib.blake2b(session.encode(), digest_size=16).hexdigest()


def check_session(session: object, where: str) -> str:
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_NAME:
        raise ApiError(
            400, f"{where} must be a string of 1 to {MAX_SESSION_NAME} characters", param=where
        )
    try:
        session.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{where} is not valid Unicode", param=where) from None
    return session


class Sessions:
    """The agents that answer the server's requests.

    Args:
        runtime: a running runtime; its agents whose names begin with ``s-`` or ``a-``
            (a state directory's, brought back) are sessions too.
        form: the model's tool format (how a reply shows its calls).
        max_sessions: most sessions kept; a new one closes the least recently used
            idle one beyond that.
        idle_timeout: seconds after which an idle session is closed (``None``: never).
    """

    def __init__(
        self,
        runtime: Runtime,
        form: ToolFormat,
        *,
        max_sessions: int,
        idle_timeout: float | None,
    ) -> None:
        self._rt = runtime
        self._form = form
        self._max = max_sessions
        self._idle_timeout = idle_timeout
        self._lock = anyio.Lock()
        #: Requests each session's agent is handling now.
        self._busy: collections.Counter[str] = collections.Counter()
        #: Sessions by name, least recently used first, with when each was last used.
        self._used: collections.OrderedDict[str, float] = collections.OrderedDict()
        now = time.monotonic()
        for name in runtime.agents:
            if name.startswith((NAMED, ANONYMOUS)):
                self._used[name] = now
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._used)

    @property
    def busy(self) -> int:
        """Sessions handling a request now."""
        return sum(1 for n in self._busy.values() if n)

    @contextlib.asynccontextmanager
    async def agent_for(self, chat: Chat) -> AsyncIterator[Agent]:
        """The agent that answers ``chat``, kept from being closed while it does."""
        one_shot = chat.session is None and not self._rt.share_prefixes
        async with self._lock:
            await self._close_idle()
            if chat.session is not None:
                agent = await self._named(chat.session)
            elif one_shot:  # nothing shared across requests: a fresh agent, closed after
                agent = await self._spawn(self._anonymous_name())
            else:
                agent = self._continued(chat) or await self._spawn(self._anonymous_name())
            self._busy[agent.name] += 1
            self._used[agent.name] = time.monotonic()
            self._used.move_to_end(agent.name)
        try:
            yield agent
        finally:
            self._busy[agent.name] -= 1
            if not self._busy[agent.name]:
                del self._busy[agent.name]
            if agent.name in self._used:
                self._used[agent.name] = time.monotonic()
                self._used.move_to_end(agent.name)
            if one_shot:
                with anyio.CancelScope(shield=True):
                    await self._close(agent.name)

    async def _named(self, session: str) -> Agent:
        name = session_agent(session)
        agent = self._rt.agents.get(name)
        return agent if agent is not None else await self._spawn(name)

    def _continued(self, chat: Chat) -> Agent | None:
        """The idle anonymous agent whose conversation ``chat`` continues the furthest."""
        best: Agent | None = None
        best_length = -1
        for name in self._used:
            agent = self._rt.agents.get(name)
            if agent is None or not name.startswith(ANONYMOUS) or self._busy[name]:
                continue
            own = [m for m in agent.history if m.role != "system"]
            if (
                agent.system == chat.system
                and len(own) > best_length
                and self._continues(own, chat.conversation)
            ):
                best, best_length = agent, len(own)
        return best

    def _continues(self, own: Sequence[Message], given: Sequence[Message]) -> bool:
        return len(own) < len(given) and all(
            says_same(o, g, self._form) for o, g in zip(own, given[: len(own)], strict=True)
        )

    def _anonymous_name(self) -> str:
        return f"{ANONYMOUS}{secrets.token_hex(8)}{next(self._numbers)}"

    async def _spawn(self, name: str) -> Agent:
        while len(self._used) >= self._max:
            idle = next((n for n in self._used if not self._busy[n]), None)
            if idle is None:
                raise ApiError(
                    503,
                    f"all {self._max} sessions are busy; try again later",
                    kind="overloaded_error",
                )
            await self._close(idle)
        agent = await self._rt.spawn(name)
        self._used[name] = time.monotonic()
        return agent

    async def _close_idle(self) -> None:
        if self._idle_timeout is None:
            return
        too_old = time.monotonic() - self._idle_timeout
        for name, used in list(self._used.items()):
            if used > too_old:
                break  # the rest were used later
            if not self._busy[name]:
                await self._close(name)

    async def _close(self, name: str) -> None:
        self._used.pop(name, None)
        agent = self._rt.agents.get(name)
        if agent is not None:
            await agent.close()
