"""MLX's buffer cache after a prefill chunk: how much of it may stay.

MLX keeps freed buffers to reuse them. A prefill chunk's activations (attention over a
long history, above all) have shapes seldom seen again, so kept they only accumulate:
on a CUDA device, 16 agent sessions grew them to 74 GB, until an allocation failed and
every sequence in flight was dropped. mlx-lm empties the cache after each of its own
prefill chunks; the engine does it for its prefills outside the ``BatchGenerator`` once
the cache holds more than :data:`KEEP_BYTES`.
"""

from __future__ import annotations

import mlx.core as mx

#: Bytes of freed buffers a prefill may leave in MLX's cache (more are released).
KEEP_BYTES = 256 << 20


def release_prefill_buffers() -> None:
    """Empty MLX's buffer cache if it holds more than :data:`KEEP_BYTES`."""
    if mx.get_cache_memory() > KEEP_BYTES:
        mx.clear_cache()
