"""What one model's KV cache looks like, layer by layer, and what a block of it costs."""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs
import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ...errors import UnsupportedModelError
from ..caches._margin import SLIDING_MARGIN as SLIDING_MARGIN
from ..caches._quantized import KVQuantization

#: Tokens per block: the growth step of mlx-lm's ``KVCache``.
BLOCK_SIZE = 256


class LayerKind(enum.Enum):
    """How a layer's cache grows with the history."""

    #: Full attention: the cache holds every token.
    GLOBAL = "global"
    #: Sliding-window attention: the cache holds the last ``window`` tokens.
    SLIDING = "sliding"


@attrs.frozen(kw_only=True)
class LayerSpec:
    """The cache of one layer."""

    #: Global or sliding-window.
    kind: LayerKind
    #: Tokens a sliding-window layer keeps (``None`` for global layers).
    window: int | None
    #: Key/value heads.
    kv_heads: int
    #: Size of one key head.
    key_dim: int
    #: Size of one value head.
    value_dim: int
    #: Element type of keys and values (of the model's computation).
    dtype: mx.Dtype
    #: How the cache is quantized (``kv_bits``), if it is.
    quantization: KVQuantization | None = None

    @property
    def stored_dtype(self) -> mx.Dtype:
        """Element type of a block's arrays: ``uint16`` for a quantized cache (its
        data, scales and biases packed: :mod:`._quantized`)."""
        return self.dtype if self.quantization is None else mx.uint16

    @property
    def stored_key_dim(self) -> int:
        """Last dimension of a block's keys array."""
        q = self.quantization
        return self.key_dim if q is None else q.width(self.key_dim, self.dtype)

    @property
    def stored_value_dim(self) -> int:
        q = self.quantization
        return self.value_dim if q is None else q.width(self.value_dim, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one full block (keys and values) of this layer."""
        per_token = self.kv_heads * (self.stored_key_dim + self.stored_value_dim)
        return per_token * self.stored_dtype.size * BLOCK_SIZE


@attrs.frozen(kw_only=True)
class ModelCacheSpec:
    """The shape of a model's KV cache, read off the loaded model.

    Use :meth:`from_model`; it refuses models whose cache the engine cannot keep
    exactly as blocks.
    """

    #: One entry per layer, in model order.
    layers: tuple[LayerSpec, ...]
    #: The longest sequence the model was trained for (``None`` if it does not say).
    context_length: int | None = None
    #: Tokens per block.
    block_size: int = BLOCK_SIZE
    #: Pool units per layer's block (see :attr:`unit_bytes`).
    _units: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)
    _unit_bytes: int = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        sizes = [layer.block_bytes for layer in self.layers]
        unit = math.gcd(*sizes) if sizes else 1
        object.__setattr__(self, "_unit_bytes", unit)
        object.__setattr__(self, "_units", tuple(size // unit for size in sizes))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def block_bytes(self) -> int:
        """Bytes of the largest block of any layer (``pool_blocks`` counts these)."""
        return max(layer.block_bytes for layer in self.layers)

    @property
    def unit_bytes(self) -> int:
        """Bytes of one unit of the pool: the greatest common divisor of the layers'
        block sizes. A block costs :meth:`units` of them, so that a pool counts what
        each block really takes when the layers' blocks differ (the global layers'
        quantized blocks beside the sliding layers' unquantized ones); when they are
        all alike, as in most models, a unit is a block."""
        return self._unit_bytes

    def units(self, layer: int) -> int:
        """Pool units one block of layer ``layer`` costs."""
        return self._units[layer]

    @property
    def max_units(self) -> int:
        """Pool units of the largest block."""
        return max(self._units, default=1)

    @property
    def sliding_layers(self) -> int:
        return sum(layer.kind is LayerKind.SLIDING for layer in self.layers)

    def blocks_held(self, tokens: int) -> int:
        """Blocks, summed over layers, that a cache of ``tokens`` tokens reads (its
        windows, not the margins: see :func:`max_blocks_for_layer`)."""
        return sum(blocks_for_layer(layer, tokens) for layer in self.layers)

    def units_held(self, tokens: int) -> int:
        """Pool units those blocks cost."""
        return sum(
            blocks_for_layer(layer, tokens) * units
            for layer, units in zip(self.layers, self._units, strict=True)
        )

    @property
    def quantization(self) -> KVQuantization | None:
        """How the cache is quantized, if it is (every layer alike)."""
        return next((layer.quantization for layer in self.layers if layer.quantization), None)

    @classmethod
    def from_model(
        cls, model: Module, *, quantization: KVQuantization | None = None
    ) -> ModelCacheSpec:
        """Read the cache spec of ``model`` by running one token through a fresh cache;
        with ``quantization``, its blocks hold quantized keys and values.

        Sliding-window layers (Gemma 3) are quantized alike, in the caches of
        :mod:`._dequantized` (mlx-lm has no quantized rotating cache). Where
        ``quantization.dequantize`` is ``None``, it is decided for the default device
        (:meth:`~._quantized.KVQuantization.resolved`).

        Raises:
            UnsupportedModelError: if a layer's cache is neither mlx-lm's ``KVCache``
                nor a plain ``RotatingKVCache`` (recurrent ``ArraysCache`` layers of
                hybrid models, chunked or quantized caches...).
            InvalidRequestError: the heads cannot be quantized in those groups.
        """
        if quantization is not None:
            quantization = quantization.resolved()
        cache = make_prompt_cache(model)
        for i, c in enumerate(cache):
            _check_cache_type(i, c)
        model(mx.array([[0]], dtype=mx.uint32), cache=cache)
        mx.eval([c.state for c in cache])
        layers: list[LayerSpec] = []
        for c in cache:
            keys, values = c.keys, c.values
            sliding = type(c) is RotatingKVCache
            if quantization is not None:
                quantization.check(int(keys.shape[3]), f"layer {len(layers)}'s keys")
                quantization.check(int(values.shape[3]), f"layer {len(layers)}'s values")
            layers.append(
                LayerSpec(
                    kind=LayerKind.SLIDING if sliding else LayerKind.GLOBAL,
                    window=int(c.max_size) if sliding else None,
                    kv_heads=int(keys.shape[1]),
                    key_dim=int(keys.shape[3]),
                    value_dim=int(values.shape[3]),
                    dtype=keys.dtype,
                    quantization=quantization,
                )
            )
        return cls(layers=tuple(layers), context_length=_context_length(model))


def blocks_for_layer(layer: LayerSpec, tokens: int) -> int:
    """Blocks one layer reads for a history of ``tokens`` tokens.

    Blocks are aligned on absolute positions (block ``i`` holds positions
    ``[256 i, 256 i + 256)``). A sliding layer reads every block that overlaps
    its window, so at most ``ceil(window / 256) + 1`` of them; the blocks cut from
    a cache that decoded past its window may hold up to ``SLIDING_MARGIN`` tokens
    more (:func:`max_blocks_for_layer` counts them).
    """
    if tokens <= 0:
        return 0
    last = (tokens - 1) // BLOCK_SIZE
    if layer.kind is LayerKind.GLOBAL or layer.window is None:
        return last + 1
    first = max(0, tokens - layer.window) // BLOCK_SIZE
    return last - first + 1


def max_blocks_for_layer(layer: LayerSpec, tokens: int) -> int:
    """Most blocks one layer holds for any history up to ``tokens`` tokens: a sliding
    layer's window with its margin, ``ceil((window + SLIDING_MARGIN) / 256) + 1``."""
    if layer.kind is LayerKind.GLOBAL or layer.window is None:
        return math.ceil(tokens / BLOCK_SIZE)
    span = layer.window + SLIDING_MARGIN
    return min(math.ceil(tokens / BLOCK_SIZE), math.ceil(span / BLOCK_SIZE) + 1)


def _check_cache_type(index: int, cache: Any) -> None:
    kind = type(cache)
    if kind is KVCache:
        return
    if kind is RotatingKVCache:
        if cache.keep != 0:
            raise UnsupportedModelError(
                f"layer {index} uses a RotatingKVCache that pins its first {cache.keep} "
                "tokens; mlx-lm's batched cache cannot keep them, so the engine refuses "
                "this model rather than answer wrongly"
            )
        return
    raise UnsupportedModelError(
        f"layer {index} uses {kind.__name__}, which the block engine cannot keep "
        "exactly (it handles KVCache and sliding-window RotatingKVCache layers); "
        "use a model whose layers are all attention layers"
    )


def _context_length(model: Module) -> int | None:
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "seq_length", "n_ctx"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
