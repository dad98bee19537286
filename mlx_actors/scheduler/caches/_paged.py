"""The cache of a global (full-attention) layer in the batch, over the pool's blocks: a
sequence's history is read where it lies, never copied into the batch.

mlx-lm's ``BatchKVCache`` holds every row's whole history in one left-padded array per
layer: a second copy of what the pool's blocks hold, padded to the longest row. Here a row
is its history's *pieces* (the blocks' arrays and the positions wanted, as the gather
takes them, :data:`~._gather.Part`) followed by its *recent* tokens: those the turn
added (its prompt, its reply), held in a batch cache of their own
(:class:`~._global.GlobalBatchKVCache`, mlx-lm's layout). Each time the model asks a layer
for its keys and values, that layer's rows are put together (zeros for the padding, the
pieces, the recent tokens) into exactly the array ``BatchKVCache`` would return: same
shape, same positions, the same values where the mask lets attention look, so the
model computes what it computes on mlx-lm's cache. The array lives only while the layer's
attention runs: at most a layer of the batch is copied at a time.

The batch's shape follows mlx-lm's bookkeeping (``_idx``, ``offset``, ``left_padding``)
through ``merge``, ``prepare``/``finalize`` (a right-padded prompt), ``extend``,
``filter`` and ``extract``, so ``BatchGenerator`` moves sequences in and out as it does
its own caches. A sequence's cache before it joins, and after it leaves, is a
:class:`PagedKVCache`: pieces and a tail, sliced (when cut into blocks) without
copying what the pieces hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from ._gather import Part
from ._global import GlobalBatchKVCache, GlobalKVCache
from ._keep import as_rows
from ._rows import Row, assemble


def _length(parts: Sequence[Part]) -> int:
    return sum(z - a for _, _, a, z in parts)


class PagedArray:
    """A sequence's keys (or values) of one layer, ``[1, heads, tokens, dim]``: pieces of
    blocks then a tail array. Slicing along the tokens copies only what is asked for."""

    def __init__(self, parts: Sequence[Part], tail: mx.array | None) -> None:
        self.parts, self.tail = tuple(parts), tail
        first = parts[0][0] if parts else tail
        assert first is not None
        tokens = _length(parts) + (int(tail.shape[2]) if tail is not None else 0)
        self.shape = (1, int(first.shape[1]), tokens, int(first.shape[3]))

    def __getitem__(self, index: Any) -> mx.array:
        """``[..., lo:hi, :]`` (the form plan_cut slices with)."""
        ellipsis, span, rest = index
        assert ellipsis is Ellipsis and rest == slice(None) and span.step is None
        lo, hi, _ = span.indices(self.shape[2])
        pieces: list[mx.array] = []
        at = 0
        for arr, start, a, z in self.parts:
            n = z - a
            if at < hi and at + n > lo:
                x, y = max(lo, at) - at + a - start, min(hi, at + n) - at + a - start
                pieces.append(arr[..., x:y, :])
            at += n
        if self.tail is not None and hi > at:
            pieces.append(self.tail[..., max(lo, at) - at : hi - at, :])
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


class PagedKVCache:
    """A sequence's cache of a global layer, outside the batch: its first ``history``
    tokens as pieces of blocks (not copied), then ``tail`` (a dense cache of the tokens
    after them, or ``None``). It joins the batch as a :class:`PagedBatchKVCache` row, and
    leaves it in the same form; it does not run the model itself."""

    def __init__(
        self,
        parts_k: Sequence[Part],
        parts_v: Sequence[Part],
        tail: GlobalKVCache | None = None,
    ) -> None:
        self.parts_k, self.parts_v = tuple(parts_k), tuple(parts_v)
        self.history = _length(parts_k)
        self.tail = tail
        self.offset = self.history + (tail.offset if tail is not None else 0)

    def _tail(self, which: str) -> mx.array | None:
        if self.tail is None or self.tail.offset == 0:
            return None
        arr = getattr(self.tail, which)
        return arr[..., : self.tail.offset, :]  # type: ignore[no-any-return]

    @property
    def keys(self) -> PagedArray | None:
        if not self.offset:
            return None
        return PagedArray(self.parts_k, self._tail("keys"))

    @property
    def values(self) -> PagedArray | None:
        if not self.offset:
            return None
        return PagedArray(self.parts_v, self._tail("values"))

    @property
    def state(self) -> tuple[Any, ...]:
        return () if self.tail is None else (self.tail.keys, self.tail.values)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes of its own (the tail's): the pieces are the pool's."""
        return self.tail.nbytes if self.tail is not None else 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        raise TypeError("a paged cache runs the model only as a row of the batch")

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> PagedBatchKVCache:
        return PagedBatchKVCache.merge(caches)


