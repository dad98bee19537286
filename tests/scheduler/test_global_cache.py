"""The global layers' batch cache of recent tokens (``scheduler/caches/_global.py``)
against mlx-lm's own ``BatchKVCache``: the same arrays through merge, growth, extend,
filter and extract; and the memory agents decoding together take."""

from __future__ import annotations

import copy
import gc
import random
from pathlib import Path

import anyio
import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_actors import Runtime
from mlx_actors.scheduler.caches._global import GlobalBatchKVCache, GlobalKVCache
from mlx_actors.testing import tiny_config, write_random_model

from ..conftest import INIT_SCALE

HEADS, DIM = 2, 8


def filled(cls: type, length: int, seed: int) -> KVCache:
    cache = cls()
    if length:
        key = mx.random.key(seed)
        k, v = mx.random.normal((2, 1, HEADS, length, DIM), key=key)
        cache.update_and_fetch(k, v)
    return cache


def held(batch: BatchKVCache) -> tuple[mx.array, mx.array, list[int], list[int]]:
    keys, values = batch.keys_and_values()
    return keys, values, batch.left_padding.tolist(), batch.offset.tolist()


def same(ours: BatchKVCache, theirs: BatchKVCache) -> None:
    for a, b in zip(held(ours), held(theirs), strict=True):
        if isinstance(a, mx.array):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
        else:
            assert a == b


def test_the_batch_cache_holds_what_mlx_lms_holds() -> None:
    """Merged from caches of unequal lengths (one empty), grown past a block, extended by
    another batch, filtered, with rows extracted before and after: every array, padding
    and offset equals mlx-lm's ``BatchKVCache`` put through the same."""
    lengths, more = [300, 17, 0, 256], [40, 511]
    ours = GlobalBatchKVCache.merge([filled(GlobalKVCache, n, i) for i, n in enumerate(lengths)])
    theirs = KVCache.merge([filled(KVCache, n, i) for i, n in enumerate(lengths)])
    same(ours, theirs)
    rng = random.Random(0)
    for step in range(260):  # one token at a time, past the room merge gave
        k, v = mx.random.normal((2, len(lengths), HEADS, 1, DIM), key=mx.random.key(100 + step))
        a, b = ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))
    same(ours, theirs)
    ours.extend(GlobalBatchKVCache.merge([filled(GlobalKVCache, n, 9 + n) for n in more]))
    theirs.extend(KVCache.merge([filled(KVCache, n, 9 + n) for n in more]))
    same(ours, theirs)
    gone = [1, 4]
    out_ours = [ours.extract(i) for i in gone]
    out_theirs = [theirs.extract(i) for i in gone]
    keep = [i for i in range(len(lengths) + len(more)) if i not in gone]
    ours.filter(keep)
    theirs.filter(keep)
    same(ours, theirs)
    row = rng.randrange(len(keep))  # a view of a batch that goes on
    out_ours.append(ours.extract(row))
    out_theirs.append(theirs.extract(row))
    for a, b in zip(out_ours, out_theirs, strict=True):
        assert a.offset == b.offset
        assert mx.array_equal(a.state[0], b.state[0]).item()
        assert mx.array_equal(a.state[1], b.state[1]).item()


def test_a_filter_keeping_every_row_matches_mlx_lms() -> None:
    """mlx-lm splits a batch by copying it and filtering both halves; the half that keeps
    every row, in order, is filtered without copying its arrays (here with padding every
    row has, which the filter drops). Afterwards, through growth and extracted rows,
    everything equals mlx-lm's."""
    padding = [3, 5, 4]
    ours, theirs = GlobalBatchKVCache(padding), BatchKVCache(padding)
    k, v = mx.random.normal((2, len(padding), HEADS, 12, DIM), key=mx.random.key(7))
    ours.update_and_fetch(k, v)
    theirs.update_and_fetch(k, v)
    ours, theirs = copy.deepcopy(ours), copy.deepcopy(theirs)
    ours.filter([0, 1, 2])
    theirs.filter([0, 1, 2])
    assert ours._idx == theirs._idx == 9  # the 3 tokens of padding every row had
    same(ours, theirs)
    for step in range(250):  # past the room the cache had
        k, v = mx.random.normal((2, len(padding), HEADS, 1, DIM), key=mx.random.key(step))
        a, b = ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))
    for row in (2, 0):
        a, b = ours.extract(row), theirs.extract(row)
        assert a.offset == b.offset
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state, strict=True))
    ours.filter([1])
    theirs.filter([1])
    same(ours, theirs)


