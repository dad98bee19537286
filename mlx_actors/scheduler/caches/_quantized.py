"""Quantized KV caches (``kv_bits``): what a block of one holds, and the caches a
sequence runs on, alone and in the shared batch.

Keys and values are quantized as mlx-lm's ``QuantizedKVCache`` quantizes them
(``mx.quantize`` per token and head, in groups of ``group_size`` along the head): a
triple of packed data (``uint32``), scales and biases (the model's dtype). A block keeps
the triple packed into one ``uint16`` array ``[1, heads, tokens, width]`` (the three
viewed as ``uint16`` side by side), so that blocks stay single arrays that slice,
gather, share and go to disk as unquantized ones do. :class:`BlockQuantizedKVCache` is
mlx-lm's ``QuantizedKVCache`` that can join a batch, and :class:`BatchQuantizedKVCache`
the batched form mlx-lm lacks (its ``BatchGenerator`` stops at ``merge`` otherwise):
left-padded like ``BatchKVCache``, each of the triple's arrays kept in step, so that a
quantized sequence decodes in the same batch as the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, dynamic_roll

from ...errors import InvalidRequestError
from ._keep import as_rows, keep_rows

#: The bits mx.quantize takes for the KV cache, and its group sizes.
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

Triple = tuple[mx.array, mx.array, mx.array]


def quantized_attention_runs() -> bool:
    """Whether mlx-lm's quantized attention (``mx.quantized_matmul`` on the cache's
    triple) runs on the default device. Not on MLX's CUDA backend (0.32.4, measured on an
    H100): for a batch of quantized matrices broadcast over query heads (grouped-query
    attention) it raises "No implementation for problem shape", and for the others it
    returns wrong values (differences of 0.06 to 0.4, and NaN, against dequantizing
    first). There global layers attend over their keys and values dequantized
    (:mod:`._dequantized`), as sliding-window layers always do."""
    return not (mx.default_device() == mx.gpu and mx.cuda.is_available())


@attrs.frozen
class KVQuantization:
    """How the KV cache is quantized: ``bits`` per value, scales and biases per
    ``group_size`` values along a head. ``dequantize``: global layers hand the model
    their keys and values dequantized (:mod:`._dequantized`) instead of the quantized
    triple mlx-lm's quantized attention takes; ``None`` until :meth:`resolved` decides it
    for the default device. Blocks hold the same either way."""

    bits: int
    group_size: int = 64
    dequantize: bool | None = None

    def resolved(self) -> KVQuantization:
        """This, with ``dequantize`` decided where it is ``None``: only where mlx-lm's
        quantized attention cannot run (:func:`quantized_attention_runs`)."""
        if self.dequantize is not None:
            return self
        return attrs.evolve(self, dequantize=not quantized_attention_runs())

    @property
    def attention(self) -> str:
        """How global layers attend, as the start log and the benchmarks say it:
        ``"quantized"`` (mlx-lm's quantized attention) or ``"dequantized"``."""
        return "dequantized" if self.dequantize else "quantized"

    def __attrs_post_init__(self) -> None:
        if type(self.bits) is not int or self.bits not in BITS:
            raise InvalidRequestError(f"kv_bits must be one of {BITS} (or None), got {self.bits!r}")
        if type(self.group_size) is not int or self.group_size not in GROUP_SIZES:
            raise InvalidRequestError(
                f"kv_group_size must be one of {GROUP_SIZES}, got {self.group_size!r}"
            )

    def width(self, dim: int, dtype: mx.Dtype) -> int:
        """``uint16`` values a block keeps per token and head for a head of ``dim``."""
        groups = dim // self.group_size
        return dim * self.bits // 16 + 2 * groups * (dtype.size // 2)

    def check(self, dim: int, where: str) -> None:
        if dim % self.group_size:
            raise InvalidRequestError(
                f"{where}: heads of {dim} cannot be quantized in groups of {self.group_size}; "
                f"choose a kv_group_size that divides {dim}"
            )


def pack(triple: Triple) -> mx.array:
    """The triple side by side as ``uint16`` (a copy)."""
    return mx.concatenate([part.view(mx.uint16) for part in triple], axis=-1)


def unpack(packed: mx.array, dim: int, dtype: mx.Dtype, q: KVQuantization) -> Triple:
    """The triple a packed array holds, each contiguous (a copy)."""
    data = dim * q.bits // 16
    groups = (dim // q.group_size) * (dtype.size // 2)
    parts = (
        (packed[..., :data], mx.uint32),
        (packed[..., data : data + groups], dtype),
        (packed[..., data + groups :], dtype),
    )
    return tuple(mx.contiguous(part).view(kind) for part, kind in parts)  # type: ignore[return-value]


def sliced(triple: Triple, lo: int, hi: int) -> Triple:
    return tuple(part[..., lo:hi, :] for part in triple)  # type: ignore[return-value]


class BlockQuantizedKVCache(QuantizedKVCache):  # type: ignore[misc]
    """mlx-lm's ``QuantizedKVCache`` that ``BatchGenerator`` can merge into a batch."""

    def merge(self, caches: Sequence[BlockQuantizedKVCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache(_BaseCache):  # type: ignore[misc]
    """A batch of quantized caches, left-padded as mlx-lm's ``BatchKVCache`` is, with
    keys and values kept as quantized triples (mlx-lm's attention takes the quantized
    path for a cache that has ``bits``)."""

    step = 256

    def __init__(self, left_padding: list[int], *, bits: int, group_size: int) -> None:
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self.bits, self.group_size = bits, group_size
        self._idx = 0
        self._right_padding: mx.array | None = None

    # -- what the model calls ------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev, n = self._idx, keys.shape[2]
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            steps = (self.step + n - 1) // self.step * self.step

            def grow(old: Triple | None, new: Triple) -> Triple:
                fresh = [mx.zeros((*p.shape[:2], steps, p.shape[3]), p.dtype) for p in new]
                if old is None:
                    return tuple(fresh)  # type: ignore[return-value]
                kept = old if prev % self.step == 0 else sliced(old, 0, prev)
                return tuple(
                    mx.concatenate([a, b], axis=2) for a, b in zip(kept, fresh, strict=True)
                )  # type: ignore[return-value]

            self.keys, self.values = grow(self.keys, qk), grow(self.values, qv)
        assert self.keys is not None and self.values is not None
        self.offset = self.offset + n
        self._idx += n
        for held, new in ((self.keys, qk), (self.values, qv)):
            for part, value in zip(held, new, strict=True):
                part[..., prev : self._idx, :] = value
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        assert self.keys is not None and self.values is not None
        return sliced(self.keys, 0, self._idx), sliced(self.values, 0, self._idx)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    # -- what the BatchGenerator calls ---------------------------------------------------

    def prepare(
        self,
        *,
        left_padding: list[int] | None = None,
        lengths: list[int] | None = None,
        right_padding: list[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            padding = mx.array(left_padding)
            self.left_padding = self.left_padding + padding
            self.offset = self.offset - padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None and self.keys is not None and self.values is not None:
            padding = self._right_padding
            self.keys = tuple(dynamic_roll(p, padding[:, None], axis=2) for p in self.keys)
            self.values = tuple(dynamic_roll(p, padding[:, None], axis=2) for p in self.values)
            self.offset = self.offset - padding
            self.left_padding = self.left_padding + padding
        self._right_padding = None

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    def filter(self, batch_indices: Any) -> None:
        rows = as_rows(batch_indices)
        if self.keys is not None and self.values is not None:
            self.keys = tuple(keep_rows(p, rows) for p in self.keys)  # type: ignore[assignment]
            self.values = tuple(keep_rows(p, rows) for p in self.values)  # type: ignore[assignment]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = int(self.left_padding.min().item())  # type: ignore[arg-type]
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys = sliced(self.keys, shift, self.keys[0].shape[2])
                self.values = sliced(self.values, shift, self.values[0].shape[2])
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other
        assert like.keys is not None and like.values is not None

        def pad(c: BatchQuantizedKVCache) -> tuple[Triple, Triple, mx.array, mx.array]:
            batch = c.offset.shape[0]
            left = idx - c._idx
            out = []
            for held, model in ((c.keys, like.keys), (c.values, like.values)):
                assert model is not None
                parts = held or tuple(
                    mx.zeros((batch, m.shape[1], 0, m.shape[3]), m.dtype) for m in model
                )
                right = size - parts[0].shape[2] - left
                padded = []
                for p in parts:
                    if right < 0:
                        p = p[..., :right, :]
                    widths = [(0, 0), (0, 0), (left, max(right, 0)), (0, 0)]
                    padded.append(mx.pad(p, widths) if left or right > 0 else p)
                out.append(tuple(padded))
            return out[0], out[1], c.offset, c.left_padding + left  # type: ignore[return-value]

        a, b = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([x, y]) for x, y in zip(a[0], b[0], strict=True))  # type: ignore[assignment]
        self.values = tuple(mx.concatenate([x, y]) for x, y in zip(a[1], b[1], strict=True))  # type: ignore[assignment]
        self.offset = mx.concatenate([a[2], b[2]])
        self.left_padding = mx.concatenate([a[3], b[3]])
        self._idx = idx

    def extract(self, idx: int) -> BlockQuantizedKVCache:
        assert self.keys is not None and self.values is not None
        padding = int(self.left_padding[idx].item())  # type: ignore[arg-type]
        cache = BlockQuantizedKVCache(group_size=self.group_size, bits=self.bits)
        cache.keys = tuple(
            mx.contiguous(p[idx : idx + 1, :, padding : self._idx]) for p in self.keys
        )
        cache.values = tuple(
            mx.contiguous(p[idx : idx + 1, :, padding : self._idx]) for p in self.values
        )
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        cache = cls([longest - n for n in lengths], bits=first.bits, group_size=first.group_size)
        if longest == 0:
            return cache
        filled = next(c for c in caches if c.keys is not None)

        def merged(which: str) -> Triple:
            model: Triple = getattr(filled, which)
            out = [mx.zeros((len(caches), m.shape[1], longest, m.shape[3]), m.dtype) for m in model]
            for i, c in enumerate(caches):
                held = getattr(c, which)
                if held is None or c.offset == 0:
                    continue
                pad = longest - c.offset
                for part, src in zip(out, held, strict=True):
                    part[i : i + 1, :, pad : pad + c.offset] = src[..., : c.offset, :]
            return tuple(out)  # type: ignore[return-value]

        cache.keys, cache.values = merged("keys"), merged("values")
        cache.offset = cache.offset + longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for held in (self.keys, self.values) if held for p in held)
