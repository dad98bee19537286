"""The cluster: agents spread over several runtimes (replicas), each a Ray actor on its
host or GPU, behind the agent API of one runtime. This module owns placement (sticky by
agent; new agents on the least busy replica, or beside agents that share their long
system prompt), the calls to replicas, and what happens when one dies.

Agents move between replicas only through their saved state: a replica saves the agent
(conversation and cache files) into its state directory, another adopts it from there
(:meth:`Runtime.detach`, :meth:`Runtime.adopt`). The replicas' state directories must
therefore be visible to every replica under the same path (one host, or a shared file
system).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import attrs

from ..errors import (
    InvalidRequestError,
    ReplicaLostError,
    RuntimeClosedError,
    UnknownAgentError,
)
from ..runtime import RuntimeStatistics
from ..runtime._state import StateDir
from ..runtime._trace import ModuleLog
from ._remote import RemoteAgent
from ._replica import Replica

log = ModuleLog()

#: System prompts at least this long that begin alike (this many characters) put their
#: agents on one replica, so that the prefix is prefilled and held once.
SHARED_PREFIX_CHARS = 512


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
        address: str | None = None,
        replica_options: Mapping[str, Any] | None = None,
        **runtime_options: Any,
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise InvalidRequestError(f"replicas must be a positive int, got {replicas!r}")
        if "state_dir" in runtime_options or "persist" in runtime_options:
            raise InvalidRequestError("a cluster keeps its replicas' state in state_dir/")
        self._model = None if model is None else os.fspath(model)
        self._count = replicas
        self._root = Path(state_dir).expanduser().resolve() if state_dir is not None else None
        self._address = address
        self._replica_options = {"num_cpus": 0, **(replica_options or {})}
        self._runtime_options = runtime_options
        self._handles: list[Any] = []
        self._alive: list[bool] = []
        self._started: list[bool] = []
        self._where: dict[str, int] = {}
        self._systems: dict[str, str | None] = {}
        #: Names of agents being spawned, and where they are going once placed (with
        #: their system prompt): placement counts them before the replica does.
        self._claimed: set[str] = set()
        self._placing: dict[str, tuple[int, str | None]] = {}
        #: Agents being moved: calls to them wait for the move (it holds the lock).
        self._moving: set[str] = set()
        self._owns_ray = False
        self._temporary: tempfile.TemporaryDirectory[str] | None = None
        self._lock = anyio.Lock()
        self._limiter = anyio.CapacityLimiter(1024)
        self._ray: Any = None

    # -- life cycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Cluster:
        try:
            import ray
        except ImportError:
            raise InvalidRequestError("Cluster needs Ray: pip install 'mlx-actors[ray]'") from None
        self._ray = ray
        if not ray.is_initialized():
            await anyio.to_thread.run_sync(self._init_ray)
            self._owns_ray = True
        try:
            self._check_resources()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            raise
        if self._root is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="mlx-actors-cluster-")
            self._root = Path(self._temporary.name)
        actor = ray.remote(Replica)
        self._handles = [
            actor.options(max_concurrency=1024, **self._replica_options).remote(
                i, self._model, str(self._dir(i)), dict(self._runtime_options)
            )
            for i in range(self._count)
        ]
        self._alive = [True] * self._count
        self._started = [False] * self._count

        async def start(index: int) -> dict[str, str | None]:
            agents: dict[str, str | None] = await self._raw(index, "start")
            self._started[index] = True
            return agents

        try:
            found = await _all(start(i) for i in range(self._count))
            for index, agents in enumerate(found):
                for name, system in agents.items():
                    if self._taken(name):  # written by hand, or by an older version
                        log.error("agent.duplicate", agent=name, replica=index)
                        continue
                    self._where[name], self._systems[name] = index, system
            await self._adopt_leftovers()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            raise
        log.info("cluster.started", replicas=self._count, agents=len(self._where))
        return self

    async def _adopt_leftovers(self) -> None:
        """Agents of a state directory written by a cluster of more replicas than this
        one come back on this one's."""
        assert self._root is not None
        extra = sorted(
            int(m[1])
            for p in self._root.glob("replica-*")
            if (m := re.fullmatch(r"replica-(\d+)", p.name)) and int(m[1]) >= self._count
        )
        for index in extra:
            where = self._dir(index)
            try:
                records = await anyio.to_thread.run_sync(StateDir(where, persist="turn").records)
            except OSError:
                continue
            agents = {r.name: r.system for r in records if not self._taken(r.name)}
            if agents:
                log.info("replica.leftover", directory=str(where), agents=len(agents))
                async with self._lock:
                    queue: list[int] = []
                    await self._adopt_all(where, agents, queue)
                    await self._evacuate(queue)

    def _check_resources(self) -> None:
        """Refuse replicas the Ray cluster could never place (they would wait forever)."""
        options = self._replica_options
        wanted = {
            "CPU": options.get("num_cpus", 0),
            "GPU": options.get("num_gpus", 0),
            **options.get("resources", {}),
        }
        have = self._ray.cluster_resources()
        for name, amount in wanted.items():
            if amount and have.get(name, 0) < amount * self._count:
                raise InvalidRequestError(
                    f"{self._count} replicas of {amount} {name} each need "
                    f"{amount * self._count}, and the Ray cluster has {have.get(name, 0)}; "
                    "change replica_options or replicas, or add nodes (ray start)"
                )

    def _init_ray(self) -> None:
        # Called on a worker thread (it blocks): Ray then warns that it set no SIGTERM
        # handler, which is as intended (the application's own handling stays).
        worker = logging.getLogger("ray._private.worker")
        worker.addFilter(_not_sigterm_notice)
        try:
            self._ray.init(
                address=self._address,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        finally:
            worker.removeFilter(_not_sigterm_notice)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self._shutdown()

    async def _shutdown(self) -> None:
        try:
            for index, alive in enumerate(self._alive):
                # A replica still starting (or never scheduled) is killed, not stopped.
                if alive and self._started[index]:
                    try:
                        await self._raw(index, "stop")
                    except Exception as exc:  # a replica that cannot stop still goes
                        log.error("replica.stop_failed", replica=index, error=repr(exc))
        finally:
            for handle in self._handles:
                with contextlib.suppress(Exception):
                    self._ray.kill(handle)
            self._handles, self._alive, self._started = [], [], []
            self._where.clear()
            self._systems.clear()
        if self._owns_ray:
            await anyio.to_thread.run_sync(self._ray.shutdown)
            self._owns_ray = False
        if self._temporary is not None:
            self._temporary.cleanup()
            self._temporary = None

    def _dir(self, index: int) -> Path:
        assert self._root is not None
        return self._root / f"replica-{index}"

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
        if not isinstance(name, str):
            raise InvalidRequestError(f"an agent's name is a str, got {name!r}")
        if self._taken(name):
            raise InvalidRequestError(f"the cluster already has an agent called {name!r}")
        self._claimed.add(name)
        try:
            if index is None:
                index = await self.place(system)
            self._placing[name] = (index, system)
            await self._call(index, method, *args)
            self._where[name], self._systems[name] = index, system
        finally:
            self._placing.pop(name, None)
            self._claimed.discard(name)
        return RemoteAgent(self, name)

    def _taken(self, name: str) -> bool:
        folded = name.casefold()
        return any(n.casefold() == folded for n in (*self._where, *self._claimed))

    def _check_open(self) -> None:
        if not self._handles:
            raise RuntimeClosedError("the cluster is not running (use async with Cluster(...))")

    def agent(self, name: str) -> RemoteAgent:
        self._check_open()
        if name not in self._where:
            raise UnknownAgentError(f"no agent of the cluster is called {name!r}")
        return RemoteAgent(self, name)

    @property
    def agents(self) -> Mapping[str, RemoteAgent]:
        return {name: RemoteAgent(self, name) for name in self._where}

    def replica_of(self, name: str) -> int:
        """The index of the replica agent ``name`` lives on."""
        try:
            return self._where[name]
        except KeyError:
            raise UnknownAgentError(f"no agent of the cluster is called {name!r}") from None

    async def place(self, system: str | None) -> int:
        """The replica for a new agent: one holding agents whose system prompt begins
        as this one does (over ``SHARED_PREFIX_CHARS`` characters), else the least
        busy (blocks resident, turns in flight, agents)."""
        self._check_open()
        alive = self._candidates(system)
        loads = await _all(self._call(i, "load") for i in alive)
        return self._least_busy(dict(zip(alive, loads, strict=True)))

    def _candidates(self, system: str | None) -> list[int]:
        """Live replicas a new agent with ``system`` may go to: those holding (or being
        given) agents whose system prompt begins alike, if any, else all."""
        alive = [i for i, ok in enumerate(self._alive) if ok]
        if not alive:
            raise ReplicaLostError("no replica of the cluster is alive")
        key = _prefix(system)
        if key is not None:
            homes = [(self._where.get(n), s) for n, s in self._systems.items()]
            homes += list(self._placing.values())
            beside = {i for i, s in homes if i is not None and _prefix(s) == key} & set(alive)
            if beside:
                return sorted(beside)
        return alive

    def _least_busy(self, loads: Mapping[int, tuple[int, int, int]]) -> int:
        """Fewest turns in flight, then fewest blocks resident, then fewest agents (as
        the cluster counts them, with those being placed there: concurrent spawns see
        each other even when a replica's own figures are a moment old)."""
        agents = collections.Counter(self._where.values())
        agents.update(i for i, _ in self._placing.values())
        busy = {i: (load[1], load[0], agents[i]) for i, load in loads.items()}
        return min(busy, key=busy.__getitem__)

    async def move(self, name: str, replica: int) -> None:
        """Move agent ``name`` to ``replica`` through its saved state (exactly: its
        conversation and cache come along; its next turn prefills only new tokens).
        Calls to the agent wait for the move, which is not cancelled midway. If the
        target cannot take it, the agent goes on where it was and the target's error
        is raised (:class:`ReplicaLostError` if the target died)."""
        source = await self._home(name)
        if replica == source:
            return
        if not (0 <= replica < len(self._alive) and self._alive[replica]):
            raise InvalidRequestError(f"replica {replica} is not a live replica")
        with anyio.CancelScope(shield=True):
            self._moving.add(name)
            try:
                async with self._lock:  # no recovery meanwhile
                    queue: list[int] = []
                    try:
                        await self._move(name, source, replica, queue)
                    finally:
                        await self._evacuate(queue)
            finally:
                self._moving.discard(name)
        log.info("agent.moved", agent=name, source=source, replica=replica)

    async def _move(self, name: str, source: int, target: int, queue: list[int]) -> None:
        """Under the lock: :meth:`move`'s steps; replicas found dead join ``queue``."""
        dead = self._dead
        try:
            await self._raw(source, "detach", name)
        except dead:
            self._mark_dead(source, queue)  # the agent is brought back from its files
            raise ReplicaLostError(f"replica {source} died; agent {name!r} was not moved") from None
        try:
            await self._raw(target, "adopt", str(self._dir(source)), name)
        except BaseException as exc:
            if isinstance(exc, dead):
                self._mark_dead(target, queue)
                # What it wrote of the agent there must not bring a second copy back.
                await _forget_in(self._dir(target), name)
            try:
                await self._raw(source, "reattach", name)
            except dead:
                self._mark_dead(source, queue)
            except Exception as again:
                log.error("agent.reattach_failed", agent=name, error=repr(again))
            if isinstance(exc, dead):
                raise ReplicaLostError(
                    f"replica {target} died; agent {name!r} was not moved"
                ) from None
            raise
        self._where[name] = target
        try:
            await self._raw(source, "forget_detached", name)
        except dead:
            self._mark_dead(source, queue)
            await _forget_in(self._dir(source), name)  # one home only

    async def stats(self) -> ClusterStatistics:
        """Each live replica's statistics (one found dead meanwhile is left out, and its
        agents brought back elsewhere), and where each agent lives."""
        self._check_open()

        async def one(index: int) -> RuntimeStatistics | None:
            try:
                stats: RuntimeStatistics = await self._call(index, "stats")
            except ReplicaLostError:
                return None
            return stats

        alive = [i for i, ok in enumerate(self._alive) if ok]
        found = dict(zip(alive, await _all(one(i) for i in alive), strict=True))
        replicas = {i: stats for i, stats in found.items() if stats is not None}
        return ClusterStatistics(replicas=replicas, placement=dict(self._where))

    # -- calls ------------------------------------------------------------------------------

    async def _on_agent(self, name: str, method: str, *args: Any) -> Any:
        return await self._call(await self._home(name), method, name, *args)

    async def _home(self, name: str) -> int:
        """The replica agent ``name`` lives on; if it is being moved, or that replica
        died, where it is after the move or the recovery."""
        self._check_open()
        index = self.replica_of(name)
        if name in self._moving or not self._alive[index]:
            with anyio.CancelScope(shield=True):
                async with self._lock:  # the move or the recovery is done
                    index = self.replica_of(name)
                    if not self._alive[index]:  # placed there as it died: bring it back
                        queue: list[int] = []
                        await self._adopt_all(
                            self._dir(index), {name: self._systems.get(name)}, queue
                        )
                        await self._evacuate(queue)
            index = self.replica_of(name)
        return index

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        """Call a replica; if it died, bring its agents back elsewhere, then raise
        :class:`ReplicaLostError`."""
        self._check_open()
        if not self._alive[index]:
            raise ReplicaLostError(f"replica {index} is gone")
        try:
            return await self._raw(index, method, *args)
        except self._dead:
            raise await self._lost(index, f"{method}()") from None

    async def _lost(self, index: int, during: str) -> ReplicaLostError:
        """Replica ``index`` was found gone during a call: recover it; the error to raise."""
        await self._recover(index)
        return ReplicaLostError(
            f"replica {index} died during {during}; its agents were brought back on the "
            "other replicas from their last saved state: make the request again"
        )

    @property
    def _dead(self) -> tuple[type[BaseException], ...]:
        """What a call to a replica raises when the replica is gone: its process died, or
        its runtime stopped while the process lives on."""
        return (self._ray.exceptions.RayActorError, ReplicaLostError)

    async def _raw(self, index: int, method: str, *args: Any) -> Any:
        ref = getattr(self._handles[index], method).remote(*args)
        try:
            return await anyio.to_thread.run_sync(
                self._ray.get, ref, abandon_on_cancel=True, limiter=self._limiter
            )
        except anyio.get_cancelled_exc_class():
            self._ray.cancel(ref)  # the turn is undone there, as on any cancel
            raise
        except self._ray.exceptions.RayTaskError as exc:
            raise _cause(exc) from None

    async def _get(self, index: int, fetch: Any) -> Any:
        """``fetch()`` on a worker thread (it waits on Ray), with :meth:`_call`'s
        handling of a replica that died and of errors raised there."""
        try:
            try:
                return await anyio.to_thread.run_sync(
                    fetch, abandon_on_cancel=True, limiter=self._limiter
                )
            except self._ray.exceptions.RayTaskError as exc:
                raise _cause(exc) from None  # a replica whose runtime stopped: below
        except self._dead:
            raise await self._lost(index, "a stream") from None

    async def _recover(self, index: int) -> None:
        """Replica ``index`` died: adopt its agents, from its state directory, on the
        others (their last saved turn; what a caller had received was saved first).
        Shielded: a caller's cancel or timeout waits for the agents to be placed."""
        self._check_open()
        with anyio.CancelScope(shield=True):
            async with self._lock:
                queue: list[int] = []
                self._mark_dead(index, queue)
                await self._evacuate(queue)

    def _mark_dead(self, index: int, queue: list[int]) -> None:
        if self._alive[index]:
            self._alive[index] = False
            with contextlib.suppress(Exception):
                self._ray.kill(self._handles[index])
            queue.append(index)

    async def _evacuate(self, queue: list[int]) -> None:
        """Under the lock: adopt the agents of each dead replica in ``queue`` on the
        live ones (a replica found dead meanwhile joins the queue)."""
        while queue:
            index = queue.pop(0)
            lost = {n: self._systems.get(n) for n, where in self._where.items() if where == index}
            log.error("replica.lost", replica=index, agents=len(lost))
            await self._adopt_all(self._dir(index), lost, queue)

    async def _adopt_all(
        self, source: Path, agents: Mapping[str, str | None], queue: list[int]
    ) -> None:
        """Under the lock: adopt ``agents`` from the state directory ``source`` on live
        replicas, then delete them there (one home only). An agent that cannot be
        adopted is lost (logged, and no longer known)."""
        for name, system in agents.items():
            target = None
            while target is None and any(self._alive):
                try:
                    target = await self._place_now(system, queue)
                    await self._raw(target, "adopt", str(source), name)
                except self._dead:
                    if target is not None:
                        self._mark_dead(target, queue)
                    target = None
                except Exception as exc:
                    log.error("agent.lost", agent=name, error=repr(exc))
                    break
            if target is None:
                if not any(self._alive):
                    log.error("agent.lost", agent=name, error="no replica is alive")
                self._where.pop(name, None)
                self._systems.pop(name, None)
                continue
            self._where[name], self._systems[name] = target, system
            await _forget_in(source, name)  # one home only
            log.info("agent.recovered", agent=name, replica=target)

    async def _place_now(self, system: str | None, queue: list[int]) -> int:
        """:meth:`place` for a recovery: replicas that do not answer join ``queue``."""
        while True:
            candidates = self._candidates(system)
            loads = {}
            for i in candidates:
                try:
                    loads[i] = await self._raw(i, "load")
                except self._dead:
                    self._mark_dead(i, queue)
                except Exception as exc:  # a replica that cannot say is not chosen
                    log.error("replica.load_failed", replica=i, error=repr(exc))
            if not loads and any(self._alive[i] for i in candidates):
                # Not a ReplicaLostError: the replicas live, the agent cannot be placed.
                raise RuntimeError("no live replica answered")
            if loads:
                return self._least_busy(loads)


async def _forget_in(directory: Path, name: str) -> None:
    """Delete agent ``name``'s record and cache from a state directory no live runtime
    uses (a dead replica's, or one left by a larger cluster); failures are logged."""
    state = StateDir(directory, persist="turn")
    try:
        await state.delete(name)
        await state.caches().drop(name)
    except Exception as exc:
        log.error("agent.forget_failed", agent=name, directory=str(directory), error=repr(exc))


def _prefix(system: str | None) -> str | None:
    if system is None or len(system) < SHARED_PREFIX_CHARS:
        return None
    return system[:SHARED_PREFIX_CHARS]


def _cause(error: Any) -> BaseException:
    """The error raised in a replica, as it was (Ray wraps it)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


async def _all(calls: Any) -> list[Any]:
    """Await ``calls`` at once; their results in order."""
    from ..actors import gather

    return await gather(*calls)


def _not_sigterm_notice(record: logging.LogRecord) -> bool:
    return "SIGTERM handler is not set" not in record.getMessage()
