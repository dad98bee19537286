"""Every agent's cache, wherever it is: the one owner of residency on the engine thread.

An agent's cache is in the pool (its blocks), on the device as a copy of those blocks
kept for a lone turn (the engine's :class:`KeptCaches`, which this manager forgets for
it), or out of the pool (evicted: taken as a :class:`CacheImage`, kept in host memory
by :class:`HostCaches` while the budget allows, and written to the store by the event
loop). :class:`CacheManager` keeps one record per agent and is the only code that
changes it: a turn's start, commit, hold and undo, a dropped result, a fork, a save's
snapshot, evicting when the pool runs short (kept copies make way first; then the idle
agent first in the :class:`EvictionOrder`), and making blocks again from an image (from
host memory here, or read back from the store and handed in). The records themselves
are :class:`CacheEntry` objects.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...errors import CacheReconstructionError, PoolExhaustedError
from ..engine._solo import KeptCaches
from ..kv._pool import AgentBlocks, BlockPool, Reservation
from ..kv._prefix import PrefixIndex
from ._entry import CacheEntry
from ._host import HostCaches
from ._image import CacheImage, PendingCopy, make_blocks, stored_ids, take_image
from ._next_use import NextUse
from ._order import EvictionOrder, expected

#: How the cache manager chooses an idle agent to evict.
EVICTION_POLICIES = ("next-use", "lru")


class CacheManager:
    """Every agent's cache record, and every change to it (engine thread only).

    ``on_evicted(agent, image)`` is called with each cache moved out of the pool (the
    caller writes it to the store). While ``host`` has a budget, evicted images carry
    every block's arrays and are kept there too, not only the blocks the store lacks.
    ``eviction``: one of :data:`EVICTION_POLICIES`.
    """

    def __init__(
        self,
        pool: BlockPool,
        index: PrefixIndex,
        kept: KeptCaches,
        host: HostCaches,
        *,
        log: Any,
        on_evicted: Callable[[str, CacheImage], None],
        share_prefixes: bool,
        persistent_store: bool,
        eviction: str = "next-use",
    ) -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        self.pool = pool
        self._index = index
        self._kept = kept
        self.host = host
        self._log = log
        self._on_evicted = on_evicted
        self._share_prefixes = share_prefixes
        self._persistent = persistent_store
        self._dtype = pool.spec.layers[0].stored_dtype
        self.agents: dict[str, CacheEntry] = {}
        self.evictions = self.restores = self.prefetches = 0
        self._serial = 0
        self.eviction = eviction
        self.next_use = NextUse()
        self.order = EvictionOrder(self.agents, pool, self.next_use, eviction)
        if eviction == "next-use":  # host memory keeps the caches expected soonest
            host.rank = self.next_use.expected_in

    def entry(self, agent: str) -> CacheEntry:
        """The agent's record (a new, empty one if it has none)."""
        entry = self.agents.get(agent)
        if entry is None:
            entry = self.agents[agent] = CacheEntry(namespace=self._namespace(agent))
        return entry

    def _namespace(self, agent: str) -> object:
        return None if self._share_prefixes else agent

    def others_busy(self, agent: str) -> bool:
        """Whether another agent's turn is in the engine (it will free or release blocks
        when it finishes). An agent between rounds of tool calls does not count: its
        next round may wait on the very room a waiting turn wants, or its tool on that
        turn, so waiting for it could wait forever."""
        return any(e.busy for name, e in self.agents.items() if name != agent)

    # -- a turn's life -----------------------------------------------------------------------

    def pin(self, agent: str, seconds: float | None) -> None:
        """Keep the agent's cache in the pool for ``seconds`` from now (``None``: no
        longer): it leaves only when no unpinned idle agent can."""
        if agent in self.agents or seconds is not None:
            entry = self.entry(agent)
            entry.pinned_until = 0.0 if seconds is None else time.perf_counter() + seconds
            self._log.debug("agent.pinned", agent=agent, seconds=seconds)

    def started(self, agent: str) -> None:
        """A turn of the agent is in the engine (its cache stays until it is committed)."""
        self.entry(agent).busy = True
        self.next_use.started(agent)

    def commit(
        self,
        agent: str,
        blocks: AgentBlocks,
        *,
        hold: bool,
        saving: bool,
        snapshot: bool,
        later: list[PendingCopy] | None = None,
    ) -> CacheImage | None:
        """``blocks`` become the agent's cache (see :class:`~..service._protocol.Commit`);
        with ``snapshot``, returns what the store lacks of it, to be saved (its copies
        to host memory added to ``later``, if given: see :func:`take_image`)."""
        entry = self.entry(agent)
        if hold and not entry.holding:
            entry.holding, entry.kept = True, entry.blocks  # the turn's start, for undo
            entry.held_since = time.perf_counter()
        elif entry.blocks is not None and entry.blocks is not blocks:
            self.pool.free(entry.blocks.blocks())  # (the same blocks: the hold ends)
        if not hold:
            if entry.kept is not None:
                self.pool.free(entry.kept.blocks())
            entry.holding, entry.kept, entry.kept_gone = False, None, False
        entry.blocks, entry.tokens = blocks, blocks.tokens
        entry.last_used, entry.busy = time.perf_counter(), saving
        self.host.prune(agent, (b.id for b in blocks.blocks()))
        if entry.stored:  # only the blocks it still holds can be referred to
            entry.stored = {
                b.id: entry.stored[b.id] for b in entry.blocks.blocks() if b.id in entry.stored
            }
        return self._take_image(agent, entry, later=later) if snapshot else None

    def undo(self, agent: str) -> None:
        """After commits with ``hold``: the cache the turn started from is the agent's
        again; the rounds' blocks are freed."""
        entry = self.agents.get(agent)
        if entry is None or not entry.holding:
            return
        if entry.kept_gone:  # evicted between rounds: the latest round's cache stays
            entry.holding = entry.kept_gone = entry.busy = False
            return
        if entry.blocks is not None:
            self.pool.free(entry.blocks.blocks())
        entry.blocks, entry.kept, entry.holding = entry.kept, None, False
        entry.tokens = entry.blocks.tokens if entry.blocks is not None else ()
        entry.busy = False
        # Saved blocks the store holds are those of the cache the turn started from.
        held = {b.id for b in entry.blocks.blocks()} if entry.blocks is not None else set()
        entry.stored = {k: v for k, v in entry.stored.items() if k in held}

    def release(self, agent: str, blocks: AgentBlocks) -> None:
        """A finished turn the agent does not take: its blocks are freed."""
        self.pool.free(blocks.blocks())
        self.entry(agent).busy = False

    def forget(self, agent: str) -> None:
        """The agent is gone (or starts over): free every copy of its cache."""
        self._kept.drop(agent)
        self.host.drop(agent)
        self.host.release(agent)
        self.next_use.forget(agent)
        entry = self.agents.pop(agent, None)
        if entry is not None:
            self._free(entry)

    def adopt(self, agent: str, tokens: tuple[int, ...]) -> None:
        """An agent whose cache is in the store (brought back from a state directory)."""
        self.agents[agent] = CacheEntry(tokens=tokens, namespace=self._namespace(agent))

    def fork(self, parent: str, child: str) -> tuple[CacheEntry, bool]:
        """``child`` holds the parent's cache by reference; returns its record and
        whether the parent's cache is out of the pool (then the child's is to be
        copied from the parent's files)."""
        source = self.entry(parent)
        stale = self.agents.get(child)
        if stale is not None:  # never leak what it held
            self._free(stale)
        if source.blocks is not None:
            self.pool.share_all(source.blocks.blocks())
        entry = self.agents[child] = CacheEntry(
            tokens=source.tokens,
            blocks=source.blocks,
            last_used=time.perf_counter(),
            namespace=source.namespace,
        )
        return entry, source.evicted

    # -- the store -----------------------------------------------------------------------------

    def snapshot(self, agent: str, later: list[PendingCopy] | None = None) -> CacheImage | None:
        """The agent's cache, its blocks the store lacks copied to host memory (or
        added to ``later``), to be saved (``None``: it has no blocks in the pool)."""
        entry = self.agents.get(agent)
        if entry is None or entry.blocks is None:
            return None
        return self._take_image(agent, entry, later=later)

    def stored(self, agent: str, refs: Mapping[int, str], serial: int) -> None:
        """A snapshot is written: where each of its blocks now is."""
        # Only the latest snapshot's files are sure to stay: a later save rewrites the
        # blocks an earlier one wrote, and deletes the earlier chunks.
        entry = self.agents.get(agent)
        if self._persistent and entry is not None and entry.snapshot == serial:
            held = {b.id for b in entry.blocks.blocks()} if entry.blocks is not None else ()
            entry.stored.update((k, ref) for k, ref in refs.items() if k in held)

    def _take_image(
        self,
        agent: str,
        entry: CacheEntry,
        *,
        whole: bool = False,
        later: list[PendingCopy] | None = None,
    ) -> CacheImage:
        """The agent's cache as an image (its blocks host memory holds are not copied)."""
        assert entry.blocks is not None
        self._serial += 1
        entry.snapshot = self._serial
        held = self.host.held(agent)
        return take_image(
            entry.blocks,
            entry.stored,
            self._dtype,
            self._serial,
            whole=whole,
            held=held,
            later=later,
        )

    # -- room in the pool ----------------------------------------------------------------------

    def make_room(self, agent: str, later_than: int | None = None) -> bool:
        """Give back a kept cache's units, or else move one idle cache (not ``agent``'s)
        out of the pool; whether either happened. With ``later_than`` (``agent`` is
        brought back ahead of its turn, expected in that many turns), only a cache
        :meth:`EvictionOrder.movable` for it leaves, and kept copies stay."""
        if later_than is not None:
            return self._evict_one(agent, later_than)
        return self._kept.make_way(agent) or self._evict_one(exclude=agent)

    def with_room(
        self, agent: str, attempt: Callable[[], Any], later_than: int | None = None
    ) -> Any:
        """Run ``attempt``; while the pool is short, make room (:meth:`make_room`) and
        try again."""
        while True:
            try:
                return attempt()
            except PoolExhaustedError as exc:
                if not self.make_room(agent, later_than):
                    raise nothing_to_evict(exc) from None

    def _evict_one(self, exclude: str, later_than: int | None = None) -> bool:
        """Move the first idle agent's cache by :meth:`EvictionOrder.victim` out of the
        pool; whether there was one."""
        name = self.order.victim(exclude, later_than)
        if name is None:
            return False
        entry = self.agents[name]
        assert entry.blocks is not None
        started = time.perf_counter()
        held = self.host.held(name)
        image = self._take_image(name, entry, whole=self.host.budget > 0)
        copied = sum(1 for key in image.arrays if key not in held)
        self.host.release(name)  # the image holds them now
        blocks = entry.blocks.num_blocks
        self.pool.free(entry.blocks.blocks())
        entry.blocks = None
        if entry.holding:  # between rounds: the turn's start goes too
            if entry.kept is not None:
                self.pool.free(entry.kept.blocks())
            entry.kept, entry.kept_gone = None, True
        self.evictions += 1
        self._log.info(
            "blocks.evicted",
            agent=name,
            why=self.order.why(name),
            blocks=blocks,
            bytes=image.nbytes,
            copied=copied,
            ms=round((time.perf_counter() - started) * 1e3, 2),
            pool_used=self.pool.used_blocks,
        )
        self.host.keep(name, image)
        self._on_evicted(name, image)
        return True

    def in_host(self, agent: str) -> CacheImage | None:
        """The agent's evicted cache, if host memory still holds it."""
        return self.host.get(agent)

    def restore(self, agent: str, image: CacheImage, *, later_than: int | None = None) -> None:
        """Make the agent's evicted cache blocks of the pool again, from ``image`` (read
        back from the store, or :meth:`in_host`). With ``later_than`` it is brought back
        ahead of its turn (expected in that many turns): see :meth:`make_room`.

        Raises:
            CacheReconstructionError: the image does not hold the agent's cache.
            PoolExhaustedError: the pool cannot hold it, even after evicting others.
        """
        entry = self.entry(agent)
        started = time.perf_counter()
        from_memory = self.host.get(agent) is image
        if from_memory:
            self._log.debug("blocks.read", agent=agent, bytes=image.nbytes, source="memory")
        if image.tokens != entry.tokens:
            raise CacheReconstructionError(
                f"the saved cache of agent {agent!r} holds {len(image.tokens)} tokens that "
                f"are not the {len(entry.tokens)} its index names"
            )
        room = 0.0  # seconds spent getting the pool's room (moving other caches out)

        def reserve(n: int) -> Reservation:
            nonlocal room
            began = time.perf_counter()
            try:
                reserved: Reservation = self.with_room(
                    agent, lambda: self.pool.reserve(n), later_than
                )
                return reserved
            finally:
                room += time.perf_counter() - began

        held: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        blocks = make_blocks(
            self.pool, image, reserve, index=self._index, namespace=entry.namespace, held=held
        )
        entry.blocks = blocks
        if self._persistent:
            entry.stored = stored_ids(image, blocks)
        self.restores += 1
        self.prefetches += later_than is not None
        self.host.taken(agent, from_memory=from_memory)
        if from_memory:  # its next eviction copies only newer blocks
            self.host.hold(agent, held)
        ahead = {} if later_than is None else {"prefetch": expected(later_than)}
        self._log.info(
            "blocks.restored",
            agent=agent,
            **ahead,
            blocks=blocks.num_blocks,
            bytes=image.nbytes,
            ms=round((time.perf_counter() - started) * 1e3, 2),
            room_ms=round(room * 1e3, 2),
            pool_used=self.pool.used_blocks,
        )

    def drop(self, agent: str, blocks: int, why: str, **fields: Any) -> None:
        """Forget the agent's cache, which the pool cannot hold beside its turn's new
        blocks: the turn starts from the conversation (``blocks``: its size, for the
        log)."""
        self.lose(agent)
        self._log.info("blocks.dropped", agent=agent, blocks=blocks, reason=why, **fields)

    def lose(self, agent: str) -> None:
        """Forget the agent's cache (it cannot be used): its next turn starts from its
        conversation."""
        entry = self.entry(agent)
        self._free(entry)
        self.host.drop(agent)
        self.host.release(agent)
        entry.tokens, entry.stored = (), {}

    def write_failed(self, agent: str, serial: int) -> None:
        """The store could not write the snapshot ``serial`` of the agent's cache: if it
        was evicted with it, and is still out of the pool, it is lost."""
        entry = self.agents.get(agent)
        if entry is not None and entry.evicted and entry.snapshot == serial:
            self.lose(agent)

    def _free(self, entry: CacheEntry) -> None:
        for blocks in (entry.blocks, entry.kept):
            if blocks is not None:
                self.pool.free(blocks.blocks())
        entry.blocks = entry.kept = None
        entry.holding = entry.kept_gone = False

    def free_all(self) -> set[int]:
        """Free every agent's blocks (the runtime is closing); returns the ``id()`` of
        each ``AgentBlocks`` freed, so that a command left over is not freed twice."""
        freed = {id(b) for e in self.agents.values() for b in (e.blocks, e.kept) if b is not None}
        for entry in self.agents.values():
            self._free(entry)
        self.host.clear()  # its host memory goes back to the process's slabs now
        return freed

    def counts(self) -> dict[str, int]:
        """What the scheduler's statistics say of the agents' caches."""
        holders: dict[int, int] = {}
        sizes: dict[int, int] = {}
        resident = 0
        for entry in self.agents.values():
            if entry.blocks is not None:
                resident += 1
                for b in entry.blocks.blocks():
                    holders[b.id] = holders.get(b.id, 0) + 1
                    sizes[b.id] = self.pool.spec.layers[b.layer].block_bytes
        return {
            "resident_agents": resident,
            "resident_blocks": len(holders),
            "agent_blocks": sum(holders.values()),
            "shared_bytes": sum((n - 1) * sizes[i] for i, n in holders.items()),
            "shared_blocks": sum(1 for n in holders.values() if n > 1),
            "agents_on_disk": sum(1 for e in self.agents.values() if e.evicted),
            "evictions": self.evictions,
            "restores": self.restores,
            "prefetches": self.prefetches,
            "memory_restores": self.host.hits,
            "host_bytes": self.host.nbytes,
        }


def nothing_to_evict(exc: PoolExhaustedError, own: int = 0) -> PoolExhaustedError:
    """``exc`` once nothing could be moved to disk; ``own``: the units of the turn's own
    cache, which stays in the pool until the turn ends."""
    mine = (
        f" This agent's own cache holds {own} of the used ones: it stays until the turn "
        "ends, beside the turn's new blocks. Every other cache"
        if own
        else " Every cache"
    )
    return PoolExhaustedError(
        f"{exc}.{mine} left in the pool belongs to an agent with a turn in flight (or is "
        "shared with one), so none could be moved to disk.",
        needed=exc.needed,
        free=exc.free,
    )
