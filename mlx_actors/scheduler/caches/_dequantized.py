"""Caches that hold quantized keys and values packed, as blocks keep them, and hand the
model them dequantized, so that the layer's attention is mlx-lm's ordinary one.

Two layers need it:

- Sliding-window layers (Gemma 3), always: mlx-lm has no quantized rotating cache
  (``RotatingKVCache.to_quantized`` raises). :class:`QuantizedMarginRotatingKVCache` and
  its batched form are the margin rotating caches of :mod:`._margin` run on the packed
  arrays: the ring, its margin, its masks and its moves through a batch (merge, extend,
  filter, extract) are the parent classes' own.
- Global layers where mlx-lm's quantized attention cannot run: on MLX's CUDA backend
  (0.32), ``mx.quantized_matmul`` raises for the shapes it takes there and returns wrong
  values for others (see :func:`~._quantized.quantized_attention_runs`).
  :class:`DequantizedKVCache` and :class:`DequantizedBatchKVCache` are mlx-lm's
  ``KVCache`` and ``BatchKVCache`` on packed arrays.

Only ``update_and_fetch`` differs from the parents': it quantizes the incoming keys and
values (the quantization mlx-lm's ``QuantizedKVCache`` applies: per token and head, in
groups along the head) and gives the model what the cache holds, dequantized. The same
as mlx-lm's cache of the layer fed each key and value after ``mx.quantize`` and
``mx.dequantize``, which the tests use as the reference. While decoding, a dequantized
copy of what the cache holds is kept in step with it, so that a step dequantizes one
token, not the history (the copy lives in working caches only, the batch's and the one
the engine keeps for an agent's next turn; blocks hold the packed form). The
conversions are :mod:`._quantize_kernels`' (one kernel launch for keys and values on a
CUDA GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ._margin import MarginBatchRotatingKVCache, MarginRotatingKVCache
from ._quantize_kernels import dequantize_pair, quantize_step
from ._quantized import KVQuantization


class _Dequantized:
    """What every cache here adds to its parent: ``update_and_fetch``, and a dequantized
    copy of its arrays (the *mirror*) kept in step with them, so that a decoding step
    dequantizes only its new token. Any change to the arrays other than a one-token
    update in place (a prefill, growth, a move through the batch, a rebuild from
    blocks: each replaces the array) makes the next update dequantize them whole."""

    quantization: KVQuantization
    keys: mx.array | None
    values: mx.array | None
    _idx: int
    #: The dequantized arrays, and the keys array they mirror.
    _mirror: tuple[mx.array, mx.array] | None = None
    _source: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        q = self.quantization
        dk, dv, dtype = int(keys.shape[-1]), int(values.shape[-1]), keys.dtype
        n = int(keys.shape[2])
        pk, pv, new_k, new_v = quantize_step(keys, values, q)
        before = self.keys
        shape = None if before is None else tuple(before.shape)
        mirror = self._mirror if before is not None and before is self._source else None
        k, _ = super().update_and_fetch(pk, pv)  # type: ignore[misc]
        assert self.keys is not None and self.values is not None
        if mirror is not None and n == 1 and tuple(self.keys.shape) == shape:
            # The update wrote one slot in place (no growth, no trim).
            mk, mv = mirror
            slot = self._end() - n
            mk[..., slot : slot + n, :] = new_k  # as the packed copy
            mv[..., slot : slot + n, :] = new_v
        else:
            mk, mv = dequantize_pair(self.keys, self.values, dk, dv, dtype, q)
        self._mirror, self._source = (mk, mv), self.keys
        held = int(k.shape[2])  # the parent hands out the first `held` slots
        return mk[..., :held, :], mv[..., :held, :]

    def _end(self) -> int:
        """The slot after the last one the parent's update wrote."""
        return self._idx

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


class DequantizedKVCache(_Dequantized, KVCache):  # type: ignore[misc]
    """mlx-lm's ``KVCache`` of packed quantized keys and values."""

    def __init__(self, quantization: KVQuantization) -> None:
        super().__init__()
        self.quantization = quantization

    def _end(self) -> int:
        return int(self.offset)

    def empty_like(self) -> DequantizedKVCache:
        return DequantizedKVCache(self.quantization)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> DequantizedBatchKVCache:
        return DequantizedBatchKVCache.merge(caches)


class DequantizedBatchKVCache(_Dequantized, BatchKVCache):  # type: ignore[misc]
    """mlx-lm's ``BatchKVCache`` of packed quantized keys and values."""

    quantization: KVQuantization

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> DequantizedBatchKVCache:
        if all(c.size() == 0 for c in caches):  # mlx-lm's would be a plain BatchKVCache
            batch = cls([0] * len(caches))
        else:
            batch = super().merge(caches)
        batch.quantization = caches[0].quantization
        return batch

    def extract(self, idx: int) -> DequantizedKVCache:
        plain = super().extract(idx)
        cache = DequantizedKVCache(self.quantization)
        cache.keys, cache.values, cache.offset = plain.keys, plain.values, plain.offset
        return cache
