"""MLX state that a Python thread's exit would otherwise destroy too late."""

from __future__ import annotations

import threading

import mlx.core as mx


class _ClearStreamsOnExit:
    """Kept in a :class:`threading.local`: Python drops it as its thread finishes, on
    that thread, holding the GIL, before ``Thread.join`` returns."""

    __slots__ = ("_ident",)

    def __init__(self) -> None:
        self._ident = threading.get_ident()

    def __del__(self) -> None:
        if threading.get_ident() == self._ident:  # not when a dead thread's dict is freed
            mx.clear_streams()


_hooks = threading.local()


def clear_streams_when_thread_ends() -> None:
    """Have ``mx.clear_streams()`` run in this thread when it ends (not the main thread).

    MLX keeps each thread's random key, a Python list, in a C++ ``thread_local``; its
    destructor takes the GIL. Left to the end of the OS thread, that destructor runs
    after ``Thread.join`` has returned, so it can meet an interpreter that has begun to
    finalise, and taking the GIL then ends the thread inside a ``noexcept`` destructor:
    the process aborts (``terminate called without an active exception``). Importing
    mlx-lm creates that key in the importing thread (``mlx_lm.sample_utils`` reads
    ``mx.random.state`` at import). ``mx.clear_streams()`` drops the key, the thread's
    streams and compiled graphs while the thread can still do so safely; MLX's exit
    handler does the same for the main thread.
    """
    if threading.current_thread() is threading.main_thread():
        return
    if getattr(_hooks, "clear", None) is None:
        _hooks.clear = _ClearStreamsOnExit()
