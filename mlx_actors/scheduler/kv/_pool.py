"""The block pool: a fixed budget of 256-token cache blocks, shared by reference count.

The pool counts in *units* (:attr:`ModelCacheSpec.unit_bytes`): a block costs its
layer's :meth:`~ModelCacheSpec.units`. In most models every layer's block is the same
size and a unit is a block; with ``kv_bits`` on a sliding-window model the global
layers' quantized blocks cost fewer units than the sliding layers' unquantized ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import attrs
import mlx.core as mx

from ...errors import CacheReconstructionError, InvalidRequestError, PoolExhaustedError
from ._spec import BLOCK_SIZE, LayerSpec, ModelCacheSpec
from ._tokens import common_prefix


@attrs.define(eq=False, repr=False)
class KVBlock:
    """Up to 256 consecutive tokens of one layer's keys and values.

    Blocks are aligned on absolute positions: a block starting at ``start`` holds
    positions ``[start, start + num_tokens)`` within ``[256 i, 256 i + 256)``. Only
    the last block of a layer (and the first of a sliding-window layer) is partial.
    The arrays are ``[1, kv_heads, num_tokens, head_dim]`` and own their memory.
    """

    #: Unique for the pool's lifetime; never reused.
    id: int
    #: Index of the layer whose cache this is.
    layer: int
    #: Absolute position of the first token held.
    start: int
    keys: mx.array | None
    values: mx.array | None
    # The arrays' length, read once: rebuilding a cache asks every block's end.
    _tokens: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._tokens = 0 if self.keys is None else int(self.keys.shape[2])

    @property
    def num_tokens(self) -> int:
        return 0 if self.keys is None else self._tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def __repr__(self) -> str:
        return f"KVBlock(id={self.id}, layer={self.layer}, tokens=[{self.start}, {self.end}))"


@attrs.frozen(eq=False)
class AgentBlocks:
    """One agent's KV cache as blocks of the pool: the blocks of each layer in position
    order, and the token ids the cache holds.

    Immutable: every turn produces a new ``AgentBlocks``; the old one stays valid until
    its blocks are freed, which is what lets a failed turn leave the agent as it was.
    Blocks may be shared with other agents (the pool counts references).
    """

    #: Per layer, its blocks in position order.
    layers: tuple[tuple[KVBlock, ...], ...]
    #: The token ids the cache holds, oldest first.
    tokens: tuple[int, ...]
    #: Positions where a shared prefix ends whose sliding-window state the blocks keep
    #: (beyond the window at the end), so that other agents can still start there.
    anchors: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        """Block references held, summed over layers."""
        return sum(len(blocks) for blocks in self.layers)

    def blocks(self) -> Iterable[KVBlock]:
        return itertools.chain.from_iterable(self.layers)

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest common prefix of the cached tokens and ``tokens``."""
        return common_prefix(self.tokens, tuple(tokens))


@attrs.frozen(kw_only=True)
class PoolStatistics:
    """A snapshot of a :class:`BlockPool`, counted in pool units of ``block_bytes``
    bytes: blocks, for every model whose layers' blocks are all the same size (see
    the module's docstring for the one case where they are not)."""

    #: Units the pool may hold in all.
    total_blocks: int
    #: Units of the distinct blocks held now (a block shared by several agents counts
    #: once).
    used_blocks: int
    #: Units promised to turns in flight, not yet filled.
    reserved_blocks: int
    #: Units neither used nor reserved (nor held by copies).
    free_blocks: int
    #: The most units ever used, reserved and held by copies at once.
    peak_blocks: int
    #: Units of the blocks referenced more than once.
    shared_blocks: int
    #: Bytes one unit costs (one block's, when a unit is a block).
    block_bytes: int
    #: Units held by copies of agents' caches outside the blocks (the caches kept for
    #: agents' next turns), given back first when a turn needs room.
    copy_blocks: int = 0

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes


