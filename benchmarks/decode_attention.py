"""A batch's decode attention: the kernel that reads each row from its first position
(``mlx_actors.scheduler.caches._decode_kernel``) against what mlx-lm's batch runs, MLX's
attention with the padding mask (on CUDA the unfused path), and against MLX's vector
kernel on the same padded rows with no mask (wrong, as fast as MLX's fused kernel gets).

For each workload (rows of the lengths given, left-padded to the longest, as a batch cache
holds them): milliseconds for one decode step's attention over ``--layers`` layers (each
layer its own keys and values), and the kernel's exactness: rows whose output has the
bits of MLX's attention on that row alone (unpadded: mlx-lm's single stream), and the
largest difference from the masked attention. Prints JSON.

    python benchmarks/decode_attention.py [--heads 32 --kv-heads 8 --dim 64 --dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import mlx.core as mx
from _models import device_name
from mlx_lm.models.base import create_causal_mask

from mlx_actors.scheduler.caches import _decode_kernel

WORKLOADS = {
    # name: (rows, shortest, longest)
    "bfcl-10x2K-12K": (10, 2048, 12288),
    "prefix-8x8K": (8, 8200, 8260),
    "32x1K-4K": (32, 1024, 4096),
    "64x256-2K": (64, 256, 2048),
    "1x8K": (1, 8192, 8192),
}
DTYPES = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}


def _time(fn: Any, repeats: int) -> float:
    mx.eval(fn())  # compiled, warm
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def run(name: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    rows, shortest, longest = WORKLOADS[name]
    dtype = DTYPES[args.dtype]
    lengths = [rng.randint(shortest, longest) for _ in range(rows)]
    tokens = max(lengths)
    capacity = (tokens // 256 + 1) * 256  # a batch cache's room
    starts = [tokens - n for n in lengths]
    scale = args.dim**-0.5
    layers = []
    for _ in range(args.layers):
        keys = mx.random.normal((rows, args.kv_heads, capacity, args.dim)).astype(dtype)
        values = mx.random.normal((rows, args.kv_heads, capacity, args.dim)).astype(dtype)
        queries = mx.random.normal((rows, 1, args.heads, args.dim)).astype(dtype)
        layers.append((queries.transpose(0, 2, 1, 3), keys, values))
    mx.eval(layers)
    view = [(q, k[..., :tokens, :], v[..., :tokens, :]) for q, k, v in layers]
    mask = create_causal_mask(1, offset=tokens - 1, left_padding=mx.array(starts))
    begins, lens = mx.array(starts), mx.array(lengths)

    def masked() -> list[mx.array]:
        return [
            mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
            for q, k, v in view
        ]

    def unmasked() -> list[mx.array]:
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale) for q, k, v in view]

    def kernel() -> list[mx.array]:
        return [_decode_kernel.attend(q, k, v, begins, lens, scale) for q, k, v in view]

    result: dict[str, Any] = {
        "rows": rows,
        "tokens": [min(lengths), max(lengths)],
        "masked_ms": round(_time(masked, args.repeats), 3),
        "unmasked_ms": round(_time(unmasked, args.repeats), 3),
    }
    q0, k0, v0 = view[0]
    if _decode_kernel.usable(q0, k0, v0, scale):
        result["kernel_ms"] = round(_time(kernel, args.repeats), 3)
        result["kernel_vs_masked"] = round(result["masked_ms"] / result["kernel_ms"], 2)
        got, want = kernel()[0], masked()[0]
        alone = _decode_kernel.attend_with_ops(q0, k0, v0, begins, lens, scale)
        result["rows_bit_identical_to_alone"] = sum(
            bool(mx.array_equal(got[b], alone[b]).item()) for b in range(rows)
        )
        diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()
        result["max_diff_vs_masked"] = float(diff.item())
    elif _decode_kernel.kernel_available():
        try:  # why it is not used: its check's answer or error
            result["kernel"] = f"check gave {_decode_kernel._check(q0.dtype, args.dim, scale)}"
        except Exception as exc:
            result["kernel"] = f"check failed: {exc!r}"
    else:
        result["kernel"] = "unavailable here (a CUDA GPU runs it)"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--workloads", nargs="*", choices=sorted(WORKLOADS), default=list(WORKLOADS)
    )
    args = parser.parse_args()
    rng = random.Random(0)
    mx.random.seed(0)
    out = {
        "benchmark": "decode_attention",
        "device": device_name(),
        "mlx": mx.__version__,
        "shape": vars(args),
        "workloads": {name: run(name, args, rng) for name in args.workloads},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
