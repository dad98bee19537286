"""Blocks to an mlx-lm cache when a sequence is inserted, and a cache back to blocks when it
is finished (or a shared prefix is published), reusing every block the index holds.

A global layer's blocks hold its whole history, so a later turn can start from any
earlier position. A sliding-window layer's cache holds only its last ``window`` tokens,
so by itself it could only continue from the very end: if the next rendering of the
conversation differs from the cache anywhere (a stop string cut from the reply's text,
a template that trims, a reply that re-encodes differently), nothing could be reused.
So when a turn's cache is cut into blocks, its sliding layers also keep the tokens
their ring overwrote last (the *margin*, :mod:`._margin`: ``SLIDING_MARGIN`` tokens
before the window), so the history's last tokens can be rewound, and the blocks the turn
started from (its *checkpoint*: the window before the turn's first new token). When the
turn added at most about a window of tokens, the runs of blocks meet and the layer can
restart anywhere in the turn; when it added more, it can still restart where the turn
began. The cost is those blocks: the margin's, and up to one more window per sliding
layer for the checkpoint, until the next turn replaces them with its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from ...errors import CacheReconstructionError
from ..caches._dequantized import DequantizedKVCache, QuantizedMarginRotatingKVCache
from ..caches._gather import Part, gather
from ..caches._global import GlobalKVCache
from ..caches._margin import MarginRotatingKVCache
from ..caches._paged import PagedKVCache
from ..caches._quantized import BlockQuantizedKVCache, pack, unpack
from ._pool import AgentBlocks, BlockPool, KVBlock, Reservation
from ._prefix import Node, Piece, PrefixIndex, cover, runs_of
from ._spec import (
    BLOCK_SIZE,
    SLIDING_MARGIN,
    LayerKind,
    LayerSpec,
    ModelCacheSpec,
    max_blocks_for_layer,
)


def check_blocks(pool: BlockPool, blocks: AgentBlocks) -> None:
    """Raise :class:`CacheReconstructionError` unless ``blocks`` fit ``pool``'s spec and
    are all live blocks of it. A block's arrays were checked when the pool took it
    (:meth:`BlockPool.allocate`), so this walks each layer's blocks once: liveness,
    order, and the positions they cover."""
    spec = pool.spec
    if len(blocks.layers) != spec.num_layers:
        raise CacheReconstructionError(
            f"the blocks hold {len(blocks.layers)} layers but the model has "
            f"{spec.num_layers}; they were made by another model"
        )
    total = blocks.num_tokens
    owns = pool.owns
    for index, (layer, layer_blocks) in enumerate(zip(spec.layers, blocks.layers, strict=True)):
        where = f"layer {index}"
        for block in layer_blocks:
            if not owns(block):
                raise CacheReconstructionError(
                    f"{where}: {block!r} is not a live block of this pool (already freed, "
                    "or made by another runtime); the agent's cache is gone"
                )
        if total == 0:
            if layer_blocks:
                raise CacheReconstructionError(f"{where}: blocks held for an empty history")
            continue
        if not layer_blocks:
            raise CacheReconstructionError(f"{where}: no blocks for {total} cached tokens")
        if layer.kind is LayerKind.GLOBAL:
            at = 0  # each block starts where the one before it ends, the first at 0
            for block in layer_blocks:
                if block.start != at:
                    _misplaced(where, layer_blocks)
                at = block.end
            if at != total:
                raise CacheReconstructionError(
                    f"{where}: blocks end at token {at} but the history has {total} tokens"
                )
            continue
        for before, after in itertools.pairwise(layer_blocks):
            if (before.start, before.end) >= (after.start, after.end):
                raise CacheReconstructionError(
                    f"{where}: blocks are out of order ({before!r} then {after!r})"
                )
        if layer_blocks[-1].end != total:
            raise CacheReconstructionError(
                f"{where}: blocks end at token {layer_blocks[-1].end} but the history has "
                f"{total} tokens"
            )
        # A sliding layer may also keep, before and inside its window, the blocks of
        # shared boundaries (anchors): what matters is that its window is covered.
        needed = max(0, total - layer.window) if layer.window is not None else 0
        if not any(
            start <= needed and end == total
            for start, end in runs_of([(b, b.end) for b in layer_blocks])
        ):
            raise CacheReconstructionError(
                f"{where}: the blocks do not hold tokens [{needed}, {total}), which the layer needs"
            )


def _misplaced(where: str, layer_blocks: Sequence[KVBlock]) -> NoReturn:
    """Raise the error that says how a global layer's blocks fail to run from 0."""
    if layer_blocks[0].start != 0:
        raise CacheReconstructionError(
            f"{where}: blocks start at token {layer_blocks[0].start} but the layer needs "
            "tokens from 0"
        )
    for before, after in itertools.pairwise(layer_blocks):
        if (before.start, before.end) >= (after.start, after.end):
            raise CacheReconstructionError(
                f"{where}: blocks are out of order ({before!r} then {after!r})"
            )
        if before.end != after.start:
            raise CacheReconstructionError(
                f"{where}: blocks are not contiguous ({before!r} then {after!r})"
            )
    raise AssertionError("unreachable: the blocks run from 0")


