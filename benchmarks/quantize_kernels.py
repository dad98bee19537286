"""The conversions of ``kv_bits``' dequantized path: the CUDA kernels of
:mod:`mlx_actors.scheduler.caches._quantize_kernels` against MLX's own ops, bit for bit and in time.

First, where the kernels can run (a CUDA GPU), it checks them bit for bit against MLX's
ops (``mx.quantize``, the packing copy, ``mx.dequantize``; unpacking and
``mx.dequantize``) over dtypes, bits, group sizes, head sizes and shapes (one token and
several), on random values and on rows that are all negative, all zero, constant or
large; any difference fails the script. Then it times, over ``--layers`` layers
evaluated together: a decoding step's cache work (what each layer's cache does with its
new token: unquantized, two writes; quantized, with MLX's ops and with the kernel), and
dequantizing a whole 2,048-token cache of ``--batch`` rows (what a cache does after a
prefill or a move through the batch). Prints JSON: microseconds.

    python benchmarks/quantize_kernels.py [--layers 16] [--batch 8 32] [--heads 8] [--dim 64]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from mlx_actors.scheduler.caches import _quantize_kernels
from mlx_actors.scheduler.caches._quantize_kernels import (
    _launch,
    dequantize_packed,
    dequantize_pair,
    kernel_available,
    quantize_step,
)
from mlx_actors.scheduler.caches._quantized import KVQuantization, pack


def with_ops(keys: mx.array, values: mx.array, q: KVQuantization) -> list[mx.array]:
    tk = mx.quantize(keys, group_size=q.group_size, bits=q.bits)
    tv = mx.quantize(values, group_size=q.group_size, bits=q.bits)
    return [
        pack(tk),
        pack(tv),
        mx.dequantize(*tk, group_size=q.group_size, bits=q.bits),
        mx.dequantize(*tv, group_size=q.group_size, bits=q.bits),
    ]


def inputs(shape: tuple[int, ...], dtype: mx.Dtype) -> list[mx.array]:
    x = mx.random.normal(shape) * 3
    rows = [
        x,
        -mx.abs(x) - 0.5,  # all negative
        mx.zeros(shape),
        mx.full(shape, 1.25),
        x * 1e4,
        mx.abs(x) + 2,  # all positive, away from zero
    ]
    return [r.astype(dtype) for r in rows]


def bits_of(a: mx.array) -> mx.array:
    """``a``'s bits, so that equal means bit for bit (signed zeros and NaN included)."""
    return a.view(mx.uint32 if a.dtype == mx.float32 else mx.uint16)


def check() -> int:
    """The kernels against MLX's ops; returns how many cases were compared."""
    cases = 0
    for dtype, bits, gs, (dk, dv), (b, h, n) in itertools.product(
        (mx.bfloat16, mx.float16, mx.float32),
        (4, 8),
        (32, 64, 128),
        ((64, 64), (128, 128), (256, 128)),
        ((1, 1, 1), (8, 8, 1), (33, 4, 1), (2, 8, 37)),
    ):
        if dk % gs or dv % gs:
            continue
        q = KVQuantization(bits, gs)
        for k, v in zip(inputs((b, h, n, dk), dtype), inputs((b, h, n, dv), dtype)[::-1]):
            want = with_ops(k, v, q)
            got = _launch("quantize", k, v, dk, dv, dtype, q)  # the kernels themselves
            got += _launch("dequantize", want[0], want[1], dk, dv, dtype, q)
            want += [
                dequantize_packed(want[0], dk, dtype, q),
                dequantize_packed(want[1], dv, dtype, q),
            ]
            names = (
                "packed keys",
                "packed values",
                "keys",
                "values",
                "unpacked keys",
                "unpacked values",
            )
            for name, g, w in zip(names, got, want, strict=True):
                same = g.shape == w.shape and g.dtype == w.dtype
                if not same or not mx.array_equal(bits_of(g), bits_of(w)).item():
                    raise SystemExit(
                        f"kernel differs from MLX's ops: {name}, {dtype} {bits} bits "
                        f"groups of {gs}, heads {dk}/{dv}, shape {b}x{h}x{n}"
                    )
            cases += 1
    return cases


