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
``mx.dequantize``, which the tests use as the reference. While decoding, a dequantized
copy of the window is kept in step with the ring, so that a step dequantizes one token,
not the window (the copy lives in the batch's working cache only; blocks hold the
packed form).
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


class _Dequantized:
    """What both caches add to their parent: ``update_and_fetch``, and a dequantized copy of
    the ring (the *mirror*) kept in step with it, so that a decoding step dequantizes
    only its new token, not the window. Any change to the ring other than a one-token
    update (a prefill, a move through the batch, a rebuild from blocks: each replaces
    the ring array) makes the next update dequantize the whole ring again."""

    quantization: KVQuantization
    keys: mx.array | None
    values: mx.array | None
    _idx: int
    #: The dequantized ring, and the ring array it mirrors.
    _mirror: tuple[mx.array, mx.array] | None = None
    _source: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        q = self.quantization
        dk, dv, dtype = int(keys.shape[-1]), int(values.shape[-1]), keys.dtype
        pk, pv = quantize_packed(keys, q), quantize_packed(values, q)
        before = self.keys
        shape = None if before is None else tuple(before.shape)
        mirror = self._mirror if before is not None and before is self._source else None
        k, _ = super().update_and_fetch(pk, pv)  # type: ignore[misc]
        assert self.keys is not None and self.values is not None
        n = int(keys.shape[2])
        if mirror is not None and n == 1 and tuple(self.keys.shape) == shape:
            # The update wrote one slot of the ring in place (no growth, no trim).
            mk, mv = mirror
            slot = self._idx - n
            mk[..., slot : slot + n, :] = dequantize_packed(pk, dk, dtype, q)
            mv[..., slot : slot + n, :] = dequantize_packed(pv, dv, dtype, q)
        else:
            mk = dequantize_packed(self.keys, dk, dtype, q)
            mv = dequantize_packed(self.values, dv, dtype, q)
        self._mirror, self._source = (mk, mv), self.keys
        held = int(k.shape[2])  # the parent hands out the ring's first `held` slots
        return mk[..., :held, :], mv[..., :held, :]

    @property
    def nbytes(self) -> int:
        mirror = sum(int(a.nbytes) for a in self._mirror) if self._mirror is not None else 0
        return int(super().nbytes) + mirror  # type: ignore[misc]


class QuantizedMarginRotatingKVCache(_Dequantized, MarginRotatingKVCache):
    """:class:`~._margin.MarginRotatingKVCache` of packed quantized keys and values."""

    def __init__(self, max_size: int, quantization: KVQuantization) -> None:
        super().__init__(max_size)
        self.quantization = quantization

    def empty_like(self) -> QuantizedMarginRotatingKVCache:
        return QuantizedMarginRotatingKVCache(self.max_size, self.quantization)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> QuantizedMarginBatchRotatingKVCache:
        batch = QuantizedMarginBatchRotatingKVCache.merge(caches)
        batch.quantization = caches[0].quantization
        return batch


class QuantizedMarginBatchRotatingKVCache(_Dequantized, MarginBatchRotatingKVCache):
    """:class:`~._margin.MarginBatchRotatingKVCache` of packed quantized keys and values."""

    quantization: KVQuantization

    def _single(self) -> QuantizedMarginRotatingKVCache:
        return QuantizedMarginRotatingKVCache(self.max_size, self.quantization)