def pieces(spec: ModelCacheSpec, blocks: AgentBlocks, keep: int) -> tuple[tuple[Piece, ...], ...]:
    """The pieces of ``blocks`` each layer needs for a cache of its first ``keep`` tokens
    (one block per position where kept boundaries overlap the window's blocks)."""
    layers = []
    for layer, layer_blocks in zip(spec.layers, blocks.layers, strict=True):
        lo = 0 if layer.window is None else max(0, keep - layer.window)
        layers.append(cover([(b, b.end) for b in layer_blocks], lo, keep) if keep else ())
    return tuple(layers)


def to_cache(
    spec: ModelCacheSpec,
    blocks: AgentBlocks | Sequence[Sequence[Piece]],
    keep: int,
    *,
    room: int = 0,
    paged: bool = False,
) -> list[Any]:
    """An mlx-lm per-layer cache holding the first ``keep`` tokens, from ``blocks`` (an
    agent's, or per layer the pieces a :class:`~._prefix.Source` found).

    Only the tokens a layer needs are copied (a sliding layer needs its last
    ``window``), in one copy per array (one launch per layer on a CUDA GPU,
    :mod:`._gather`). With ``room``, a global layer's arrays have
    space for that many more tokens (rounded up to a block), so that updating the
    cache in place does not copy it again. The copies are lazy: MLX runs them when the
    cache is first used. ``paged``: a global layer (unquantized) copies nothing, its
    cache is the pieces (:class:`~._paged.PagedKVCache`, to join the batch).
    """
    layers = pieces(spec, blocks, keep) if isinstance(blocks, AgentBlocks) else blocks
    tail = -(keep + room) % BLOCK_SIZE + room if room else 0
    caches: list[Any] = []
    for layer, layer_pieces in zip(spec.layers, layers, strict=True):
        lo = 0 if layer.window is None else max(0, keep - layer.window)
        if paged and layer.kind is LayerKind.GLOBAL and layer.quantization is None:
            caches.append(PagedKVCache(*_parts(layer_pieces)))
            continue
        extra = tail if layer.kind is LayerKind.GLOBAL else 0
        keys, values = gather(*_parts(layer_pieces), extra)
        q = layer.quantization
        if q is not None and not q.dequantize and layer.kind is LayerKind.GLOBAL:
            cache: Any = BlockQuantizedKVCache(group_size=q.group_size, bits=q.bits)
            cache.keys = unpack(keys, layer.key_dim, layer.dtype, q)
            cache.values = unpack(values, layer.value_dim, layer.dtype, q)
            cache.offset = keep
            caches.append(cache)
            continue
        if layer.kind is LayerKind.GLOBAL:
            cache = global_cache(layer)  # a dequantized one keeps the packed arrays
        else:
            cache = window_cache(layer)  # a quantized one keeps the blocks' packed arrays
            cache._idx = keep - lo
        cache.keys, cache.values, cache.offset = keys, values, keep
        caches.append(cache)
    return caches


