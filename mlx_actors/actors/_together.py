"""Several agents at once: :func:`gather` runs asks (or any awaitables) concurrently, on
asyncio or trio, and gives their results in order."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


async def gather(*asks: Awaitable[T]) -> list[T]:
    """Await ``asks`` concurrently and return their results in the order given::

        replies = await gather(alice.ask("Pros?"), bob.ask("Cons?"), carol.ask("Verdict?"))

    Turns of different agents share the engine's batches. If one fails, the others are
    cancelled (each agent is left as it was before its turn) and that first error is
    raised as it is, not wrapped in a group.
    """
    results: list[Any] = [None] * len(asks)
    errors: list[BaseException] = []

    async def run(index: int, ask: Awaitable[T], tg: anyio.abc.TaskGroup) -> None:
        try:
            results[index] = await ask
        except Exception as exc:
            errors.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for index, ask in enumerate(asks):
            tg.start_soon(run, index, ask, tg)
    if errors:
        raise errors[0]
    return results
