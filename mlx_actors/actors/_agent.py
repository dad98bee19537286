"""An agent: one task with a bounded mailbox, its conversation and its cache blocks."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import anyio
import attrs
from anyio.abc import TaskStatus
from typing_extensions import Unpack

from ..errors import AgentClosedError, InvalidRequestError, MlxActorsError
from ..scheduler import Scheduler
from ._envelope import Envelope
from ._mailbox import Mailbox
from ._reply import Message, Reply, TurnStream
from ._requests import Requests
from ._settings import TurnOptions, TurnSettings, check_name
from ._tools import Tool, as_tools, check_tool_choice
from ._transaction import AgentState
from ._turn import TurnRunner


@attrs.frozen(kw_only=True)
class AgentStatistics:
    """A snapshot of one agent."""

    #: Requests waiting in the mailbox (the running turn not included).
    queued: int
    #: Tasks waiting to put a request into a full mailbox.
    senders_waiting: int
    #: Turns answered so far.
    turns: int
    #: Conversation tokens held in the agent's KV cache.
    cached_tokens: int
    #: Cache blocks the agent holds (one block is 256 tokens of one layer).
    cached_blocks: int
    #: Whether the cache was moved to disk to make room (it comes back on the next turn).
    on_disk: bool


class Keeper(Protocol):
    """How the runtime keeps an agent beyond its process (a state directory), and makes
    new agents from it."""

    @property
    def saves_turns(self) -> bool:
        """Whether :meth:`changed` writes after every turn (then a turn is kept only
        once written)."""
        ...

    async def changed(self, agent: Agent) -> None:
        """After a turn or a reset: save what changed (raise
        :class:`~mlx_actors.errors.StateWriteError` if it could not be saved)."""

    def writes(self, agent: Agent) -> int:
        """How many saves of ``agent`` have read it so far (a ``flush`` too): one more
        since a turn was committed means the state directory may hold that turn."""
        ...

    async def rewrite(self, agent: Agent) -> None:
        """Save ``agent`` as it is now, whatever the keeper saves after turns: a turn
        written meanwhile was taken back (raise
        :class:`~mlx_actors.errors.StateWriteError` if it could not be saved)."""

    def closing(self, agent: Agent) -> None:
        """``close()`` began: the name stays taken until :meth:`closed`."""

    async def closed(self, agent: Agent) -> None:
        """After ``close()`` stopped the agent: forget it, and free its name."""

    def check_new_name(self, name: str) -> None:
        """Raise :class:`InvalidRequestError` unless a new agent may take ``name``."""

    async def fork(
        self, parent: Agent, name: str, options: TurnOptions, mailbox_size: int | None
    ) -> Agent:
        """Start an agent with ``parent``'s conversation and cache."""
        ...


@attrs.frozen
class _Saves:
    """The keeper, for one agent (what its state saves through)."""

    keeper: Keeper
    agent: Agent

    @property
    def saves_turns(self) -> bool:
        return self.keeper.saves_turns

    async def changed(self) -> None:
        await self.keeper.changed(self.agent)

    def writes(self) -> int:
        return self.keeper.writes(self.agent)

    async def rewrite(self) -> None:
        await self.keeper.rewrite(self.agent)


