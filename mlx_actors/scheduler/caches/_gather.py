"""Blocks of one layer into one cache array: on a CUDA GPU, one kernel launch per layer
for keys and values together; elsewhere MLX's ``concatenate``.

A cache rebuilt from blocks is a copy of each block's tokens into one array per layer.
MLX's ``concatenate`` runs one copy kernel per input, so an 8K-token history of a
48-layer model is about a thousand launches of a megabyte each: on a GPU the launches,
not the bytes, set the time. The kernel here (:func:`copy`) copies all of a layer's
pieces, and zeroes the room left after them, in one launch, from a small table of where
each piece goes; a paged batch's rows are put together by the same kernel
(:mod:`._rows`). It is built for a power of two of pieces (a launch with more inputs
than it uses costs more), head sizes and dtype. MLX compiles a custom kernel at its
first launch in each process (1-2 s each on an H100) and keeps no compiled copy on disk:
:func:`compile_kernels` can do that before the first turn instead of inside a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

#: A piece of a block: its array (``[1, heads, tokens, dim]``), the block's first
#: position, and the positions ``[a, z)`` wanted.
Part = tuple[mx.array, int, int, int]

#: Most pieces one launch takes; longer histories take several launches.
MAX_PARTS = 128

_BYTES = 16  # each thread moves 16 bytes at a time

#: Compiled kernels by the number of parts they take.
_kernels: dict[int, Any] = {}


def gather(
    parts_k: Sequence[Part], parts_v: Sequence[Part], room: int = 0
) -> tuple[mx.array, mx.array]:
    """Keys and values: the positions of each part, in order, then ``room`` zeros."""
    if _use_kernel(parts_k, parts_v):
        return _gather_kernel(parts_k, parts_v, room)
    return concatenate(parts_k, room), concatenate(parts_v, room)


def concatenate(parts: Sequence[Part], room: int = 0) -> mx.array:
    """The positions of each part, in order, then ``room`` zeros, with MLX's own ops."""
    slices = [
        arr if a == start and z - a == arr.shape[2] else arr[..., a - start : z - start, :]
        for arr, start, a, z in parts
    ]
    if room:
        shape = (*slices[0].shape[:2], room, slices[0].shape[3])
        slices.append(mx.zeros(shape, slices[0].dtype))
    return slices[0] if len(slices) == 1 else mx.concatenate(slices, axis=2)