def over_blocks(
    spec: ModelCacheSpec, layers: Sequence[Sequence[Piece]], keep: int, cache: list[Any]
) -> list[Any]:
    """``cache`` (one holding at least ``keep`` tokens, the first ``keep`` of which
    ``layers`` hold as pieces of blocks) as it joins a paged batch: its global layers
    (unquantized) become :class:`PagedKVCache` rows, read from the pieces; only their
    tokens after ``keep`` stay in ``cache``'s arrays (a view of them, for the batch to
    copy as it merges them)."""
    out: list[Any] = []
    for layer, c, layer_pieces in zip(spec.layers, cache, layers or [()] * len(cache), strict=True):
        if (
            layer.kind is not LayerKind.GLOBAL
            or layer.quantization is not None
            or type(c) is not GlobalKVCache
        ):
            out.append(c)
            continue
        if not keep or c.offset < keep:  # no history from the blocks: every token recent
            out.append(PagedKVCache((), (), c))
            continue
        tail = GlobalKVCache()
        if c.offset > keep:
            tail.keys = c.keys[..., keep : c.offset, :]
            tail.values = c.values[..., keep : c.offset, :]
            tail.offset = c.offset - keep
        out.append(PagedKVCache(*_parts(layer_pieces), tail))
    return out


def _parts(pieces: Sequence[Piece]) -> tuple[list[Part], list[Part]]:
    """A layer's pieces as the gather's parts: keys', values'."""
    return (
        [(b.keys, b.start, a, z) for b, a, z in pieces if b.keys is not None],
        [(b.values, b.start, a, z) for b, a, z in pieces if b.values is not None],
    )


def make_cache(spec: ModelCacheSpec) -> list[Any]:
    """An empty per-layer cache for a model with ``spec``: :func:`global_cache` for
    global layers and :func:`window_cache` for sliding-window ones."""
    return [
        window_cache(layer) if layer.kind is LayerKind.SLIDING else global_cache(layer)
        for layer in spec.layers
    ]


def global_cache(layer: LayerSpec) -> Any:
    """An empty cache for a global layer: mlx-lm's ``KVCache`` (batched one layer at a
    time: :class:`~._global.GlobalKVCache`); with ``kv_bits``,
    :class:`~._quantized.BlockQuantizedKVCache` (mlx-lm's quantized attention), or
    :class:`~._dequantized.DequantizedKVCache` where that cannot run."""
    q = layer.quantization
    if q is None:
        return GlobalKVCache()
    if q.dequantize:
        return DequantizedKVCache(q)
    return BlockQuantizedKVCache(group_size=q.group_size, bits=q.bits)


def window_cache(layer: LayerSpec) -> MarginRotatingKVCache:
    """An empty cache for a sliding-window layer."""
    assert layer.window is not None
    if layer.quantization is not None:
        return QuantizedMarginRotatingKVCache(layer.window, layer.quantization)
    return MarginRotatingKVCache(layer.window)


def blocks_needed(spec: ModelCacheSpec, final_tokens: int, shared_tokens: int) -> int:
    """Pool units of the new blocks a turn may need: the final history's blocks, less
    the full blocks of global layers it takes unchanged from blocks that already exist."""
    shared = shared_tokens // BLOCK_SIZE
    total = 0
    for i, layer in enumerate(spec.layers):
        n = max_blocks_for_layer(layer, final_tokens)
        total += (n - shared if layer.kind is LayerKind.GLOBAL else n) * spec.units(i)
    return total


def checkpoint_copies(spec: ModelCacheSpec, layers: Sequence[Sequence[Piece]]) -> int:
    """Pool units of the blocks cutting a cache copies to keep the sliding layers'
    checkpoint (the pieces ``layers`` a sequence started from): one block per piece that
    ends inside its block."""
    return sum(
        spec.units(i)
        for i, (layer, layer_pieces) in enumerate(zip(spec.layers, layers, strict=False))
        if layer.kind is LayerKind.SLIDING
        for block, _, z in layer_pieces
        if z < block.end
    )


def checkpoint_blocks(spec: ModelCacheSpec, at: int) -> int:
    """Pool units of the blocks a prefix of ``at`` tokens needs beyond its whole chunks
    of global layers: the last partial chunk of each global layer and every block of
    the sliding ones."""
    total = 0
    for i, layer in enumerate(spec.layers):
        if layer.kind is LayerKind.GLOBAL:
            total += spec.units(i) if at % BLOCK_SIZE else 0
        else:
            total += max_blocks_for_layer(layer, at) * spec.units(i)
    return total


