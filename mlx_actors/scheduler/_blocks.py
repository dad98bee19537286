"""Blocks to an mlx-lm cache when a sequence is inserted, and a finished cache back to blocks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..errors import CacheReconstructionError
from ._pool import AgentBlocks, BlockPool, KVBlock, Reservation
from ._spec import BLOCK_SIZE, LayerKind, LayerSpec, ModelCacheSpec, max_blocks_for_layer


def check_blocks(pool: BlockPool, blocks: AgentBlocks) -> None:
    """Raise :class:`CacheReconstructionError` unless ``blocks`` fit ``pool``'s spec and
    are all live blocks of it."""
    spec = pool.spec
    if len(blocks.layers) != spec.num_layers:
        raise CacheReconstructionError(
            f"the blocks hold {len(blocks.layers)} layers but the model has "
            f"{spec.num_layers}; they were made by another model"
        )
    total = blocks.num_tokens
    for index, (layer, layer_blocks) in enumerate(zip(spec.layers, blocks.layers, strict=True)):
        where = f"layer {index}"
        for block in layer_blocks:
            if not pool.owns(block):
                raise CacheReconstructionError(
                    f"{where}: {block!r} is not a live block of this pool (already freed, "
                    "or made by another runtime); the agent's cache is gone"
                )
            _check_arrays(where, layer, block)
        if total == 0:
            if layer_blocks:
                raise CacheReconstructionError(f"{where}: blocks held for an empty history")
            continue
        if not layer_blocks:
            raise CacheReconstructionError(f"{where}: no blocks for {total} cached tokens")
        for before, after in itertools.pairwise(layer_blocks):
            if before.end != after.start:
                raise CacheReconstructionError(
                    f"{where}: blocks are not contiguous ({before!r} then {after!r})"
                )
        first, last = layer_blocks[0], layer_blocks[-1]
        if last.end != total:
            raise CacheReconstructionError(
                f"{where}: blocks end at token {last.end} but the history has {total} tokens"
            )
        needed = 0 if layer.window is None else max(0, total - layer.window)
        if first.start > needed:
            raise CacheReconstructionError(
                f"{where}: blocks start at token {first.start} but the layer needs "
                f"tokens from {needed}"
            )


def _check_arrays(where: str, layer: LayerSpec, block: KVBlock) -> None:
    keys, values = block.keys, block.values
    if keys is None or values is None:
        raise CacheReconstructionError(f"{where}: {block!r} holds no data")
    expected_k = (1, layer.kv_heads, keys.shape[2], layer.key_dim)
    expected_v = (1, layer.kv_heads, keys.shape[2], layer.value_dim)
    if tuple(keys.shape) != expected_k or tuple(values.shape) != expected_v:
        raise CacheReconstructionError(
            f"{where}: {block!r} has keys {tuple(keys.shape)} and values "
            f"{tuple(values.shape)}; the model needs {expected_k} and {expected_v}"
        )
    if keys.dtype != layer.dtype or values.dtype != layer.dtype:
        raise CacheReconstructionError(
            f"{where}: {block!r} holds {keys.dtype}, the model's cache is {layer.dtype}"
        )
    if (
        not 0 < keys.shape[2] <= BLOCK_SIZE
        or block.start // BLOCK_SIZE != (block.end - 1) // BLOCK_SIZE
    ):
        raise CacheReconstructionError(f"{where}: {block!r} crosses a block boundary")


def max_trim(spec: ModelCacheSpec, blocks: AgentBlocks) -> int:
    """How many tokens can be dropped from the end of ``blocks`` and the cache rebuilt.

    Global layers can lose any number. A sliding layer that has dropped old tokens
    can only go back as far as the oldest token it still holds allows.
    """
    total = blocks.num_tokens
    limit = total
    for layer, layer_blocks in zip(spec.layers, blocks.layers, strict=True):
        if layer.window is None or not layer_blocks or layer_blocks[0].start == 0:
            continue
        # After dropping n tokens the layer needs positions from total - n - window.
        limit = min(limit, total - layer.window - layer_blocks[0].start)
    return max(0, limit)


def to_cache(spec: ModelCacheSpec, blocks: AgentBlocks, keep: int) -> list[Any]:
    """An mlx-lm per-layer cache holding the first ``keep`` tokens of ``blocks``.

    Only the tokens a layer needs are copied (a sliding layer needs its last
    ``window``). The copies are lazy: MLX runs them when the batch is built.
    """
    caches: list[Any] = []
    for layer, layer_blocks in zip(spec.layers, blocks.layers, strict=True):
        lo = 0 if layer.window is None else max(0, keep - layer.window)
        keys = _gather([(b, b.keys) for b in layer_blocks], lo, keep)
        values = _gather([(b, b.values) for b in layer_blocks], lo, keep)
        if layer.kind is LayerKind.GLOBAL:
            cache: Any = KVCache()
        else:
            cache = RotatingKVCache(max_size=layer.window, keep=0)
            cache._idx = keep - lo
        cache.keys, cache.values, cache.offset = keys, values, keep
        caches.append(cache)
    return caches


def _gather(parts: Sequence[tuple[KVBlock, mx.array | None]], lo: int, hi: int) -> mx.array:
    """Positions ``[lo, hi)`` of a layer, from its blocks' arrays."""
    pieces = [
        a[..., max(lo, b.start) - b.start : min(hi, b.end) - b.start, :]
        for b, a in parts
        if a is not None and b.start < hi and b.end > lo
    ]
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def blocks_needed(spec: ModelCacheSpec, final_tokens: int, shared_tokens: int) -> int:
    """New blocks a turn may need: the final history's blocks, less the full blocks of
    global layers it keeps unchanged from the previous cache."""
    shared = shared_tokens // BLOCK_SIZE
    total = 0
    for layer in spec.layers:
        n = max_blocks_for_layer(layer, final_tokens)
        total += n - shared if layer.kind is LayerKind.GLOBAL else n
    return total


