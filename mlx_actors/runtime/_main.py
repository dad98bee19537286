"""A script's entry point: :func:`run` an async ``main`` on asyncio or trio, and end it on
Ctrl-C with one line instead of a traceback."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from ..errors import InvalidRequestError

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

T = TypeVar("T")

#: The exit status of a process ended by SIGINT, as shells report it (128 + 2).
INTERRUPTED = 130


def run(main: Callable[..., Awaitable[T]], *args: Any, backend: str = "asyncio") -> T:
    """Run ``main(*args)`` with anyio (``backend``: ``"asyncio"`` or ``"trio"``) and
    return its result.

    Ctrl-C cancels ``main``: a runtime it entered stops after the engine's step in
    progress (a short one: prefills are paced), turns in flight are undone as on any
    cancel, and the process exits with status 130 after printing ``interrupted`` on
    stderr, with no traceback. Other errors propagate as they are.

    Raises:
        InvalidRequestError: an event loop already runs in this thread (a notebook):
            there, ``await main(...)`` directly.
    """
    if _loop_running():
        raise InvalidRequestError(
            "run() starts an event loop, and one already runs in this thread (a notebook "
            "does that): there, await main(...) directly instead"
        )
    try:
        return anyio.run(main, *args, backend=backend)
    except KeyboardInterrupt:
        pass
    except BaseExceptionGroup as group:
        if not _interrupted(group):
            raise
    print("interrupted", file=sys.stderr, flush=True)
    raise SystemExit(INTERRUPTED)


def _loop_running() -> bool:
    """Whether this thread already runs an event loop (asyncio's, or trio's)."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    import trio  # here: a script on asyncio need not import it

    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def _interrupted(error: BaseException) -> bool:
    """Whether ``error`` is a Ctrl-C, alone or in a group with cancellations."""
    if isinstance(error, BaseExceptionGroup):
        leaves = list(_leaves(error))
        return any(isinstance(e, KeyboardInterrupt) for e in leaves) and all(
            isinstance(e, (KeyboardInterrupt, asyncio.CancelledError))
            or (type(e).__module__.startswith("trio") and type(e).__name__ == "Cancelled")
            for e in leaves
        )
    return isinstance(error, KeyboardInterrupt)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for error in group.exceptions:
        out.extend(_leaves(error) if isinstance(error, BaseExceptionGroup) else [error])
    return out