class Cut:
    """A cache about to become blocks: for each block, the live one the index holds for
    the same tokens (pinned already: a reference is taken), or the positions to copy.
    Make it with :func:`plan_cut`; then :meth:`apply` it, or :meth:`abandon` it."""

    def __init__(
        self,
        pool: BlockPool,
        index: PrefixIndex,
        tokens: Sequence[int],
        nodes: list[Node],
        anchors: tuple[int, ...],
    ) -> None:
        self.pool, self.index, self.tokens, self.nodes = pool, index, tokens, nodes
        self.anchors = anchors
        #: Per layer: the blocks shared (pinned), and the copies to make as
        #: (node, first position, keys, values).
        self.shared: list[list[KVBlock]] = []
        #: Per layer: the first blocks, in order, before every shared and copied one
        #: (pinned too).
        self.heads: list[list[KVBlock]] = [[] for _ in pool.spec.layers]
        self.copies: list[list[tuple[Node, int, mx.array, mx.array]]] = []

    @property
    def new_blocks(self) -> int:
        """Pool units of the blocks :meth:`apply` makes (draws from its reservation)."""
        return sum(len(layer) * self.pool.spec.units(i) for i, layer in enumerate(self.copies))

    def apply(self, reservation: Reservation) -> AgentBlocks:
        """Make the new blocks from ``reservation``; the ``AgentBlocks`` holds them and
        the pinned ones. On error every block is freed again."""
        made: list[KVBlock] = []
        try:
            layers = []
            for number, (shared, copies) in enumerate(zip(self.shared, self.copies, strict=True)):
                out = {b.id: b for b in shared}
                for node, start, keys, values in copies:
                    block = reservation.allocate(number, start, keys, values)
                    made.append(block)
                    self.index.attach(node, block)
                    out[block.id] = block
                rest = sorted(out.values(), key=lambda b: (b.start, b.end))
                layers.append((*self.heads[number], *rest))
        except BaseException:
            self.pool.free(made)
            self.abandon()
            raise
        return AgentBlocks(tuple(layers), tuple(self.tokens), self.anchors)

    def abandon(self) -> None:
        """Drop the pinned blocks and the nodes made for nothing."""
        for shared in (*self.heads, *self.shared):
            self.pool.free(shared)
        self.shared = [[] for _ in self.shared]
        self.heads = [[] for _ in self.heads]
        for node in reversed(self.nodes):
            self.index.prune(node)


