"""Which idle agent's cache leaves the pool first, and why (:class:`EvictionOrder`): the
one expected to be asked furthest from now (:class:`~._next_use.NextUse`), or with
``eviction="lru"`` the least recently used; pinned agents and agents between rounds of
tool calls last. Reads the :class:`~._manager.CacheManager`'s records; changes nothing.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping

from ..kv._pool import BlockPool, KVBlock
from ._entry import CacheEntry
from ._next_use import NextUse


def expected(turns: int) -> str:
    """How the trace says when an agent's next turn is expected."""
    return f"next turn expected in {turns} turns"


class EvictionOrder:
    """The eviction order over ``agents`` (the manager's records, read live)."""

    def __init__(
        self, agents: Mapping[str, CacheEntry], pool: BlockPool, next_use: NextUse, eviction: str
    ) -> None:
        self._agents = agents
        self._pool = pool
        self._next_use = next_use
        self._eviction = eviction

    def victim(self, exclude: str, later_than: int | None = None) -> str | None:
        """The idle agent (not ``exclude``) whose cache leaves first (:meth:`_priority`),
        among those whose cache holds a block nobody else does; failing that, among
        those holding a block that only idle agents hold (a parent and its fork:
        evicting them all frees it); ``None`` if evicting any would free nothing. With
        ``later_than``, only agents :meth:`movable` for one expected in that many turns."""
        idle = {
            name: entry
            for name, entry in self._agents.items()
            if entry.blocks is not None
            and not entry.busy
            and name != exclude
            and (later_than is None or self.movable(name, later_than))
        }
        alone = [
            (self._priority(name, entry), name)
            for name, entry in idle.items()
            if entry.blocks is not None
            and any(self._pool.references(b) == 1 for b in entry.blocks.blocks())
        ]
        return min(alone)[1] if alone else self._together(idle)

    def _together(self, idle: dict[str, CacheEntry]) -> str | None:
        """The least recently used of the ``idle`` agents holding a block that no one
        else holds (no turn, no other agent), if any."""
        holders: collections.Counter[int] = collections.Counter()
        blocks: dict[int, KVBlock] = {}
        for entry in idle.values():
            assert entry.blocks is not None
            for block in entry.blocks.blocks():
                holders[block.id] += 1
                blocks[block.id] = block
        freed = {i for i, n in holders.items() if self._pool.references(blocks[i]) == n}
        candidates = [
            (self._priority(name, entry), name)
            for name, entry in idle.items()
            if entry.blocks is not None and any(b.id in freed for b in entry.blocks.blocks())
        ]
        return min(candidates)[1] if candidates else None

    def movable(self, name: str, later_than: int) -> bool:
        """Whether ``name``'s cache may leave to bring back one expected in
        ``later_than`` turns: it is not pinned and is expected later than that."""
        entry = self._agents[name]
        return (
            not entry.pinned(time.perf_counter()) and self._next_use.expected_in(name) > later_than
        )

    def _priority(self, name: str, entry: CacheEntry) -> tuple[bool, float, float]:
        """Eviction order (the least first): unpinned agents before pinned ones; then
        the agent expected furthest from now, then the least recently used (with
        ``eviction="lru"``, the least recently used)."""
        pinned = entry.pinned(time.perf_counter())
        if self._eviction == "lru":
            return (pinned, 0.0, entry.last_used)
        return (pinned, -self._next_use.expected_in(name), entry.last_used)

    def why(self, name: str) -> str:
        """Why ``name`` was chosen, for the trace."""
        entry = self._agents[name]
        if entry.pinned(time.perf_counter()):
            held = "between rounds of tool calls" if entry.holding else "pinned"
            return f"{held}, and no unpinned agent could leave"
        if self._eviction == "lru":
            return "least recently used"
        return expected(self._next_use.expected_in(name))
