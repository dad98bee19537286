"""What a sliding-window layer's cache drops while it decodes, kept a little longer: the
*margin*, so that a turn can rewind the last tokens of the history on every layer.

A sliding-window layer's cache (mlx-lm's ``RotatingKVCache``, or ``BatchRotatingKVCache``
in the batch) holds its last ``window`` tokens; each decoded token overwrites the oldest.
To continue the history from ``k`` tokens before its end, the layer needs the ``window``
tokens before that point, ``k`` of which the ring has already overwritten. When the next
rendering of a conversation differs from the cache near its end (a stop string cut from
the reply's text, a template that trims, a reply that re-encodes differently), those few
tokens decide whether the turn costs the tokens that differ or the whole last turn.

The caches here are mlx-lm's, with one addition: just before a decoding step's update
overwrites tokens that were not kept yet, they copy the next :data:`CHUNK` oldest ones
aside (a prefill's trim is not copied: the margin then stops at the gap it leaves),
and keep the last few such copies (at least :data:`SLIDING_MARGIN` tokens
before the window). Nothing else changes: the ring, its masks and what the model
computes are mlx-lm's own, so outputs stay token-identical. The batch form keeps the
copies per row through ``merge``, ``extend``, ``filter`` and ``extract``, the way
``BatchGenerator`` moves sequences in and out; the copies' positions are worked out from
the rows' offsets only when a sequence leaves (``extract``), so capturing never waits for
the device. When the sequence's cache is cut into blocks, the sliding layers keep the
margin with their window (:func:`~._blocks.plan_cut`), so the prefix index can serve any
position in it.

Cost: one copy of :data:`CHUNK` tokens per sliding layer (and row) every :data:`CHUNK`
decoded tokens, and in the pool up to ``SLIDING_MARGIN`` more tokens per sliding layer (at most
one block more, and none when the window's first block already reaches that far back).
The subclasses read mlx-lm 0.32's ring bookkeeping (``_idx``, ``rotated``, ``_offset``,
``left_padding``), which is why ``pyproject.toml`` keeps mlx-lm below 0.33.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

#: Tokens a sliding-window layer keeps before its window at the end of a turn (the
#: margin), so that the turn's last tokens can be rewound.
SLIDING_MARGIN = 64


#: Tokens copied aside at once, before the ring overwrites them.
CHUNK = 32
#: Most tokens kept aside per sequence, and most copied at once: the margin, and a
#: chunk copied ahead of what the ring has overwritten.
KEPT = SLIDING_MARGIN + CHUNK


@attrs.frozen
class Dropped:
    """Tokens a ring overwrote, copied aside: ``keys``/``values`` of shape
    ``(1, heads, n, dim)`` from position ``start``. Captured in a batch, the positions are
    known only relative to the row's offset then: ``start`` is ``offsets[row] + start``,
    and the first ``pads[row] - skip`` entries are the row's left padding, not tokens
    (both arrays read when the row leaves: :meth:`resolved`)."""

    keys: mx.array
    values: mx.array
    start: int
    offsets: mx.array | None = None
    pads: mx.array | None = None
    row: int = 0
    skip: int = 0

    def resolved(self) -> Dropped | None:
        """With its positions worked out (``None`` if it holds only padding)."""
        if self.offsets is None or self.pads is None:
            return self
        offset, pads = self.offsets[self.row].item(), self.pads[self.row].item()
        assert isinstance(offset, int) and isinstance(pads, int)
        n = int(self.keys.shape[2])
        cut = min(n, max(0, pads - self.skip))
        if cut == n:
            return None
        keys, values = self.keys[..., cut:, :], self.values[..., cut:, :]
        return Dropped(keys, values, offset + self.start + cut)


def _held(cache: Any) -> int:
    """Tokens the ring holds, in temporal order starting at :func:`_oldest_slot`."""
    length = int(cache.keys.shape[2])
    if isinstance(cache, BatchRotatingKVCache):
        return length if cache.rotated else min(cache._idx, length)
    if cache._idx == length or cache._idx < cache.offset:
        return length
    return int(cache._idx)


def _copy_oldest(cache: Any, first: int, n: int, row: int | None = None) -> list[mx.array]:
    """A copy of the ring's tokens ``first`` to ``first + n`` in temporal order (of one
    ``row`` of a batch, in a buffer of its own): ``[keys, values]``, not evaluated."""
    length = int(cache.keys.shape[2])
    full = _held(cache) == length
    start = (cache._idx % length if full else 0) + first
    parts = []
    for array in (cache.keys, cache.values):
        if row is not None:
            array = array[row : row + 1]
        a = start % length
        b = a + n
        if b <= length:
            piece = array[..., a:b, :]
        else:
            piece = mx.concatenate([array[..., a:, :], array[..., : b - length, :]], axis=2)
        parts.append(mx.contiguous(piece))
    return parts


def _plan_copy(cache: Any, uncopied: int | None) -> tuple[int, int] | None:
    """Before a one-token in-place update: the tokens of the ring (in temporal order:
    first, end) to copy aside, if the update overwrites one of its ``uncopied`` newest
    (``None``: all) that were not copied yet."""
    if cache.keys is None:
        return None
    held = _held(cache)
    lost = held + 1 - cache.max_size  # the update drops the `lost` oldest
    copied = 0 if uncopied is None else max(0, held - uncopied)
    if lost <= copied:
        return None
    first = max(copied, lost - KEPT)
    return first, min(held, max(lost, first + CHUNK))


def _keep(dropped: list[Dropped], new: Dropped) -> list[Dropped]:
    """``dropped`` with ``new`` after it, less the oldest copies the others make
    unnecessary (those after them reach ``KEPT`` tokens back)."""
    out = [*dropped, new]
    while len(out) > 1 and sum(int(d.keys.shape[2]) for d in out[1:]) >= KEPT:
        out.pop(0)
    return out


class MarginRotatingKVCache(RotatingKVCache):  # type: ignore[misc]
    """mlx-lm's ``RotatingKVCache`` that keeps the tokens it overwrote last (:class:`Dropped`,
    oldest first, at least ``SLIDING_MARGIN`` of them once it has overwritten that many)."""

    def __init__(self, max_size: int, keep: int = 0) -> None:
        super().__init__(max_size, keep)
        self.dropped: list[Dropped] = []
        #: How many of the newest tokens are not copied aside (``None``: any).
        self.uncopied: int | None = None

    def _update_in_place(self, keys: mx.array, values: mx.array) -> Any:
        if keys.shape[2] == 1:
            plan = _plan_copy(self, self.uncopied)
            if plan is not None:
                first, end = plan
                k, v = _copy_oldest(self, first, end - first)
                mx.async_eval(k, v)  # type: ignore[no-untyped-call]
                held = _held(self)
                self.dropped = _keep(self.dropped, Dropped(k, v, self.offset - held + first))
                self.uncopied = held - end
        out = super()._update_in_place(keys, values)
        if self.uncopied is not None:
            self.uncopied += int(keys.shape[2])
        return out

    def _update_concat(self, keys: mx.array, values: mx.array) -> Any:
        if self.uncopied is not None:
            self.uncopied += int(keys.shape[2])
        return super()._update_concat(keys, values)

    def empty_like(self) -> MarginRotatingKVCache:
        """A new empty cache of the same kind and window."""
        return MarginRotatingKVCache(self.max_size)

    def margin(self, lo: int) -> tuple[int, mx.array, mx.array] | None:
        """The kept tokens from ``lo`` (or the oldest kept after it) up to the oldest
        the ring holds, as one run: ``(start, keys, values)``, or ``None``."""
        if self.keys is None or not self.dropped:
            return None
        end = self.offset - _held(self)
        pieces: list[tuple[int, mx.array, mx.array]] = []
        for chunk in reversed(self.dropped):
            n = int(chunk.keys.shape[2])
            a, z = max(chunk.start, lo), min(chunk.start + n, end)
            if z < end or a >= z:
                break  # not contiguous with what follows
            pieces.append(
                (
                    a,
                    chunk.keys[..., a - chunk.start : z - chunk.start, :],
                    chunk.values[..., a - chunk.start : z - chunk.start, :],
                )
            )
            end = a
            if a <= lo:
                break
        if not pieces:
            return None
        pieces.reverse()
        keys = mx.concatenate([p[1] for p in pieces], axis=2)
        values = mx.concatenate([p[2] for p in pieces], axis=2)
        return pieces[0][0], keys, values

    @property
    def nbytes(self) -> int:
        kept = sum(int(d.keys.nbytes) + int(d.values.nbytes) for d in self.dropped)
        return int(super().nbytes) + kept

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> MarginBatchRotatingKVCache:
        return MarginBatchRotatingKVCache.merge(caches)


class MarginBatchRotatingKVCache(BatchRotatingKVCache):  # type: ignore[misc]
    """mlx-lm's ``BatchRotatingKVCache`` that keeps, per row, the tokens it overwrote
    last; :meth:`extract` hands them to the row's :class:`MarginRotatingKVCache`.

    Every row writes the same slot at each step, so one copy of the ring's oldest
    slots serves every row; each row keeps the part of it that it had not copied yet
    (rows join with different histories). Per row, ``_copied`` is the count of tokens
    written to the batch (``_written``) when its copies last reached the newest token
    (``None``: never), so that a step that copies nothing costs one comparison."""

    def __init__(self, max_size: int, left_padding: list[int]) -> None:
        super().__init__(max_size, left_padding)
        self.rows: list[list[Dropped]] = [[] for _ in left_padding]
        self._written = 0
        self._copied: list[int | None] = [None for _ in left_padding]
        self._least: int | None = None  # min(_copied), None if any is None

    @property
    def uncopied(self) -> list[int | None]:
        """Per row, how many of the newest tokens are not copied aside (``None``: any)."""
        return [None if c is None else self._written - c for c in self._copied]

    def _set_uncopied(self, uncopied: Sequence[int | None]) -> None:
        self._copied = [None if u is None else self._written - u for u in uncopied]
        least = [c for c in self._copied if c is not None]
        self._least = min(least) if least and len(least) == len(self._copied) else None

    def _update_in_place(self, keys: mx.array, values: mx.array) -> Any:
        if keys.shape[2] == 1 and self.keys is not None and self._copied:
            held = _held(self)
            lost = held + 1 - self.max_size
            if lost > 0 and (self._least is None or self._written - self._least > held - lost):
                self._copy_aside(held)
        out = super()._update_in_place(keys, values)
        self._written += int(keys.shape[2])
        return out

    def _copy_aside(self, held: int) -> None:
        # Row r's copy begins at its position offset[r] - held + its first, unless that
        # is padding (the ring's first left_padding[r] tokens of the row are); both are
        # read when the row leaves. (New arrays: mlx-lm updates left_padding in place.)
        offsets, pads = self.offset + 0, self.left_padding + 0
        uncopied = self.uncopied
        copies: list[mx.array] = []
        for row, u in enumerate(uncopied):
            plan = _plan_copy(self, u)
            if plan is None:
                continue
            first, end = plan
            # A buffer per row: rows copy at different steps, and a view of a batch-wide
            # copy would keep all of it alive for as long as the row keeps its part.
            k, v = _copy_oldest(self, first, end - first, row)
            copies += (k, v)
            kept = Dropped(k, v, first - held, offsets, pads, row, first)
            self.rows[row] = _keep(self.rows[row], kept)
            uncopied[row] = held - end
        mx.async_eval(copies)  # type: ignore[no-untyped-call]
        self._set_uncopied(uncopied)

    def _update_concat(self, keys: mx.array, values: mx.array) -> Any:
        if self._lengths is not None and self.keys is not None:
            self._unpad()
        out = super()._update_concat(keys, values)
        self._written += int(keys.shape[2])
        return out

    def finalize(self) -> None:
        if self._lengths is not None:
            self._unpad()
        super().finalize()

    def _unpad(self) -> None:
        """Before mlx-lm rolls right-padded rows (adding the roll to ``left_padding``):
        a row whose ring a prefill trimmed beyond its padding has ``left_padding`` below
        zero, which would then undercount the padding slots the roll brings to the
        front, and those would be copied aside as tokens. None of the row's slots is
        padding by then, so count zero. (What the model computes does not change: the
        mask already hides the rolled-in slots.)"""
        self.left_padding = mx.maximum(self.left_padding, 0)  # type: ignore[has-type]

    @property
    def nbytes(self) -> int:
        kept = sum(int(d.keys.nbytes) + int(d.values.nbytes) for row in self.rows for d in row)
        return int(super().nbytes) + kept

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> MarginBatchRotatingKVCache:
        batch = super().merge(caches)
        batch.rows = [list(getattr(c, "dropped", ())) for c in caches]
        batch._set_uncopied([getattr(c, "uncopied", None) for c in caches])
        return batch  # type: ignore[no-any-return]

    def extend(self, other: Any) -> None:
        count = int(other.offset.shape[0])
        self.rows = [*self.rows, *getattr(other, "rows", [[] for _ in range(count)])]
        uncopied = [*self.uncopied, *getattr(other, "uncopied", [None] * count)]
        super().extend(other)
        self._set_uncopied(uncopied)

    def filter(self, batch_indices: Any) -> None:
        keep: Any = batch_indices
        if isinstance(keep, mx.array):
            keep = keep.tolist()
        uncopied = self.uncopied
        self.rows = [self.rows[int(i)] for i in keep]
        self._set_uncopied([uncopied[int(i)] for i in keep])
        super().filter(batch_indices)

    def _single(self) -> MarginRotatingKVCache:
        """A new empty cache of one row of this kind."""
        return MarginRotatingKVCache(self.max_size)

    def extract(self, idx: int) -> MarginRotatingKVCache:
        plain = super().extract(idx)
        cache = self._single()
        cache.keys, cache.values = plain.keys, plain.values
        cache.offset, cache._idx = plain.offset, plain._idx
        cache.dropped = [r for d in self.rows[idx] if (r := d.resolved()) is not None]
        cache.uncopied = self.uncopied[idx]
        return cache
