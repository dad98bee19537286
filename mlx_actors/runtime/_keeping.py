"""The agents' keeper (the ``Keeper`` of ``actors/_agent.py``): what is saved in the state
directory and when, the count of each agent's saves, and the agents started here (new,
forked, resumed, reattached, adopted) or detached for another runtime."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ..actors import Agent, Message, Tool, TurnOptions
from ..errors import (
    AgentClosedError,
    CorruptStateError,
    InvalidRequestError,
    MlxActorsError,
    ModelMismatchError,
    StateWriteError,
)
from ..scheduler import Scheduler
from ._registry import Registry
from ._state import AgentRecord, StateDir
from ._store import DiskCacheStore


class AgentKeeper:
    """Keeps a runtime's agents in its state directory (``state``; with none, only
    tracks which agents leaving would keep) and starts them in the runtime's task group.
    It is the keeper every agent of the runtime is given."""

    def __init__(
        self,
        *,
        state: StateDir | None,
        store: DiskCacheStore,
        scheduler: Scheduler,
        registry: Registry,
        task_group: TaskGroup,
        mailbox_size: int,
        log: Any,
        check_running: Callable[[], None],
    ) -> None:
        self._state = state
        self._store = store
        self._scheduler = scheduler
        self._registry = registry
        self._tg = task_group
        self._mailbox_size = mailbox_size
        self._log = log
        self._check_running = check_running
        self._keeping: dict[str, anyio.Lock] = {}
        #: How many saves read each agent (see :meth:`writes`).
        self._writes: collections.Counter[str] = collections.Counter()
        #: Every agent not closed by its user, live or stopped: what leaving keeps (and
        #: the only agents whose files are written).
        self._kept: dict[str, Agent] = {}

    # -- the Keeper protocol ----------------------------------------------------------------

    @property
    def saves_turns(self) -> bool:
        """Whether :meth:`changed` saves after each turn."""
        return self._state is not None and self._state.persist == "turn"

    async def changed(self, agent: Agent) -> None:
        """Save an agent after each turn (``persist="turn"``)."""
        if self.saves_turns:
            await self._keep(agent)

    def writes(self, agent: Agent) -> int:
        """How many saves have read ``agent`` (a ``flush`` inside a turn's hold may write a
        turn whose caller then gives up)."""
        return self._writes[agent.name]

    async def rewrite(self, agent: Agent) -> None:
        """Save ``agent`` now (a turn written meanwhile was taken back)."""
        await self._keep(agent)

    def closing(self, agent: Agent) -> None:
        """``agent.close()`` began; its name stays taken until :meth:`closed`, so that a
        new agent of that name waits for the old one's files to be gone."""
        self._registry.closing(agent)

    async def closed(self, agent: Agent) -> None:
        """A closed agent is forgotten by the state directory."""
        try:
            if self._state is not None:
                async with self._keeping.setdefault(agent.name, anyio.Lock()):
                    if self._kept.get(agent.name) is agent:
                        # Under the lock: a save that was under way may have written it.
                        await self._scheduler.forget(agent.name, drop=True)
                        await self._state.delete(agent.name)  # may fail: close again
                        del self._kept[agent.name]
            elif self._kept.get(agent.name) is agent:
                del self._kept[agent.name]
        finally:
            self._registry.closed(agent)

    def check_new_name(self, name: str) -> None:
        """Raise unless a new agent may be called ``name``."""
        self._registry.check_new_name(name)

    async def fork(
        self, parent: Agent, name: str, options: TurnOptions, mailbox_size: int | None
    ) -> Agent:
        """Start ``name`` with ``parent``'s conversation and cache."""
        await self._registry.check_free(name)
        with self._registry.claim(name):  # taken from now on: the fork awaits the engine thread
            await self._scheduler.fork(parent.name, name)
            stats = parent.statistics()
            try:
                agent = await self.start(
                    name,
                    system=parent.system,
                    options=options,
                    mailbox_size=mailbox_size,
                    messages=[m for m in parent.history if m.role != "system"],
                    turns=stats.turns,
                    cached=(stats.cached_tokens, stats.cached_blocks),
                    tools=parent.tools,
                )
            except BaseException:  # the runtime began to close meanwhile
                with anyio.CancelScope(shield=True):
                    await self._scheduler.forget(name, drop=True)
                raise
        await self.first_save(agent)
        return agent

    # -- starting agents -------------------------------------------------------------------

    async def start(self, name: str, *, mailbox_size: int | None, **kwargs: Any) -> Agent:
        """Start agent ``name`` (``Agent``'s other arguments in ``kwargs``), kept here."""
        self._check_running()  # a closing runtime stops only the agents it has already
        agent = Agent(
            name,
            self._scheduler,
            mailbox_size=mailbox_size or self._mailbox_size,
            log=self._log,
            on_stopped=self._registry.stopped,
            keeper=self,
            **kwargs,
        )
        self._registry.add(agent)
        self._kept[name] = agent
        try:
            await self._tg.start(agent.serve)
        except BaseException:
            if self._kept.get(name) is agent:
                del self._kept[name]
            self._registry.remove(agent)
            raise
        return agent

    async def _start_saved(
        self, record: AgentRecord, tokens: tuple[int, ...], blocks: int
    ) -> Agent:
        """Start an agent as ``record`` saved it, its cache (``tokens``, in ``blocks``
        blocks) on disk."""
        return await self.start(
            record.name,
            system=record.system,
            options=record.options,
            mailbox_size=self._mailbox_size,
            messages=[Message.from_dict(m) for m in record.messages],
            turns=record.turns,
            cached=(len(tokens), blocks),
            tools=[
                Tool(name=t["name"], description=t["description"], parameters=t["parameters"])
                for t in record.tools
            ],
        )

    async def first_save(self, agent: Agent) -> None:
        """Save a new agent (``persist="turn"``); if that fails, it never existed."""
        if self._state is None or self._state.persist != "turn":
            return
        # Shielded: a cancel cannot land between the record's write and the reply, so
        # the agent either exists, on disk too, or was never made.
        with anyio.CancelScope(shield=True):
            try:
                await self._keep(agent)
            except BaseException:
                if self._kept.get(agent.name) is agent:
                    del self._kept[agent.name]
                await agent._stop(AgentClosedError(f"agent {agent.name!r} was not made"))
                await self._scheduler.forget(agent.name, drop=True)
                raise

    # -- saving ----------------------------------------------------------------------------

    async def _keep(self, agent: Agent) -> None:
        """Save the agent's record, then its cache; one save of an agent at a time. The
        record is what keeps the turn (:class:`StateWriteError` if it cannot be
        written), and the only write waited for: the cache a turn's commit copied is
        written in the background (the next save of the agent waits for it). A cache
        that cannot be written is only logged: the one on disk stays valid for the
        conversation's beginning, and a later turn prefills the rest."""
        assert self._state is not None
        async with self._keeping.setdefault(agent.name, anyio.Lock()):
            if self._kept.get(agent.name) is not agent:  # closed: its files are gone
                return
            self._writes[agent.name] += 1
            options = agent.options
            messages = [m.as_dict() for m in agent.history if m.role != "system"]
            record = AgentRecord(
                name=agent.name,
                system=agent.system,
                options=options,
                messages=messages,
                turns=agent.statistics().turns,
                tools=[t.spec()["function"] for t in agent.tools],
            )
            await self._state.save(record)
            try:
                await self._scheduler.save(agent.name, wait=False)
            except MlxActorsError as exc:
                self._log.error("blocks.save_failed", agent=agent.name, error=str(exc))

    async def _keep_or_log(self, agent: Agent) -> None:
        try:
            await self._keep(agent)
        except MlxActorsError as exc:  # leaving: nobody left to tell but the trace
            self._log.error("agent.save_failed", agent=agent.name, error=str(exc))

    async def keep_all(self) -> None:
        """Leaving: keep every agent as its last turn left it (those stopped by a cancel
        too); failures are only logged."""
        if self._state is not None:
            async with anyio.create_task_group() as tg:
                for agent in self._kept.values():
                    tg.start_soon(self._keep_or_log, agent)

    async def flush(self) -> None:
        """:meth:`Runtime.flush`: save every live agent (with a state directory), then
        finish the disk work asked for so far."""
        failures: list[StateWriteError] = []
        if self._state is not None:

            async def keep(agent: Agent) -> None:
                try:
                    await self._keep(agent)
                except StateWriteError as exc:
                    failures.append(exc)

            async with anyio.create_task_group() as tg:
                for agent in list(self._registry.agents.values()):
                    tg.start_soon(keep, agent)
        await self._scheduler.idle_disk()
        if failures:
            raise failures[0]

    # -- saved agents ----------------------------------------------------------------------

    async def resume(self) -> None:
        """Bring back the agents a state directory holds; their caches stay on disk
        until their next turn. A cache that cannot be read costs only that agent its
        cache; a cache no agent record lists (its agent never finished being made) is
        deleted."""
        if self._state is None:
            return
        records = await anyio.to_thread.run_sync(self._state.records)
        names = {record.name for record in records}
        for orphan in await anyio.to_thread.run_sync(self._store.agents):
            if orphan not in names:
                await self._store.drop(orphan)
        for record in records:
            await self._resume_one(record)

    async def _resume_one(self, record: AgentRecord) -> Agent:
        """Start an agent of this state directory as it was saved, its cache on disk."""
        try:
            tokens, blocks = await anyio.to_thread.run_sync(self._store.tokens, record.name)
        except CorruptStateError as exc:
            self._log.error("blocks.lost", agent=record.name, error=str(exc))
            await self._store.drop(record.name)
            tokens, blocks = (), 0
        if tokens:
            self._scheduler.adopt(record.name, tokens)
        agent = await self._start_saved(record, tokens, blocks)
        self._log.info("agent.resumed", agent=record.name, cached_tokens=len(tokens))
        return agent

    async def detach(self, name: str) -> None:
        """:meth:`Runtime.detach`."""
        state = self._need_state("detach")
        agent = self._registry.agent(name)
        await self._keep(agent)
        async with self._keeping.setdefault(name, anyio.Lock()):
            if self._kept.get(name) is agent:
                del self._kept[name]  # no later save, and no deletion when it stops
        await agent._stop(AgentClosedError(f"agent {name!r} moved to another runtime"))
        await self._scheduler.forget(name, drop=False)
        await self._scheduler.idle_disk()
        del state

    async def reattach(self, name: str) -> Agent:
        """:meth:`Runtime.reattach`."""
        state = self._need_state("reattach")
        if name in self._registry.agents:
            raise InvalidRequestError(f"agent {name!r} is live here")
        return await self._resume_one(await anyio.to_thread.run_sync(state.record, name))

    async def forget_detached(self, name: str) -> None:
        """:meth:`Runtime.forget_detached`."""
        state = self._need_state("forget_detached")
        if name in self._registry.agents:
            raise InvalidRequestError(f"agent {name!r} is live here: close() it instead")
        await self._scheduler.forget(name, drop=True)
        await state.delete(name)

    async def adopt(self, source: str | os.PathLike[str], name: str) -> Agent:
        """:meth:`Runtime.adopt`."""
        state = self._need_state("adopt")
        other = StateDir(source, persist="turn")
        if await anyio.to_thread.run_sync(other.identity) != await anyio.to_thread.run_sync(
            state.identity
        ):
            raise ModelMismatchError(
                f"{other.path} was written by another model or kv setting than {state.path}"
            )
        record = await anyio.to_thread.run_sync(other.record, name)
        await self._registry.check_free(name)
        with self._registry.claim(name):
            try:
                tokens: tuple[int, ...] = ()
                blocks = 0
                try:
                    image = await other.caches().load(name)
                except MlxActorsError as exc:  # the conversation comes; the cache does not
                    self._log.error("blocks.lost", agent=name, error=str(exc))
                else:
                    await self._store.save(name, image)
                    tokens, blocks = image.tokens, image.num_blocks
                    self._scheduler.adopt(name, tokens)
                await state.save(record)
                agent = await self._start_saved(record, tokens, blocks)
            except BaseException:
                with anyio.CancelScope(shield=True):  # no half-adopted copy is left here
                    await self._scheduler.forget(name, drop=True)
                    await state.delete(name)
                raise
        self._log.info("agent.adopted", agent=name, source=str(other.path))
        return agent

    def _need_state(self, what: str) -> StateDir:
        self._check_running()
        if self._state is None:
            raise InvalidRequestError(f"{what} needs a Runtime with a state_dir")
        return self._state