def time_step(write: Callable[[int], list[mx.array]], iters: int) -> float:
    mx.eval(write(0))
    mx.synchronize()
    samples = []
    for i in range(iters):
        t0 = time.perf_counter()
        mx.eval(write(1 + i % 1000))
        mx.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def step_writes(
    layers: int, batch: int, heads: int, dim: int, q: KVQuantization | None, fused: bool
) -> Callable[[int], list[mx.array]]:
    """A step's cache work over ``layers`` layers: per layer, the new token's keys and
    values written into a 2,048-slot cache (packed and into the dequantized copy when
    quantized)."""
    dtype = mx.bfloat16
    new = [
        (
            mx.random.normal((batch, heads, 1, dim)).astype(dtype),
            mx.random.normal((batch, heads, 1, dim)).astype(dtype),
        )
        for _ in range(layers)
    ]
    width = dim if q is None else q.width(dim, dtype)
    ring = [
        [mx.zeros((batch, heads, 2048, width), dtype if q is None else mx.uint16) for _ in "kv"]
        for _ in range(layers)
    ]
    mirror = [[mx.zeros((batch, heads, 2048, dim), dtype) for _ in "kv"] for _ in range(layers)]
    mx.eval(new, ring, mirror)

    def write(i: int) -> list[mx.array]:
        out = []
        for (k, v), r, m in zip(new, ring, mirror):
            if q is None:
                r[0][..., i : i + 1, :] = k
                r[1][..., i : i + 1, :] = v
                out += r
                continue
            pk, pv, dk, dv = quantize_step(k, v, q) if fused else with_ops(k, v, q)
            r[0][..., i : i + 1, :] = pk
            r[1][..., i : i + 1, :] = pv
            m[0][..., i : i + 1, :] = dk
            m[1][..., i : i + 1, :] = dv
            out += [*r, *m]
        return out

    return write


def rebuild(
    layers: int, batch: int, heads: int, dim: int, q: KVQuantization, kernel: bool
) -> Callable[[int], list[mx.array]]:
    """Each layer's packed 2,048-token keys and values, dequantized whole."""
    dtype = mx.bfloat16
    packed = []
    for _ in range(layers):
        x = mx.random.normal((batch, heads, 2048, dim)).astype(dtype)
        packed.append(with_ops(x, -x, q)[:2])
    mx.eval(packed)

    def run(i: int) -> list[mx.array]:
        if kernel:
            return [a for pk, pv in packed for a in dequantize_pair(pk, pv, dim, dim, dtype, q)]
        return [dequantize_packed(a, dim, dtype, q) for pair in packed for a in pair]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    kernel = kernel_available()
    result: dict[str, object] = {
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "kernel": kernel,
        "checked_cases": check() if kernel else 0,
        "layers": args.layers,
        "heads": args.heads,
        "dim": args.dim,
        "us": [],
    }
    rows: list[dict[str, object]] = []
    for batch in args.batch:
        row: dict[str, object] = {"batch": batch}
        row["unquantized"] = time_step(
            step_writes(args.layers, batch, args.heads, args.dim, None, False), args.iters
        )
        for bits in (8, 4):
            q = KVQuantization(bits, 64)
            for fused in (False, True) if kernel else (False,):
                name = f"{bits}-bit {'kernel' if fused else 'mlx ops'}"
                row[name] = time_step(
                    step_writes(args.layers, batch, args.heads, args.dim, q, fused), args.iters
                )
                row[f"{bits}-bit whole cache, {'kernel' if fused else 'mlx ops'}"] = time_step(
                    rebuild(args.layers, batch, args.heads, args.dim, q, fused),
                    max(1, args.iters // 5),
                )
        rows.append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
        print(json.dumps(rows[-1]), flush=True)
    result["us"] = rows
    # The timed runs went through the kernels only if their checks at first use passed.
    result["kernels_used"] = kernel and all(_quantize_kernels._agrees.values())
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