class Agent:
    """A long-lived agent: one task with a bounded mailbox, its conversation, and its KV
    cache as blocks of the runtime's pool.

    Made by :meth:`Runtime.spawn`, not directly. Turns are handled one at a time, in
    the order they arrive; a full mailbox makes senders wait. Each turn sends the
    scheduler only the tokens its cache lacks.
    """

    def __init__(
        self,
        name: str,
        scheduler: Scheduler,
        *,
        system: str | None,
        options: TurnOptions,
        mailbox_size: int,
        log: Any,
        on_stopped: Callable[[Agent], None],
        keeper: Keeper | None = None,
        messages: Sequence[Message] = (),
        turns: int = 0,
        cached: tuple[int, int] = (0, 0),
        tools: Sequence[Tool] = (),
    ) -> None:
        self.name = name
        self.options = options
        self._state = AgentState(
            name,
            scheduler,
            log=log,
            saves=None if keeper is None else _Saves(keeper, self),
            system=system,
            tools=tools,
            messages=messages,
            turns=turns,
            cached=cached,
        )
        self._scheduler = scheduler
        self._turns = TurnRunner(name, scheduler, self._state)
        self._log = log
        self._keeper = keeper
        self._mailbox = Mailbox(
            name,
            mailbox_size,
            handlers={
                "ask": self._turn,
                "respond": self._turn,
                "tell": self._state.tell,
                "fork": self._fork,
                "reset": self._state.reset,
            },
            deliver=self._state.deliver,
            on_stopped=functools.partial(on_stopped, self),
        )
        self._requests = Requests(self, scheduler, self._mailbox, self._state)
        self._close_done: anyio.Event | None = None

    def __repr__(self) -> str:
        return f"<Agent {self.name!r}, {len(self._state.messages)} messages>"

    # -- the public face --------------------------------------------------------------------

    @property
    def history(self) -> tuple[Message, ...]:
        """The conversation: the system prompt (if any), then user and assistant turns."""
        system = (Message(role="system", content=self.system),) if self.system else ()
        return (*system, *self._state.messages)

    @property
    def system(self) -> str | None:
        """The system prompt (``None``: none)."""
        return self._state.system

    @system.setter
    def system(self, system: str | None) -> None:
        self._state.system = system

    @property
    def cached_tokens(self) -> int:
        """Tokens of the conversation held in the agent's KV cache."""
        return self._state.cached_tokens

    @property
    def closed(self) -> bool:
        return self._mailbox.closing is not None

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The tools the agent may call (see ``spawn(tools=...)``)."""
        return self._state.tools

    def use_tools(self, tools: Sequence[Callable[..., Any] | Tool]) -> None:
        """Replace the agent's tools from its next turn on (an agent brought back from a
        state directory has its tools' descriptions, not their functions: give them
        again). The conversation is rendered with the new tools, so a turn after a
        change that alters their descriptions prefills the conversation again."""
        self._requests.check_loop()
        made = as_tools(tools)
        check_tool_choice(self.options.tool_choice, made)
        self._state.tools = made

    def statistics(self) -> AgentStatistics:
        return AgentStatistics(
            queued=self._mailbox.queued(),
            senders_waiting=self._mailbox.senders_waiting(),
            turns=self._state.turns,
            cached_tokens=self._state.cached_tokens,
            cached_blocks=self._state.cached_blocks,
            on_disk=self._scheduler.on_disk(self.name),
        )

    def pin(self, seconds: float = 300.0) -> None:
        """Keep this agent's cache in the pool for ``seconds`` from now, as a hint that
        it will be asked again soon (while a tool it called runs, say): when a turn
        needs room, unpinned idle agents' caches leave first. A pinned cache still
        leaves when nothing else can; pinning again sets a new time.

        Raises:
            InvalidRequestError: ``seconds`` is not a number of seconds > 0.
            AgentClosedError: the agent is closed.
        """
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not (0 < seconds < float("inf"))
        ):
            raise InvalidRequestError(f"seconds must be a number > 0, got {seconds!r}")
        self._requests.check_open()
        self._scheduler.pin(self.name, float(seconds))

    def unpin(self) -> None:
        """End :meth:`pin`: the agent's cache leaves in its turn again."""
        self._requests.check_open()
        self._scheduler.pin(self.name, None)

    async def ask(
        self,
        text: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (also cancels the turn; see below)
        schema: Any = None,
        **settings: Unpack[TurnSettings],
    ) -> Reply:
        """Send ``text`` as the next user message and wait for the reply.

        With ``schema`` (a JSON schema dict, or a pydantic model class) the reply is
        decoded under a constraint that makes it a JSON value of that schema, and
        ``reply.data`` holds it parsed (an instance of the model class). Say in ``text``
        what the fields mean: the constraint decides the form, not the content.

        ``settings`` (:class:`TurnSettings`: ``max_tokens``, ``temperature``, ``stop``,
        ``logprobs``...) override the agent's defaults for this turn. ``timeout``
        (seconds) covers waiting in the mailbox too; on timeout the turn is cancelled,
        the agent is left as before it, and :class:`TurnTimeoutError` is raised.
        Cancelling the caller cancels the turn the same way, even when the cancel
        meets the finished turn on its way back: a turn is kept only once its caller
        has the reply.

        Raises:
            InvalidRequestError: empty or non-string text, bad settings.
            AgentClosedError: the agent was closed.
            RuntimeClosedError: the runtime shut down first.
            PoolExhaustedError: the pool had no room for the turn, and no turn in
                flight could make some.
            StateWriteError: the turn could not be saved to the state directory (it
                was undone).
            ReplyFormatError: with ``schema``, the reply was cut (by ``max_tokens`` or
                a stop string) before its value was complete (the turn was undone).
        """
        envelope = self._requests.envelope(text, timeout, settings, schema=schema)
        await envelope.send()
        reply = await envelope.outcome()
        assert reply is not None
        return reply

    def stream(
        self,
        text: str,
        *,
        timeout: float | None = None,
        schema: Any = None,
        **settings: Unpack[TurnSettings],
    ) -> TurnStream:
        """Like :meth:`ask`, but gives the reply's text as it is generated::

        async with agent.stream("Hello") as pieces:
            async for piece in pieces:
                print(piece, end="")
        reply = pieces.reply
        """
        envelope = self._requests.envelope(text, timeout, settings, schema=schema)
        envelope.push, envelope.pieces = anyio.create_memory_object_stream[str](math.inf)
        return TurnStream(envelope)

    async def respond(
        self,
        conversation: Sequence[Message],
        *,
        system: str | None = None,
        tools: Sequence[Tool] = (),
        timeout: float | None = None,  # noqa: ASYNC109 (as ask's)
        schema: Any = None,
        **settings: Unpack[TurnSettings],
    ) -> Reply:
        """Answer ``conversation``, a whole conversation as its caller keeps it (an HTTP
        client's copy, say), in place of the agent's own.

        The agent's conversation, system prompt and tools become the ones given, and
        its cache is reused as far as the rendered conversation agrees with it, token
        by token: a conversation that continues the agent's prefills only its new
        messages; an edited or trimmed one goes back to where the two part. A message
        that says what the agent's own says (an assistant reply as the caller was given
        it: its text before its calls, and its calls) keeps the agent's own form, as
        the model wrote it.

        ``conversation`` holds :class:`Message` s of roles ``"user"``, ``"assistant"``
        (with ``tool_calls`` it made), ``"tool"`` (a call's result, with the call's
        ``tool_call_id``) and ``"system"``, and ends with a user or tool message.
        ``tools`` (:class:`Tool` s; their functions, if any, are not used) are
        described to the model, and the calls it writes are not run: they come back
        as ``reply.pending_calls`` (``finish_reason="tool_calls"``), and their results
        come as tool messages of the next conversation. With ``schema``,
        ``reply.data`` is ``None`` if the reply was cut before its value was complete
        (nothing is raised). Otherwise as :meth:`ask`.

        Raises:
            InvalidRequestError: a malformed conversation, tools or settings.
            AgentClosedError, RuntimeClosedError, PoolExhaustedError, StateWriteError:
                as for :meth:`ask`.
        """
        envelope = self._requests.respond_envelope(
            conversation, system, tools, timeout, settings, schema
        )
        await envelope.send()
        reply = await envelope.outcome()
        assert reply is not None
        return reply

    def respond_stream(
        self,
        conversation: Sequence[Message],
        *,
        system: str | None = None,
        tools: Sequence[Tool] = (),
        timeout: float | None = None,
        schema: Any = None,
        **settings: Unpack[TurnSettings],
    ) -> TurnStream:
        """Like :meth:`respond`, but gives the reply's text as it is generated (see
        :meth:`stream`). The pieces are what the model writes, calls included."""
        envelope = self._requests.respond_envelope(
            conversation, system, tools, timeout, settings, schema
        )
        envelope.push, envelope.pieces = anyio.create_memory_object_stream[str](math.inf)
        return TurnStream(envelope)

    async def tell(self, text: str, *, role: Literal["user", "assistant"] = "user") -> None:
        """Add a message to the conversation without a reply, after the requests already
        in the mailbox: what other agents said, a document, a correction. Nothing runs
        through the model now; its tokens are prefilled with the next turn.

        ``role="assistant"`` puts words in the agent's own mouth. Two messages of the
        same role in a row are kept as they are; a chat template that insists on
        alternating roles refuses the next turn (``InvalidRequestError``).

        Raises:
            InvalidRequestError: empty or non-string text, another role.
            AgentClosedError: the agent was closed.
            StateWriteError: the message could not be saved (it was not added).
        """
        if role not in ("user", "assistant"):
            raise InvalidRequestError(f"role must be 'user' or 'assistant', got {role!r}")
        envelope = self._requests.envelope(text, None, {}, kind="tell")
        envelope.message = Message(role=role, content=envelope.text)
        await envelope.send()
        await envelope.outcome()

    async def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and free the cache, after
        the turns already in the mailbox. Cancelling the caller withdraws a reset still
        waiting there; one the agent has begun completes."""
        self._requests.check_loop()
        envelope = Envelope(agent=self, kind="reset")
        await envelope.send()
        await envelope.outcome()

    async def fork(
        self,
        name: str,
        *,
        mailbox_size: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (like ask's: covers the mailbox)
        **settings: Unpack[TurnSettings],
    ) -> Agent:
        """A new agent called ``name`` with this agent's system prompt, conversation and
        KV cache, after the turns already in the mailbox. The cache is shared by
        reference: nothing is copied or prefilled, and both agents then go their own way
        (a turn of either never changes what the other reads).

        ``settings`` override this agent's defaults for the new one. This agent is
        not changed. A fork is the way to branch: several critics of one draft, what-if
        continuations, a search over replies.

        Raises:
            InvalidRequestError: a bad or taken name, bad settings.
            AgentClosedError: this agent was closed.
            RuntimeClosedError: the runtime shut down first.
        """
        if self._keeper is None:
            raise InvalidRequestError("this agent cannot be forked: it has no runtime")
        check_name(name)
        if mailbox_size is not None and (
            isinstance(mailbox_size, bool) or not isinstance(mailbox_size, int) or mailbox_size <= 0
        ):
            raise InvalidRequestError(f"mailbox_size must be a positive int, got {mailbox_size!r}")
        envelope = self._requests.envelope(name, timeout, settings, kind="fork")
        envelope.mailbox_size = mailbox_size
        await envelope.send()
        await envelope.outcome()
        assert isinstance(envelope.forked, Agent)
        return envelope.forked

    async def close(self) -> None:
        """Stop and forget the agent: the running turn is cancelled, queued ones fail
        with :class:`AgentClosedError`, its cache blocks go back to the pool, and what a
        state directory kept of it is deleted."""
        self._requests.check_outside()
        if self._close_done is not None:  # closed, or being closed, by another call
            with anyio.CancelScope(shield=True):
                await self._close_done.wait()
            return
        self._close_done = done = anyio.Event()
        try:
            if self._keeper is not None:
                self._keeper.closing(self)
            await self._stop(AgentClosedError(f"agent {self.name!r} is closed"))
            with anyio.CancelScope(shield=True):
                await self._scheduler.forget(self.name, drop=True)
                if self._keeper is not None:
                    await self._keeper.closed(self)
        except BaseException:
            self._close_done = None  # what failed (deleting its files) can be tried again
            raise
        finally:
            done.set()

    # -- inside the agent -----------------------------------------------------------------

    def _check_outside(self) -> tuple[Envelope, ...]:
        return self._requests.check_outside()

    def _closed_error(self) -> MlxActorsError:
        """The error of a request that comes after the agent stopped."""
        return self._mailbox.closed_error()

    async def _post(self, envelope: Envelope) -> None:
        await self._mailbox.put(envelope)

    def _withdraw(self) -> None:
        self._mailbox.withdraw()

    async def _stop(self, error: MlxActorsError, *, wait: bool = True) -> None:
        """Cancel the running turn, fail the queued ones with ``error`` and end the task;
        with ``wait``, until it has ended."""
        await self._mailbox.stop(error, wait=wait)

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The agent's task: take envelopes from the mailbox, one at a time."""
        await self._mailbox.serve(task_status=task_status)

    async def _turn(self, envelope: Envelope) -> None:
        await self._turns.run(envelope, self.options)

    async def _fork(self, envelope: Envelope) -> None:
        assert self._keeper is not None and envelope.options is not None
        with anyio.CancelScope(shield=True):  # short, and must not stop half-way
            child = await self._keeper.fork(
                self, envelope.text, envelope.options, envelope.mailbox_size
            )
            if envelope.cancelled:  # the caller went away: leave nothing behind
                await child.close()
                return
        envelope.forked = child
        self._state.delivered(envelope, functools.partial(self._unfork, envelope))

    async def _unfork(self, envelope: Envelope) -> None:
        """Close a fork whose caller went away."""
        child, envelope.forked = envelope.forked, None
        assert isinstance(child, Agent)
        await child.close()
