"""The paged batch cache (``scheduler/caches/_paged.py``) against mlx-lm's own
``BatchKVCache``: rows whose histories are pieces of blocks give attention the same keys
and values, through merge, a right-padded prompt, growth, extend, filter, a split and
extract; and a finished row's cache slices as the whole cache would."""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_actors.scheduler.caches._global import GlobalKVCache
from mlx_actors.scheduler.caches._paged import PagedBatchKVCache, PagedKVCache

HEADS, DIM, BLOCK = 2, 8, 256


def history(length: int, seed: int) -> tuple[mx.array, mx.array]:
    return mx.random.normal((2, 1, HEADS, length, DIM), key=mx.random.key(seed))  # type: ignore[return-value]


def dense(cls: type, keys: mx.array, values: mx.array) -> KVCache:
    cache = cls()
    if keys.shape[2]:
        cache.update_and_fetch(keys, values)
    return cache


def paged(keys: mx.array, values: mx.array, held: int) -> PagedKVCache:
    """The first ``held`` tokens as blocks (256-token arrays of their own), the rest as
    a tail."""
    parts_k, parts_v = [], []
    for start in range(0, held, BLOCK):
        end = min(start + BLOCK, held)
        k = mx.contiguous(keys[..., start:end, :])
        v = mx.contiguous(values[..., start:end, :])
        parts_k.append((k, start, start, end))
        parts_v.append((v, start, start, end))
    tail = dense(GlobalKVCache, keys[..., held:, :], values[..., held:, :])
    return PagedKVCache(parts_k, parts_v, tail)


def rows(specs: list[tuple[int, int | None]], seed: int) -> tuple[list[KVCache], list[object]]:
    """Per row (length, tokens held as blocks, or ``None``: a dense cache of ours):
    mlx-lm's caches and ours."""
    theirs, ours = [], []
    for i, (length, held) in enumerate(specs):
        keys, values = history(length, seed + i)
        theirs.append(dense(KVCache, keys, values))
        ours.append(
            dense(GlobalKVCache, keys, values) if held is None else paged(keys, values, held)
        )
    return theirs, ours


def same(ours: PagedBatchKVCache, theirs: BatchKVCache, got: tuple[mx.array, mx.array]) -> None:
    """What attention sees: equal where the mask lets it look, and ours zero elsewhere."""
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours._idx == theirs._idx
    pads = theirs.left_padding
    for a, b in zip(got, theirs.keys_and_values(), strict=True):
        assert a.shape == b.shape
        visible = (mx.arange(b.shape[2])[None] >= pads[:, None])[:, None, :, None]
        assert mx.array_equal(a, mx.where(visible, b, 0)).item()


def step(ours: PagedBatchKVCache, theirs: BatchKVCache, tokens: int, seed: int) -> None:
    k, v = mx.random.normal((2, len(ours.rows), HEADS, tokens, DIM), key=mx.random.key(seed))
    got = ours.update_and_fetch(k, v)
    theirs.update_and_fetch(k, v)
    same(ours, theirs, got)


def test_the_paged_batch_gives_attention_what_mlx_lms_gives() -> None:
    specs = [(700, 512), (300, 300), (17, 0), (0, None), (513, 256), (40, None)]
    theirs_rows, ours_rows = rows(specs, 0)
    theirs = KVCache.merge(theirs_rows)
    ours = PagedBatchKVCache.merge(ours_rows)
    assert isinstance(ours, PagedBatchKVCache)
    # A prompt of unequal lengths, right-padded, as BatchGenerator prefills it.
    lengths = [5, 1, 3, 5, 2, 4]
    padding = [max(lengths) - n for n in lengths]
    for cache in (ours, theirs):
        cache.prepare(lengths=lengths, right_padding=padding)
    step(ours, theirs, max(lengths), 1)
    ours.finalize()
    theirs.finalize()
    for n in range(260):  # one token at a time, past the recent tokens' room
        step(ours, theirs, 1, 100 + n)
    # A second batch joins (its rows from blocks too), rows leave, a split.
    more_theirs, more_ours = rows([(1000, 768), (2, None)], 50)
    theirs.extend(KVCache.merge(more_theirs))
    ours.extend(PagedBatchKVCache.merge(more_ours))
    step(ours, theirs, 1, 400)
    gone = [0, 3, 6]
    out_theirs = [theirs.extract(i) for i in gone]
    out_ours = [ours.extract(i) for i in gone]
    keep = [i for i in range(len(ours.rows)) if i not in gone]
    half = copy.deepcopy(ours)
    half_theirs = copy.deepcopy(theirs)
    theirs.filter(keep)
    ours.filter(keep)
    step(ours, theirs, 1, 500)
    half.filter([1, 2])
    half_theirs.filter([1, 2])
    step(half, half_theirs, 1, 600)
    for a, b in zip(out_ours, out_theirs, strict=True):
        assert a.offset == b.offset
        for mine, full in ((a.keys, b.keys), (a.values, b.values)):
            assert mine is not None and mine.shape == full.shape
            for lo, hi in ((0, a.offset), (250, 260), (a.offset - 3, a.offset)):
                assert mx.array_equal(mine[..., lo:hi, :], full[..., lo:hi, :]).item()


def test_a_batch_without_histories_is_mlx_lms_own() -> None:
    theirs_rows, ours_rows = rows([(30, None), (0, None)], 7)
    theirs, ours = KVCache.merge(theirs_rows), PagedBatchKVCache.merge(ours_rows)
    step(ours, theirs, 1, 8)
    keys, _ = ours.keys_and_values()
    assert keys.shape == (2, HEADS, 31, DIM)
    assert ours.nbytes == ours.recent.nbytes