def plan_cut(
    pool: BlockPool,
    cache: Sequence[Any],
    tokens: Sequence[int],
    *,
    index: PrefixIndex,
    namespace: Hashable = None,
    path: Sequence[Node] = (),
    anchors: Sequence[int] = (),
    checkpoint: Sequence[Sequence[Piece]] = (),
    source: Sequence[Sequence[Piece]] = (),
    pinned: list[KVBlock] | None = None,
) -> Cut:
    """Plan cutting a cache holding ``tokens`` into blocks: every block the index
    already holds for these tokens is shared, the rest copied. Sliding layers keep the
    blocks that overlap their window, those of the ``anchors`` (shared boundaries)
    that are still live, and the blocks of the ``checkpoint`` pieces (per layer, what
    the sequence's cache was built from when it started).

    ``source``: per layer, the pieces the cache was built from, where ``path`` (the
    nodes of their whole chunks) came with them: a global layer keeps their blocks for
    those chunks as they are (what the cache holds there), without looking them up.
    ``pinned``: references to those blocks that the blocks cut take over (each taken
    out of the list; a block not in it gains a reference)."""
    spec = pool.spec
    total = len(tokens)
    nodes = index.chain(namespace, tokens, total, path) if total else []
    live, kept = _anchor_blocks(spec, index, namespace, tokens, nodes, anchors)
    cut = Cut(pool, index, tokens, list(nodes), live)
    try:
        whole = len(path) if total >= len(path) * BLOCK_SIZE else 0
        cut.heads = _heads(pool, source, whole, pinned)
        for number, (layer, c) in enumerate(zip(spec.layers, cache, strict=True)):
            keys, values = c.keys, c.values
            if isinstance(c, RotatingKVCache) and keys is not None:
                keys, values = c._temporal_order(keys), c._temporal_order(values)
            if isinstance(keys, tuple):  # quantized: blocks keep the triple packed
                keys, values = _Packed(keys, c.offset), _Packed(values, c.offset)
            held = int(keys.shape[2]) if keys is not None else 0
            if layer.kind is LayerKind.GLOBAL:
                if c.offset != total or held < total:
                    raise CacheReconstructionError(
                        f"layer {number}: the cache holds {c.offset} tokens, expected {total}"
                    )
                oldest, first = 0, 0
            else:
                # The rotating cache holds its last `held` tokens in temporal order.
                assert layer.window is not None
                held = min(held, c.offset)
                oldest = total - held
                if c.offset != total or held < min(total, layer.window):
                    raise CacheReconstructionError(
                        f"layer {number}: the cache holds {held} of {c.offset} tokens, "
                        f"expected the last {min(total, layer.window)} of {total}"
                    )
                # The tokens it overwrote last (the margin) come before them.
                lo = max(0, total - layer.window - SLIDING_MARGIN)
                margin = c.margin(lo) if isinstance(c, MarginRotatingKVCache) else None
                if margin is not None and margin[0] < oldest:
                    start, before_k, before_v = margin
                    keys = mx.concatenate([before_k[..., : oldest - start, :], keys], axis=2)
                    values = mx.concatenate([before_v[..., : oldest - start, :], values], axis=2)
                    oldest = start
                first = max(oldest, lo) // BLOCK_SIZE
            shared: dict[int, KVBlock] = {}
            copies = []
            cut.shared.append([])
            first = max(first, len(cut.heads[number]))
            for node in nodes[first:]:
                want = max(oldest, node.start)
                block = node.blocks.get(number)
                if block is not None and block.start <= want:
                    shared[block.id] = block
                else:
                    lo, hi = want - oldest, node.end - oldest
                    copies.append(
                        (
                            node,
                            want,
                            mx.contiguous(keys[..., lo:hi, :]),
                            mx.contiguous(values[..., lo:hi, :]),
                        )
                    )
            for block in kept[number]:
                shared.setdefault(block.id, block)
            if layer.kind is LayerKind.SLIDING and number < len(checkpoint):
                _keep_checkpoint(
                    cut, nodes, number, checkpoint[number], oldest, shared, copies, namespace
                )
            for block in shared.values():
                cut.shared[-1].append(pool.share(block))
            cut.copies.append(copies)
    except BaseException:
        cut.abandon()
        raise
    return cut


def _heads(
    pool: BlockPool, source: Sequence[Sequence[Piece]], whole: int, pinned: list[KVBlock] | None
) -> list[list[KVBlock]]:
    """Per layer, the blocks of the first ``whole`` chunks a global layer keeps from
    ``source`` (none where its pieces there are not whole blocks from 0), each with a
    reference taken over from ``pinned`` or taken anew."""
    spec = pool.spec
    heads: list[list[KVBlock]] = [[] for _ in spec.layers]
    if not whole or not source:
        return heads
    for number, (layer, layer_pieces) in enumerate(zip(spec.layers, source, strict=False)):
        if layer.kind is not LayerKind.GLOBAL or len(layer_pieces) < whole:
            continue
        block, a, z = layer_pieces[whole - 1]
        # Contiguous from 0, each inside one chunk: whole blocks if the last one is.
        if (a, z, block.start, block.end) == ((whole - 1) * BLOCK_SIZE, whole * BLOCK_SIZE) * 2:
            heads[number] = [b for b, _, _ in layer_pieces[:whole]]
    missing = {b.id: b for head in heads for b in head}
    rest = []
    for block in pinned or ():
        if missing.pop(block.id, None) is None:
            rest.append(block)
    pool.share_all(missing.values())  # (raises before anything changed)
    if pinned is not None:
        pinned[:] = rest
    return heads


class _Packed:
    """A quantized cache's triple, sliced along its tokens as one packed array would be
    (only the slices taken are packed: a copy of the blocks made, not of the cache)."""

    def __init__(self, triple: tuple[mx.array, mx.array, mx.array], offset: int) -> None:
        self.triple = triple
        self.shape = (*triple[0].shape[:2], min(offset, triple[0].shape[2]), 0)

    def __getitem__(self, index: Any) -> mx.array:
        return pack(tuple(part[index] for part in self.triple))  # type: ignore[arg-type]


