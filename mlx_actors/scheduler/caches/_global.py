"""The cache of a global (full-attention) layer and its batched form: mlx-lm's ``KVCache``
and ``BatchKVCache``, whose copies are made one layer at a time. The batch holds its
rows' tokens in it (all of them, or with ``paged_batch`` those after the histories:
:mod:`._paged`).

The batch cache changes shape by copying. It grows by a block of every row when its room
runs out (a new array, the old one still alive), and a sequence joining or leaving the
batch makes new arrays of every row (``extend``, ``filter``), as rolling rows whose
prompts were right-padded does (``finalize``). mlx-lm builds these copies
lazily, inside the step that runs the model: every layer's old and new arrays are then
alive at once, and for that moment the batch's cache is held twice. Here each copy is
evaluated as soon as it is made, so the old array of a layer is freed before the next
layer is copied: at most one layer's copy is held beside the cache. A finished
sequence's cache is handed out as a view of its row (cutting blocks from it copies only
what the blocks do not hold yet), copied only if the batch goes on without it. The
values, the shapes and so the model's computation are mlx-lm's own. (A batch mlx-lm
splits in two is not deep-copied first: each half copies only its own rows.) On a CUDA
GPU a decode step's attention reads each row from its first position, with no padding mask
(:mod:`._attention`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ._attention import RowStarts
from ._keep import as_rows, keep_rows


class GlobalKVCache(KVCache):  # type: ignore[misc]
    """mlx-lm's ``KVCache``, batched as :class:`GlobalBatchKVCache`."""

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> GlobalBatchKVCache:
        return GlobalBatchKVCache.merge(caches)


