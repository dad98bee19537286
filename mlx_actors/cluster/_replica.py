"""One replica of a cluster: a normal :class:`~mlx_actors.Runtime` (its model copy, its
pool, its state directory) inside a Ray actor process, answering the cluster's calls.

Ray runs an async actor's methods as tasks of one asyncio loop; the runtime is entered
and left by one long-lived task of that loop (an anyio task group must be left by the
task that entered it), and the methods call its agents from their own tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..actors import Reply
from ..errors import ReplicaLostError
from ..runtime import Runtime, RuntimeStatistics


class Replica:
    """The body of a replica's Ray actor (wrapped with ``ray.remote`` by the cluster)."""

    def __init__(
        self, index: int, model: str | None, state_dir: str, options: dict[str, Any]
    ) -> None:
        self.index, self.model, self.state_dir, self.options = index, model, state_dir, options
        self._rt: Runtime | None = None
        self._error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    async def start(self) -> dict[str, str | None]:
        """Enter the runtime; return the agents its state directory brought back, with
        their system prompts (for placement)."""
        ready, self._stop = asyncio.Event(), asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._main(ready))
        await ready.wait()
        if self._error is not None:
            raise self._error
        assert self._rt is not None
        return {name: agent.system for name, agent in self._rt.agents.items()}

    async def _main(self, ready: asyncio.Event) -> None:
        assert self._stop is not None
        try:
            async with Runtime(self.model, state_dir=self.state_dir, **self.options) as rt:
                self._rt = rt
                ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._error = exc
        finally:
            self._rt = None
            ready.set()

    async def stop(self) -> None:
        """Leave the runtime (every agent saved, as any runtime leaves)."""
        if self._stop is not None and self._task is not None:
            self._stop.set()
            await self._task

    def _runtime(self) -> Runtime:
        if self._rt is None:
            # The cluster takes this as the replica's death and brings its agents back.
            raise ReplicaLostError(
                f"replica {self.index}'s runtime is not running"
            ) from self._error
        return self._rt

    # -- the agent API, by name -------------------------------------------------------------

    async def spawn(self, name: str, kwargs: dict[str, Any]) -> None:
        await self._runtime().spawn(name, **kwargs)

    async def ask(self, name: str, text: str, kwargs: dict[str, Any]) -> Reply:
        return await self._runtime().agent(name).ask(text, **kwargs)

    async def stream(
        self, name: str, text: str, kwargs: dict[str, Any]
    ) -> AsyncIterator[str | Reply]:
        """The turn's text pieces, then its :class:`Reply` (a Ray streaming generator:
        the cluster reads each item as it is yielded)."""
        async with self._runtime().agent(name).stream(text, **kwargs) as pieces:
            async for piece in pieces:
                yield piece
        yield pieces.reply

    async def tell(self, name: str, text: str, kwargs: dict[str, Any]) -> None:
        await self._runtime().agent(name).tell(text, **kwargs)

    async def fork(self, name: str, child: str, kwargs: dict[str, Any]) -> None:
        await self._runtime().agent(name).fork(child, **kwargs)

    async def reset(self, name: str) -> None:
        await self._runtime().agent(name).reset()

    async def close(self, name: str) -> None:
        await self._runtime().agent(name).close()

    async def history(self, name: str) -> tuple[Any, ...]:
        return self._runtime().agent(name).history

    async def stats(self) -> RuntimeStatistics:
        return await self._runtime().stats()

    async def load(self) -> tuple[int, int, int]:
        """How busy the replica is: blocks resident, turns in flight, live agents."""
        rt = self._runtime()
        stats = await rt.stats()
        return stats.pool.used_blocks, stats.turns_in_flight, len(rt.agents)

    # -- moving agents --------------------------------------------------------------------

    async def detach(self, name: str) -> None:
        await self._runtime().detach(name)

    async def reattach(self, name: str) -> None:
        await self._runtime().reattach(name)

    async def forget_detached(self, name: str) -> None:
        await self._runtime().forget_detached(name)

    async def adopt(self, source: str, name: str) -> str | None:
        """Take agent ``name`` from another replica's state directory; its system prompt."""
        return (await self._runtime().adopt(Path(source), name)).system
