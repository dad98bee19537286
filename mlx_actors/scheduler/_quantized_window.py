"""Quantized sliding-window caches (``kv_bits`` on Gemma 3's sliding-window layers): the
margin rotating caches of :mod:`._margin`, holding each token's keys and values as
``mx.quantize``'s triple packed into one ``uint16`` array, as blocks keep them.

mlx-lm has no quantized rotating cache (``RotatingKVCache.to_quantized`` raises). Here
the ring, its margin, its masks and its moves through a batch (merge, extend, filter,
extract) are the parent classes' own, run on the packed arrays; only
``update_and_fetch`` differs: it quantizes the incoming keys and values (the quantization
mlx-lm's ``QuantizedKVCache`` applies: per token and head, in groups along the head) and
gives the model the ring dequantized, so the layer's attention is mlx-lm's ordinary one,
over the window's keys and values as the quantized cache holds them. The same as
mlx-lm's ``RotatingKVCache`` fed each key and value after ``mx.quantize`` and
``mx.dequantize``, which the tests use as the reference. A window is at most a few
thousand tokens, so dequantizing it at every step costs little beside the layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ._margin import MarginBatchRotatingKVCache, MarginRotatingKVCache
from ._quantized import KVQuantization, pack, unpack


def quantize_packed(x: mx.array, q: KVQuantization) -> mx.array:
    """``x`` quantized as mlx-lm's ``QuantizedKVCache`` does, its triple packed."""
    return pack(mx.quantize(x, group_size=q.group_size, bits=q.bits))


def dequantize_packed(packed: mx.array, dim: int, dtype: mx.Dtype, q: KVQuantization) -> mx.array:
    """What a packed array holds, dequantized to heads of ``dim`` in ``dtype``."""
    data, scales, biases = unpack(packed, dim, dtype, q)
    return mx.dequantize(data, scales, biases, group_size=q.group_size, bits=q.bits)


def _fetch(
    q: KVQuantization, keys: mx.array, values: mx.array, update: Any
) -> tuple[mx.array, mx.array]:
    k, v = update(quantize_packed(keys, q), quantize_packed(values, q))
    return (
        dequantize_packed(k, int(keys.shape[-1]), keys.dtype, q),
        dequantize_packed(v, int(values.shape[-1]), values.dtype, q),
    )


class QuantizedMarginRotatingKVCache(MarginRotatingKVCache):
    """:class:`~._margin.MarginRotatingKVCache` of packed quantized keys and values."""

    def __init__(self, max_size: int, quantization: KVQuantization) -> None:
        super().__init__(max_size)
        self.quantization = quantization

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return _fetch(self.quantization, keys, values, super().update_and_fetch)

    def empty_like(self) -> QuantizedMarginRotatingKVCache:
        return QuantizedMarginRotatingKVCache(self.max_size, self.quantization)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> QuantizedMarginBatchRotatingKVCache:
        batch = QuantizedMarginBatchRotatingKVCache.merge(caches)
        batch.quantization = caches[0].quantization
        return batch


class QuantizedMarginBatchRotatingKVCache(MarginBatchRotatingKVCache):
    """:class:`~._margin.MarginBatchRotatingKVCache` of packed quantized keys and values."""

    quantization: KVQuantization

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return _fetch(self.quantization, keys, values, super().update_and_fetch)

    def _single(self) -> QuantizedMarginRotatingKVCache:
        return QuantizedMarginRotatingKVCache(self.max_size, self.quantization)
