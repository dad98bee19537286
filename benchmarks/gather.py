"""EXP-006: time blocks -> mlx-lm cache, against a plain copy of the same bytes.

The spec is Gemma 3 12B's cache: 48 layers (8 global, 40 sliding-window layers of 1024
tokens), 8 KV heads of size 256, bfloat16. For each history length the script builds
one agent's blocks, rebuilds its cache from them (what the engine does once per turn,
at insert) and forces the copy with ``mx.eval``; the same with MLX's ``concatenate``
alone (what the gather is on devices without its kernel,
:mod:`mlx_actors.scheduler.caches._gather`); then it copies an array of the same bytes on
the same device. It prints JSON: p50/p95/p99
in milliseconds and GB/s for each, the fraction of copy bandwidth the gather reaches,
and whether the gather's arrays equal the concatenated ones bit for bit.

On a CUDA GPU it also measures another layout before anyone builds it (``arena``): each
layer's blocks as slots of one array per layer (``[slots, heads, 256, dim]``), the whole
cache gathered by one kernel launch whose inputs are those 96 arrays and a table, instead
of one input per block. The blocks' pieces are computed inside the timing, as the gather
computes them.

On every device it also measures a second layout (``slabs``): each layer's blocks as
views of a few larger arrays ("slabs" of 1024 or 2048 tokens, as if each turn's new
blocks were cut as one array), gathered by today's code with the consecutive pieces of
one slab merged into one part. It bounds what cutting blocks that way would give.

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
from mlx_actors.scheduler.caches._gather import Part, concatenate, kernel_available
from mlx_actors.scheduler.kv._blocks import pieces, to_cache
from mlx_actors.scheduler.kv._pool import KVBlock
from mlx_actors.scheduler.kv._spec import BLOCK_SIZE, blocks_for_layer

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
    arena = arena_probe(blocks, tokens, iters, nbytes, c) if kernel_available() else None
    slabs = {size: slab_probe(blocks, tokens, iters, nbytes, c, size) for size in (1024, 2048)}
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
        "arena": arena,
        "slabs": slabs,
    }


_arena_kernels: dict[int, object] = {}


def arena_kernel(layers: int):  # type: ignore[no-untyped-def]
    """Every piece of every layer in one launch: block ``blockIdx.y``'s head ``blockIdx.z``.
    The table: the number of pieces, each layer's length, then per piece (layer, slot,
    first position in the slot, count, where it goes)."""
    if layers not in _arena_kernels:
        cases = "\n".join(
            f"case {i}: ka = ka{i}; va = va{i}; ko = ko{i}; vo = vo{i}; break;"
            for i in range(layers)
        )
        source = """
        const int part = blockIdx.y;
        if (part >= table[0]) return;
        const long h = blockIdx.z, heads = gridDim.z;
        const int* row = table + 1 + LAYERS + 5 * part;
        const int layer = row[0];
        const long slot = row[1], lo = row[2], count = row[3], dst = row[4];
        const long total = table[1 + layer];
        const T* ka = nullptr; const T* va = nullptr; T* ko = nullptr; T* vo = nullptr;
        switch (layer) { CASES default: return; }
        constexpr int VK = DK * sizeof(T) / 16, VV = DV * sizeof(T) / 16;
        const long step = (long)gridDim.x * blockDim.x;
        const long first = (long)blockIdx.x * blockDim.x + threadIdx.x;
        const uint4* ki = reinterpret_cast<const uint4*>(ka) + ((slot * heads + h) * 256 + lo) * VK;
        const uint4* vi = reinterpret_cast<const uint4*>(va) + ((slot * heads + h) * 256 + lo) * VV;
        uint4* kd = reinterpret_cast<uint4*>(ko) + (h * total + dst) * VK;
        uint4* vd = reinterpret_cast<uint4*>(vo) + (h * total + dst) * VV;
        for (long i = first; i < count * VK; i += step) kd[i] = ki[i];
        for (long i = first; i < count * VV; i += step) vd[i] = vi[i];
        """.replace("CASES", cases).replace("LAYERS", str(layers))
        _arena_kernels[layers] = mx.fast.cuda_kernel(
            name=f"mlx_actors_bench_arena_{layers}",
            input_names=[
                *(f"ka{i}" for i in range(layers)),
                *(f"va{i}" for i in range(layers)),
                "table",
            ],
            output_names=[*(f"ko{i}" for i in range(layers)), *(f"vo{i}" for i in range(layers))],
            source=source,
        )
    return _arena_kernels[layers]


def arena_probe(
    blocks: AgentBlocks, tokens: int, iters: int, nbytes: int, copy: list[float]
) -> dict[str, object]:
    """The blocks copied into per-layer arenas (not timed), then gathered from them."""
    spec = GEMMA3_12B
    first = spec.layers[0]
    assert all(
        (layer.kv_heads, layer.key_dim, layer.value_dim, layer.dtype)
        == (first.kv_heads, first.key_dim, first.value_dim, first.dtype)
        for layer in spec.layers
    ), "the probe takes layers of one shape"
    heads, dk, dv, dtype = first.kv_heads, first.key_dim, first.value_dim, first.dtype
    slot: dict[int, int] = {}
    arenas_k, arenas_v = [], []
    for layer_blocks in blocks.layers:
        ak = mx.zeros((2 * len(layer_blocks), heads, BLOCK_SIZE, dk), dtype)
        av = mx.zeros((2 * len(layer_blocks), heads, BLOCK_SIZE, dv), dtype)
        for s, b in enumerate(layer_blocks):  # every other slot: others' blocks between
            at = b.start % BLOCK_SIZE
            ak[2 * s, :, at : at + b.num_tokens, :] = b.keys[0]
            av[2 * s, :, at : at + b.num_tokens, :] = b.values[0]
            slot[b.id] = 2 * s
        mx.eval(ak, av)
        arenas_k.append(ak)
        arenas_v.append(av)
    kernel = arena_kernel(spec.num_layers)

    def gather() -> list[mx.array]:
        rows: list[int] = []
        totals: list[int] = []
        for number, layer in enumerate(pieces(spec, blocks, tokens)):
            filled = 0
            for b, a, z in layer:
                rows += (number, slot[b.id], a - b.start + b.start % BLOCK_SIZE, z - a, filled)
                filled += z - a
            totals.append(filled)
        n = len(rows) // 5
        outs = kernel(
            inputs=[*arenas_k, *arenas_v, mx.array([n, *totals, *rows], dtype=mx.int32)],
            template=[("T", dtype), ("DK", dk), ("DV", dv)],
            grid=(256 * 16, n, heads),
            threadgroup=(256, 1, 1),
            output_shapes=[(1, heads, t, dk) for t in totals] + [(1, heads, t, dv) for t in totals],
            output_dtypes=[dtype] * (2 * spec.num_layers),
        )
        layers = spec.num_layers
        return [a for i in range(layers) for a in (outs[i], outs[layers + i])]

    return probe(gather, blocks, tokens, iters, nbytes, copy)


def probe(  # type: ignore[no-untyped-def]
    gather, blocks: AgentBlocks, tokens: int, iters: int, nbytes: int, copy: list[float]
) -> dict[str, object]:
    """Time another layout's ``gather`` against the copy; check it equals ``to_cache``."""
    want = [a for c in to_cache(GEMMA3_12B, blocks, tokens) for a in (c.keys, c.values)]
    same = all(mx.array_equal(a, b).item() for a, b in zip(gather(), want, strict=True))
    stats = percentiles(timed(gather, iters))
    gbs = nbytes / (stats["p50_ms"] / 1e3) / 1e9
    copy_gbs = nbytes / (percentiles(copy)["p50_ms"] / 1e3) / 1e9
    return {
        **stats,
        "gb_per_s": gbs,
        "fraction_of_copy_bandwidth": gbs / copy_gbs,
        "equals_gather": same,
    }


