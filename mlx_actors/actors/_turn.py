"""Running a turn (an ask or a respond): the conversation rendered as the model reads
it, the grammar its reply must follow, each round of tool calls, and the reply; the
agent's state commits it."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
import jinja2
from anyio.streams.memory import MemoryObjectSendStream

from ..errors import InvalidRequestError, ReplyFormatError
from ..scheduler import SEEDS, AgentBlocks, Scheduler, Turn, Usage, json_schema, parse_reply
from ._conversation import continue_from
from ._envelope import Envelope
from ._render import Renderer, Rendering, renderer_for
from ._reply import Message, Reply
from ._settings import TurnOptions
from ._tool_format import ToolFormat, tool_format
from ._tools import Tool, ToolCall, named_tools, run_call
from ._transaction import AgentState

#: Conversations of fewer characters are rendered on the event loop (under two milliseconds
#: on a small CPU); longer ones on a worker thread, so that the loop never waits on them.
RENDER_ON_LOOP = 4_000


class TurnRunner:
    """Runs one agent's turns, one at a time, and keeps what the next one reuses: the
    last rendering of the conversation and the grammars of its tools."""

    def __init__(self, name: str, scheduler: Scheduler, state: AgentState) -> None:
        self.name = name
        self._scheduler = scheduler
        self._state = state
        self._format: ToolFormat | None = None
        #: Grammars of required calls and tool-or-answer replies, compiled once each.
        self._grammars: dict[tuple[tuple[Tool, ...], str], str] = {}
        self._renderer: Renderer = renderer_for(scheduler.tokenizer)
        #: The last rendering of the conversation: the next one encodes only what changed.
        self._rendering: Rendering | None = None

    async def run(self, envelope: Envelope, defaults: TurnOptions) -> None:
        """One ask (or respond): the reply, and with tools every round of calls before
        it. Rounds after the first commit their cache with ``hold``; if the ask fails,
        the agent's cache is undone to the one it started from, and its conversation
        never changed. ``defaults``: the agent's own settings (on its own seed, each
        turn gets a stream of its own)."""
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
        if seed is not None and defaults.seed == seed:
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
            self._rendering = self._renderer.render(
                conversation, self._rendering, share=self._scheduler.share_prefixes, **extra
            )
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
