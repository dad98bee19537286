"""A script's entry point: :func:`run` an async ``main`` on asyncio or trio, and end it on
Ctrl-C with one line instead of a traceback (a second Ctrl-C: at once)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from ..errors import InvalidRequestError

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

T = TypeVar("T")

#: The exit status of a process ended by SIGINT, as shells report it (128 + 2).
INTERRUPTED = 130

#: What the first Ctrl-C prints while the script winds down.
STOPPING = "stopping after the current step... (Ctrl-C again to stop at once)"


def run(main: Callable[..., Awaitable[T]], *args: Any, backend: str = "asyncio") -> T:
    """Run ``main(*args)`` with anyio (``backend``: ``"asyncio"`` or ``"trio"``) and
    return its result.

    Ctrl-C cancels ``main``: it prints that the script is stopping, a runtime it
    entered stops after the engine's step in progress (a short one: prefills are
    paced), turns in flight are undone as on any cancel, and the process exits with
    status 130 after printing ``interrupted`` on stderr, with no traceback. A second
    Ctrl-C while it stops ends the process at once (status 130, ``interrupted``): what
    was in flight is lost as if the process were killed, which a state directory is
    written to survive (with ``persist="exit"``, the turns since the last save are
    lost). Other errors propagate as they are.

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
        return anyio.run(_interruptible, main, args, backend=backend)
    except KeyboardInterrupt:
        pass
    except BaseExceptionGroup as group:
        if not _interrupted(group):
            raise
    print("interrupted", file=sys.stderr, flush=True)
    raise SystemExit(INTERRUPTED)


async def _interruptible(main: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    """``main(*args)``, with the event loop's Ctrl-C handling wrapped (see :func:`run`)."""
    previous = _watch_interrupts()
    unwake = _wake_on_signals() if previous is not None else None
    try:
        return await main(*args)
    finally:
        if unwake is not None:
            unwake()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _watch_interrupts() -> Any:
    """Wrap the SIGINT handler the event loop installed: the first Ctrl-C says that the
    script is stopping and goes to the loop (which cancels ``main``); a second ends the
    process at once. Returns the handler it wrapped (``None``: left alone, off the main
    thread or with no Python handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        return None
    seen = 0

    def handler(signum: int, frame: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == 1:
            print(STOPPING, file=sys.stderr, flush=True)
            previous(signum, frame)
            return
        sys.stdout.flush()
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)  # no waiting on threads, no clean-up: the user asked twice

    signal.signal(signal.SIGINT, handler)
    return previous


def _wake_on_signals() -> Callable[[], None] | None:
    """Make a signal wake an asyncio loop that sleeps, as trio's own wake-up does.

    Python runs a signal's handler on the main thread between bytecodes. When the
    kernel hands the signal to another thread (the engine's, MLX's), or just before the
    loop's ``epoll_wait``, nothing interrupts the wait, and the handler waits with it: a
    Ctrl-C went unanswered for as long as the loop slept. A wake-up fd (the one
    ``loop.add_signal_handler`` would set) makes the loop's selector return at once.
    Returns what undoes it (``None``: not asyncio, or a wake-up fd is already set).
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None  # trio: it sets its own wake-up fd
    read, write = socket.socketpair()
    read.setblocking(False)
    write.setblocking(False)
    previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    if previous != -1:  # someone else's, who reads it: leave it to them
        signal.set_wakeup_fd(previous)
        read.close()
        write.close()
        return None
    loop.add_reader(read.fileno(), _drain, read)

    def undo() -> None:
        loop.remove_reader(read.fileno())
        signal.set_wakeup_fd(-1)
        read.close()
        write.close()

    return undo


def _drain(read: socket.socket) -> None:
    """Read the signal numbers the wake-up fd received (the handlers run on their own)."""
    try:
        while read.recv(4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass


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