def _keep_checkpoint(
    cut: Cut,
    nodes: Sequence[Node],
    number: int,
    pieces: Sequence[Piece],
    oldest: int,
    shared: dict[int, KVBlock],
    copies: list[tuple[Node, int, mx.array, mx.array]],
    namespace: Hashable,
) -> None:
    """Add to layer ``number``'s blocks those of the ``pieces`` a sliding layer's cache
    started from, where they reach before ``oldest`` (what the layer's cache holds now).
    A block used to its end belongs to this history and is shared; one used only in
    part (the history changed inside it, or it came from a longer one) is copied up to
    where it was used, as the block of a node ending there."""
    spans = {(b.start, b.end) for b in shared.values()}
    spans.update((start, node.end) for node, start, _, _ in copies)
    for block, a, z in pieces:
        if a >= oldest or block.id in shared or (a, z) in spans:
            continue
        if z == block.end:
            shared[block.id] = block
            continue
        depth = (z - 1) // BLOCK_SIZE
        if depth < len(nodes) and nodes[depth].end == z:
            node = nodes[depth]
        else:
            node = cut.index.chain(namespace, cut.tokens, z, nodes)[-1]
            cut.nodes.append(node)
        held = node.blocks.get(number)
        if held is not None and held.start <= a:
            shared[held.id] = held
            continue
        keys, values = block.keys, block.values
        assert keys is not None and values is not None
        lo, hi = a - block.start, z - block.start
        copies.append(
            (
                node,
                a,
                mx.contiguous(keys[..., lo:hi, :]),
                mx.contiguous(values[..., lo:hi, :]),
            )
        )


def from_cache(
    pool: BlockPool,
    cache: Sequence[Any],
    tokens: Sequence[int],
    reservation: Reservation,
    *,
    index: PrefixIndex | None = None,
    namespace: Hashable = None,
    path: Sequence[Node] = (),
    anchors: Sequence[int] = (),
    checkpoint: Sequence[Sequence[Piece]] = (),
    source: Sequence[Sequence[Piece]] = (),
    pinned: list[KVBlock] | None = None,
) -> AgentBlocks:
    """Cut a cache holding ``tokens`` into blocks (:func:`plan_cut`), the new ones drawn
    from ``reservation``. On error every block taken is freed again. The copies are
    lazy: evaluate the new blocks (:func:`evaluate`) before the cache is dropped."""
    index = index if index is not None else PrefixIndex(pool.spec)
    cut = plan_cut(
        pool,
        cache,
        tokens,
        index=index,
        namespace=namespace,
        path=path,
        anchors=anchors,
        checkpoint=checkpoint,
        source=source,
        pinned=pinned,
    )
    return cut.apply(reservation)


def _anchor_blocks(
    spec: ModelCacheSpec,
    index: PrefixIndex,
    namespace: Hashable,
    tokens: Sequence[int],
    nodes: Sequence[Node],
    anchors: Sequence[int],
) -> tuple[tuple[int, ...], list[list[KVBlock]]]:
    """The anchors whose window every sliding layer still has live blocks for, and those
    blocks per layer (other anchors are dropped)."""
    kept: list[list[KVBlock]] = [[] for _ in spec.layers]
    if not spec.sliding_layers:
        return (), kept
    live = []
    for at in sorted(set(anchors)):
        if not 0 < at < len(tokens):
            continue
        depth = (at - 1) // BLOCK_SIZE
        last: Node | None = nodes[depth]
        if at % BLOCK_SIZE:
            parent = nodes[depth - 1] if depth else index.root(namespace)
            last = parent.children.get(tuple(tokens[depth * BLOCK_SIZE : at]))
        if last is None:
            continue
        found: list[tuple[int, KVBlock]] = []
        for number, layer in enumerate(spec.layers):
            if layer.window is None:
                continue
            lo = max(0, at - layer.window)
            chain = [*nodes[lo // BLOCK_SIZE : depth], last]
            blocks = [node.blocks.get(number) for node in chain]
            if not all(
                b is not None and b.start <= max(lo, node.start)
                for b, node in zip(blocks, chain, strict=True)
            ):
                break
            found.extend((number, b) for b in blocks if b is not None)
        else:
            live.append(at)
            for number, block in found:
                kept[number].append(block)
    return tuple(live), kept


def evaluate(blocks: Sequence[AgentBlocks]) -> None:
    """Run the copies of new blocks, of any number of sequences, in one evaluation."""
    arrays = [a for b in blocks for block in b.blocks() for a in (block.keys, block.values)]
    mx.eval([a for a in arrays if a is not None])
