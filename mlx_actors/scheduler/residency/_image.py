"""An agent's cache as host memory (numpy), for disk: taken from blocks and made back into
blocks, on the engine thread. The files themselves are written and read elsewhere."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

import attrs
import mlx.core as mx
import numpy as np

from ...errors import CacheReconstructionError
from ..kv._blocks import check_blocks
from ..kv._pool import AgentBlocks, BlockPool, KVBlock, Reservation
from ..kv._prefix import Node, PrefixIndex
from ..kv._spec import BLOCK_SIZE
from ._transfer import to_device, to_host

#: Same-width unsigned types: a bit-exact host copy of any key/value dtype (bf16 too).
_BITS = {2: mx.uint16, 4: mx.uint32, 1: mx.uint8}


def dtype_name(dtype: mx.Dtype) -> str:
    """``"bfloat16"`` for ``mx.bfloat16``."""
    return str(dtype).rsplit(".", 1)[-1]


#: What blocks hold: keys and values, or (``uint16``) quantized ones packed.
_DTYPES = {dtype_name(t): t for t in (mx.float16, mx.bfloat16, mx.float32, mx.uint16)}


@attrs.frozen(kw_only=True)
class BlockEntry:
    """Where one block of the image is: its layer, positions, and, once saved, its file."""

    layer: int
    start: int
    end: int
    #: The block's key in ``CacheImage.arrays`` (its id in the pool that made the image).
    key: int
    #: Where the block is stored, if it is (set by the store that wrote or read it).
    ref: str | None = None


@attrs.frozen(kw_only=True)
class CacheImage:
    """An agent's cache outside the pool: the layout of its blocks, and the bits of those
    that are not stored yet (``arrays``, by ``BlockEntry.key``; keys then values)."""

    tokens: tuple[int, ...]
    layers: tuple[tuple[BlockEntry, ...], ...]
    dtype: str
    arrays: Mapping[int, tuple[np.ndarray, np.ndarray]] = attrs.field(factory=dict)
    #: Which snapshot of the agent's cache this is (the engine thread numbers them).
    serial: int = 0
    #: Shared boundaries whose sliding-window state the blocks keep.
    anchors: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return sum(len(layer) for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the image carries."""
        return sum(k.nbytes + v.nbytes for k, v in self.arrays.values())

    def whole(self) -> bool:
        """Whether the image carries the arrays of every block (needs no files)."""
        return all(e.key in self.arrays for row in self.layers for e in row)


#: A block's keys and values as host memory (unsigned bits), by block id.
HostArrays = Mapping[int, tuple[np.ndarray, np.ndarray]]


#: An image's copies to host memory not done yet: the dict its arrays go in, and the
#: device arrays to copy there (by block key; keys then values).
PendingCopy = tuple[dict[int, tuple[np.ndarray, np.ndarray]], dict[int, tuple[mx.array, mx.array]]]


def take_image(
    blocks: AgentBlocks,
    stored: Mapping[int, str],
    dtype: mx.Dtype,
    serial: int,
    *,
    whole: bool = False,
    held: HostArrays | None = None,
    later: list[PendingCopy] | None = None,
) -> CacheImage:
    """Copy to host memory the blocks whose id is not in ``stored`` (id -> ref), or,
    ``whole``, every block (the stored ones keep their refs); a block whose bits host
    memory already ``held`` is taken from there, not copied. With ``later``, the copies
    are added to it instead, and the image lacks those arrays until
    :func:`copy_to_host` has done them (blocks' arrays never change: the copy reads
    what the blocks held now even if the pool frees them meanwhile)."""
    held = held or {}
    layers = []
    arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    pending: dict[int, tuple[mx.array, mx.array]] = {}
    for layer_blocks in blocks.layers:
        entries = []
        for b in layer_blocks:
            ref = stored.get(b.id)
            if (ref is None or whole) and b.id not in pending and b.id not in arrays:
                if b.id in held:
                    arrays[b.id] = held[b.id]
                else:
                    assert b.keys is not None and b.values is not None
                    pending[b.id] = (_as_bits(b.keys), _as_bits(b.values))
            entries.append(BlockEntry(layer=b.layer, start=b.start, end=b.end, key=b.id, ref=ref))
        layers.append(tuple(entries))
    if pending:
        if later is not None:
            later.append((arrays, pending))
        else:
            copy_to_host([(arrays, pending)])
    return CacheImage(
        tokens=blocks.tokens,
        layers=tuple(layers),
        dtype=dtype_name(dtype),
        arrays=arrays,
        serial=serial,
        anchors=blocks.anchors,
    )


def copy_to_host(copies: list[PendingCopy]) -> None:
    """Do the copies of several images at once: one evaluation and one wait for the
    device for all of them, not one per image."""
    every = [pair for _, pending in copies for pair in pending.values()]
    mx.eval(every)
    out = iter(to_host([a for pair in every for a in pair]))
    for arrays, pending in copies:
        arrays.update((key, (next(out), next(out))) for key in pending)