def kernel_available() -> bool:
    """Whether the gather kernel can run here: MLX's default device is a CUDA GPU."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def _use_kernel(parts_k: Sequence[Part], parts_v: Sequence[Part]) -> bool:
    if len(parts_k) < 2 or not kernel_available():
        return False  # one piece is a slice: no copy at all
    first_k, first_v = parts_k[0][0], parts_v[0][0]
    size = first_k.dtype.size
    return (
        first_k.dtype == first_v.dtype
        and first_k.shape[1] == first_v.shape[1]
        and (first_k.shape[3] * size) % _BYTES == 0
        and (first_v.shape[3] * size) % _BYTES == 0
    )


def _gather_kernel(
    parts_k: Sequence[Part], parts_v: Sequence[Part], room: int
) -> tuple[mx.array, mx.array]:
    groups = [
        (parts_k[i : i + MAX_PARTS], parts_v[i : i + MAX_PARTS])
        for i in range(0, len(parts_k), MAX_PARTS)
    ]
    outs = [_launch(k, v, room if n == len(groups) - 1 else 0) for n, (k, v) in enumerate(groups)]
    if len(outs) == 1:
        return outs[0]
    return (
        mx.concatenate([k for k, _ in outs], axis=2),
        mx.concatenate([v for _, v in outs], axis=2),
    )


def _launch(
    parts_k: Sequence[Part], parts_v: Sequence[Part], room: int
) -> tuple[mx.array, mx.array]:
    """One launch: a table entry per piece, and one for the room (zeros)."""
    table: list[int] = []
    filled = longest = 0
    for slot, (arr, start, a, z) in enumerate(parts_k):
        table += (slot, 0, arr.shape[2], a - start, z - a, 0, filled)
        filled += z - a
        longest = max(longest, z - a)
    if room:
        table += (-1, 0, 0, 0, room, 0, filled)
    keys = [part[0] for part in parts_k]
    values = [part[0] for part in parts_v]
    return copy(keys, values, table, rows=1, length=filled + room, longest=max(longest, room))


def copy(
    keys: Sequence[mx.array],
    values: Sequence[mx.array],
    table: Sequence[int],
    *,
    rows: int,
    length: int,
    longest: int,
) -> tuple[mx.array, mx.array]:
    """One launch of the copy kernel: keys and values ``[rows, heads, length, dim]``
    written as ``table`` says, seven ints per entry: the source (an index into
    ``keys``/``values``, row-contiguous ``[n, heads, len, dim]`` arrays; -1 writes
    zeros), its row and length, the first position taken, how many, and the output row
    and position they go to. ``longest``: the most positions an entry copies. The
    kernel takes a power of two of arrays (at most :data:`MAX_PARTS`; the rest unused)."""
    slots = 1 << (len(keys) - 1).bit_length()
    keys, values = list(keys), list(values)
    keys += [keys[0]] * (slots - len(keys))
    values += [values[0]] * (slots - len(values))
    heads, dk, dv = keys[0].shape[1], keys[0].shape[3], values[0].shape[3]
    dtype = keys[0].dtype
    chunks = longest * max(dk, dv) * dtype.size // _BYTES
    threads = 256 * max(1, min(64, -(-chunks // 256)))
    k, v = _get_kernel(slots)(
        inputs=[*keys, *values, mx.array([*table, length], dtype=mx.int32)],
        template=[("T", dtype), ("DK", dk), ("DV", dv)],
        grid=(threads, len(table) // 7, heads),
        threadgroup=(256, 1, 1),
        output_shapes=[(rows, heads, length, dk), (rows, heads, length, dv)],
        output_dtypes=[dtype, dtype],
    )
    return k, v


# Entry ``blockIdx.y`` of head ``blockIdx.z``: ``count`` tokens from position ``lo`` of
# row ``srow`` of its slot's array (zeros for slot -1), to position ``dst`` of output row
# ``orow``. Arrays are row-contiguous, so each head's tokens are one run of memory,
# copied 16 bytes per thread.
_SOURCE = """
    const int entry = blockIdx.y;
    const long h = blockIdx.z;
    const long heads = gridDim.z;
    const int* e = table + 7 * entry;
    const int slot = e[0];
    const long srow = e[1], len = e[2], lo = e[3], count = e[4], orow = e[5], dst = e[6];
    const long total = table[7 * gridDim.y];
    const T* ks = nullptr;
    const T* vs = nullptr;
    switch (slot) {
{cases}
        default: break;  // zeros
    }
    constexpr int VK = DK * sizeof(T) / 16;
    constexpr int VV = DV * sizeof(T) / 16;
    const long step = (long)gridDim.x * blockDim.x;
    const long first = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4* ko_ = reinterpret_cast<uint4*>(ko) + ((orow * heads + h) * total + dst) * VK;
    uint4* vo_ = reinterpret_cast<uint4*>(vo) + ((orow * heads + h) * total + dst) * VV;
    const long at = (srow * heads + h) * len + lo;
    const uint4* ki = ks ? reinterpret_cast<const uint4*>(ks) + at * VK : nullptr;
    const uint4* vi = vs ? reinterpret_cast<const uint4*>(vs) + at * VV : nullptr;
    for (long i = first; i < count * VK; i += step) {
        ko_[i] = ki ? ki[i] : zero;
    }
    for (long i = first; i < count * VV; i += step) {
        vo_[i] = vi ? vi[i] : zero;
    }
"""


def compile_kernels(dtype: mx.Dtype, key_dim: int, value_dim: int) -> None:
    """Have MLX compile the kernel for every number of arrays a launch takes (a power
    of two up to :data:`MAX_PARTS`), for arrays of ``dtype`` with heads of ``key_dim``
    and ``value_dim`` (a CUDA GPU only)."""
    keys, values = mx.zeros((1, 1, 1, key_dim), dtype), mx.zeros((1, 1, 1, value_dim), dtype)
    part_k, part_v = (keys, 0, 0, 1), (values, 0, 0, 1)
    if not _use_kernel([part_k, part_k], [part_v, part_v]):
        return
    for slots in (1 << n for n in range(MAX_PARTS.bit_length())):  # 1, 2, 4, ... MAX_PARTS
        mx.eval(*_launch([part_k] * slots, [part_v] * slots, 0))


def _get_kernel(slots: int) -> Any:
    kernel = _kernels.get(slots)
    if kernel is None:
        cases = "\n".join(f"        case {i}: ks = k{i}; vs = v{i}; break;" for i in range(slots))
        kernel = _kernels[slots] = mx.fast.cuda_kernel(
            name=f"mlx_actors_copy_{slots}",
            input_names=[
                *(f"k{i}" for i in range(slots)),
                *(f"v{i}" for i in range(slots)),
                "table",
            ],
            output_names=["ko", "vo"],
            source=_SOURCE.replace("{cases}", cases),
        )
    return kernel
