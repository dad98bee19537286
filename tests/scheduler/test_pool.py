"""The block pool's accounting: allocate, share, reserve and free in any order."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_actors.errors import CacheReconstructionError, InvalidRequestError, PoolExhaustedError
from mlx_actors.scheduler import BlockPool, LayerKind, LayerSpec, ModelCacheSpec

SPEC = ModelCacheSpec(
    layers=tuple(
        LayerSpec(
            kind=LayerKind.GLOBAL, window=None, kv_heads=2, key_dim=4, value_dim=4, dtype=mx.float16
        )
        for _ in range(2)
    )
)
DATA = mx.zeros((1, 2, 1, 4), dtype=mx.float16)


def test_block_bytes_and_sizing_from_a_byte_budget() -> None:
    assert SPEC.block_bytes == 2 * (4 + 4) * 2 * 256
    pool = BlockPool.from_bytes(SPEC, 10 * SPEC.block_bytes + 5)
    assert pool.total_blocks == 10
    with pytest.raises(InvalidRequestError, match="holds no block"):
        BlockPool.from_bytes(SPEC, SPEC.block_bytes - 1)
    with pytest.raises(InvalidRequestError):
        BlockPool(SPEC, total_blocks=0)


def test_exhaustion_says_what_was_needed_and_free() -> None:
    pool = BlockPool(SPEC, total_blocks=3)
    pool.allocate(0, 0, DATA, DATA)
    with pytest.raises(PoolExhaustedError) as info:
        pool.reserve(3)
    assert (info.value.needed, info.value.free) == (3, 2)
    assert isinstance(info.value, MemoryError)
    assert pool.statistics().reserved_blocks == 0


@pytest.mark.parametrize(
    ("start", "keys", "why"),
    [
        (0, mx.zeros((1, 3, 1, 4), dtype=mx.float16), "the model needs"),
        (0, mx.zeros((1, 2, 1, 4)), "the model's cache is"),
        (0, mx.zeros((1, 2, 257, 4), dtype=mx.float16), "crosses a block boundary"),
        (255, mx.zeros((1, 2, 2, 4), dtype=mx.float16), "crosses a block boundary"),
    ],
)
def test_a_block_whose_arrays_do_not_fit_its_layer_is_refused(
    start: int, keys: mx.array, why: str
) -> None:
    pool = BlockPool(SPEC, total_blocks=3)
    with pytest.raises(CacheReconstructionError, match=why):
        pool.allocate(1, start, keys, keys)
    stats = pool.statistics()
    assert (stats.used_blocks, stats.reserved_blocks, stats.free_blocks) == (0, 0, 3)


def test_sharing_many_blocks_takes_a_reference_to_each_or_to_none() -> None:
    pool = BlockPool(SPEC, total_blocks=3)
    a, b, c = (pool.allocate(0, 256 * i, DATA, DATA) for i in range(3))
    assert pool.share_all([a, b]) == [a, b]
    assert [pool.references(x) for x in (a, b, c)] == [2, 2, 1]
    pool.free([c])
    with pytest.raises(InvalidRequestError, match="not a live block"):
        pool.share_all([a, c, b])
    assert [pool.references(x) for x in (a, b)] == [2, 2]
    pool.free([a, b, a, b])
    assert pool.used_blocks == 0


def test_a_freed_block_cannot_be_used_again() -> None:
    pool = BlockPool(SPEC, total_blocks=3)
    block = pool.allocate(0, 0, DATA, DATA)
    pool.free([block])
    assert block.keys is None and not pool.owns(block)
    with pytest.raises(InvalidRequestError):
        pool.free([block])
    with pytest.raises(InvalidRequestError):
        pool.share(block)


class PoolMachine(RuleBasedStateMachine):
    """Random interleavings of every pool operation, checked against a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(SPEC, total_blocks=8)
        self.refs: dict[int, int] = {}  # block id -> references we hold
        self.blocks: dict[int, object] = {}
        self.reservations: list = []
        self.reserved = 0
        self.peak = 0

    def _note(self) -> None:
        self.peak = max(self.peak, len(self.refs) + self.reserved)

    @rule()
    def allocate(self) -> None:
        free = 8 - len(self.refs) - self.reserved
        if free == 0:
            with pytest.raises(PoolExhaustedError):
                self.pool.allocate(0, 0, DATA, DATA)
            return
        block = self.pool.allocate(0, 0, DATA, DATA)
        assert block.id not in self.refs
        self.refs[block.id] = 1
        self.blocks[block.id] = block
        self._note()

    @rule(n=st.integers(0, 5))
    def reserve(self, n: int) -> None:
        free = 8 - len(self.refs) - self.reserved
        if n > free:
            with pytest.raises(PoolExhaustedError):
                self.pool.reserve(n)
            return
        self.reservations.append(self.pool.reserve(n))
        self.reserved += n
        self._note()

    @precondition(lambda self: any(r.remaining for r in self.reservations))
    @rule(data=st.data())
    def fill_from_reservation(self, data: st.DataObject) -> None:
        reservation = data.draw(st.sampled_from([r for r in self.reservations if r.remaining]))
        block = reservation.allocate(1, 0, DATA, DATA)
        self.reserved -= 1
        self.refs[block.id] = 1
        self.blocks[block.id] = block

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def release_reservation(self, data: st.DataObject) -> None:
        reservation = data.draw(st.sampled_from(self.reservations))
        self.reserved -= reservation.remaining
        reservation.release()
        self.reservations.remove(reservation)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        bid = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.share(self.blocks[bid])
        self.refs[bid] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        bid = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.free([self.blocks[bid]])
        self.refs[bid] -= 1
        if not self.refs[bid]:
            del self.refs[bid]
            assert self.blocks.pop(bid).keys is None

    @invariant()
    def counts_are_true(self) -> None:
        stats = self.pool.statistics()
        assert stats.used_blocks == len(self.refs)
        assert stats.reserved_blocks == self.reserved
        assert stats.free_blocks == 8 - len(self.refs) - self.reserved
        assert stats.shared_blocks == sum(1 for n in self.refs.values() if n > 1)
        assert stats.peak_blocks == self.peak
        for bid, n in self.refs.items():
            assert self.pool.references(self.blocks[bid]) == n


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(1, 3), max_size=20))
@settings(deadline=None)
def test_freeing_everything_empties_the_pool(shares: list[int]) -> None:
    pool = BlockPool(SPEC, total_blocks=20)
    held = []
    for n in shares:
        block = pool.allocate(0, 0, DATA, DATA)
        held.extend([block] + [pool.share(block) for _ in range(n - 1)])
    assert pool.used_blocks == len(shares)
    pool.free(reversed(held))
    assert pool.statistics().used_blocks == 0
    assert pool.free_blocks == 20