class GlobalBatchKVCache(RowStarts, BatchKVCache):  # type: ignore[misc]
    """mlx-lm's ``BatchKVCache``, each copy of its arrays evaluated when it is made; a
    decode step attends from each row's first position (:class:`~._attention.RowStarts`)."""

    keys: mx.array | None
    values: mx.array | None
    offset: mx.array
    left_padding: mx.array

    def __init__(self, left_padding: list[int]) -> None:
        super().__init__(left_padding)
        #: Finished rows handed out as views since the last :meth:`filter`.
        self._extracted: list[KVCache] = []
        #: ``left_padding`` as a list, until it changes (reading it waits for the device).
        self._padding: list[int] | None = list(left_padding)

    def padding(self) -> list[int]:
        """Each row's left padding (read from the device once per change)."""
        if self._padding is None:
            self._padding = as_rows(self.left_padding)
        return self._padding

    def __deepcopy__(self, memo: dict[int, Any]) -> GlobalBatchKVCache:
        """A copy that shares the arrays' data (mlx-lm deep-copies a batch to split it,
        then filters both halves: each half's rows are copied by its own filter)."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        if self.keys is not None and self.values is not None:  # new arrays, same data
            copy.keys, copy.values = self.keys[...], self.values[...]
        copy._extracted = []
        copy.left_padding, copy.offset = self.left_padding[...], self.offset[...]
        return copy

    def _settle(self) -> None:
        if self.keys is not None:
            mx.eval(self.keys, self.values)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is not None and self._idx + keys.shape[2] > self.keys.shape[2]:
            self._grow(keys.shape[2])
        return super().update_and_fetch(keys, values)  # type: ignore[no-any-return]

    def _grow(self, tokens: int) -> None:
        """Room for ``tokens`` more, as mlx-lm's ``update_and_fetch`` makes it."""
        assert self.keys is not None and self.values is not None
        prev, step = self._idx, self.step
        batch, heads, _, key_dim = self.keys.shape
        blocks = (step + tokens - 1) // step
        old_k, old_v = self.keys, self.values
        if prev % step:
            old_k, old_v = old_k[..., :prev, :], old_v[..., :prev, :]
        room_k = mx.zeros((batch, heads, blocks * step, key_dim), old_k.dtype)
        room_v = mx.zeros((batch, heads, blocks * step, self.values.shape[3]), old_v.dtype)
        self.keys = mx.concatenate([old_k, room_k], axis=2)
        self.values = mx.concatenate([old_v, room_v], axis=2)
        self._settle()

    def prepare(self, **kwargs: Any) -> None:
        super().prepare(**kwargs)
        self._padding = None

    def finalize(self) -> None:
        super().finalize()  # rolls right-padded rows: a copy
        self._padding = None
        self._settle()

    def extend(self, other: Any) -> None:
        super().extend(other)
        self._padding = None
        self._settle()

    def extract(self, idx: int) -> KVCache:
        """Row ``idx``'s cache, as a view of the batch's arrays (see the module)."""
        assert self.keys is not None and self.values is not None
        padding = self.padding()[idx]
        cache = KVCache()
        cache.keys = self.keys[idx : idx + 1, :, padding : self._idx]
        cache.values = self.values[idx : idx + 1, :, padding : self._idx]
        cache.offset = self._idx - padding
        self._extracted.append(cache)
        return cache

    def filter(self, batch_indices: Any) -> None:
        """Keep rows ``batch_indices``, as mlx-lm's ``filter`` does: the padding every
        row kept has is dropped. The rows are copied a run of consecutive rows at a
        time (:func:`._keep.keep_rows`); none when all stay in order (the half of a
        split that keeps them all)."""
        for cache in self._extracted:  # their rows copied, the old arrays can go
            cache.keys, cache.values = mx.contiguous(cache.keys), mx.contiguous(cache.values)
        mx.eval([(c.keys, c.values) for c in self._extracted])
        self._extracted = []
        rows = as_rows(batch_indices)
        if not rows:
            super().filter(batch_indices)
            self._padding = None
            return
        kept = [self.padding()[i] for i in rows]
        shift = min(kept)  # the padding every row kept has
        if self.keys is not None and self.values is not None:
            self.keys = keep_rows(self.keys, rows, shift)
            self.values = keep_rows(self.values, rows, shift)
            self._settle()
        index = mx.array(rows)
        self.offset = self.offset[index]
        self.left_padding = self.left_padding[index] - shift
        self._idx -= shift
        self._padding = [p - shift for p in kept]

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> GlobalBatchKVCache:
        """The caches left-padded into one, as mlx-lm's ``merge``, with a block of room
        (mlx-lm's first update would grow it by copying). One layer's copy, evaluated:
        the caches merged are spent (their arrays dropped, so freed as it goes). A
        single cache with room for a token (a prefill job's, joining the batch) is
        not copied: the batch of one takes its arrays."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:  # mlx-lm's would be a plain BatchKVCache
            return cls([0] * len(caches))
        (alone,) = caches if len(caches) == 1 else (None,)
        if alone is not None and alone.keys.shape[2] > alone.offset:  # room for a token
            batch = cls([0])  # a batch of one: its arrays as they are, no copy
            batch.keys, batch.values = alone.keys, alone.values
            batch.offset += alone.offset
            batch._idx = alone.offset
            alone.keys = alone.values = None
            return batch
        padding = [longest - n for n in lengths]
        first = next(c for c in caches if c.keys is not None)
        _, heads, _, key_dim = first.keys.shape
        capacity = (longest // cls.step + 1) * cls.step
        keys = mx.zeros((len(caches), heads, capacity, key_dim), first.keys.dtype)
        values = mx.zeros((len(caches), heads, capacity, first.values.shape[3]), first.values.dtype)
        for i, (pad, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is not None:
                keys[i : i + 1, :, pad:longest] = c.keys[..., : c.offset, :]
                values[i : i + 1, :, pad:longest] = c.values[..., : c.offset, :]
        batch = cls(padding)
        batch.keys, batch.values = keys, values
        batch.offset += longest
        batch._idx = longest
        batch._settle()
        for c in caches:
            c.keys = c.values = None
        return batch
