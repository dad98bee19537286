"""Host copies of blocks still in the pool: a cache brought back from an image keeps the
image's arrays, so that its next eviction copies only the blocks made since (the engine
thread's side, on a real pool of a tiny model's blocks)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_actors.scheduler.kv._pool import AgentBlocks
from mlx_actors.scheduler.residency import CacheImage, CacheManager
from mlx_actors.scheduler.residency._image import PendingCopy, copy_to_host

from ..conftest import Loaded
from .test_prefetch import cache_of, setup, turn


def evicted(caches: CacheManager, out: dict[str, CacheImage], name: str) -> CacheImage:
    assert caches.make_room("z") and caches.entry(name).evicted
    return out.pop(name)


def copied(caches: CacheManager) -> int:
    log = caches._log.events  # type: ignore[attr-defined]
    return int(next(f for e, f in reversed(log) if e == "blocks.evicted")["copied"])


def device_bits(blocks: AgentBlocks) -> list[np.ndarray]:
    """Every block's keys and values as bits, in order (read before the blocks go)."""
    out = []
    for b in blocks.blocks():
        assert b.keys is not None and b.values is not None
        out += [np.array(a.view(mx.uint32)) for a in (b.keys, b.values)]
    return out


def image_bits(image: CacheImage) -> list[np.ndarray]:
    return [a for row in image.layers for e in row for a in image.arrays[e.key]]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_cache_brought_back_leaves_again_without_copying_what_host_memory_holds(
    tiny: Loaded,
) -> None:
    caches, _, out = setup(tiny, blocks=400, host=1 << 30)
    turn(caches, "a", cache_of(tiny, caches.pool, 0, 600))
    first = evicted(caches, out, "a")
    total = len(first.arrays)
    assert copied(caches) == total  # nothing held yet
    caches.restore("a", first)
    blocks = caches.entry("a").blocks
    assert blocks is not None and caches.host.held("a")
    expected = device_bits(blocks)
    again = evicted(caches, out, "a")
    assert copied(caches) == 0
    # the same host arrays, by block: not copies of copies
    assert {id(a) for pair in again.arrays.values() for a in pair} == {
        id(a) for pair in first.arrays.values() for a in pair
    }
    assert same(image_bits(again), expected)
    assert caches.host.held("a") == {}  # the image holds them now


def test_a_turn_s_new_blocks_are_copied_and_those_it_replaced_let_go(tiny: Loaded) -> None:
    caches, _, out = setup(tiny, blocks=400, host=1 << 30)
    turn(caches, "a", cache_of(tiny, caches.pool, 0, 600))
    caches.restore("a", evicted(caches, out, "a"))
    restored = caches.entry("a").blocks
    assert restored is not None
    # a turn that keeps every block but each layer's last, and adds one
    grown = cache_of(tiny, caches.pool, 9, 600)
    layers = tuple(
        (*old[:-1], new[-1]) for old, new in zip(restored.layers, grown.layers, strict=True)
    )
    caches.pool.share_all([b for layer in layers for b in layer[:-1]])
    caches.pool.free([b for layer in grown.layers for b in layer[:-1]])
    mixed = AgentBlocks(layers, restored.tokens)
    caches.started("a")
    caches.commit("a", mixed, hold=False, saving=False, snapshot=False)
    assert set(caches.host.held("a")) == {b.id for layer in layers for b in layer[:-1]}
    expected = device_bits(mixed)
    image = evicted(caches, out, "a")
    assert copied(caches) == len(layers)  # the last block of each layer
    assert same(image_bits(image), expected)


def test_copies_of_blocks_give_way_to_evicted_caches(tiny: Loaded) -> None:
    caches, _, out = setup(tiny, blocks=400, host=1 << 30)
    turn(caches, "a", cache_of(tiny, caches.pool, 0, 300))
    caches.restore("a", evicted(caches, out, "a"))
    held = caches.host.nbytes
    assert held > 0
    caches.host.budget = held  # room for one such cache
    turn(caches, "b", cache_of(tiny, caches.pool, 1, 300))
    caches.pin("a", 60.0)  # b leaves
    image = evicted(caches, out, "b")
    assert caches.host.get("b") is image and caches.host.held("a") == {}
    assert caches.host.nbytes == image.nbytes
    caches.pin("a", None)  # a leaves too, copied whole
    evicted(caches, out, "a")
    assert copied(caches) == len(image.arrays)


def test_a_cache_read_back_from_disk_keeps_no_copies_and_closing_lets_all_go(
    tiny: Loaded,
) -> None:
    caches, _, out = setup(tiny, blocks=400, host=1 << 30)
    turn(caches, "a", cache_of(tiny, caches.pool, 0, 300))
    turn(caches, "b", cache_of(tiny, caches.pool, 1, 300))
    caches.pin("b", 60.0)
    image = evicted(caches, out, "a")
    caches.host.drop("a")  # as if pushed out: the image comes from the files
    caches.restore("a", image)
    assert caches.host.held("a") == {} and caches.host.nbytes == 0
    caches.pin("b", None)
    caches.pin("a", 60.0)
    caches.restore("b", evicted(caches, out, "b"))  # from host memory: copies kept
    assert caches.host.held("b") and caches.host.nbytes > 0
    caches.free_all()
    assert caches.host.held("b") == {} and caches.host.nbytes == 0


def test_snapshots_taken_together_are_copied_later_as_their_blocks_were(tiny: Loaded) -> None:
    caches, _, _ = setup(tiny, blocks=400)
    later: list[PendingCopy] = []
    images, expected = [], []
    for i, name in enumerate(("a", "b", "c")):
        blocks = cache_of(tiny, caches.pool, i, 300 + 100 * i)
        caches.started(name)
        images.append(
            caches.commit(name, blocks, hold=False, saving=True, snapshot=True, later=later)
        )
        expected.append(device_bits(blocks))
    assert len(later) == 3 and not any(image is not None and image.arrays for image in images)
    # the agents move on before the copy: their blocks go back to the pool and are
    # taken again by other caches
    for name in ("a", "b", "c"):
        caches.forget(name)
    assert caches.pool.used_blocks == 0
    others = [cache_of(tiny, caches.pool, 7 + i, 500) for i in range(3)]
    copy_to_host(later)
    for image, bits in zip(images, expected, strict=True):
        assert image is not None and image.whole()
        assert same(image_bits(image), bits)
    for blocks in others:
        caches.pool.free(blocks.blocks())
