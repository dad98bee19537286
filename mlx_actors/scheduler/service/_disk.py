"""The store's work, on the event loop: writing evicted and saved caches, reading back the
ones the engine thread asks for, copying for forks, deleting; one agent's operations in
order, each in the background on a worker thread of the store's.

Which tier an agent's cache is in is the engine thread's record
(:class:`~..residency._manager.CacheManager`); :class:`DiskWork` keeps only what the
disk work needs of it: the agents whose cache the engine thread said is out of the pool
(and by which snapshot), so that a read or a copy after a failed write starts over
instead of reading what is not there.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ...errors import MlxActorsError
from ..residency._image import CacheImage
from ._protocol import CacheStore, Forget, Prefetched, Save, Stored, WriteFailed


class DiskWork:
    """Runs ``store``'s operations in the background of the task group it is given
    (:meth:`start`); ``put`` sends the engine thread a command."""

    def __init__(self, store: CacheStore, put: Callable[[object], None], *, log: Any) -> None:
        self.store = store
        self._put = put
        self._log = log
        self._group: TaskGroup | None = None
        self._tail: dict[str, anyio.Event] = {}
        #: Agents whose cache is out of the pool, as the engine thread said (each with
        #: the snapshot that evicted it; 0: one the store held already).
        self._out: dict[str, int] = {}
        #: Where each agent's last save put its blocks, for the engine thread (sent
        #: with the agent's next commit or save: :meth:`take_stored`).
        self._stored: dict[str, Stored] = {}
        #: Reads ahead of a turn under way (:meth:`prefetch`), and the latest one's
        #: image until the agent's cache is back or leaves again.
        self._prefetching: dict[str, anyio.Event] = {}
        #: (agent, the eviction's snapshot it was read for, image)
        self._prefetched: tuple[str, int, CacheImage] | None = None
        #: Each agent's write under way that its save did not wait for (:meth:`write_behind`).
        self._behind: dict[str, anyio.Event] = {}
        #: The image each eviction is writing, until written: a read for it meanwhile
        #: takes it rather than waiting for the write and reading the files back.
        self._leaving: dict[str, CacheImage] = {}

    def start(self, group: TaskGroup) -> None:
        self._group = group

    def take_stored(self, agent: str) -> Stored | None:
        """Where the agent's last save put its blocks, if the engine thread has not
        been told yet."""
        return self._stored.pop(agent, None)

    def out(self, agent: str) -> bool:
        """Whether the agent's cache is in the store rather than in the pool."""
        return agent in self._out

    def run(self, agent: str, work: Callable[[], Awaitable[Any]]) -> anyio.Event:
        """Run ``work`` in the background after the agent's earlier disk work; the event
        is set when it is done."""
        assert self._group is not None
        previous = self._tail.get(agent)
        done = self._tail[agent] = anyio.Event()

        async def run() -> None:
            try:
                if previous is not None:
                    await previous.wait()
                await work()
            except Exception as exc:
                self._log.error("blocks.write_failed", agent=agent, error=str(exc))
            finally:
                done.set()
                if self._tail.get(agent) is done:
                    del self._tail[agent]

        self._group.start_soon(run)
        return done

    async def idle(self) -> None:
        """Wait until every disk operation asked for so far is done."""
        for event in list(self._tail.values()):
            await event.wait()

    # -- what the engine thread says -----------------------------------------------------------

    def adopted(self, agent: str) -> None:
        """The agent's cache is in the store already (a state directory's)."""
        self._out[agent] = 0

    def evicted(self, agent: str, image: CacheImage) -> None:
        """The agent's cache left the pool as ``image``: write it."""
        self._out[agent] = image.serial
        self._drop_prefetched(agent)
        self._leaving[agent] = image
        self.run(agent, lambda: self._write_evicted(agent, image))

    def restored(self, agent: str) -> None:
        """The agent's cache is back in the pool (or dropped for good)."""
        self._out.pop(agent, None)
        self._drop_prefetched(agent)
        if not self.store.persistent:  # a swap area keeps only what is out
            self.run(agent, lambda: self.store.drop(agent))

    def lost(self, agent: str) -> None:
        """The agent's saved cache does not fit the model: delete it."""
        self._out.pop(agent, None)
        self._drop_prefetched(agent)
        self.run(agent, lambda: self.store.drop(agent))

    def save(self, command: Save, image: CacheImage | None) -> None:
        """Write a save's snapshot (``None``: nothing in the pool to save) and answer it."""

        async def save() -> None:
            try:
                if image is not None:
                    await self._write(command.agent, image, saved=True)
            except BaseException as exc:
                command.reply(exc)
                raise
            else:
                command.reply(None)

        self.run(command.agent, save)

    async def write(self, agent: str, image: CacheImage) -> None:
        """Write a save's snapshot after the agent's earlier disk work; raise what
        stopped the write."""
        failure: list[BaseException] = []

        async def write() -> None:
            try:
                await self._write(agent, image, saved=True)
            except BaseException as exc:
                failure.append(exc)
                raise

        await self.run(agent, write).wait()
        if failure:
            raise failure[0]

    async def write_behind(
        self, agent: str, image: Callable[[], Awaitable[CacheImage | None]]
    ) -> None:
        """Write a save's snapshot (``image()``, once the engine thread has it) in the
        background, after the agent's earlier disk work; a failure is only logged
        (``blocks.save_failed``: the older cache on disk stays). Waits only while the
        agent's previous write of this kind is under way: one at a time per agent, so
        the snapshots waiting to be written stay few."""
        previous = self._behind.get(agent)
        if previous is not None:
            await previous.wait()

        async def write() -> None:
            try:
                taken = await image()
                if taken is not None:
                    await self._write(agent, taken, saved=True)
            except Exception as exc:
                self._log.error("blocks.save_failed", agent=agent, error=str(exc))

        self._behind[agent] = self.run(agent, write)

    # -- what the event loop asks --------------------------------------------------------------

    async def read(self, agent: str) -> CacheImage | None:
        """The agent's cache from the store, once its earlier disk work is done (``None``:
        the write that evicted it failed, so it starts over); a read ahead of the turn
        already under way or done serves it.

        Raises:
            MlxActorsError: the files could not be read (they are deleted).
        """
        ahead = self._prefetching.get(agent)
        if ahead is not None:
            await ahead.wait()
        if self._prefetched is not None and self._prefetched[0] == agent:
            _, serial, image = self._prefetched
            self._prefetched = None
            if self._out.get(agent) == serial:
                return image
        return await self._read(agent)

    def prefetch(self, agent: str) -> None:
        """Read the agent's cache back ahead of its turn, in the background, and send it
        to the engine thread (:class:`Prefetched`; ``None`` if it could not be read: the
        turn's own read then deals with the files)."""
        assert self._group is not None
        done = self._prefetching[agent] = anyio.Event()
        serial = self._out.get(agent)

        async def read() -> None:
            image = None
            try:
                image = await self._read(agent, ahead=True)
            except Exception as exc:  # files deleted meanwhile, or unreadable
                self._log.debug("blocks.prefetch_failed", agent=agent, error=repr(exc))
            finally:
                if image is not None and serial is not None and self._out.get(agent) == serial:
                    self._prefetched = (agent, serial, image)  # still the cache that is out
                self._put(Prefetched(agent, image))
                del self._prefetching[agent]
                done.set()

        self._group.start_soon(read)

    def _drop_prefetched(self, agent: str) -> None:
        if self._prefetched is not None and self._prefetched[0] == agent:
            self._prefetched = None

    async def _read(self, agent: str, *, ahead: bool = False) -> CacheImage | None:
        """The agent's cache from the store, once its earlier disk work is done; with
        ``ahead`` (a prefetch) files that cannot be read are left for the turn's read.
        A cache whose eviction is still being written comes from the image being
        written, if it carries every block (no wait, no file read)."""
        leaving = self._leaving.get(agent)
        if leaving is not None and self._out.get(agent) == leaving.serial and leaving.whole():
            self._log_read(agent, leaving, "write", 0.0, ahead)
            return leaving
        pending = self._tail.get(agent)
        if pending is not None:
            await pending.wait()
        if agent not in self._out:  # the write that evicted it failed
            return None
        started = time.perf_counter()
        try:
            image = await self.store.load(agent)
        except MlxActorsError as exc:
            if ahead:
                raise
            # The agent's next turn starts again from its conversation.
            self._log.error("blocks.lost", agent=agent, error=str(exc))
            await self.forget(agent, drop=True)
            raise
        self._log_read(agent, image, "disk", time.perf_counter() - started, ahead)
        return image

    def _log_read(
        self, agent: str, image: CacheImage, source: str, seconds: float, ahead: bool
    ) -> None:
        self._log.debug(
            "blocks.read",
            agent=agent,
            bytes=image.nbytes,
            source=source,
            ms=round(seconds * 1e3, 2),
            **({"prefetch": True} if ahead else {}),
        )

    async def copy(self, parent: str, child: str) -> None:
        """Make the child's cache a copy of the parent's files (a fork of an evicted
        agent), after the parent's earlier disk work; if there is nothing to copy, the
        child starts from its conversation."""
        previous = self._tail.get(parent)

        async def copy() -> None:
            if previous is not None:
                await previous.wait()
            if parent not in self._out:  # the write that evicted it failed
                self._put(Forget(child))
                return
            try:
                await self.store.copy(parent, child)
            except Exception:
                self._put(Forget(child))  # the child starts from its conversation
                raise
            self._out[child] = 0

        await self.run(child, copy).wait()

    async def forget(self, agent: str, *, drop: bool) -> None:
        """Free the agent's cache; with ``drop``, delete it from the store as well."""
        self._put(Forget(agent))
        self._out.pop(agent, None)
        self._stored.pop(agent, None)
        self._behind.pop(agent, None)
        self._drop_prefetched(agent)
        if drop:
            await self.run(agent, lambda: self.store.drop(agent)).wait()

    # -- writes ----------------------------------------------------------------------------------

    async def _write(self, agent: str, image: CacheImage, *, saved: bool = False) -> None:
        """Write ``image``; a ``saved`` one's block places go to the engine thread (an
        evicted one's are of no use there: its blocks are gone)."""
        started = time.perf_counter()
        refs = await self.store.save(agent, image)
        self._log.debug(
            "blocks.written",
            agent=agent,
            bytes=image.nbytes,
            ms=round((time.perf_counter() - started) * 1e3, 2),
        )
        if saved:
            self._stored[agent] = Stored(agent, refs, image.serial)

    async def _write_evicted(self, agent: str, image: CacheImage) -> None:
        try:
            await self._write(agent, image)
        except Exception as exc:
            # The cache is gone, not corrupt: the agent's next turn starts again from
            # its conversation rather than failing (unless it is back in the pool
            # from host memory: the engine thread knows).
            self._log.error("blocks.write_failed", agent=agent, error=repr(exc))
            self._put(WriteFailed(agent, image.serial))
            if self._out.get(agent) == image.serial:
                del self._out[agent]
        finally:
            if self._leaving.get(agent) is image:
                del self._leaving[agent]
