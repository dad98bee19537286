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

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import attrs

from ..actors import Message, Reply
from ..errors import InvalidRequestError, ReplicaLostError, UnknownAgentError
from ..runtime import RuntimeStatistics
from ..runtime._state import StateDir
from ..runtime._trace import ModuleLog
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
        self._where: dict[str, int] = {}
        self._systems: dict[str, str | None] = {}
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
        try:
            found = await _all(self._raw(i, "start") for i in range(self._count))
        except BaseException:
            await self._shutdown()
            raise
        for index, agents in enumerate(found):
            for name, system in agents.items():
                self._where[name], self._systems[name] = index, system
        log.info("cluster.started", replicas=self._count, agents=len(self._where))
        return self

    def _init_ray(self) -> None:
        self._ray.init(
            address=self._address,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self._shutdown()

    async def _shutdown(self) -> None:
        for index, alive in enumerate(self._alive):
            if alive:
                try:
                    await self._raw(index, "stop")
                except Exception as exc:  # a replica that cannot stop still goes
                    log.error("replica.stop_failed", replica=index, error=repr(exc))
        for handle in self._handles:
            self._ray.kill(handle)
        self._handles, self._alive = [], []
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
        arguments; tools run in the replica's process, so they must pickle)."""
        index = await self.place(kwargs.get("system"))
        await self._call(index, "spawn", name, kwargs)
        self._where[name], self._systems[name] = index, kwargs.get("system")
        return RemoteAgent(self, name)

    def agent(self, name: str) -> RemoteAgent:
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
        alive = [i for i, ok in enumerate(self._alive) if ok]
        if not alive:
            raise ReplicaLostError("no replica of the cluster is alive")
        key = _prefix(system)
        if key is not None:
            beside = {self._where[n] for n, s in self._systems.items() if _prefix(s) == key} & set(
                alive
            )
            if beside:
                alive = sorted(beside)
        loads = await _all(self._call(i, "load") for i in alive)
        # Fewest turns in flight, then fewest blocks resident, then fewest agents.
        busy = {i: (load[1], load[0], load[2]) for i, load in zip(alive, loads, strict=True)}
        return min(alive, key=busy.__getitem__)

    async def move(self, name: str, replica: int) -> None:
        """Move agent ``name`` to ``replica`` through its saved state (exactly: its
        conversation and cache come along; its next turn prefills only new tokens)."""
        source = self.replica_of(name)
        if replica == source:
            return
        if not (0 <= replica < len(self._alive) and self._alive[replica]):
            raise InvalidRequestError(f"replica {replica} is not a live replica")
        await self._call(source, "detach", name)
        await self._call(replica, "adopt", str(self._dir(source)), name)
        self._where[name] = replica
        await self._call(source, "forget_detached", name)
        log.info("agent.moved", agent=name, source=source, replica=replica)

    async def stats(self) -> ClusterStatistics:
        alive = [i for i, ok in enumerate(self._alive) if ok]
        stats = await _all(self._call(i, "stats") for i in alive)
        replicas = dict(zip(alive, stats, strict=True))
        return ClusterStatistics(replicas=replicas, placement=dict(self._where))

    # -- calls ------------------------------------------------------------------------------

    async def _on_agent(self, name: str, method: str, *args: Any) -> Any:
        return await self._call(self.replica_of(name), method, name, *args)

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        """Call a replica; if it died, bring its agents back elsewhere, then raise
        :class:`ReplicaLostError`."""
        if not self._alive[index]:
            raise ReplicaLostError(f"replica {index} is gone")
        try:
            return await self._raw(index, method, *args)
        except self._ray.exceptions.RayActorError:
            await self._recover(index)
            raise ReplicaLostError(
                f"replica {index} died during {method}(); its agents were brought back on "
                "the other replicas from their last saved state: make the request again"
            ) from None

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
            return await anyio.to_thread.run_sync(
                fetch, abandon_on_cancel=True, limiter=self._limiter
            )
        except self._ray.exceptions.RayTaskError as exc:
            raise _cause(exc) from None
        except self._ray.exceptions.RayActorError:
            await self._recover(index)
            raise ReplicaLostError(
                f"replica {index} died during a stream; its agents were brought back on "
                "the other replicas from their last saved state: make the request again"
            ) from None

    async def _recover(self, index: int) -> None:
        """Replica ``index`` died: adopt its agents, from its state directory, on the
        others (their last saved turn; what a caller had received was saved first)."""
        async with self._lock:
            if not self._alive[index]:
                return
            self._alive[index] = False
            self._ray.kill(self._handles[index])
            lost = [name for name, where in self._where.items() if where == index]
            log.error("replica.lost", replica=index, agents=len(lost))
            dead = StateDir(self._dir(index), persist="turn")
            for name in lost:
                del self._where[name]
                try:
                    target = await self.place(self._systems.get(name))
                    await self._raw(target, "adopt", str(self._dir(index)), name)
                except Exception as exc:
                    log.error("agent.lost", agent=name, error=repr(exc))
                    continue
                self._where[name] = target
                await dead.delete(name)  # one home only; its orphan cache goes at a start
                log.info("agent.recovered", agent=name, replica=target)


@attrs.frozen(eq=False)
class RemoteAgent:
    """An agent of a :class:`Cluster`: the agent API, each call made on its replica."""

    cluster: Cluster
    name: str

    @property
    def replica(self) -> int:
        """The replica it lives on now."""
        return self.cluster.replica_of(self.name)

    async def ask(self, text: str, **settings: Any) -> Reply:
        """As :meth:`Agent.ask`; :class:`ReplicaLostError` if its replica died meanwhile
        (the agent is then back elsewhere, as it was before the turn)."""
        reply: Reply = await self.cluster._on_agent(self.name, "ask", text, settings)
        return reply

    def stream(self, text: str, **settings: Any) -> RemoteTurnStream:
        """As :meth:`Agent.stream`: ``async with agent.stream(text) as pieces``, each
        piece as the replica generates it, then ``pieces.reply``."""
        return RemoteTurnStream(self, text, settings)

    async def tell(self, text: str, **settings: Any) -> None:
        await self.cluster._on_agent(self.name, "tell", text, settings)

    async def fork(self, name: str, **settings: Any) -> RemoteAgent:
        """A fork on the same replica (it shares the parent's cache blocks)."""
        index = self.replica
        await self.cluster._call(index, "fork", self.name, name, settings)
        self.cluster._where[name] = index
        self.cluster._systems[name] = self.cluster._systems.get(self.name)
        return RemoteAgent(self.cluster, name)

    async def reset(self) -> None:
        await self.cluster._on_agent(self.name, "reset")

    async def close(self) -> None:
        await self.cluster._on_agent(self.name, "close")
        self.cluster._where.pop(self.name, None)
        self.cluster._systems.pop(self.name, None)

    async def history(self) -> tuple[Message, ...]:
        history: tuple[Message, ...] = await self.cluster._on_agent(self.name, "history")
        return history


class RemoteTurnStream:
    """The text of one turn of a :class:`RemoteAgent`, as its replica generates it (a
    Ray streaming generator). Leaving the ``async with`` block early cancels the turn
    there; the agent is left as it was before it."""

    def __init__(self, agent: RemoteAgent, text: str, settings: dict[str, Any]) -> None:
        self._agent, self._text, self._settings = agent, text, settings
        self._generator: Any = None
        self._reply: Reply | None = None

    @property
    def reply(self) -> Reply:
        if self._reply is None:
            raise RuntimeError("the turn has not finished: read the stream to its end first")
        return self._reply

    async def __aenter__(self) -> RemoteTurnStream:
        cluster = self._agent.cluster
        index = cluster.replica_of(self._agent.name)
        method = cluster._handles[index].stream.options(num_returns="streaming")
        self._generator = method.remote(self._agent.name, self._text, self._settings)
        self._index = index
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._reply is None and self._generator is not None:
            self._agent.cluster._ray.cancel(self._generator)  # undone there

    def __aiter__(self) -> RemoteTurnStream:
        return self

    async def __anext__(self) -> str:
        if self._reply is not None:
            raise StopAsyncIteration
        if self._generator is None:
            await self.__aenter__()
        cluster = self._agent.cluster

        def next_item() -> Any:
            return cluster._ray.get(next(self._generator))

        item = await cluster._get(self._index, next_item)
        if isinstance(item, Reply):
            self._reply = item
            raise StopAsyncIteration
        assert isinstance(item, str)
        return item


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