def slab_probe(
    blocks: AgentBlocks, tokens: int, iters: int, nbytes: int, copy: list[float], size: int
) -> dict[str, object]:
    """Each layer's blocks copied into slabs of ``size`` tokens (not timed); the cache
    gathered from the slabs, consecutive pieces of one slab as one part."""
    from mlx_actors.scheduler.caches._gather import gather as gather_parts

    spec = GEMMA3_12B
    slab: dict[int, tuple[mx.array, mx.array, int]] = {}
    for layer_blocks in blocks.layers:
        groups: dict[int, list[KVBlock]] = {}
        for b in layer_blocks:
            groups.setdefault(b.start // size, []).append(b)
        for group in groups.values():
            k = mx.concatenate([b.keys for b in group if b.keys is not None], axis=2)
            v = mx.concatenate([b.values for b in group if b.values is not None], axis=2)
            for b in group:
                slab[b.id] = (k, v, group[0].start)
    mx.eval([a for k, v, _ in slab.values() for a in (k, v)])

    def gather() -> list[mx.array]:
        out: list[mx.array] = []
        for layer in pieces(spec, blocks, tokens):
            parts_k: list[Part] = []
            parts_v: list[Part] = []
            for b, a, z in layer:
                k, v, start = slab[b.id]
                if parts_k and parts_k[-1][0] is k and parts_k[-1][3] == a:
                    parts_k[-1] = (*parts_k[-1][:3], z)
                    parts_v[-1] = (*parts_v[-1][:3], z)
                else:
                    parts_k.append((k, start, a, z))
                    parts_v.append((v, start, a, z))
            out += gather_parts(parts_k, parts_v)
        return out

    return probe(gather, blocks, tokens, iters, nbytes, copy)


def check(cases: int = 200) -> int:
    """Gather random pieces (partial blocks, offsets, room, more pieces than one launch
    takes, several dtypes and head sizes) and compare with ``concatenate``, bit for bit."""
    import random

    from mlx_actors.scheduler.caches._gather import MAX_PARTS, gather

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
