"""EXP-006: time blocks -> mlx-lm cache, against a plain copy of the same bytes.

The spec is Gemma 3 12B's cache: 48 layers (8 global, 40 sliding-window layers of 1024
tokens), 8 KV heads of size 256, bfloat16. For each history length the script builds
one agent's blocks, rebuilds its cache from them (what the engine does once per turn,
at insert) and forces the copy with ``mx.eval``; the same with MLX's ``concatenate``
alone (what the gather is on devices without its kernel, :mod:`mlx_actors.scheduler._gather`);
then it copies an array of the same bytes on the same device. It prints JSON: p50/p95/p99
in milliseconds and GB/s for each, the fraction of copy bandwidth the gather reaches,
and whether the gather's arrays equal the concatenated ones bit for bit.

    python benchmarks/gather.py [--sizes 2048 4096 8192] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx

from mlx_actors.scheduler import AgentBlocks, BlockPool, LayerKind, LayerSpec, ModelCacheSpec
from mlx_actors.scheduler._blocks import pieces, to_cache
from mlx_actors.scheduler._gather import concatenate, kernel_available
from mlx_actors.scheduler._spec import BLOCK_SIZE, blocks_for_layer

GEMMA3_12B = ModelCacheSpec(
    layers=tuple(
        LayerSpec(
            kind=LayerKind.GLOBAL if i % 6 == 5 else LayerKind.SLIDING,
            window=None if i % 6 == 5 else 1024,
            kv_heads=8,
            key_dim=256,
            value_dim=256,
            dtype=mx.bfloat16,
        )
        for i in range(48)
    ),
    context_length=131072,
)


def make_blocks(pool: BlockPool, tokens: int) -> AgentBlocks:
    layers = []
    for index, layer in enumerate(pool.spec.layers):
        count = blocks_for_layer(layer, tokens)
        first = (tokens - 1) // BLOCK_SIZE - count + 1
        blocks = []
        for b in range(first, first + count):
            start, end = b * BLOCK_SIZE, min((b + 1) * BLOCK_SIZE, tokens)
            shape = (1, layer.kv_heads, end - start, layer.key_dim)
            k = mx.random.normal(shape).astype(layer.dtype)
            v = mx.random.normal(shape).astype(layer.dtype)
            blocks.append(pool.allocate(index, start, k, v))
        mx.eval([(b.keys, b.values) for b in blocks])
        layers.append(tuple(blocks))
    return AgentBlocks(tuple(layers), tuple(range(tokens)))


def percentiles(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50_ms": q[49] * 1e3, "p95_ms": q[94] * 1e3, "p99_ms": q[98] * 1e3}


def timed(fn, iters: int, warmup: int = 3) -> list[float]:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        mx.eval(fn())
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - start)
    return samples


def run(tokens: int, iters: int) -> dict[str, object]:
    pool = BlockPool(GEMMA3_12B, total_blocks=1 << 20)
    blocks = make_blocks(pool, tokens)

    def gather() -> list[mx.array]:
        cache = to_cache(GEMMA3_12B, blocks, tokens)
        return [a for c in cache for a in (c.keys, c.values)]

    def concatenated() -> list[mx.array]:
        return [
            concatenate([(getattr(b, kind), b.start, a, z) for b, a, z in layer])
            for layer in pieces(GEMMA3_12B, blocks, tokens)
            for kind in ("keys", "values")
        ]

    out = gather()
    same = all(mx.array_equal(a, b).item() for a, b in zip(out, concatenated(), strict=True))
    nbytes = sum(a.nbytes for a in out)
    # The same bytes as one array per layer, copied.
    sources = [mx.zeros(a.shape, a.dtype) for a in out]
    mx.eval(sources)
    del out

    def copy() -> list[mx.array]:
        return [mx.array(s) for s in sources]

    g = timed(gather, iters)
    n = timed(concatenated, iters)
    c = timed(copy, iters)
    pool.free(blocks.blocks())
    g_stats, n_stats, c_stats = percentiles(g), percentiles(n), percentiles(c)
    g_gbs = nbytes / (g_stats["p50_ms"] / 1e3) / 1e9
    n_gbs = nbytes / (n_stats["p50_ms"] / 1e3) / 1e9
    c_gbs = nbytes / (c_stats["p50_ms"] / 1e3) / 1e9
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "gather": {**g_stats, "gb_per_s": g_gbs},
        "concatenate": {**n_stats, "gb_per_s": n_gbs},
        "copy": {**c_stats, "gb_per_s": c_gbs},
        "fraction_of_copy_bandwidth": g_gbs / c_gbs,
        "concatenate_fraction_of_copy_bandwidth": n_gbs / c_gbs,
        "gather_equals_concatenate": same,
    }


def check(cases: int = 200) -> int:
    """Gather random pieces (partial blocks, offsets, room, more pieces than one launch
    takes, several dtypes and head sizes) and compare with ``concatenate``, bit for bit."""
    import random

    from mlx_actors.scheduler._gather import MAX_PARTS, gather

    rng = random.Random(0)
    for case in range(cases):
        # A few shapes only: the kernel is compiled once for each.
        dtype = rng.choice([mx.bfloat16, mx.float32])
        heads, dk = rng.choice([1, 3, 8]), rng.choice([64, 256])
        dv = dk if rng.random() < 0.8 else 64
        n = rng.choice([1, 2, 3, 5, 17, MAX_PARTS + 3]) if case % 7 else MAX_PARTS * 2 + 1
        ks, vs = [], []
        for _ in range(n):
            length = rng.randint(1, BLOCK_SIZE)
            start = rng.randrange(0, 4096)
            a = start + rng.randrange(0, length)
            z = rng.randint(a + 1, start + length)
            k = mx.random.normal((1, heads, length, dk)).astype(dtype)
            v = mx.random.normal((1, heads, length, dv)).astype(dtype)
            ks.append((k, start, a, z))
            vs.append((v, start, a, z))
        room = rng.choice([0, 0, 1, 255, 300])
        got = gather(ks, vs, room)
        want = (concatenate(ks, room), concatenate(vs, room))
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype, (case, g.shape, w.shape)
            assert mx.array_equal(g, w).item(), (
                f"case {case}: the gather differs ({dtype}, heads {heads}, dims {dk}/{dv}, "
                f"{n} parts, room {room})"
            )
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--check", type=int, default=200, help="random layouts to check")
    args = parser.parse_args()
    results = {
        "benchmark": "gather",
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "mlx": mx.__version__,
        "gather_kernel": kernel_available(),
        "checked_against_concatenate": check(args.check),
        "spec": "Gemma 3 12B: 48 layers (8 global, 40 sliding 1024), 8 KV heads x 256, bf16",
        "runs": [run(n, args.iters) for n in args.sizes],
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
