"""An agent: one task with a bounded mailbox, its conversation and its cache blocks."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import anyio
import attrs
import jinja2
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream
from typing_extensions import Unpack

from ..errors import (
    AgentClosedError,
    InvalidRequestError,
    MlxActorsError,
    ReplyFormatError,
)
from ..scheduler import (
    SEEDS,
    AgentBlocks,
    Scheduler,
    Turn,
    Usage,
    json_schema,
    parse_reply,
    schema_grammar,
)
from ._conversation import check_conversation, continue_from
from ._envelope import Envelope, running
from ._mailbox import Mailbox
from ._render import Renderer, Rendering, renderer_for
from ._reply import Message, Reply, TurnStream
from ._settings import (
    TurnOptions,
    TurnSettings,
    check_name,
    check_text,
    check_timeout,
)
from ._tool_format import ToolFormat, tool_format
from ._tools import Tool, ToolCall, as_tools, check_tool_choice, named_tools, run_call
from ._transaction import AgentState

#: Conversations of fewer characters are rendered on the event loop (under two milliseconds
#: on a small CPU); longer ones on a worker thread, so that the loop never waits on them.
RENDER_ON_LOOP = 4_000


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
        self._format: ToolFormat | None = None
        #: Grammars of required calls and tool-or-answer replies, compiled once each.
        self._grammars: dict[tuple[tuple[Tool, ...], str], str] = {}
        self._scheduler = scheduler
        self._renderer: Renderer = renderer_for(scheduler.tokenizer)
        #: The last rendering of the conversation: the next one encodes only what changed.
        self._rendering: Rendering | None = None
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
        self._check_loop()
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
        envelope = self._envelope(text, timeout, settings, schema=schema)
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
        envelope = self._envelope(text, timeout, settings, schema=schema)
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
        envelope = self._respond_envelope(conversation, system, tools, timeout, settings, schema)
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
        envelope = self._respond_envelope(conversation, system, tools, timeout, settings, schema)
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
        envelope = self._envelope(text, None, {}, kind="tell")
        envelope.message = Message(role=role, content=envelope.text)
        await envelope.send()
        await envelope.outcome()

    async def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and free the cache, after
        the turns already in the mailbox. Cancelling the caller withdraws a reset still
        waiting there; one the agent has begun completes."""
        self._check_loop()
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
        envelope = self._envelope(name, timeout, settings, kind="fork")
        envelope.mailbox_size = mailbox_size
        await envelope.send()
        await envelope.outcome()
        assert envelope.forked is not None
        return envelope.forked

    async def close(self) -> None:
        """Stop and forget the agent: the running turn is cancelled, queued ones fail
        with :class:`AgentClosedError`, its cache blocks go back to the pool, and what a
        state directory kept of it is deleted."""
        self._check_outside()
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

    def _envelope(
        self,
        text: object,
        timeout: float | None,
        settings: Mapping[str, Any],
        kind: Literal["ask", "fork", "tell"] = "ask",
        schema: Any = None,
    ) -> Envelope:
        self._check_open()
        text = check_text("text", text, self._scheduler.max_text_chars)
        options = self.options.override(**settings)
        if kind in ("ask", "fork"):
            check_tool_choice(options.tool_choice, self._state.tools)
        return Envelope(
            agent=self,
            kind=kind,
            text=text,
            options=options,
            timeout=check_timeout(timeout),
            schema=schema,
            grammar=schema_grammar(schema) if schema is not None else None,
        )

    def _respond_envelope(
        self,
        conversation: Sequence[Message],
        system: str | None,
        tools: Sequence[Tool],
        timeout: float | None,
        settings: Mapping[str, Any],
        schema: Any,
    ) -> Envelope:
        self._check_open()
        limit = self._scheduler.max_text_chars
        given = check_conversation(conversation, limit)
        if system is not None and system != "":
            check_text("system", system, limit)
        made = as_tools(tools)
        options = self.options.override(**settings)
        check_tool_choice(options.tool_choice, made)
        return Envelope(
            agent=self,
            kind="respond",
            conversation=given,
            system=system or None,
            tools=made,
            options=options,
            timeout=check_timeout(timeout),
            schema=schema,
            grammar=schema_grammar(schema) if schema is not None else None,
        )

    def _check_open(self) -> None:
        if self._mailbox.closing is not None:
            raise self._closed_error()
        self._check_loop()

    def _check_loop(self) -> None:
        """Refuse a call from another event loop than the runtime's: its wake-ups would
        never reach the caller's loop."""
        try:
            here = anyio.lowlevel.current_token()
        except Exception:
            here = None
        if here != self._scheduler.token:
            raise InvalidRequestError(
                f"agent {self.name!r} was called from another event loop (or thread) than "
                "its Runtime's; call it from the runtime's loop, for instance with "
                "anyio.from_thread.run(agent.ask, text, token=...) from a worker thread"
            )

    def _check_outside(self) -> tuple[Envelope, ...]:
        """The requests still running that this call comes from (by a tool); refused
        if one of them is this agent's: it takes one request at a time, so it would
        wait for itself."""
        senders = running()
        agents = [e.agent for e in senders]
        if self in agents:
            via = " -> ".join(repr(a.name) for a in (*agents[agents.index(self) :], self))
            raise InvalidRequestError(
                f"agent {self.name!r} was sent a request (or closed) from inside its own "
                f"turn, by a tool ({via}): an agent takes one request at a time, so it "
                "would wait for itself; ask another agent, or do it after the turn"
            )
        return senders

    def _closed_error(self) -> MlxActorsError:
        """The error of a request that comes after the agent stopped."""
        return self._mailbox.closed_error()

    async def _stop(self, error: MlxActorsError, *, wait: bool = True) -> None:
        """Cancel the running turn, fail the queued ones with ``error`` and end the task;
        with ``wait``, until it has ended."""
        await self._mailbox.stop(error, wait=wait)

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The agent's task: take envelopes from the mailbox, one at a time."""
        await self._mailbox.serve(task_status=task_status)

    async def _turn(self, envelope: Envelope) -> None:
        """One ask (or respond): the reply, and with tools every round of calls before
        it. Rounds after the first commit their cache with ``hold``; if the ask fails,
        the agent's cache is undone to the one it started from, and its conversation
        never changed."""
        assert envelope.options is not None
        started = time.perf_counter()
        options = envelope.options
        responding = envelope.kind == "respond"
        if responding:  # the caller's conversation, and it runs the calls
            system, agent_tools, most_rounds = envelope.system, envelope.tools, 0
            messages = continue_from(
                self._state.messages, envelope.conversation, self._tool_format()
            )
        else:  # tools as they are now: use_tools() changes the next turn
            system, agent_tools = self._state.system, self._state.tools
            most_rounds = options.max_tool_rounds
            messages = [*self._state.messages, Message(role="user", content=envelope.text)]
        seed = options.seed
        if seed is not None and self.options.seed == seed:
            seed = (seed + self._state.turns) % SEEDS  # each of the agent's turns its own stream
        tools = {t.name: t for t in agent_tools} if options.tool_choice != "none" else {}
        ran: list[ToolCall] = []
        usage: Usage | None = None
        ttft = 0.0
        held = False
        loose: AgentBlocks | None = None  # a round's blocks not yet given back or kept
        try:
            for rounds in itertools.count():
                turn = Turn(
                    agent=self.name,
                    tokens=await self._tokens(messages, agent_tools, system),
                    max_tokens=options.max_tokens,
                    sampling=options.sampling(seed if rounds == 0 else _round_seed(seed, rounds)),
                    stop=options.stop,
                    grammar=await self._grammar(envelope, options, agent_tools, rounds == 0),
                    on_text=_pusher(envelope.push) if envelope.push is not None else None,
                )
                result = await self._scheduler.run_turn(
                    turn, sent=envelope.arrived if rounds == 0 else None
                )
                loose = result.blocks
                if usage is None:
                    ttft = result.submitted_at + result.ttft_s - started
                usage = _add_usage(usage, result.usage)
                key = (self.name, self._state.turns, rounds)
                calls = (
                    self._tool_format().calls(result.text, key, agent_tools)
                    if tools and not self._answered(envelope, result.text)
                    else ()
                )
                if not calls or rounds >= most_rounds:
                    break
                self._scheduler.commit(self.name, result.blocks, hold=True)
                loose, held = None, True
                messages.append(Message(role="assistant", content=result.text, tool_calls=calls))
                for call in calls:
                    done, text = await run_call(call, tools)
                    ran.append(done)
                    messages.append(
                        Message(role="tool", content=text, name=call.name, tool_call_id=call.id)
                    )
            data = None
            if envelope.schema is not None and not calls:
                data = _data(result.text, envelope.schema, raises=not responding)
        except BaseException:
            if loose is not None:
                self._scheduler.release(self.name, loose)
            if held:
                self._scheduler.undo(self.name)
            raise
        answer = Message(role="assistant", content=result.text, tool_calls=calls)
        replaced = (system, agent_tools) if responding else None
        if not await self._state.commit_turn(
            envelope, result.blocks, [*messages, answer], replaced
        ):
            return
        assert usage is not None
        pending = tuple(c for c in calls if c.error is None)
        envelope.reply = Reply(
            text=result.text,
            tokens=result.tokens,
            finish_reason="tool_calls" if pending else result.finish_reason,
            stop=result.stop,
            pending_calls=pending,
            logprobs=result.logprobs,
            top_logprobs=result.top_logprobs,
            data=data,
            tool_calls=tuple(ran),
            usage=usage,
            ttft_s=ttft,
            total_s=time.perf_counter() - started,
        )

    async def _tokens(
        self, messages: list[Message], tools: Sequence[Tool], system: str | None
    ) -> list[int]:
        """The conversation rendered as the model reads it: on the event loop when it is
        short and the tokenizer is free, else on a worker thread.

        Raises:
            InvalidRequestError: the chat template refused the conversation.
        """
        lock = self._scheduler.tokenizer_lock
        size = sum(len(m.content) for m in messages) + len(system or "")
        size += sum(len(json.dumps(t.spec())) for t in tools)
        try:
            if size < RENDER_ON_LOOP and lock.acquire(blocking=False):  # quick, and free
                try:
                    return self._render(messages, tools, system, locked=True)
                finally:
                    lock.release()
            return await anyio.to_thread.run_sync(
                functools.partial(self._render, messages, tools, system), abandon_on_cancel=True
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(
                f"the model's chat template refused the conversation: {exc}"
            ) from None

    def _tool_format(self) -> ToolFormat:
        if self._format is None:
            self._format = tool_format(self._scheduler.tokenizer)
        return self._format

    def _answered(self, envelope: Envelope, text: str) -> bool:
        """Whether a reply under ``schema`` took the answer's branch of its grammar (a
        call starts with the call's opening): then it holds no call, whatever its text
        says."""
        start = self._tool_format().start
        return envelope.schema is not None and not text.lstrip().startswith(start)

    async def _grammar(
        self, envelope: Envelope, options: TurnOptions, tools: tuple[Tool, ...], first: bool
    ) -> str | None:
        """What a round's reply must follow: a call on the first round when one is
        required; with ``schema``, the answer (or, with tools, a call or the answer).
        Compiled once per tools, choice and schema, on a worker thread."""
        choice = options.tool_choice
        if not tools or choice == "none":
            return envelope.grammar
        if first and choice != "auto":
            chosen = tools if choice == "required" else named_tools(choice, tools)
            answer = None
        elif envelope.schema is None:
            return None
        else:
            chosen, answer = tools, json_schema(envelope.schema)
        key = (chosen, json.dumps(answer, sort_keys=True))
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = await anyio.to_thread.run_sync(
                self._tool_format().call_grammar, chosen, answer
            )
            if len(self._grammars) >= 16:
                self._grammars.clear()
            self._grammars[key] = grammar
        return grammar

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
        assert child is not None
        await child.close()

    def _render(
        self,
        messages: list[Message],
        tools: Sequence[Tool],
        system: str | None,
        *,
        locked: bool = False,
    ) -> list[int]:
        """The conversation as the model reads it, under the tokenizer's lock (it is
        not thread-safe; ``locked``: the caller holds it). Only what changed since the
        last rendering is tokenised again."""
        extra: dict[str, Any] = {}
        if tools or any(m.role == "tool" or m.tool_calls for m in messages):
            conversation, extra = self._tool_format().conversation(system, messages, tools)
        else:
            head = [Message(role="system", content=system)] if system else []
            conversation = [m.as_dict() for m in (*head, *messages)]
        with contextlib.nullcontext() if locked else self._scheduler.tokenizer_lock:
            self._rendering = self._renderer.render(conversation, self._rendering, **extra)
        return list(self._rendering.tokens)


def _data(text: str, schema: Any, *, raises: bool) -> Any:
    """The reply's value under ``schema``; unless ``raises``, ``None`` for a reply that
    is not a complete value (instead of :class:`ReplyFormatError`)."""
    try:
        return parse_reply(text, schema)
    except ReplyFormatError:
        if raises:
            raise
        return None


def _add_usage(total: Usage | None, more: Usage) -> Usage:
    if total is None:
        return more
    return Usage(
        **{a.name: getattr(total, a.name) + getattr(more, a.name) for a in attrs.fields(Usage)}
    )


def _round_seed(seed: int | None, rounds: int) -> int | None:
    """A later round's seed: its own stream, reproducible from the turn's."""
    return None if seed is None else (seed + 7919 * rounds) % SEEDS


def _pusher(push: MemoryObjectSendStream[str]) -> Callable[[str], None]:
    """A text callback that never raises: a reader that went away just stops reading."""

    def send(piece: str) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            push.send_nowait(piece)

    return send
