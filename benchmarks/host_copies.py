"""Blocks to host memory and back, as an eviction and a restore copy them. Prints JSON.

    python benchmarks/host_copies.py --arrays 1024 --kib 256

``to_host`` copies ``--arrays`` device arrays of ``--kib`` KiB each (an 8K-token cache of
the Llama-3.2-1B shape is 1,024 of 256 KiB: a block's keys or values) into slots of the
process's host memory, as an eviction does; ``to_device`` copies them back into arrays
of their own, as a restore does. On MLX's CUDA backend both run the kernels of
``mlx_actors/scheduler/residency/_host_kernels.py`` (32 arrays per launch); elsewhere
they are ``np.copyto`` and ``mx.array``. Median of ``--repeats`` runs, in milliseconds
and GB/s; every copy is checked bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_actors.scheduler.residency import _host_kernels, _transfer


def run(args: argparse.Namespace) -> dict[str, Any]:
    words = args.kib * 512  # uint16 words
    device = [
        mx.random.randint(0, 1 << 16, (words,), dtype=mx.uint32).astype(mx.uint16)
        for _ in range(args.arrays)
    ]
    mx.eval(device)
    expected = [np.array(a) for a in device[:: max(1, args.arrays // 16)]]
    memory = _transfer.host_memory()
    kernels = memory is not None and memory.mapped
    if memory is not None:
        memory.allow(4 * args.arrays * args.kib * 1024)
    if kernels:
        _host_kernels.compile_kernels()
    times: dict[str, list[float]] = {"to_host": [], "to_device": []}
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        mx.synchronize()
        started = time.perf_counter()
        host = _transfer.to_host(device)
        out_s = time.perf_counter() - started
        started = time.perf_counter()
        back = _transfer.to_device(host)
        mx.eval(back)
        mx.synchronize()
        in_s = time.perf_counter() - started
        step = max(1, args.arrays // 16)
        for a, h, b in zip(expected, host[::step], back[::step], strict=True):
            assert np.array_equal(a, h) and np.array_equal(a, np.array(b)), "copies differ"
        del host, back
        if repeat:
            times["to_host"].append(out_s * 1e3)
            times["to_device"].append(in_s * 1e3)
    nbytes = args.arrays * args.kib * 1024
    result: dict[str, Any] = {
        "device": str(mx.default_device()),
        "kernels": kernels,
        "kernel_failures": list(_host_kernels.failed),
        "arrays": args.arrays,
        "bytes": nbytes,
    }
    for what, ms in times.items():
        median = statistics.median(ms)
        result[f"{what}_ms"] = round(median, 2)
        result[f"{what}_gb_s"] = round(nbytes / median / 1e6, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrays", type=int, default=1024)
    parser.add_argument("--kib", type=int, default=256, help="KiB per array")
    parser.add_argument("--repeats", type=int, default=5)
    print(json.dumps(run(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