def test_filters_keeping_any_rows_match_mlx_lms() -> None:
    """Rows are kept as runs of consecutive rows copied together: for every way of keeping
    some of six rows of unequal padding (one run or several, the padding they all have
    dropped or not), the cache and the next updates equal mlx-lm's."""
    lengths = [40, 3, 300, 0, 77, 256]
    rng = random.Random(1)
    for trial in range(24):
        keep = sorted(rng.sample(range(len(lengths)), rng.randint(1, len(lengths))))
        ours = GlobalBatchKVCache.merge(
            [filled(GlobalKVCache, n, i) for i, n in enumerate(lengths)]
        )
        theirs = KVCache.merge([filled(KVCache, n, i) for i, n in enumerate(lengths)])
        ours.filter(keep)
        theirs.filter(keep)
        same(ours, theirs)
        for step in range(3):
            k, v = mx.random.normal((2, len(keep), HEADS, 1, DIM), key=mx.random.key(trial + step))
            a, b = ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)
            assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))
        same(ours, theirs)


def test_a_single_cache_merges_without_a_copy() -> None:
    """A prefill job's cache joins the batch as a batch of one: it takes the cache's
    arrays (no copy) and holds, and updates, what mlx-lm's merge of it holds."""
    for length in (300, 256):  # room left in the cache's arrays; none
        ours_single, theirs_single = filled(GlobalKVCache, length, 5), filled(KVCache, length, 5)
        keys = ours_single.keys
        ours = GlobalBatchKVCache.merge([ours_single])
        theirs = KVCache.merge([theirs_single])
        assert (ours.keys is keys) == (length % 256 != 0)
        same(ours, theirs)
        for step in range(300):
            k, v = mx.random.normal((2, 1, HEADS, 1, DIM), key=mx.random.key(step))
            a, b = ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)
            assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))
        same(ours, theirs)


def test_an_empty_merge_is_still_ours() -> None:
    batch = GlobalBatchKVCache.merge([GlobalKVCache(), GlobalKVCache()])
    assert isinstance(batch, GlobalBatchKVCache)
    k, v = mx.ones((2, 2, HEADS, 3, DIM))
    keys, _ = batch.update_and_fetch(k, v)
    assert keys.shape == (2, HEADS, 3, DIM)


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(
        tmp_path_factory.mktemp("models") / "eight-layers",
        tiny_config(num_hidden_layers=8),
        seed=3,
        init_scale=INIT_SCALE,
    )


def test_agents_decoding_together_hold_their_histories_about_once(eight_layers: Path) -> None:
    """Four agents with 1K-token histories decode a turn together. With ``paged_batch``,
    that turn's peak beside the pool's blocks is the batch's recent tokens (a block of
    room per row), a layer's keys and values put together for attention, and the
    prompts' prefill: the histories are read from the blocks, and the agents' kept
    caches are dropped as they join (1.7 times the histories' bytes here). Without it
    the batch's cache holds a copy of every history, made a layer at a time (2.6 times;
    with mlx-lm's lazy copies it was 4.2). The replies are the same."""

    async def run(paged: bool) -> tuple[int, int, int, list[tuple[int, ...]]]:
        gc.collect()
        mx.clear_cache()
        base = mx.get_active_memory()
        async with Runtime(  # the four turns start as one batch, on a loaded machine too
            eight_layers,
            log_level="off",
            pool_bytes=64 << 20,
            paged_batch=paged,
            admission_window=1.0,
        ) as rt:
            gc.collect()
            weights = mx.get_active_memory() - base
            agents = [await rt.spawn(f"a{i}", max_tokens=1) for i in range(4)]
            for i, agent in enumerate(agents):  # one after another: each cache is kept
                text = "".join(random.Random(i).choice("abcdefgh ") for _ in range(1000))
                await agent.ask(text)
            kv = (await rt.stats()).pool.used_bytes
            gc.collect()
            mx.clear_cache()
            before = mx.get_active_memory() - base - weights
            mx.reset_peak_memory()
            replies: list[tuple[int, ...]] = [() for _ in agents]

            async def ask(i: int) -> None:
                replies[i] = (await agents[i].ask("And then?", max_tokens=8)).tokens

            async with anyio.create_task_group() as tg:
                for i in range(len(agents)):
                    tg.start_soon(ask, i)
            return kv, before, mx.get_peak_memory() - base - weights, replies

    kv, before, copied, replies = anyio.run(run, False)
    # Before: the pool's blocks and the kept caches (a copy of each agent's, with room).
    assert before >= 1.9 * kv
    assert copied <= 2.75 * kv, copied / kv
    kv, _, paged, paged_replies = anyio.run(run, True)
    assert paged <= 1.85 * kv, paged / kv
    assert paged_replies == replies
