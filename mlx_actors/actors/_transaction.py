"""What an agent's requests change, and the one owner of the agent as it was before them:
its conversation, system prompt, tools, turn count and cache size; a turn's commit, its
undo or take-back when its caller went away; a tell and a reset; the saves of each."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
import attrs

from ..errors import MlxActorsError
from ..scheduler import AgentBlocks, Scheduler
from ._envelope import Envelope
from ._reply import Message
from ._tools import Tool


class Saves(Protocol):
    """The agent's keeper (:class:`~mlx_actors.actors.Keeper`), for this agent."""

    @property
    def saves_turns(self) -> bool: ...

    async def changed(self) -> None: ...

    def writes(self) -> int: ...

    async def rewrite(self) -> None: ...


@attrs.frozen
class Before:
    """What a turn changes, as it was before the turn: what undoing it restores."""

    messages: list[Message]
    turns: int
    cached: tuple[int, int]
    system: str | None
    tools: tuple[Tool, ...]
    #: The keeper's count of the agent's saves (see :meth:`Keeper.writes`).
    writes: int


class AgentState:
    """An agent's conversation, system prompt, tools, turns and cache size, and how a
    request changes them: committed, then kept once its caller takes the outcome, or
    undone (in the state directory too) if the caller went away first."""

    def __init__(
        self,
        name: str,
        scheduler: Scheduler,
        *,
        log: Any,
        saves: Saves | None,
        system: str | None,
        tools: Sequence[Tool],
        messages: Sequence[Message],
        turns: int,
        cached: tuple[int, int],
    ) -> None:
        self.name = name
        self.system = system
        self.tools = tuple(tools)
        self.messages: list[Message] = list(messages)
        self.turns = turns
        self.cached_tokens, self.cached_blocks = cached
        self._scheduler = scheduler
        self._log = log
        self._saves = saves
        #: How to undo the request on its way to its caller (see :meth:`deliver`).
        self._undo_delivered: Callable[[], Awaitable[None]] | None = None

    async def commit_turn(
        self,
        envelope: Envelope,
        blocks: AgentBlocks,
        messages: list[Message],
        replaced: tuple[str | None, tuple[Tool, ...]] | None = None,
    ) -> bool:
        """Make ``messages`` the conversation and ``blocks`` its cache (with
        ``replaced``, respond's system prompt and tools the agent's); ``False`` if the
        turn was taken back (its caller gave up while it was saved)."""
        # Commit the reply and its cache together: nothing awaits until the keeper. The
        # cache the turn started from is held until the turn is saved (with a keeper)
        # and, for an ask, until its caller takes the reply (see ``deliver``).
        before = self.snapshot()
        saving = self._saves is not None and self._saves.saves_turns
        delivering = envelope.push is None
        hold = saving or delivering
        self._scheduler.commit(self.name, blocks, hold=hold, saving=hold, snapshot=saving)
        self.cached_tokens, self.cached_blocks = blocks.num_tokens, blocks.num_blocks
        self.messages = messages
        if replaced is not None:
            self.system, self.tools = replaced
        self.turns += 1
        if saving:
            assert self._saves is not None
            # The turn is kept once saved; a caller who gave up meanwhile (a cancel, a
            # timeout) or a save that failed leaves the agent as it was before the turn,
            # its cache included (the turn's blocks go back to the pool).
            with anyio.CancelScope(shield=True):
                try:
                    await self._saves.changed()
                except BaseException:
                    self.undo_commit(before)
                    raise
                if envelope.cancelled and await self.take_back(before):
                    return False
        # Kept on disk although its caller gave up: kept here too, over its start's
        # cache (the take-back restored it), so nothing more to commit.
        if not (saving and envelope.cancelled):
            self._commit_delivered(envelope, blocks, before, delivering)
        return True

    def _commit_delivered(
        self,
        envelope: Envelope,
        blocks: AgentBlocks,
        before: Before,
        delivering: bool,
    ) -> None:
        """The turn's blocks become the agent's cache for good (its start's are freed)
        now, or, for an ask, when its caller takes the reply."""
        if not delivering:
            self._scheduler.commit(self.name, blocks)
            return
        keep = functools.partial(self._scheduler.commit, self.name, blocks)
        self.delivered(envelope, functools.partial(self._undo_turn, envelope, before), keep)

    def delivered(
        self,
        envelope: Envelope,
        undo: Callable[[], Awaitable[None]],
        keep: Callable[[], None] | None = None,
    ) -> None:
        """``envelope`` is done: it goes to its caller, ``undo`` at hand (see
        :meth:`deliver`); ``keep`` runs when the caller takes it."""
        envelope.delivering, envelope.keep, self._undo_delivered = True, keep, undo

    async def deliver(self, envelope: Envelope) -> None:
        """A request's outcome is on its way: keep it once its caller takes it; undo it
        if the caller went away first (it saw a cancel or a timeout, not the outcome).
        A closing agent keeps it."""
        undo, self._undo_delivered = self._undo_delivered, None
        assert undo is not None
        try:
            await envelope.received.wait()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    if envelope.receipt is None:  # closing: kept
                        envelope.take(True)
                    elif not envelope.receipt:
                        try:
                            await undo()
                        except Exception as exc:  # the caller is gone; the agent goes on
                            self._log.error("agent.undo_failed", agent=self.name, error=repr(exc))
                finally:
                    envelope.settled.set()

    async def _undo_turn(self, envelope: Envelope, before: Before) -> None:
        """Undo an ask whose caller went away (its reply stays if the state directory
        keeps it: see :meth:`take_back`)."""
        if await self.take_back(before):
            envelope.reply = None

    async def take_back(self, before: Before) -> bool:
        """Undo a turn committed with ``hold``: the conversation and the cache are those
        before it, in the state directory too (the cache first, so that the save writes
        that one). ``False`` if the directory keeps the turn (saving the agent without
        it failed): then the conversation keeps it too, over the cache before it (a
        prefix of it: the next turn prefills the rest)."""
        after = self.snapshot()
        self.undo_commit(before)
        if not self._written_since(before.writes) or await self._save_undo():
            return True
        self.restore(after, cache=False)
        return False

    def undo_commit(self, before: Before) -> None:
        """Take back a turn committed with ``hold``: the conversation and the cache are
        the ones before it."""
        self.restore(before)
        self._scheduler.undo(self.name)

    def snapshot(self) -> Before:
        return Before(
            messages=self.messages,
            turns=self.turns,
            cached=(self.cached_tokens, self.cached_blocks),
            system=self.system,
            tools=self.tools,
            writes=self._writes(),
        )

    def _writes(self) -> int:
        return 0 if self._saves is None else self._saves.writes()

    def _written_since(self, writes: int) -> bool:
        """Whether the state directory may hold what changed since the keeper's count
        was ``writes``: it saves every turn, or a save (a ``flush``) read the agent
        since."""
        saves = self._saves
        return saves is not None and (saves.saves_turns or saves.writes() != writes)

    def restore(self, before: Before, *, cache: bool = True) -> None:
        """Put back what ``before`` holds (the cache's size only with ``cache``)."""
        self.messages, self.turns = before.messages, before.turns
        self.system, self.tools = before.system, before.tools
        if cache:
            self.cached_tokens, self.cached_blocks = before.cached

    async def _save_undo(self) -> bool:
        """Save the agent as it was before a turn its caller gave up on; ``False`` if
        that failed (the turn stays on disk, so it is kept, and a caller who timed out
        gets the reply after all)."""
        assert self._saves is not None
        try:
            await self._saves.rewrite()
        except MlxActorsError as exc:
            self._log.error("agent.save_failed", agent=self.name, error=str(exc))
            return False
        return True

    async def tell(self, envelope: Envelope) -> None:
        """Add a told message to the conversation (and save it)."""
        assert envelope.message is not None
        before, writes = self.messages, self._writes()
        self.messages = [*before, envelope.message]
        if self._saves is not None:
            with anyio.CancelScope(shield=True):  # short, and must not stop half-way
                try:
                    await self._saves.changed()
                except BaseException:
                    self.messages = before
                    raise
                if envelope.cancelled:  # the caller gave up: as if never told
                    await self._untell(before, writes)
        if self.messages is not before:
            self.delivered(envelope, functools.partial(self._untell, before, writes))

    async def _untell(self, before: list[Message], writes: int) -> None:
        """Take back a message whose caller went away (it stays if saving the agent
        without it failed)."""
        after, self.messages = self.messages, before
        if self._written_since(writes) and not await self._save_undo():
            self.messages = after

    async def reset(self, envelope: Envelope) -> None:
        """Forget the conversation and free the cache (and save that)."""
        before = self.messages
        self.messages, self.cached_tokens, self.cached_blocks = [], 0, 0
        with anyio.CancelScope(shield=True):
            await self._scheduler.forget(self.name, drop=True)
            if self._saves is not None:
                try:
                    await self._saves.changed()
                except BaseException:
                    self.messages = before  # as the state directory still has it
                    raise