class BlockPool:
    """A fixed budget of cache blocks for one model, ``total_blocks`` pool units (blocks,
    when the model's blocks are all alike).

    Blocks are counted, not preallocated: each :class:`KVBlock` owns its arrays, and
    the pool decides whether a block may exist. Reference counts let several
    ``AgentBlocks`` share a block; it is released when the last reference is freed.
    A turn reserves the blocks it may need before it runs (:meth:`reserve`), so it
    can never run out half-way.

    ``on_release`` is called with every block the pool releases (its last reference
    gone), before its arrays are dropped (:meth:`on_release` adds more).

    Not thread-safe: the engine thread is the only one that touches it.
    """

    def __init__(
        self,
        spec: ModelCacheSpec,
        *,
        total_blocks: int,
        on_release: Callable[[KVBlock], None] | None = None,
    ) -> None:
        if not isinstance(total_blocks, int) or total_blocks <= 0:
            raise InvalidRequestError(f"total_blocks must be a positive int, got {total_blocks!r}")
        self.spec = spec
        self.total_blocks = total_blocks
        self._refs: dict[int, int] = {}
        self._live: dict[int, KVBlock] = {}
        self._used = 0
        self._reserved = 0
        self._copies = 0
        self._peak = 0
        self._ids = itertools.count()
        self._on_release = [on_release] if on_release is not None else []

    @classmethod
    def from_bytes(
        cls,
        spec: ModelCacheSpec,
        budget_bytes: int,
        *,
        on_release: Callable[[KVBlock], None] | None = None,
    ) -> BlockPool:
        """A pool holding as many blocks as fit in ``budget_bytes``."""
        total = int(budget_bytes) // spec.unit_bytes
        if total < spec.max_units:
            raise InvalidRequestError(
                f"a pool of {budget_bytes} bytes holds no block: one block of this model "
                f"costs {spec.block_bytes} bytes"
            )
        return cls(spec, total_blocks=total, on_release=on_release)

    @property
    def used_blocks(self) -> int:
        """Units of the live blocks."""
        return self._used

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self._used - self._reserved - self._copies

    @property
    def copy_blocks(self) -> int:
        """Units held by copies of caches outside the blocks (:meth:`hold_copy`)."""
        return self._copies

    def units_for(self, nbytes: int) -> int:
        """Units that ``nbytes`` of device memory cost (rounded up)."""
        return -(-int(nbytes) // self.spec.unit_bytes)

    def hold_copy(self, nbytes: int) -> int | None:
        """Count a copy of ``nbytes`` (a cache kept outside the blocks) against the
        budget, if the free units allow; returns the units held (``None``: no room)."""
        units = self.units_for(nbytes)
        if units > self.free_blocks:
            return None
        self._copies += units
        self._note_peak()
        return units

    def release_copy(self, units: int) -> None:
        """Give back what :meth:`hold_copy` held."""
        self._copies -= units

    @property
    def budget_bytes(self) -> int:
        return self.total_blocks * self.spec.unit_bytes

    def statistics(self) -> PoolStatistics:
        units = self.spec.units
        return PoolStatistics(
            total_blocks=self.total_blocks,
            used_blocks=self._used,
            reserved_blocks=self._reserved,
            free_blocks=self.free_blocks,
            peak_blocks=self._peak,
            shared_blocks=sum(units(self._live[i].layer) for i, n in self._refs.items() if n > 1),
            block_bytes=self.spec.unit_bytes,
            copy_blocks=self._copies,
        )

    def on_release(self, callback: Callable[[KVBlock], None]) -> None:
        """Call ``callback`` with every block the pool releases (its last reference
        gone), before its arrays are dropped."""
        self._on_release.append(callback)

    def reserve(self, n: int) -> Reservation:
        """Set ``n`` units aside for one turn.

        Raises:
            PoolExhaustedError: if fewer than ``n`` units are free.
        """
        if n < 0:
            raise InvalidRequestError(f"cannot reserve {n} blocks")
        free = self.free_blocks
        if n > free:
            what = "blocks" if self.spec.max_units == 1 else f"units of {self.spec.unit_bytes} B"
            raise PoolExhaustedError(
                f"the block pool needs {n} free {what} but has {free} "
                f"({self.used_blocks} used, {self._reserved} reserved, of "
                f"{self.total_blocks}); free agents' caches, close agents, or give the "
                "runtime a larger pool",
                needed=n,
                free=free,
            )
        self._reserved += n
        self._note_peak()
        return Reservation(self, n)

    def allocate(self, layer: int, start: int, keys: mx.array, values: mx.array) -> KVBlock:
        """Make one block outside any reservation (raises :class:`PoolExhaustedError`)."""
        reservation = self.reserve(self.spec.units(layer))
        try:
            return reservation.allocate(layer, start, keys, values)
        finally:
            reservation.release()

    def share(self, block: KVBlock) -> KVBlock:
        """Take one more reference to a live block."""
        self._check_live(block)
        self._refs[block.id] += 1
        return block

    def share_all(self, blocks: Iterable[KVBlock]) -> list[KVBlock]:
        """Take one more reference to each of ``blocks`` (a whole history's at once:
        all are checked first, so either every block gains a reference or none does)."""
        out = list(blocks)
        live, refs = self._live, self._refs
        for block in out:
            if live.get(block.id) is not block:
                self._check_live(block)
        for block in out:
            refs[block.id] += 1
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block; a block with none left is released."""
        live, refs = self._live, self._refs
        for block in blocks:
            if live.get(block.id) is not block:
                self._check_live(block)
            left = refs[block.id] - 1
            if left:
                refs[block.id] = left
            else:
                del refs[block.id]
                del live[block.id]
                self._used -= self.spec.units(block.layer)
                for callback in self._on_release:
                    callback(block)
                block.keys = block.values = None

    def owns(self, block: KVBlock) -> bool:
        """Whether ``block`` is a live block of this pool."""
        return self._live.get(block.id) is block

    def owns_id(self, block_id: int) -> bool:
        return block_id in self._live

    def references(self, block: KVBlock) -> int:
        return self._refs.get(block.id, 0) if self.owns(block) else 0

    def _check_live(self, block: KVBlock) -> None:
        if not self.owns(block):
            raise InvalidRequestError(f"{block!r} is not a live block of this pool")

    def _note_peak(self) -> None:
        self._peak = max(self._peak, self._used + self._reserved + self._copies)

    def _take_reserved(self, layer: int, start: int, keys: mx.array, values: mx.array) -> KVBlock:
        block = KVBlock(next(self._ids), layer, start, keys, values)
        check_arrays(self.spec.layers[layer], block)
        units = self.spec.units(layer)
        self._reserved -= units
        self._used += units
        self._refs[block.id] = 1
        self._live[block.id] = block
        return block


def check_arrays(layer: LayerSpec, block: KVBlock) -> None:
    """Raise :class:`CacheReconstructionError` unless ``block``'s arrays are what its
    layer stores: ``[1, kv_heads, tokens, dim]`` of the stored dtype, within one
    256-token span. The pool takes no block that fails (so a live block needs no check
    again)."""
    keys, values = block.keys, block.values
    where = f"layer {block.layer}"
    if keys is None or values is None:
        raise CacheReconstructionError(f"{where}: {block!r} holds no data")
    expected_k = (1, layer.kv_heads, keys.shape[2], layer.stored_key_dim)
    expected_v = (1, layer.kv_heads, keys.shape[2], layer.stored_value_dim)
    if tuple(keys.shape) != expected_k or tuple(values.shape) != expected_v:
        raise CacheReconstructionError(
            f"{where}: {block!r} has keys {tuple(keys.shape)} and values "
            f"{tuple(values.shape)}; the model needs {expected_k} and {expected_v}"
        )
    if keys.dtype != layer.stored_dtype or values.dtype != layer.stored_dtype:
        raise CacheReconstructionError(
            f"{where}: {block!r} holds {keys.dtype}, the model's cache is {layer.stored_dtype}"
        )
    if (
        not 0 < keys.shape[2] <= BLOCK_SIZE
        or block.start // BLOCK_SIZE != (block.end - 1) // BLOCK_SIZE
    ):
        raise CacheReconstructionError(f"{where}: {block!r} crosses a block boundary")


class Reservation:
    """Units set aside for one turn; :meth:`release` returns what was not used."""

    def __init__(self, pool: BlockPool, count: int) -> None:
        self._pool = pool
        self.remaining = count

    def allocate(self, layer: int, start: int, keys: mx.array, values: mx.array) -> KVBlock:
        units = self._pool.spec.units(layer)
        if self.remaining < units:
            raise PoolExhaustedError(
                "a turn needed more blocks than it reserved; this is a bug in mlx-actors",
                needed=units,
                free=self.remaining,
            )
        block = self._pool._take_reserved(layer, start, keys, values)  # checks it first
        self.remaining -= units
        return block

    def grow(self, n: int) -> None:
        """Set ``n`` more units aside (raises :class:`PoolExhaustedError`)."""
        self._pool.reserve(n)  # checks and counts them
        self.remaining += n

    def give(self, n: int, other: Reservation) -> None:
        """Hand ``n`` of these units to ``other`` (the pool's count is unchanged)."""
        n = min(n, self.remaining)
        self.remaining -= n
        other.remaining += n

    def release(self) -> None:
        self._pool._reserved -= self.remaining
        self.remaining = 0
