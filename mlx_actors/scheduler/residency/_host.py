"""Evicted caches kept in host memory, in front of the disk.

When the pool runs short, an idle agent's cache leaves it as a :class:`CacheImage` (host
memory) and is written to the store. :class:`HostCaches` also keeps some of those
images, up to a budget of bytes, so that the agent's next turn takes its cache back
from memory: no file read, no checksum, and no trip to the event loop. An image is
dropped when the agent is restored, forgotten, or its write fails, or when others push
it out: with a :attr:`~HostCaches.rank` (the cache manager's expected next use), the
image of the agent expected furthest from now first, so that the ones needed soonest
stay (in a round robin, the agent that just left is dropped, not the next speaker);
without one, the least recently evicted first. Engine thread only (the
:class:`~._manager.CacheManager` owns it).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from ._image import CacheImage


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
        while self.nbytes > self.budget:
            self.drop(self._furthest())

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
