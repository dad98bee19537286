"""Evicted caches kept in host memory, in front of the disk.

When the pool runs short, an idle agent's cache leaves it as a :class:`CacheImage` (host
memory) and is written to the store. :class:`HostCaches` also keeps some of those
images, up to a budget of bytes, so that the agent's next turn takes its cache back
from memory: no file read, no checksum, and no trip to the event loop. An image is
dropped when the agent is restored, forgotten, or its write fails, or when others push
it out: with a :attr:`~HostCaches.rank` (the cache manager's expected next use), the
image of the agent expected furthest from now first, so that the ones needed soonest
stay (in a round robin, the agent that just left is dropped, not the next speaker);
without one, the least recently evicted first.

The same budget keeps host copies of blocks still in the pool (:meth:`HostCaches.hold`):
a cache brought back from an image kept here is made blocks from those arrays, and they
stay, by block, so that when the agent leaves again only the blocks its turns made since are
copied out of the device (an 8K-token cache that took one 16-token turn: one block per
layer, not every block). Copies of blocks give way first when the budget is short,
those of the agent expected soonest (the least likely to leave) first. Engine thread
only (the :class:`~._manager.CacheManager` owns it).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import numpy as np

from ._image import CacheImage, HostArrays


class HostCaches:
    """At most ``budget`` bytes of evicted caches, by agent."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nbytes = 0
        self._images: collections.OrderedDict[str, CacheImage] = collections.OrderedDict()
        self._sizes: dict[str, int] = {}
        #: Restores served from memory.
        self.hits = 0
        #: How far from now each agent is expected (turns), if known: the furthest
        #: leaves first when the budget is short.
        self.rank: Callable[[str], int] | None = None
        #: Host copies of blocks in the pool, by agent, then block id.
        self._held: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        self._held_sizes: dict[str, int] = {}

    def __contains__(self, agent: str) -> bool:
        return agent in self._images

    def __len__(self) -> int:
        return len(self._images)

    def keep(self, agent: str, image: CacheImage) -> None:
        """Keep ``image`` as ``agent``'s evicted cache (it must hold every block's
        arrays), dropping others, or this one, over the budget."""
        self.drop(agent)
        size = image.nbytes
        if size > self.budget or not image.whole():
            return
        self._images[agent] = image
        self._sizes[agent] = size
        self.nbytes += size
        self._fit()

    def _fit(self) -> None:
        """Within the budget: copies of blocks go first, then images."""
        while self.nbytes > self.budget and self._held:
            self.release(self._soonest())
        while self.nbytes > self.budget:
            self.drop(self._furthest())

    def _soonest(self) -> str:
        """The agent whose copies of blocks go first: expected soonest (ties: held the
        longest), or without :attr:`rank` held the longest."""
        if self.rank is None:
            return next(iter(self._held))
        rank = self.rank
        return min(enumerate(self._held), key=lambda a: (rank(a[1]), a[0]))[1]

    def _furthest(self) -> str:
        """The kept agent to drop first: expected furthest from now (ties: the least
        recently evicted), or without :attr:`rank` the least recently evicted."""
        if self.rank is None:
            return next(iter(self._images))
        rank = self.rank
        return max(enumerate(self._images), key=lambda a: (rank(a[1]), -a[0]))[1]

    def get(self, agent: str) -> CacheImage | None:
        """``agent``'s kept image (``None`` if there is none)."""
        return self._images.get(agent)

    def taken(self, agent: str, *, from_memory: bool) -> None:
        """``agent``'s cache is back in the pool (``from_memory``: from the image kept
        here, though the room made for it may have pushed that out since): drop what is
        kept of it."""
        self.hits += from_memory
        self.drop(agent)

    def drop(self, agent: str) -> None:
        if self._images.pop(agent, None) is not None:
            self.nbytes -= self._sizes.pop(agent)

    def hold(self, agent: str, arrays: HostArrays) -> None:
        """Keep ``arrays`` (block id -> host copies of its keys and values) as copies of
        ``agent``'s blocks in the pool, within the budget."""
        self.release(agent)
        if not arrays:
            return
        self._held[agent] = dict(arrays)
        size = self._held_sizes[agent] = sum(k.nbytes + v.nbytes for k, v in arrays.values())
        self.nbytes += size
        self._fit()

    def held(self, agent: str) -> HostArrays:
        """The host copies of ``agent``'s blocks, by block id (empty if none)."""
        return self._held.get(agent, {})

    def prune(self, agent: str, live: Iterable[int]) -> None:
        """Let go of the copies of ``agent``'s blocks that are not in ``live`` (ids)."""
        held = self._held.get(agent)
        if held is None:
            return
        keep = {i: held[i] for i in live if i in held}
        if len(keep) < len(held):
            self.hold(agent, keep)

    def clear(self) -> None:
        """Let go of every image and copy (the runtime is closing)."""
        for agent in list(self._images):
            self.drop(agent)
        for agent in list(self._held):
            self.release(agent)

    def release(self, agent: str) -> None:
        """Let go of every copy of ``agent``'s blocks."""
        if self._held.pop(agent, None) is not None:
            self.nbytes -= self._held_sizes.pop(agent)
