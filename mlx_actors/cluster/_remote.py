"""What callers hold of a cluster's agents: :class:`RemoteAgent`, the agent API with each
call made on the agent's replica, and :class:`RemoteTurnStream`, one turn's text as the
replica generates it."""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from ..actors import Message, Reply
from ._placement import Placement
from ._replicas import Replicas


class AgentHome(Protocol):
    """What a handle asks of the cluster that placed its agent (a ``Cluster``)."""

    _placement: Placement
    _replicas: Replicas

    def replica_of(self, name: str) -> int: ...

    async def _home(self, name: str) -> int: ...

    async def _on_agent(self, name: str, method: str, *args: Any) -> Any: ...

    async def _start(
        self, name: str, system: str | None, index: int | None, method: str, *args: Any
    ) -> RemoteAgent: ...


@attrs.frozen(eq=False)
class RemoteAgent:
    """An agent of a ``Cluster``: the agent API, each call made on its replica."""

    cluster: AgentHome
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
        cluster = self.cluster
        index = await cluster._home(self.name)
        system = settings.get("system", cluster._placement.systems.get(self.name))
        return await cluster._start(name, system, index, "fork", self.name, name, settings)

    async def reset(self) -> None:
        await self.cluster._on_agent(self.name, "reset")

    async def close(self) -> None:
        await self.cluster._on_agent(self.name, "close")
        self.cluster._placement.drop(self.name)

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
        index = await cluster._home(self._agent.name)
        method = cluster._replicas.handles[index].stream.options(num_returns="streaming")
        self._generator = method.remote(self._agent.name, self._text, self._settings)
        self._index = index
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._reply is None and self._generator is not None:
            self._agent.cluster._replicas.ray.cancel(self._generator)  # undone there

    def __aiter__(self) -> RemoteTurnStream:
        return self

    async def __anext__(self) -> str:
        if self._reply is not None:
            raise StopAsyncIteration
        if self._generator is None:
            await self.__aenter__()
        cluster = self._agent.cluster

        def next_item() -> Any:
            return cluster._replicas.ray.get(next(self._generator))

        item = await cluster._replicas.get(self._index, next_item)
        if isinstance(item, Reply):
            self._reply = item
            raise StopAsyncIteration
        assert isinstance(item, str)
        return item
