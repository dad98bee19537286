"""A request in an agent's mailbox and the caller's handle on its outcome (its reply,
its error, its cancellation), and the requests the calling code runs inside."""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from typing import Any, Literal, Protocol

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import MlxActorsError, TurnTimeoutError
from ..scheduler import Scheduler
from ._reply import Message, Reply
from ._settings import TurnOptions
from ._tools import Tool


class Addressee(Protocol):
    """What an envelope needs of the agent it is sent to (an :class:`Agent`, which
    imports this module: not the other way round)."""

    @property
    def name(self) -> str: ...

    @property
    def _scheduler(self) -> Scheduler: ...

    def _check_outside(self) -> tuple[Envelope, ...]:
        """The requests this call comes from (refused if one is the agent's own)."""
        ...

    async def _post(self, envelope: Envelope) -> None:
        """Put ``envelope`` in the mailbox (anyio's closed or broken resource errors
        if it takes no more)."""

    def _closed_error(self) -> MlxActorsError:
        """The error of a request that comes after the agent stopped."""
        ...

    def _withdraw(self) -> None:
        """A request in the mailbox was cancelled: the agent will skip it."""


#: The requests this task is handling, outermost first: the one its agent is running,
#: and those whose tools sent it there. A tool (on the event loop or a worker thread)
#: sees them too, so a request to one of their agents while it runs, which would wait
#: for itself, is refused. (A task a tool starts inherits them: a request it sends
#: after they finished is not refused.)
handling: contextvars.ContextVar[tuple[Envelope, ...]] = contextvars.ContextVar(
    "mlx_actors_handling", default=()
)


def running() -> tuple[Envelope, ...]:
    """The requests still running that the calling code runs inside (by a tool)."""
    return tuple(e for e in handling.get() if not e.done.is_set())


def running_here() -> frozenset[Addressee]:
    """The agents whose turns the calling code runs inside (a tool's, or what a tool
    called): stopping one of them must not wait for it, since that would wait for
    itself."""
    return frozenset(e.agent for e in running())


@attrs.define(eq=False)
class Envelope:
    """A request in an agent's mailbox, and the caller's handle on its outcome."""

    agent: Addressee
    kind: Literal["ask", "respond", "reset", "fork", "tell"]
    text: str = ""
    #: ``respond``'s conversation, system prompt and tools (in place of the agent's).
    conversation: tuple[Message, ...] = ()
    system: str | None = None
    tools: tuple[Tool, ...] = ()
    options: TurnOptions | None = None
    #: ``tell``'s message.
    message: Message | None = None
    #: What the reply must be (``ask(schema=...)``), and its grammar.
    schema: Any = None
    grammar: str | None = None
    mailbox_size: int | None = None
    forked: Addressee | None = None
    timeout: float | None = None
    pieces: MemoryObjectReceiveStream[str] | None = None
    push: MemoryObjectSendStream[str] | None = None
    done: anyio.Event = attrs.field(factory=anyio.Event)
    reply: Reply | None = None
    error: BaseException | None = None
    completed: bool = False
    sent: bool = False
    in_mailbox: bool = False
    cancelled: bool = False
    #: Counted among the turns the scheduler expects (until it sends it, or ends).
    announced: bool = False
    scope: anyio.CancelScope | None = None
    deadline: float = math.inf
    #: The requests, still running, that sent this one (see ``handling``).
    senders: tuple[Envelope, ...] = ()
    #: Done, and on its way to the caller (an ask, a tell, a fork): the agent can still
    #: undo it until the caller takes the outcome (``receipt`` True: ``keep`` runs at
    #: once, before anything the caller does next) or turns out to have gone (False:
    #: it is undone), then sets ``settled``.
    delivering: bool = False
    keep: Callable[[], None] | None = None
    receipt: bool | None = None
    received: anyio.Event = attrs.field(factory=anyio.Event)
    settled: anyio.Event = attrs.field(factory=anyio.Event)

    def deadline_in(self) -> float | None:
        """Seconds left before the turn's timeout (``None``: no timeout)."""
        if self.deadline == math.inf:
            return None
        return max(0.0, self.deadline - anyio.current_time())

    def timeout_error(self) -> TurnTimeoutError:
        return TurnTimeoutError(
            f"agent {self.agent.name!r} did not answer within {self.timeout} s; the turn "
            "was cancelled and the agent left as it was before it"
        )

    async def send(self) -> None:
        """Put the envelope in the mailbox (waits while the mailbox is full)."""
        self.senders = self.agent._check_outside()
        self.sent = True
        if self.kind in ("ask", "respond"):
            self.agent._scheduler.asked()
            self.announced = True
        if self.timeout is not None:
            self.deadline = anyio.current_time() + self.timeout
        try:
            with anyio.fail_after(self.deadline_in()):
                await self.agent._post(self)
            self.in_mailbox = True
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.arrived()  # it never reaches the mailbox: no longer expected
            raise self.agent._closed_error() from None
        except BaseException as exc:
            await self.abandon()
            if isinstance(exc, TimeoutError):
                raise self.timeout_error() from None
            raise

    async def outcome(self) -> Reply | None:
        """Wait for the request and return its reply (``None`` for a reset), or raise
        its error."""
        try:
            with anyio.fail_after(self.deadline_in()):
                await self.done.wait()
        except BaseException as exc:
            await self.abandon()
            if isinstance(exc, TimeoutError):
                if self.reply is not None:  # kept after all (it could not be undone)
                    return self.reply
                raise self.timeout_error() from None
            raise
        self.take(True)  # no await since the wait: the caller has it
        if self.error is not None:
            raise self.error
        return self.reply

    def take(self, taken: bool) -> None:
        """Say whether the caller took the outcome on its way (see ``delivering``)."""
        if self.delivering and self.receipt is None:
            self.receipt = taken
            if taken and self.keep is not None:
                self.keep()
            self.received.set()

    def cancel(self) -> None:
        self.cancelled = True
        if self.scope is not None:
            self.scope.cancel()  # running: the agent rolls back, then finishes it
        else:
            if self.in_mailbox:  # still queued: the agent will skip it
                self.agent._withdraw()
            self.finish()

    async def abandon(self) -> None:
        """Cancel the turn and wait until the agent is back as it was before it (a reply
        made but not yet taken is undone too, where it can be)."""
        if not self.done.is_set():
            self.cancel()
            with anyio.CancelScope(shield=True):
                await self.done.wait()
        if self.delivering:
            self.take(False)
            with anyio.CancelScope(shield=True):
                await self.settled.wait()

    def arrived(self) -> None:
        """The turn reached the scheduler (or never will): no longer expected."""
        if self.announced:
            self.announced = False
            self.agent._scheduler.announce(-1)

    def finish(self) -> None:
        self.arrived()
        if self.push is not None:
            self.push.close()
        self.done.set()
