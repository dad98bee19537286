"""What saving one turn of a long conversation costs the store: the cache of a history of
N tokens is saved once, then each of ``--turns`` turns adds ``--new`` tokens and saves
again, as a runtime with ``persist="turn"`` does (the blocks saved before are referred to,
the blocks the turn changed are written, then the index). Prints JSON: the median time
of a turn's save per history length. No model: the blocks are small arrays, so the time
is the store's own work (content keys, the index, the files), not the bytes of the
blocks.

    python benchmarks/store_saves.py --history 2048 18432 73728
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

from mlx_actors.runtime._store import DiskCacheStore
from mlx_actors.scheduler import BLOCK_SIZE, BlockEntry, CacheImage


def image(
    tokens: list[int],
    layers: int,
    refs: dict[tuple[int, int], str],
    ids: dict[tuple[int, int, int], int],
) -> CacheImage:
    """The cache of ``tokens``: every layer's blocks, those ``refs`` holds (by layer and
    start, with the same end as saved) referred to, the others given as arrays."""
    rows, arrays = [], {}
    for layer in range(layers):
        row = []
        for start in range(0, len(tokens), BLOCK_SIZE):
            end = min(start + BLOCK_SIZE, len(tokens))
            key = ids.setdefault((layer, start, end), len(ids))
            ref = refs.get((layer, start, end))
            if ref is None:
                bits = np.full((1, 1, end - start, 8), key % 65536, dtype=np.uint16)
                arrays[key] = (bits, bits)
            row.append(BlockEntry(layer=layer, start=start, end=end, key=key, ref=ref))
        rows.append(tuple(row))
    return CacheImage(tokens=tuple(tokens), layers=tuple(rows), dtype="float16", arrays=arrays)


async def turns(root: Path, history: int, args: argparse.Namespace) -> list[float]:
    store = DiskCacheStore(root, persistent=True)
    tokens = [(7 * i) % 50000 for i in range(history)]
    ids: dict[tuple[int, int, int], int] = {}
    refs: dict[tuple[int, int], str] = {}
    times = []
    for turn in range(args.turns + 1):
        shot = image(tokens, args.layers, refs, ids)
        started = time.perf_counter()
        placed = await store.save("agent", shot)
        if turn:  # the first save writes every block: not a turn's
            times.append(time.perf_counter() - started)
        refs = {(e.layer, e.start, e.end): placed[e.key] for row in shot.layers for e in row}
        tokens += [(11 * i + turn) % 50000 for i in range(args.new)]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=int, nargs="+", default=[2048, 18432, 73728])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--new", type=int, default=80, help="tokens each turn adds")
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    out = {}
    for history in args.history:
        with tempfile.TemporaryDirectory(prefix="mlx-actors-store-") as root:
            times = anyio.run(turns, Path(root), history, args)
        out[str(history)] = round(1000 * statistics.median(times), 2)
    print(
        json.dumps(
            {
                "benchmark": "store_saves",
                "machine": platform.machine(),
                "layers": args.layers,
                "new_tokens": args.new,
                "turn_save_ms": out,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