class PagedBatchKVCache(BatchKVCache):  # type: ignore[misc]
    """mlx-lm's ``BatchKVCache``, its rows' histories read from the pool's blocks (see
    the module). ``recent`` holds the tokens after each row's history."""

    offset: mx.array
    left_padding: mx.array
    _idx: int

    def __init__(self, left_padding: list[int]) -> None:
        super().__init__(left_padding)
        #: Per row: its history's key pieces, value pieces, and their tokens.
        self.rows: list[tuple[tuple[Part, ...], tuple[Part, ...], int]] = [
            ((), (), 0) for _ in left_padding
        ]
        self.recent = GlobalBatchKVCache([0] * len(left_padding))
        #: ``recent``'s left padding, read once per change of the batch.
        self._recent_pad = [0] * len(left_padding)
        self._right: list[int] | None = None

    # -- what the model sees -----------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.recent.update_and_fetch(keys, values)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Every row, left-padded to ``_idx`` tokens: what ``BatchKVCache`` returns."""
        rk, rv = self.recent.keys, self.recent.values
        assert rk is not None and rv is not None  # an update made them
        ridx = self.recent._idx
        if not any(history for _, _, history in self.rows):
            return rk[..., :ridx, :], rv[..., :ridx, :]  # the same layout
        rows: list[Row] = []
        for (parts_k, parts_v, history), pad in zip(self.rows, self._recent_pad, strict=True):
            recent = ridx - pad
            rows.append((self._idx - history - recent, parts_k, parts_v, ridx - recent, ridx))
        return assemble(rows, rk, rv)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.recent.keys, self.recent.values, self.offset, self.left_padding

    @property
    def nbytes(self) -> int:
        """Bytes of its own (the recent tokens'): the pieces are the pool's."""
        return int(self.recent.nbytes)

    def empty(self) -> bool:
        return bool(self._idx == 0)

    def trim(self, n: int) -> int:
        raise NotImplementedError("the batch's rows are not trimmed")

    # -- sequences joining and leaving -------------------------------------------------

    def prepare(
        self,
        *,
        left_padding: list[int] | None = None,
        lengths: list[int] | None = None,
        right_padding: list[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self._idx:
                raise ValueError("Left padding can only be added to an empty BatchKVCache")
            self.recent.prepare(left_padding=left_padding)
            self.left_padding += mx.array(left_padding)
            self.offset = self.offset - mx.array(left_padding)
            self._recent_pad = [p + q for p, q in zip(self._recent_pad, left_padding, strict=True)]
        if right_padding is not None and max(right_padding) > 0:
            self.recent.prepare(right_padding=right_padding)
            self._right = list(right_padding)

    def finalize(self) -> None:
        if self._right is None:
            return
        padding, self._right = self._right, None
        self.recent.finalize()
        shift = mx.array(padding)
        self.offset = self.offset - shift
        self.left_padding += shift
        self._recent_pad = [p + q for p, q in zip(self._recent_pad, padding, strict=True)]

    def filter(self, batch_indices: Any) -> None:
        keep = as_rows(batch_indices)
        self.rows = [self.rows[i] for i in keep]
        self.offset = self.offset[mx.array(keep)]
        self.left_padding = self.left_padding[mx.array(keep)]
        self.recent.filter(keep)
        self._recent_pad = as_rows(self.recent.left_padding)
        shift = min(self._pads())
        if shift > 0:  # as mlx-lm's: drop the padding every row has
            self._idx -= shift
            self.left_padding -= shift

    def _pads(self) -> list[int]:
        ridx = self.recent._idx
        return [
            self._idx - history - (ridx - pad)
            for (_, _, history), pad in zip(self.rows, self._recent_pad, strict=True)
        ]

    def extend(self, other: Any) -> None:
        if not isinstance(other, PagedBatchKVCache):
            raise TypeError(f"cannot extend a paged batch cache with {type(other).__name__}")
        longest = max(self._idx, other._idx)
        self.left_padding = mx.concatenate(
            [self.left_padding + (longest - self._idx), other.left_padding + (longest - other._idx)]
        )
        self.offset = mx.concatenate([self.offset, other.offset])
        self.rows = [*self.rows, *other.rows]
        self._idx = longest
        self.recent.extend(other.recent)
        self._recent_pad = as_rows(self.recent.left_padding)

    def extract(self, idx: int) -> PagedKVCache:
        """Row ``idx``'s cache: its pieces, and its recent tokens as a view (copied only
        if the batch goes on without it, as :class:`GlobalBatchKVCache` does)."""
        parts_k, parts_v, _ = self.rows[idx]
        tail = self.recent.extract(idx) if self.recent.keys is not None else None
        return PagedKVCache(parts_k, parts_v, tail)

    def __deepcopy__(self, memo: dict[int, Any]) -> PagedBatchKVCache:
        """A copy sharing the pieces and the recent tokens' data (mlx-lm copies a batch to
        split it, then filters both halves)."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.rows = list(self.rows)
        copy._recent_pad = list(self._recent_pad)
        copy.recent = self.recent.__deepcopy__(memo)
        return copy

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> PagedBatchKVCache:
        """The caches as rows: a :class:`PagedKVCache`'s pieces stay where they are, its
        tail and any other cache's tokens become the row's recent tokens (merged as
        :meth:`GlobalBatchKVCache.merge` does)."""
        rows: list[tuple[tuple[Part, ...], tuple[Part, ...], int]] = []
        tails: list[Any] = []
        for c in caches:
            if isinstance(c, PagedKVCache):
                rows.append((c.parts_k, c.parts_v, c.history))
                tails.append(c.tail if c.tail is not None else GlobalKVCache())
            else:
                rows.append(((), (), 0))
                tails.append(c)
        lengths = [history + t.size() for (_, _, history), t in zip(rows, tails, strict=True)]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths])
        batch.offset += longest
        batch._idx = longest
        batch.rows = rows
        batch.recent = GlobalBatchKVCache.merge(tails)
        batch._recent_pad = as_rows(batch.recent.left_padding)
        return batch
