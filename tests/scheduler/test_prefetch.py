"""Bringing back the cache of the agent expected next (the engine thread's side, on a real
pool of a tiny model's blocks)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_actors.scheduler import BlockPool
from mlx_actors.scheduler.engine._solo import kept_for
from mlx_actors.scheduler.kv import blocks_needed, from_cache
from mlx_actors.scheduler.kv._pool import AgentBlocks
from mlx_actors.scheduler.kv._prefix import PrefixIndex
from mlx_actors.scheduler.residency import CacheImage, CacheManager, HostCaches
from mlx_actors.scheduler.residency._prefetch import Prefetcher

from ..conftest import Loaded


class Log:
    """The events the cache manager logs, by name."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    debug = info


def setup(
    tiny: Loaded, blocks: int, host: int = 0
) -> tuple[CacheManager, Prefetcher, dict[str, CacheImage]]:
    pool = BlockPool(tiny.spec, total_blocks=blocks)
    out: dict[str, CacheImage] = {}
    caches = CacheManager(
        pool,
        PrefixIndex(tiny.spec),
        kept_for(pool),
        HostCaches(host),  # 0: every evicted cache goes to disk only
        log=Log(),
        on_evicted=out.__setitem__,
        share_prefixes=False,
        persistent_store=False,
    )
    return caches, Prefetcher(caches, log=Log()), out


def cache_of(tiny: Loaded, pool: BlockPool, agent: int, n: int) -> AgentBlocks:
    """Blocks of a real cache of ``n`` tokens, its own for each ``agent``."""
    tokens = [(7 * i + agent) % 256 for i in range(n)]
    cache = make_prompt_cache(tiny.model)
    tiny.model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    reservation = pool.reserve(blocks_needed(tiny.spec, n, 0))
    try:
        return from_cache(pool, cache, tokens, reservation)
    finally:
        reservation.release()


def turn(caches: CacheManager, name: str, blocks: AgentBlocks) -> None:
    caches.started(name)
    caches.commit(name, blocks, hold=False, saving=False, snapshot=False)


def test_a_cache_read_back_ahead_is_not_used_once_the_agent_has_moved_on(tiny: Loaded) -> None:
    caches, prefetcher, out = setup(tiny, blocks=400)
    turn(caches, "a", cache_of(tiny, caches.pool, 0, 300))
    assert caches.make_room("b")
    first = out.pop("a")
    prefetcher.read_back("a", first)  # read back ahead; its turn takes it another way
    assert prefetcher.image("a") is first
    caches.restore("a", first)
    assert prefetcher.image("a") is None  # back in the pool: nothing to bring
    turn(caches, "a", cache_of(tiny, caches.pool, 0, 600))  # the agent goes on
    assert caches.make_room("b")
    assert caches.entry("a").evicted and "a" in out
    assert prefetcher.image("a") is None  # the old read holds another cache


def test_only_agents_expected_later_make_room_for_the_one_expected_next(tiny: Loaded) -> None:
    per_agent = blocks_needed(tiny.spec, 300, 0)
    caches, prefetcher, out = setup(tiny, blocks=3 * per_agent)
    turn(caches, "a", cache_of(tiny, caches.pool, 0, 300))
    assert caches.make_room("z") and list(out) == ["a"]  # the pool's only cache leaves
    for number, name in enumerate("bcd", start=1):  # the pool is full
        caches.commit(
            name, cache_of(tiny, caches.pool, number, 300), hold=False, saving=False, snapshot=False
        )
    for name in "abcd" * 3:  # a round robin: a is next, then b, c, d
        caches.next_use.started(name)
    assert [caches.next_use.expected_in(name) for name in "abcd"] == [1, 2, 3, 4]
    for name in "bcd":
        caches.pin(name, 60.0)
    assert prefetcher.run() == (None, None)  # only pinned caches could make room
    caches.pin("b", None)
    caches.pin("c", None)
    assert prefetcher.run() == (None, "a")  # on disk: to be read first
    assert prefetcher.run() == (None, None)  # once
    prefetcher.read_back("a", out.pop("a"))
    assert prefetcher.run() == ("a", None)
    assert not caches.entry("a").evicted and caches.prefetches == 1
    # c, expected after b, made room; d, expected last, is pinned
    assert list(out) == ["c"] and not caches.entry("d").evicted


def test_host_memory_keeps_the_caches_expected_soonest(tiny: Loaded) -> None:
    caches, _, out = setup(tiny, blocks=400, host=1 << 30)
    for number, name in enumerate("abc"):
        blocks = cache_of(tiny, caches.pool, number, 300)
        caches.commit(name, blocks, hold=False, saving=False, snapshot=False)
    for name in "abc" * 2:
        caches.next_use.started(name)  # a round robin: a, b, c expected in 1, 2, 3 turns
    assert caches.make_room("z") and caches.make_room("z")  # c, then b
    assert list(out) == ["c", "b"]
    caches.host.budget = 2 * out["c"].nbytes  # room for two of these caches
    caches.next_use.started("a")  # a spoke: now b, c, a are expected in 1, 2, 3
    assert caches.make_room("z")
    # Host memory is short: the cache expected furthest (a's, the newest) is let go,
    # not the least recently evicted (c's, expected in two turns).
    assert "a" not in caches.host and "b" in caches.host and "c" in caches.host
