"""Evicted caches brought back ahead of their turns: the agent expected to be asked next
gets its cache back into the pool while other turns run, so that its turn does not wait
for it (KVFlow, arXiv:2507.07400, overlaps such prefetches with the running steps).

With ``eviction="next-use"``, after each turn starts, the evicted agent expected soonest
(:class:`~._next_use.NextUse`), if it is asked in a regular order (its last two periods
the same) and expected within :data:`HORIZON` turns, is
brought back when the pool has room for it without moving out any agent expected as soon
or sooner, any pinned agent, or any agent with a turn in flight (:meth:`EvictionOrder.
movable`). From host memory it is made blocks at once, between two steps; from the
store, the event loop reads it in the background first (the engine thread goes on
stepping) and hands the image back. With ``eviction="lru"`` nothing is brought back
ahead. Engine thread only.
"""

from __future__ import annotations

from typing import Any

from ...errors import CacheReconstructionError, PoolExhaustedError
from ..kv._spec import BLOCK_SIZE
from ._image import CacheImage
from ._manager import CacheManager

#: How many turns ahead an evicted agent may be expected and still be brought back: the
#: next turn only (a round robin's next speaker, the main agent between its helpers).
HORIZON = 1


class Prefetcher:
    """Chooses the cache to bring back ahead of its turn, and brings it back."""

    def __init__(self, caches: CacheManager, *, log: Any) -> None:
        self._caches = caches
        self._log = log
        #: Whether a turn started since the last look (what is expected next changed).
        self.due = False
        #: Agents whose cache the event loop is reading back for this.
        self._reading: set[str] = set()
        #: The latest cache read back for this, until it is made blocks.
        self._arrived: tuple[str, CacheImage] | None = None

    def image(self, agent: str) -> CacheImage | None:
        """The agent's evicted cache, if host memory holds it or a read for this
        brought it (its turn needs no read of its own)."""
        image = self._caches.in_host(agent)
        if image is None and self._arrived is not None and self._arrived[0] == agent:
            image = self._arrived[1]
            entry = self._caches.agents.get(agent)
            if entry is None or not entry.evicted or image.tokens != entry.tokens:
                self._arrived, image = None, None  # back since, or out again as another
        return image

    def read_back(self, agent: str, image: CacheImage | None) -> None:
        """The event loop's answer to a read this asked for (``None``: no image, as
        when the write that evicted it failed): kept (the latest one only) until it can
        be made blocks."""
        self._reading.discard(agent)
        entry = self._caches.agents.get(agent)
        if image is None or entry is None or not entry.evicted or image.tokens != entry.tokens:
            return  # gone, changed or back already: its turn does what it needs
        self._arrived = (agent, image)
        self.due = True

    def run(self) -> tuple[str | None, str | None]:
        """Bring back the evicted agent expected next, if it fits; returns the agent
        whose cache came back (from host memory), and the one whose cache is to be read
        from the store first (the caller asks the event loop)."""
        self.due = False
        caches = self._caches
        if caches.eviction != "next-use":
            return None, None
        found = self._candidate()
        if found is None:
            return None, None
        agent, due = found
        if agent in self._reading or not self._fits(agent, due):
            return None, None
        image = self.image(agent)
        if image is None:
            self._reading.add(agent)
            self._log.debug("blocks.prefetching", agent=agent, source="disk")
            return None, agent
        try:
            caches.restore(agent, image, later_than=due)
        except (PoolExhaustedError, CacheReconstructionError):
            return None, None  # its turn restores it (from what arrived), or finds out why not
        if self._arrived is not None and self._arrived[0] == agent:
            self._arrived = None
        return agent, None

    def _candidate(self) -> tuple[str, int] | None:
        """The idle evicted agent expected soonest, within :data:`HORIZON` turns, among
        those asked in a regular order (a guess brings back one cache for nothing and
        moves out another that may be needed)."""
        caches = self._caches
        best: tuple[int, str] | None = None
        for name, entry in caches.agents.items():
            if entry.evicted and not entry.busy and caches.next_use.regular(name):
                due = caches.next_use.expected_in(name)
                if due <= HORIZON and (best is None or (due, name) < best):
                    best = (due, name)
        return None if best is None else (best[1], best[0])

    def _fits(self, agent: str, due: int) -> bool:
        """Whether the pool's free units, and those of the caches that may leave for
        ``agent``, hold its cache (all its blocks counted, none shared)."""
        caches = self._caches
        pool = caches.pool
        spec = pool.spec
        blocks = -(-len(caches.agents[agent].tokens) // BLOCK_SIZE)
        need = sum(spec.units(layer) for layer in range(spec.num_layers)) * blocks
        room = pool.free_blocks
        for name, entry in caches.agents.items():
            if room >= need:
                break
            if entry.blocks is None or entry.busy or name == agent:
                continue
            if caches.order.movable(name, due):
                room += sum(
                    spec.units(b.layer) for b in entry.blocks.blocks() if pool.references(b) == 1
                )
        return room >= need
