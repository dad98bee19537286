"""A paged batch's rows put together for one layer's attention: each row's padding
(zeros), the pieces of its history's blocks, and its recent tokens, into one
``[rows, heads, tokens, dim]`` array of keys and one of values.

On a CUDA GPU, one launch per layer of :mod:`._gather`'s copy kernel writes keys and
values together from a table of where each piece goes (a batch whose history has more
than :data:`~._gather.MAX_PARTS` blocks per layer takes a launch per group of rows).
Elsewhere, MLX writes each piece into an array of zeros, in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ._gather import _BYTES, MAX_PARTS, Part, copy, kernel_available

#: A row: its padding, its history's key and value pieces, and the positions
#: ``[a, z)`` of its recent tokens in the recent arrays.
Row = tuple[int, Sequence[Part], Sequence[Part], int, int]


def assemble(
    rows: Sequence[Row], recent_k: mx.array, recent_v: mx.array
) -> tuple[mx.array, mx.array]:
    """Keys and values of every row, each ``pad`` zeros, its pieces, its recent tokens
    (every row the same length)."""
    if (
        kernel_available()
        and _fits(recent_k, recent_v)
        and all(len(row[1]) < MAX_PARTS for row in rows)
    ):
        return _assemble_kernel(rows, recent_k, recent_v)
    return _write(rows, recent_k, 1), _write(rows, recent_v, 2)


def _write(rows: Sequence[Row], recent: mx.array, which: int) -> mx.array:
    pad, parts, _, a, z = rows[0]
    length = pad + sum(y - x for _, _, x, y in parts) + z - a
    out = mx.zeros((len(rows), recent.shape[1], length, recent.shape[3]), recent.dtype)
    for i, (at, parts_k, parts_v, a, z) in enumerate(rows):
        for arr, start, x, y in parts_k if which == 1 else parts_v:
            out[i : i + 1, :, at : at + y - x] = arr[..., x - start : y - start, :]
            at += y - x
        if z > a:
            out[i : i + 1, :, at : at + z - a] = recent[i : i + 1, :, a:z, :]
    return out


def _fits(recent_k: mx.array, recent_v: mx.array) -> bool:
    size = recent_k.dtype.size
    return (
        recent_k.dtype == recent_v.dtype
        and (recent_k.shape[3] * size) % _BYTES == 0
        and (recent_v.shape[3] * size) % _BYTES == 0
    )


def _assemble_kernel(
    rows: Sequence[Row], recent_k: mx.array, recent_v: mx.array
) -> tuple[mx.array, mx.array]:
    groups: list[list[int]] = [[]]
    count = 0
    for i, row in enumerate(rows):
        n = len(row[1])
        if groups[-1] and count + n > MAX_PARTS - 1:
            groups.append([])
            count = 0
        groups[-1].append(i)
        count += n
    outs = [_launch([rows[i] for i in group], group, recent_k, recent_v) for group in groups]
    if len(outs) == 1:
        return outs[0]
    return (
        mx.concatenate([k for k, _ in outs], axis=0),
        mx.concatenate([v for _, v in outs], axis=0),
    )


def _launch(
    rows: Sequence[Row], numbers: Sequence[int], recent_k: mx.array, recent_v: mx.array
) -> tuple[mx.array, mx.array]:
    """One launch for ``rows`` (rows ``numbers`` of the recent arrays): a table entry
    per padding, per piece and per run of recent tokens."""
    keys: list[mx.array] = []
    values: list[mx.array] = []
    table: list[int] = []
    longest = length = 0
    recent = sum(len(row[1]) for row in rows)  # the recent arrays' slot, after the pieces
    for out_row, (row, number) in enumerate(zip(rows, numbers, strict=True)):
        pad, parts_k, parts_v, a, z = row
        if pad:
            table += (-1, 0, 0, 0, pad, out_row, 0)
        at = pad
        for (arr_k, start, x, y), (arr_v, _, _, _) in zip(parts_k, parts_v, strict=True):
            table += (len(keys), 0, arr_k.shape[2], x - start, y - x, out_row, at)
            keys.append(arr_k)
            values.append(arr_v)
            at += y - x
            longest = max(longest, y - x)
        if z > a:
            table += (recent, number, recent_k.shape[2], a, z - a, out_row, at)
            at += z - a
        longest = max(longest, pad, z - a)
        length = at
    return copy(
        [*keys, recent_k],
        [*values, recent_v],
        table,
        rows=len(rows),
        length=length,
        longest=longest,
    )