def make_blocks(
    pool: BlockPool,
    image: CacheImage,
    reserve: Callable[[int], Reservation],
    *,
    index: PrefixIndex | None = None,
    namespace: Hashable = None,
    held: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
) -> AgentBlocks:
    """Blocks of ``pool`` holding ``image`` (every array present). A block the index
    already holds for the same tokens is shared (pinned first); only the others are
    made, from ``reserve(n)``, which may move other caches to disk to find room, and
    ``held`` gets each made block's id with the image's arrays of it. On error every
    block taken is freed again."""
    spec = pool.spec
    dtype = _DTYPES.get(image.dtype)
    if len(image.layers) != spec.num_layers or dtype is None:
        raise CacheReconstructionError(
            f"a saved cache of {len(image.layers)} layers of {image.dtype} does not fit this "
            f"model ({spec.num_layers} layers of {spec.layers[0].dtype})"
        )
    index = index if index is not None else PrefixIndex(spec)
    tokens = image.tokens
    nodes = index.chain(namespace, tokens, len(tokens)) if tokens else []
    used: list[Node] = list(nodes)
    plan: list[list[tuple[BlockEntry, Node, KVBlock | None]]] = []
    made: list[KVBlock] = []
    pinned: list[KVBlock] = []
    reservation: Reservation | None = None
    try:
        for number, entries in enumerate(image.layers):
            row = []
            for e in entries:
                if not 0 <= e.start < e.end <= len(tokens):
                    raise CacheReconstructionError(
                        f"block {e.key} holds tokens [{e.start}, {e.end}) of a cache of "
                        f"{len(tokens)}"
                    )
                node = _node(index, namespace, tokens, nodes, e.end)
                used.append(node)
                block = node.blocks.get(number)
                if block is not None and block.start <= e.start:
                    pinned.append(pool.share(block))
                else:
                    block = None
                row.append((e, node, block))
            plan.append(row)
        units = spec.units
        reservation = reserve(
            sum(units(number) for number, row in enumerate(plan) for _, _, b in row if b is None)
        )
        wanted = list(dict.fromkeys(e.key for row in plan for e, _, b in row if b is None))
        bits = to_device([_bits(image, key, which, dtype) for key in wanted for which in (0, 1)])
        arrays = {
            key: (bits[2 * i].view(dtype), bits[2 * i + 1].view(dtype))
            for i, key in enumerate(wanted)
        }
        layers = []
        for number, row in enumerate(plan):
            out = []
            for e, node, block in row:
                if block is None:
                    keys, values = arrays[e.key]
                    block = reservation.allocate(number, e.start, keys, values)
                    made.append(block)
                    if held is not None:
                        held[block.id] = image.arrays[e.key]
                    index.attach(node, block)
                out.append(block)
            layers.append(tuple(out))
        mx.eval([(b.keys, b.values) for b in made])
        blocks = AgentBlocks(tuple(layers), tokens, image.anchors)
        check_blocks(pool, blocks)  # the blocks must fit the spec exactly
    except BaseException:
        pool.free(made)
        pool.free(pinned)
        for node in reversed(used):
            index.prune(node)
        raise
    finally:
        if reservation is not None:
            reservation.release()
    return blocks


def _node(
    index: PrefixIndex, namespace: Hashable, tokens: tuple[int, ...], nodes: list[Node], end: int
) -> Node:
    """The node of the block that ends at ``end`` (a kept boundary may end mid-chunk)."""
    depth = (end - 1) // BLOCK_SIZE
    if end % BLOCK_SIZE == 0 or end == len(tokens):
        return nodes[depth]
    return index.chain(namespace, tokens, end, nodes[:depth])[-1]


def _as_bits(a: mx.array) -> mx.array:
    return a.view(_BITS[a.dtype.size])


def _bits(image: CacheImage, key: int, which: int, dtype: mx.Dtype) -> np.ndarray:
    try:
        bits = image.arrays[key][which]
    except KeyError:
        raise CacheReconstructionError(f"the saved cache lacks block {key}") from None
    if bits.dtype.itemsize != dtype.size:
        raise CacheReconstructionError(
            f"block {key} holds {bits.dtype.itemsize}-byte values, the cache {dtype.size}-byte"
        )
    return bits


def stored_ids(image: CacheImage, blocks: AgentBlocks) -> dict[int, str]:
    """Ids of ``blocks`` (made from ``image``) mapped to where the image says they are (a
    block shared from the pool that holds more than the saved one is not stored)."""
    refs: dict[int, str] = {}
    for entries, layer_blocks in zip(image.layers, blocks.layers, strict=True):
        for e, b in zip(entries, layer_blocks, strict=True):
            if e.ref is not None and (e.start, e.end) == (b.start, b.end):
                refs[b.id] = e.ref
    return refs
