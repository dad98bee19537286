"""Blocks <-> mlx-lm cache: the round trip is exact, and block counts are as designed."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_actors.scheduler import BLOCK_SIZE, BlockPool
from mlx_actors.scheduler.kv import blocks_needed, from_cache, to_cache

from ..conftest import Loaded


def filled_cache(tiny: Loaded, n: int) -> tuple[list, list[int]]:
    tokens = [(7 * i) % 256 for i in range(n)]
    cache = make_prompt_cache(tiny.model)
    tiny.model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache, tokens


@pytest.mark.parametrize("n", [1, 255, 256, 257, 700, 1024])
def test_round_trip_is_exact(tiny: Loaded, n: int) -> None:
    pool = BlockPool(tiny.spec, total_blocks=100)
    cache, tokens = filled_cache(tiny, n)
    reservation = pool.reserve(blocks_needed(tiny.spec, n, 0))
    blocks = from_cache(pool, cache, tokens, reservation)
    reservation.release()
    assert blocks.tokens == tuple(tokens)
    for layer in blocks.layers:
        assert len(layer) == math.ceil(n / BLOCK_SIZE)
        assert all(b.num_tokens == BLOCK_SIZE for b in layer[:-1])
        assert layer[-1].num_tokens == n - BLOCK_SIZE * (len(layer) - 1)
    assert pool.used_blocks == tiny.spec.num_layers * math.ceil(n / BLOCK_SIZE)
    for keep in sorted({n, n - 1, 1, n // 2} - {0}):
        rebuilt = to_cache(tiny.spec, blocks, keep)
        for original, copy in zip(cache, rebuilt):
            assert copy.offset == keep
            assert mx.array_equal(copy.keys, original.keys[..., :keep, :])
            assert mx.array_equal(copy.values, original.values[..., :keep, :])
    # and back again: the rebuilt cache makes the same blocks
    again = pool.reserve(blocks_needed(tiny.spec, n, 0))
    second = from_cache(pool, to_cache(tiny.spec, blocks, n), tokens, again)
    again.release()
    for a, b in zip(blocks.blocks(), second.blocks()):
        assert (a.layer, a.start, a.end) == (b.layer, b.start, b.end)
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)
    pool.free(blocks.blocks())
    pool.free(second.blocks())
    assert pool.used_blocks == 0


def test_a_failed_cut_returns_every_block(tiny: Loaded) -> None:
    pool = BlockPool(tiny.spec, total_blocks=100)
    cache, tokens = filled_cache(tiny, 600)
    reservation = pool.reserve(blocks_needed(tiny.spec, 600, 0))
    with pytest.raises(Exception, match="expected 601"):
        from_cache(pool, cache, [*tokens, 1], reservation)
    reservation.release()
    assert pool.statistics().used_blocks == 0
