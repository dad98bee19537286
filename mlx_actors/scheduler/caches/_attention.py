"""The attention function mlx-lm's models call, with a cache of ours able to attend by
itself: a batch's decode step reads each row from its first position
(:mod:`._decode_kernel`) instead of attending over the padding through a mask.

mlx-lm's models call one function for every attention layer,
``mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values, cache, scale,
mask, sinks)``, imported by name into each model's module. :func:`install` puts
:func:`attention` under that name in the modules a model's layers come from (once per
process; a module's other names are left alone). :func:`attention` asks the layer's cache
first (a cache with an ``attend`` method, :class:`RowStarts`) and otherwise, or when
the cache declines, calls mlx-lm's function unchanged: models and caches that are not ours
compute exactly what they did. Inside :func:`masked` (an engine run with
``decode_kernel=False``) the batch caches decline on that thread: every decoding step then
computes what mlx-lm's ``BatchGenerator`` computes, bit for bit.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from . import _decode_kernel

_MLX_LM_ATTENTION = base.scaled_dot_product_attention
_local = threading.local()


@contextlib.contextmanager
def masked(on: bool = True) -> Iterator[None]:
    """With ``on``, batch caches leave attention to mlx-lm's masked path inside this block
    (on this thread)."""
    before = getattr(_local, "masked", False)
    _local.masked = on
    try:
        yield
    finally:
        _local.masked = before


def attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, unless ``cache`` attends by itself."""
    attend = getattr(cache, "attend", None)
    if attend is not None and sinks is None:
        out: mx.array | None = attend(queries, keys, values, scale)
        if out is not None:
            return out
    return _MLX_LM_ATTENTION(  # type: ignore[no-any-return]
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
    )


def install(model: Any) -> None:
    """Make the modules ``model``'s layers come from call :func:`attention` where they
    call mlx-lm's attention function."""
    for name in {type(module).__module__ for module in model.modules()}:
        namespace = sys.modules.get(name)
        if getattr(namespace, "scaled_dot_product_attention", None) is _MLX_LM_ATTENTION:
            namespace.scaled_dot_product_attention = attention  # type: ignore[union-attr]


def compile_kernels(model: Any, spec: Any) -> None:
    """Compile (and check) the decode kernel for what ``model``'s global layers attend
    with (their dtype, head size and every attention scale the model's attention
    modules hold; on a CUDA GPU, where MLX compiles a custom kernel at its first launch
    in each process)."""
    scales = {
        module.scale
        for module in model.modules()
        if hasattr(module, "q_proj") and isinstance(getattr(module, "scale", None), float)
    }
    global_layers = [x for x in spec.layers if x.window is None and x.quantization is None]
    for layer in {(x.dtype, x.key_dim) for x in global_layers}:
        for scale in scales:
            _decode_kernel.compile_kernel(*layer, scale)


class RowStarts:
    """A batch cache of mlx-lm's bookkeeping (``left_padding``, ``offset``: each row's
    padding and length) whose decode step attends from each row's first position: on a
    CUDA GPU, with MLX's vector-attention arithmetic and no mask (each row's output is
    what MLX's attention gives that row alone); elsewhere mlx-lm's masked attention."""

    left_padding: mx.array
    offset: mx.array
    _right_padding: mx.array | None

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float
    ) -> mx.array | None:
        """The attention of one new token per row, or ``None`` (use mlx-lm's)."""
        if getattr(_local, "masked", False):
            return None
        if self._right_padding is not None or not _decode_kernel.usable(
            queries, keys, values, scale
        ):
            return None
        return _decode_kernel.attend(queries, keys, values, self.left_padding, self.offset, scale)
