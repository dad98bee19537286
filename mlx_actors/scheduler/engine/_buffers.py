"""MLX's buffer cache while engines run: how much of it may stay.

MLX keeps freed buffers to reuse them, and reuses one only for a request of about its
size. A prefill chunk's activations (attention over a long history, above all) have
shapes seldom seen again, so kept they only accumulate: on a CUDA device, whose cache
MLX lets grow to the device's memory, 16 agent sessions grew it to 74 GB, until an
allocation failed and every sequence in flight was dropped. While an engine runs, MLX's
cache limit is at most :data:`CACHE_BYTES` (and a sixteenth of MLX's memory limit):
MLX then frees the buffers used longest ago as the cache passes it, and the buffers of
the steps that repeat stay. Emptying the whole cache after each prefill chunk instead,
as mlx-lm does after its own, took 16 ms a chunk on an H100 and made every later step
allocate its buffers again (prefill jobs 47 ms against 28-32 ms a chunk). mlx-lm's
``BatchGenerator`` empties it too, after each chunk of its batch of prompts and every 512
decoding steps: inside an engine's step (:func:`keeping`) that call leaves the cache as it
is (mlx-lm's ``generate`` module is given :data:`mlx.core` with that one function
changed, :class:`_KeptCache`; everywhere else it empties the cache as before).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

#: Most bytes of freed buffers MLX keeps while an engine runs.
CACHE_BYTES = 4 << 30

_lock = threading.Lock()
_holders = 0
_previous = 0
#: Whether this thread runs an engine's step (:func:`keeping`).
_local = threading.local()
_generate: Any = importlib.import_module("mlx_lm.generate")  # the module, not the function


class _KeptCache(types.ModuleType):
    """``mlx.core`` as mlx-lm's ``generate`` module calls it: the same, except that
    ``clear_cache`` leaves MLX's buffer cache as it is on a thread inside :func:`keeping`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    @staticmethod
    def clear_cache() -> None:
        if not getattr(_local, "stepping", False):
            mx.clear_cache()


@contextlib.contextmanager
def keeping() -> Iterator[None]:
    """mlx-lm's ``BatchGenerator`` does not empty MLX's buffer cache inside this block
    (on this thread)."""
    _local.stepping = True
    try:
        yield
    finally:
        _local.stepping = False


def hold() -> None:
    """An engine starts: the first one lowers MLX's cache limit to
    :data:`CACHE_BYTES` (or a sixteenth of its memory limit, or the limit already
    set, whichever is least)."""
    global _holders, _previous
    with _lock:
        if _generate.mx is mx:
            _generate.mx = _KeptCache(mx.__name__)
        if _holders == 0:
            limit = min(CACHE_BYTES, mx.get_memory_limit() // 16)
            _previous = mx.set_cache_limit(limit)
            if _previous < limit:  # a smaller limit was set: it stays
                mx.set_cache_limit(_previous)
        _holders += 1


def release() -> None:
    """An engine closed: the last one puts MLX's cache limit back as it was."""
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0:
            mx.set_cache_limit(_previous)
