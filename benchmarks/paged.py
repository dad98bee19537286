"""Decode step time of the same rows on mlx-lm's batch cache and on the paged batch
(``paged_batch``: histories read from 256-token blocks, each layer's keys and values put
together as attention asks for them), one ``BatchGenerator``, the same model. Prints
JSON; the greedy tokens of the last step are checked equal.

    python benchmarks/paged.py --shape llama-3.2-1b --dtype bf16 --rows 32 --history 2048

Each configuration runs twice, alternating, after the rows' histories are prefilled
once; a step is timed from the first decoded token on.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import mlx.core as mx
import mlx_lm
from _models import model_arguments, random_model, run_facts
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlx_actors.scheduler.caches._global import GlobalKVCache
from mlx_actors.scheduler.caches._paged import PagedKVCache

BLOCK = 256


def histories(model: Any, rows: int, length: int) -> list[list[tuple[mx.array, mx.array]]]:
    """Per row, per layer: the keys and values of a ``length``-token history."""
    out = []
    for i in range(rows):
        cache = make_prompt_cache(model)
        model(mx.array([[(i * 7 + j) % 200 for j in range(length)]]), cache=cache)
        mx.eval([c.state for c in cache])
        out.append([(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache])
    return out


def dense(rows: list[list[tuple[mx.array, mx.array]]]) -> list[list[Any]]:
    caches = []
    for layers in rows:
        row = []
        for keys, values in layers:
            c = GlobalKVCache()
            c.keys, c.values, c.offset = mx.array(keys), mx.array(values), keys.shape[2]
            row.append(c)
        caches.append(row)
    mx.eval([c.state for row in caches for c in row])
    return caches


def paged(rows: list[list[tuple[mx.array, mx.array]]]) -> list[list[Any]]:
    caches = []
    for layers in rows:
        row = []
        for keys, values in layers:
            parts_k, parts_v = [], []
            for start in range(0, keys.shape[2], BLOCK):
                end = min(start + BLOCK, keys.shape[2])
                k, v = (
                    mx.contiguous(keys[..., start:end, :]),
                    mx.contiguous(values[..., start:end, :]),
                )
                mx.eval(k, v)
                parts_k.append((k, start, start, end))
                parts_v.append((v, start, start, end))
            row.append(PagedKVCache(parts_k, parts_v))
        caches.append(row)
    return caches


def decode(model: Any, caches: list[list[Any]], steps: int) -> tuple[float, int, list[int]]:
    """Seconds per step, MLX's peak above what was in use, and the last step's tokens."""
    rows = len(caches)
    gen = BatchGenerator(
        model,
        max_tokens=steps + 8,
        stop_tokens=[],
        completion_batch_size=max(32, rows),
        prefill_batch_size=max(8, rows),
    )
    gen.insert([[1, 2]] * rows, max_tokens=[steps + 8] * rows, caches=caches)
    del caches
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    done, began, last = 0, 0.0, []
    while done < steps:
        _, responses = gen.next()
        if responses:
            if not done:
                began = time.perf_counter()
            done += 1
            last = [r.token for r in responses]
    seconds = (time.perf_counter() - began) / (steps - 1)
    peak = mx.get_peak_memory() - before
    gen.close()
    mx.clear_cache()
    return seconds, peak, last


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model_arguments(parser)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--history", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    path = args.model or random_model(args.shape, args.dtype)
    model, _ = mlx_lm.load(str(path))
    rows = histories(model, args.rows, args.history)
    runs: dict[str, list[dict[str, float]]] = {"mlx_lm_layout": [], "paged": []}
    tokens: dict[str, list[int]] = {}
    for _ in range(2):
        for name, make in (("mlx_lm_layout", dense), ("paged", paged)):
            seconds, peak, last = decode(model, make(rows), args.steps)
            runs[name].append({"ms_per_step": 1000 * seconds, "peak_bytes": peak})
            tokens[name] = last
    ratios = [
        p["ms_per_step"] / d["ms_per_step"]
        for d, p in zip(runs["mlx_lm_layout"], runs["paged"], strict=True)
    ]
    print(
        json.dumps(
            {
                **run_facts("paged", args),
                "rows": args.rows,
                "history": args.history,
                "runs": runs,
                "paged_step_over_mlx_lm_layout": ratios,
                "same_tokens": tokens["paged"] == tokens["mlx_lm_layout"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
