"""What the engine thread owes the event loop, and its delivery there: each event of a step
handed to its turn, to the command waiting for it, or to the disk work; the snapshots that
commits asked for, until their saves take them; and the answers to commands that the
stopped engine thread never saw."""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import attrs

from ...errors import CorruptStateError, EngineError, RuntimeClosedError
from ..residency._image import CacheImage
from ._disk import DiskWork
from ._events import (
    Cancelled,
    Event,
    Evicted,
    Failed,
    Finished,
    Forked,
    NeedsRestore,
    Prefetch,
    Printed,
    Restored,
    RestoreFailed,
    SaveReady,
    Snapshot,
    Statistics,
)
from ._loop import Outbox
from ._protocol import Cancel, Commit, Fork, Query, Save, SchedulerStatistics, Submit, Turn


@attrs.define
class PendingSnapshot:
    """A snapshot of an agent's cache taken with its commit, for its save; ``image``
    is set when it comes back (``None``: nothing to write)."""

    ready: anyio.Event = attrs.Factory(anyio.Event)
    image: CacheImage | None = None


class Deliveries:
    """The event loop's side of the engine thread's answers (event loop only)."""

    def __init__(self, disk: DiskWork, *, log: Any) -> None:
        self._disk = disk
        self._log = log
        #: Snapshots taken with a commit, waiting for the agent's save, by agent; and
        #: every one the engine thread has not answered yet, by number.
        self._snapshots: dict[str, PendingSnapshot] = {}
        self._unanswered: dict[int, PendingSnapshot] = {}
        self._numbers = itertools.count(1)
        #: The engine's statistics once its thread stopped (the answer to later queries).
        self.final: SchedulerStatistics | None = None
        #: Why the engine thread stopped, if an error stopped it (later turns fail so).
        self.failure: EngineError | None = None

    # -- snapshots -----------------------------------------------------------------------

    def expect_snapshot(self, agent: str, snapshot: bool) -> int:
        """A commit of ``agent`` is on its way: any snapshot no save took is stale; with
        ``snapshot``, the number of the one it asks for (else 0)."""
        self._snapshots.pop(agent, None)
        if not snapshot:
            return 0
        number = next(self._numbers)
        self._snapshots[agent] = self._unanswered[number] = PendingSnapshot()
        return number

    def take_snapshot(self, agent: str) -> PendingSnapshot | None:
        """The snapshot taken for ``agent``'s save, if a commit asked for one."""
        return self._snapshots.pop(agent, None)

    def _snapshot_taken(self, number: int, image: CacheImage | None) -> None:
        taken = self._unanswered.pop(number, None)
        if taken is not None:
            taken.image = image
            taken.ready.set()

    # -- events --------------------------------------------------------------------------

    def deliver(self, events: Outbox) -> None:
        """Hand one step's events to their turns, in order."""
        for event in events:
            try:
                self._one(event)
            except Exception as exc:  # one broken reply must not stop the others
                self._log.error(
                    "scheduler.delivery_failed", kind=type(event).__name__, error=repr(exc)
                )

    def _one(self, event: Event) -> None:
        match event:
            case Printed(turn, text):
                if turn.on_text is not None and not turn.settled.is_set():
                    turn.on_text(text)
            case Finished(turn, result):
                turn.result = result
                turn.settled.set()
            case Failed(turn, error):
                fail(turn, error)
            case Cancelled(turn):
                turn.cancelled.set()
            case NeedsRestore(turn):
                turn.needs_restore = True
                turn.settled.set()
            case Evicted(agent, image):
                self._disk.evicted(agent, image)
            case RestoreFailed(turn, error):
                self._lost(turn, error)
            case Restored(agent):
                self._disk.restored(agent)
            case Prefetch(agent):
                self._disk.prefetch(agent)
            case SaveReady(command, image):
                self._disk.save(command, image)
            case Snapshot(_, number, image):
                self._snapshot_taken(number, image)
            case Statistics(reply, statistics):
                reply(statistics)
            case Forked(command, on_disk):
                command.reply(on_disk)

    def _lost(self, turn: Turn, error: BaseException) -> None:
        """The cache read back for ``turn``'s agent does not fit the model: delete it,
        and fail the turn (the agent's next turn starts from its conversation)."""
        agent = turn.agent
        self._log.error("blocks.lost", agent=agent, error=str(error))
        self._disk.lost(agent)
        fail(
            turn,
            CorruptStateError(
                f"the saved cache of agent {agent!r} ({self._disk.store.where(agent)}) "
                f"does not fit the model, so it was deleted and the agent's next "
                f"turn starts from its conversation: {error}"
            ),
        )

    def refuse(self, command: object) -> None:
        """Answer a command the stopped engine thread will never see."""
        if isinstance(command, Submit):
            fail(command.turn, self.failure or RuntimeClosedError("the runtime has shut down"))
        elif isinstance(command, Cancel):
            command.turn.cancelled.set()
        elif isinstance(command, Query) and self.final is not None:
            command.reply(self.final)
        elif isinstance(command, (Save, Fork)):
            command.reply(None)
        elif isinstance(command, Commit) and command.snapshot:
            self._snapshot_taken(command.snapshot, None)


def fail(turn: Turn, error: BaseException) -> None:
    """End ``turn`` with ``error`` (unless it has its answer already)."""
    if not turn.settled.is_set():
        turn.error = error
        turn.settled.set()
    turn.cancelled.set()
