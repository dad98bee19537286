"""What the engine thread tells the event loop: one class per kind of event, handed over
in order, one step's worth at a time (see :class:`~._loop.EngineLoop`'s outbox). The
scheduler's async side (:meth:`~._deliveries.Deliveries.deliver`) acts on each."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ..engine._records import CompletedGeneration
from ..residency._image import CacheImage
from ._protocol import Fork, Save, SchedulerStatistics, Turn


@attrs.frozen
class Printed:
    """A piece of the turn's text that is safe to show."""

    turn: Turn
    text: str


@attrs.frozen
class Finished:
    """The turn's reply and its cache blocks."""

    turn: Turn
    result: CompletedGeneration


@attrs.frozen
class Failed:
    """The turn ended with ``error`` (it took nothing from the pool)."""

    turn: Turn
    error: BaseException


@attrs.frozen
class Cancelled:
    """A cancellation reached the engine (or found nothing to cancel)."""

    turn: Turn


@attrs.frozen
class NeedsRestore:
    """The turn's agent has its cache on disk: read it back, then submit again."""

    turn: Turn


@attrs.frozen
class RestoreFailed:
    """The cache read back for the turn's agent does not fit the model."""

    turn: Turn
    error: BaseException


@attrs.frozen
class Evicted:
    """The agent's cache left the pool: write ``image`` (host memory, then disk)."""

    agent: str
    image: CacheImage


@attrs.frozen
class Restored:
    """The agent's cache is back in the pool (or was dropped): forget the copy out."""

    agent: str


@attrs.frozen
class Prefetch:
    """Read the agent's cache back from the store ahead of its turn, and send it to the
    engine thread (:class:`~._protocol.Prefetched`)."""

    agent: str


@attrs.frozen
class SaveReady:
    """What a :class:`~._protocol.Save` asked for: the blocks to write (``None``:
    nothing new, or the runtime shut down first)."""

    command: Save
    image: CacheImage | None


@attrs.frozen
class Snapshot:
    """What a :class:`~._protocol.Commit` with a ``snapshot`` number asked for: the
    committed cache's blocks to write (``None``: the runtime shut down first)."""

    agent: str
    number: int
    image: CacheImage | None


@attrs.frozen
class Statistics:
    """The answer to a :class:`~._protocol.Query`."""

    reply: Callable[[SchedulerStatistics], None]
    statistics: SchedulerStatistics


@attrs.frozen
class Forked:
    """The answer to a :class:`~._protocol.Fork`: whether the parent's cache is on disk
    (``None``: the runtime shut down first)."""

    command: Fork
    on_disk: bool | None


#: Everything the engine thread hands to the event loop.
Event = (
    Printed
    | Finished
    | Failed
    | Cancelled
    | NeedsRestore
    | RestoreFailed
    | Evicted
    | Restored
    | Prefetch
    | SaveReady
    | Snapshot
    | Statistics
    | Forked
)