def from_cache(
    pool: BlockPool,
    cache: Sequence[Any],
    tokens: Sequence[int],
    reservation: Reservation,
    previous: AgentBlocks | None,
    unchanged: int,
) -> AgentBlocks:
    """Cut a finished sequence's cache into blocks.

    Full blocks of global layers that lie within the first ``unchanged`` tokens are
    shared with ``previous`` instead of copied: only the tail is copied. Sliding
    layers keep the blocks that overlap their window. On error every block taken is
    freed again. The copies are lazy: evaluate the new blocks (:func:`evaluate`) before
    the finished cache is dropped, so that they hold their own memory.
    """
    spec = pool.spec
    total = len(tokens)
    shared = unchanged // BLOCK_SIZE if previous is not None else 0
    made: list[KVBlock] = []
    taken: list[KVBlock] = []
    try:
        layers = []
        for index, (layer, c) in enumerate(zip(spec.layers, cache, strict=True)):
            keys, values = c.keys, c.values
            held = int(keys.shape[2]) if keys is not None else 0
            if layer.kind is LayerKind.GLOBAL:
                if c.offset != total or held < total:
                    raise CacheReconstructionError(
                        f"layer {index}: the finished cache holds {c.offset} tokens, "
                        f"expected {total}"
                    )
                kept = previous.layers[index][:shared] if previous is not None else ()
                out = [pool.share(b) for b in kept]
                taken.extend(out)
                first = shared * BLOCK_SIZE
                oldest = 0
            else:
                # The rotating cache holds its last `held` tokens in temporal order.
                assert layer.window is not None
                oldest = total - held
                if held < min(total, layer.window):
                    raise CacheReconstructionError(
                        f"layer {index}: the finished cache holds {held} tokens, fewer "
                        f"than its window of {layer.window}"
                    )
                first = max(oldest, max(0, total - layer.window) // BLOCK_SIZE * BLOCK_SIZE)
                out = []
            start = first
            while start < total:
                end = min((start // BLOCK_SIZE + 1) * BLOCK_SIZE, total)
                block = reservation.allocate(
                    index,
                    start,
                    mx.contiguous(keys[..., start - oldest : end - oldest, :]),
                    mx.contiguous(values[..., start - oldest : end - oldest, :]),
                )
                made.append(block)
                out.append(block)
                start = end
            layers.append(tuple(out))
    except BaseException:
        pool.free(made)
        pool.free(taken)
        raise
    return AgentBlocks(tuple(layers), tuple(tokens))


def evaluate(blocks: Sequence[AgentBlocks]) -> None:
    """Run the copies of new blocks, of any number of sequences, in one evaluation."""
    arrays = [a for b in blocks for block in b.blocks() for a in (block.keys, block.values)]
    mx.eval([a for a in arrays if a is not None])
