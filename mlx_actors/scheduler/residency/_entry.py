"""One agent's cache record (:class:`CacheEntry`): where its cache is, and what holds it
in the pool (a turn in flight, a pin, a round of tool calls). The
:class:`~._manager.CacheManager` owns every record and alone changes them."""

from __future__ import annotations

import attrs

from ..kv._pool import AgentBlocks

#: How long an agent between rounds of tool calls (its tools running) counts as pinned:
#: its cache leaves only if no unpinned idle agent's can; after that, a tool still
#: running holds no memory others need (as ``mlx-actors serve``'s default pin of a
#: session waiting for its client's tools).
ROUND_PIN_SECONDS = 60.0


@attrs.define(eq=False)
class CacheEntry:
    """One agent's cache: resident as blocks, or out of the pool (``blocks is None``
    while ``tokens`` is not empty)."""

    tokens: tuple[int, ...] = ()
    blocks: AgentBlocks | None = None
    last_used: float = 0.0
    #: A turn of the agent is queued, running, or finished and not yet committed.
    busy: bool = False
    #: The serial of the agent's latest snapshot for the store.
    snapshot: int = 0
    #: Ids of the agent's blocks whose data its saved cache already holds, and where.
    stored: dict[int, str] = attrs.Factory(dict)
    #: Which blocks the agent may share (every agent's, unless sharing is off: then
    #: its own and its forks').
    namespace: object = None
    #: Until when (``time.perf_counter()``) the agent is pinned: not evicted while
    #: another idle agent can be.
    pinned_until: float = 0.0
    #: A turn of several rounds (tool calls) is under way: the cache it started from
    #: (``kept``, ``None`` if there was none) waits for its end. Meanwhile the agent
    #: is evicted only as a pinned one is (:data:`ROUND_PIN_SECONDS`).
    holding: bool = False
    kept: AgentBlocks | None = None
    #: When the turn's first round ended (``time.perf_counter()``).
    held_since: float = 0.0
    #: The cache the turn started from was freed when the agent was evicted between
    #: rounds: an undo keeps the latest round's cache instead (a next turn goes back
    #: from it to where its conversation parts from the round's).
    kept_gone: bool = False

    @property
    def evicted(self) -> bool:
        """The cache is out of the pool (on disk, or in host memory on its way there)."""
        return self.blocks is None and bool(self.tokens)

    def pinned(self, now: float) -> bool:
        """Pinned by :meth:`CacheManager.pin`, or between rounds of tool calls for less
        than :data:`ROUND_PIN_SECONDS`."""
        return self.pinned_until > now or (
            self.holding and now - self.held_since < ROUND_PIN_SECONDS
        )
