"""What the event loop and the engine thread say to each other: turns, commands, and the
store that keeps caches on disk."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import anyio
import attrs

from ..engine._records import CompletedGeneration, EngineStatistics, Sampling
from ..kv._pool import AgentBlocks, PoolStatistics
from ..residency._image import CacheImage


@attrs.define(eq=False)
class Turn:
    """One agent's request and where its answer goes.

    ``tokens`` is the whole rendered conversation: the engine thread compares it with
    the agent's cache and prefills only what the cache lacks. Made on the event loop;
    the scheduler sets ``result`` or ``error`` (or asks for the cache to be read back
    from disk) before it sets ``settled``.
    """

    agent: str
    tokens: list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    #: A grammar (llguidance's) the reply must follow: decoding is constrained to it.
    grammar: str | None = None
    #: Called on the event loop with each printable piece of text.
    on_text: Callable[[str], None] | None = None
    id: int = attrs.field(factory=itertools.count(1).__next__)
    result: CompletedGeneration | None = None
    error: BaseException | None = None
    #: The agent's cache is on disk: read it and submit the turn again.
    needs_restore: bool = False
    settled: anyio.Event = attrs.field(factory=anyio.Event)
    #: Set once a cancellation has reached the engine (or found nothing to cancel).
    cancelled: anyio.Event = attrs.field(factory=anyio.Event)
    uid: int | None = None
    queued_at: float = attrs.field(factory=time.perf_counter)


@attrs.frozen(kw_only=True)
class SchedulerStatistics:
    """Where the scheduler stands."""

    pool: PoolStatistics
    engine: EngineStatistics
    #: Turns queued or running now.
    turns_in_flight: int
    #: Agents whose cache is in the pool.
    resident_agents: int
    #: Distinct blocks those agents hold (a block several agents share counts once).
    resident_blocks: int
    #: Blocks those agents hold, counted once per agent holding them.
    agent_blocks: int
    #: Bytes of the blocks counted more than once in ``agent_blocks``, beyond the first.
    shared_bytes: int
    #: Distinct blocks held by more than one agent.
    shared_blocks: int
    #: Agents whose cache was moved to disk.
    agents_on_disk: int
    #: Caches moved to disk, and brought back, so far.
    evictions: int
    restores: int
    #: Of ``restores``, those served from host memory instead of the files.
    memory_restores: int = 0
    #: Of ``restores``, those made ahead of the agent's turn (expected next).
    prefetches: int = 0
    #: Bytes of evicted caches and of host copies of blocks kept in host memory now.
    host_bytes: int = 0


class CacheStore(Protocol):
    """Where agents' caches go when they leave the pool (implemented by the runtime).

    ``save`` writes what an image carries (blocks already stored are referred to, not
    written again) and returns where each of its blocks now is, by block key; ``load``
    gives back an image with every block's arrays. Calls for one agent run in order.
    """

    #: Whether a cache stays on disk after it is loaded (a state directory), or is
    #: deleted once back in the pool (a swap area).
    persistent: bool

    async def save(self, agent: str, image: CacheImage) -> Mapping[int, str]: ...

    async def load(self, agent: str) -> CacheImage: ...

    async def drop(self, agent: str) -> None: ...

    async def copy(self, agent: str, other: str) -> None:
        """Make ``other``'s cache a copy of ``agent``'s (a fork of an evicted agent)."""
        ...

    def where(self, agent: str) -> object:
        """Where the agent's cache is (named in errors)."""
        ...


@attrs.frozen
class Submit:
    turn: Turn
    image: CacheImage | None = None


@attrs.frozen
class Cancel:
    turn: Turn


@attrs.frozen
class Commit:
    """The agent took the turn's result: its blocks become the agent's cache. With
    ``hold``, the turn goes on (a round of tool calls, its save, or its reply on the way
    to the caller): the cache it started from is kept aside, for :class:`Undo`, until a
    commit without ``hold``. While it is ``saving`` (being saved, or delivered), the
    turn still counts as in flight (it ends by itself, so others may wait for the room
    it will give back). A ``snapshot`` number asks for the committed cache's blocks the
    store lacks, for the turn's save (:class:`~._events.Snapshot`); ``stored`` says
    where the agent's last save put its blocks."""

    agent: str
    blocks: AgentBlocks
    hold: bool = False
    saving: bool = False
    snapshot: int = 0
    stored: Stored | None = None


@attrs.frozen
class Undo:
    """A turn that committed rounds with ``hold`` failed: the cache it started from
    becomes the agent's again, and the rounds' blocks are freed."""

    agent: str


@attrs.frozen
class Release:
    """The agent dropped a finished turn (its caller went away): free its blocks."""

    agent: str
    blocks: AgentBlocks


@attrs.frozen
class Save:
    """Copy the agent's unsaved blocks to host memory for the store (``stored``: where
    its last save put its blocks)."""

    agent: str
    #: Called with ``None`` once the cache is written, or with what stopped the write.
    reply: Callable[[BaseException | None], None]
    stored: Stored | None = None


@attrs.frozen
class Stored:
    """A snapshot of the agent's cache is written: where each of its blocks is (carried
    by the agent's next :class:`Commit` or :class:`Save`)."""

    agent: str
    refs: Mapping[int, str]
    serial: int


@attrs.frozen
class WriteFailed:
    """The store could not write the snapshot ``serial`` that evicted the agent's cache:
    the cache is lost if it is still out of the pool (its next turn starts from its
    conversation)."""

    agent: str
    serial: int


@attrs.frozen
class Forget:
    agent: str


@attrs.frozen
class Prefetched:
    """The answer to a :class:`~._events.Prefetch`: the agent's cache read back from the
    store ahead of its turn (``None``: it could not be)."""

    agent: str
    image: CacheImage | None


@attrs.frozen
class Pin:
    """Keep the agent's cache in the pool for ``seconds`` from now (``None``: no longer):
    while others can leave, it is not evicted."""

    agent: str
    seconds: float | None


@attrs.frozen
class Adopt:
    """An agent brought back from a state directory: its cache is on disk."""

    agent: str
    tokens: tuple[int, ...]


@attrs.frozen
class Fork:
    """A new agent starts with the parent's cache, by reference."""

    parent: str
    child: str
    #: Called with whether the parent's cache is on disk (the child's must be copied
    #: from the parent's files), or ``None`` if the runtime shut down first.
    reply: Callable[[bool | None], None]


@attrs.frozen
class Query:
    reply: Callable[[SchedulerStatistics], None]


SHUTDOWN = object()
