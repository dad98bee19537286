"""Which idle agent's cache leaves the pool: the one expected to be asked furthest from
now, against the least recently used, on the same conversations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_actors import Runtime
from mlx_actors.errors import InvalidRequestError

from .test_persistence import converse

pytestmark = pytest.mark.anyio


async def test_a_round_robin_restores_fewer_caches_than_lru_with_the_same_replies(
    tiny_dir: Path, tmp_path: Path
) -> None:
    names = [f"agent{i}" for i in range(5)]
    runs = {}
    for policy in ("lru", "next-use"):
        trace = tmp_path / f"{policy}.jsonl"
        async with Runtime(
            tiny_dir, pool_blocks=14, log_level="off", eviction=policy, trace=trace
        ) as rt:
            replies = await converse(rt, names, range(4))
            stats = await rt.stats()
        events = [json.loads(line) for line in trace.read_text().splitlines()]
        evicted = [e for e in events if e["event"] == "blocks.evicted"]
        runs[policy] = replies, stats, evicted
    (lru, lru_stats, lru_evicted), (ours, stats, evicted) = runs["lru"], runs["next-use"]
    assert {k: r.tokens for k, r in ours.items()} == {k: r.tokens for k, r in lru.items()}
    # LRU evicts the agent asked next, every time: each later turn waits on a restore
    assert lru_stats.restores >= 3 * len(names) - 2
    assert 0 < 3 * stats.restores <= 2 * lru_stats.restores
    assert {e["why"] for e in lru_evicted} == {"least recently used"}
    assert all(e["why"].startswith("next turn expected in ") for e in evicted)


async def test_an_unknown_eviction_policy_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="eviction must be one of"):
        Runtime(tiny_dir, eviction="fifo")
