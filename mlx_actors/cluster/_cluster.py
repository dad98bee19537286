"""The cluster: agents spread over several runtimes (replicas), each a Ray actor on its
host or GPU, behind the agent API of one runtime. This module owns placement (sticky by
agent; new agents on the least busy replica, or beside agents that share their long
system prompt; :class:`Placement`, ``_placement.py``), and moves; the replicas themselves,
the calls to them and what happens when one dies are :class:`Replicas` (``_replicas.py``).

Agents move between replicas only through their saved state: a replica saves the agent
(conversation and cache files) into its state directory, another adopts it from there
(:meth:`Runtime.detach`, :meth:`Runtime.adopt`). The replicas' state directories must
therefore be visible to every replica under the same path (one host, or a shared file
system).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import attrs

from ..errors import InvalidRequestError, ReplicaLostError, UnknownAgentError
from ..runtime import RuntimeStatistics
from ..runtime._state import PERSIST_MODES
from ..runtime._trace import ModuleLog
from ._placement import Placement
from ._remote import RemoteAgent
from ._replicas import Replicas, forget_in

log = ModuleLog()


@attrs.frozen
class ClusterStatistics:
    """A snapshot of a cluster."""

    #: Each live replica's runtime statistics, by replica index.
    replicas: Mapping[int, RuntimeStatistics]
    #: Which replica each agent lives on.
    placement: Mapping[str, int]


class Cluster:
    """Agents on several runtimes, one per Ray actor: ``async with Cluster(...) as cl``.

    Each replica runs a normal :class:`~mlx_actors.Runtime` (one copy of the model, its
    own block pool, its own state directory ``state_dir/replica-N``) on its host or GPU.
    ``spawn`` places an agent on one replica and it stays there; its turns run in that
    replica's batches. Works from asyncio and trio.

    Args:
        model: what every replica runs (as ``Runtime``'s ``model``: a path every replica
            can read, a hub id, or ``None`` for the default model).
        replicas: how many runtimes.
        state_dir: the replicas' state directories' parent (a temporary directory by
            default: then nothing outlives the cluster). With one, a new cluster on it
            brings every agent back.
        persist: when each replica saves its agents: after every turn (``"turn"``, the
            default: a replica that dies loses no turn that was answered, its agents
            come back on the others) or only when the cluster closes (``"exit"``: no
            save on a turn's path; a replica that dies takes its agents' turns since
            they were last saved with it).
        address: a Ray cluster to join (``ray start --head`` elsewhere); by default a
            running Ray instance, or a local one started for the cluster.
        replica_options: Ray actor options of each replica, such as ``{"num_gpus": 1}``
            (default: no CPU reserved; a runtime's engine runs on its own thread).
        runtime_options: the other arguments of each replica's ``Runtime``
            (``pool_bytes``, ``max_batch_size``, ``log_level``...).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        replicas: int = 2,
        state_dir: str | os.PathLike[str] | None = None,
        persist: str = "turn",
        address: str | None = None,
        replica_options: Mapping[str, Any] | None = None,
        **runtime_options: Any,
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise InvalidRequestError(f"replicas must be a positive int, got {replicas!r}")
        if "state_dir" in runtime_options or "persist" in runtime_options:
            raise InvalidRequestError(
                "a cluster keeps its replicas' state in state_dir/ (and says when with its "
                "own persist=)"
            )
        if persist not in PERSIST_MODES:
            raise InvalidRequestError(f"persist must be one of {PERSIST_MODES}, got {persist!r}")
        self._model = None if model is None else os.fspath(model)
        self._runtime_options = {**runtime_options, "persist": persist}
        self._placement = Placement()
        self._replicas = Replicas(
            count=replicas,
            root=Path(state_dir).expanduser().resolve() if state_dir is not None else None,
            address=address,
            options={"num_cpus": 0, **(replica_options or {})},
            placement=self._placement,
        )

    # -- life cycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Cluster:
        replicas = self._replicas
        await replicas.connect()
        try:
            replicas.check_resources()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            raise
        replicas.launch(self._model, self._runtime_options)

        async def start(index: int) -> dict[str, str | None]:
            agents: dict[str, str | None] = await replicas.raw(index, "start")
            replicas.started[index] = True
            return agents

        try:
            found = await _all(start(i) for i in range(replicas.count))
            for index, agents in enumerate(found):
                for name, system in agents.items():
                    if self._placement.taken(name):  # written by hand, or by an older version
                        log.error("agent.duplicate", agent=name, replica=index)
                        continue
                    self._placement.put(name, index, system)
            await replicas.adopt_leftovers()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            raise
        log.info("cluster.started", replicas=replicas.count, agents=len(self._placement.where))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self._shutdown()

    async def _shutdown(self) -> None:
        await self._replicas.shutdown()

    # -- agents -----------------------------------------------------------------------------

    async def spawn(self, name: str, **kwargs: Any) -> RemoteAgent:
        """Start an agent on the replica :meth:`place` chooses (``Runtime.spawn``'s
        arguments; tools run in the replica's process, so they must pickle). Names are
        unique in the cluster, ignoring case."""
        return await self._start(name, kwargs.get("system"), None, "spawn", name, kwargs)

    async def _start(
        self, name: str, system: str | None, index: int | None, method: str, *args: Any
    ) -> RemoteAgent:
        """Claim ``name``, place it (on ``index`` if given), and ask that replica to
        ``method(*args)`` it into being."""
        self._check_open()
        with self._placement.claim(name):
            if index is None:
                index = await self.place(system)
            self._placement.placing(name, index, system)
            await self._replicas.call(index, method, *args)
            self._placement.put(name, index, system)
        return RemoteAgent(self, name)

    def _check_open(self) -> None:
        self._replicas.check_open()

    def agent(self, name: str) -> RemoteAgent:
        self._check_open()
        if name not in self._placement.where:
            raise UnknownAgentError(f"no agent of the cluster is called {name!r}")
        return RemoteAgent(self, name)

    @property
    def agents(self) -> Mapping[str, RemoteAgent]:
        return {name: RemoteAgent(self, name) for name in self._placement.where}

    def replica_of(self, name: str) -> int:
        """The index of the replica agent ``name`` lives on."""
        return self._placement.replica_of(name)

    async def place(self, system: str | None) -> int:
        """The replica for a new agent: one holding agents whose system prompt begins
        as this one does (over ``SHARED_PREFIX_CHARS`` characters), else the least
        busy (blocks resident, turns in flight, agents)."""
        self._check_open()
        alive = self._placement.candidates(system, self._replicas.live())
        loads = await _all(self._replicas.call(i, "load") for i in alive)
        return self._placement.least_busy(dict(zip(alive, loads, strict=True)))

    async def move(self, name: str, replica: int) -> None:
        """Move agent ``name`` to ``replica`` through its saved state (exactly: its
        conversation and cache come along; its next turn prefills only new tokens).
        Calls to the agent wait for the move, which is not cancelled midway. If the
        target cannot take it, the agent goes on where it was and the target's error
        is raised (:class:`ReplicaLostError` if the target died)."""
        replicas = self._replicas
        source = await self._home(name)
        if replica == source:
            return
        if not (0 <= replica < len(replicas.alive) and replicas.alive[replica]):
            raise InvalidRequestError(f"replica {replica} is not a live replica")
        with anyio.CancelScope(shield=True):
            self._placement.moving.add(name)
            try:
                async with replicas.lock:  # no recovery meanwhile
                    queue: list[int] = []
                    try:
                        await self._move(name, source, replica, queue)
                    finally:
                        await replicas.evacuate(queue)
            finally:
                self._placement.moving.discard(name)
        log.info("agent.moved", agent=name, source=source, replica=replica)

    async def _move(self, name: str, source: int, target: int, queue: list[int]) -> None:
        """Under the lock: :meth:`move`'s steps; replicas found dead join ``queue``."""
        replicas = self._replicas
        dead = replicas.dead
        try:
            await replicas.raw(source, "detach", name)
        except dead:
            replicas.mark_dead(source, queue)  # the agent is brought back from its files
            raise ReplicaLostError(f"replica {source} died; agent {name!r} was not moved") from None
        try:
            await replicas.raw(target, "adopt", str(replicas.dir(source)), name)
        except BaseException as exc:
            if isinstance(exc, dead):
                replicas.mark_dead(target, queue)
                # What it wrote of the agent there must not bring a second copy back.
                await forget_in(replicas.dir(target), name)
            try:
                await replicas.raw(source, "reattach", name)
            except dead:
                replicas.mark_dead(source, queue)
            except Exception as again:
                log.error("agent.reattach_failed", agent=name, error=repr(again))
            if isinstance(exc, dead):
                raise ReplicaLostError(
                    f"replica {target} died; agent {name!r} was not moved"
                ) from None
            raise
        self._placement.where[name] = target
        try:
            await replicas.raw(source, "forget_detached", name)
        except dead:
            replicas.mark_dead(source, queue)
            await forget_in(replicas.dir(source), name)  # one home only

    async def stats(self) -> ClusterStatistics:
        """Each live replica's statistics (one found dead meanwhile is left out, and its
        agents brought back elsewhere), and where each agent lives."""
        self._check_open()

        async def one(index: int) -> RuntimeStatistics | None:
            try:
                stats: RuntimeStatistics = await self._replicas.call(index, "stats")
            except ReplicaLostError:
                return None
            return stats

        alive = self._replicas.live()
        found = dict(zip(alive, await _all(one(i) for i in alive), strict=True))
        replicas = {i: stats for i, stats in found.items() if stats is not None}
        return ClusterStatistics(replicas=replicas, placement=dict(self._placement.where))

    # -- calls ------------------------------------------------------------------------------

    async def _on_agent(self, name: str, method: str, *args: Any) -> Any:
        return await self._replicas.call(await self._home(name), method, name, *args)

    async def _home(self, name: str) -> int:
        """The replica agent ``name`` lives on; if it is being moved, or that replica
        died, where it is after the move or the recovery."""
        self._check_open()
        replicas = self._replicas
        index = self.replica_of(name)
        if name in self._placement.moving or not replicas.alive[index]:
            with anyio.CancelScope(shield=True):
                async with replicas.lock:  # the move or the recovery is done
                    index = self.replica_of(name)
                    if not replicas.alive[index]:  # placed there as it died: bring it back
                        queue: list[int] = []
                        await replicas.adopt_all(
                            replicas.dir(index), {name: self._placement.systems.get(name)}, queue
                        )
                        await replicas.evacuate(queue)
            index = self.replica_of(name)
        return index


async def _all(calls: Any) -> list[Any]:
    """Await ``calls`` at once; their results in order."""
    from ..actors import gather

    return await gather(*calls)
