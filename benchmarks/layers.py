"""Where the time of a batched run goes, layer by layer, on the same N prompts: raw mlx-lm
``BatchGenerator`` on the main thread and on a worker thread, ``BlockPoolBatchEngine`` on
the main thread and on a worker thread, and the full actors runtime. Prints JSON with each
mode's median seconds, steps and per-step milliseconds.

    python benchmarks/layers.py --shape smollm2-135m --dtype bf16 --agents 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import mlx_lm
from _models import SHAPES, device_name, random_model
from batching import prompts_for, raw_generator, through_actors, through_batch_generator

from mlx_actors import Runtime
from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine, ModelCacheSpec


def raw_steps(model: Any, tokenizer: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    gen = raw_generator(model, tokenizer, len(prompts))
    start = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[new] * len(prompts))
    live, steps = set(uids), []
    while live:
        t = time.perf_counter()
        _, responses = gen.next()
        steps.append(time.perf_counter() - t)
        live -= {r.uid for r in responses if r.finish_reason is not None}
    seconds = time.perf_counter() - start
    gen.close()
    return {"seconds": seconds, "steps": steps}


def engine_steps(model: Any, tokenizer: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    engine = BlockPoolBatchEngine(
        model,
        tokenizer,
        BlockPool(ModelCacheSpec.from_model(model), total_blocks=1 << 16),
        max_batch_size=max(32, len(prompts)),
    )
    start = time.perf_counter()
    for p in prompts:
        engine.submit("a", p, max_tokens=new)
    steps = []
    while engine.active:
        t = time.perf_counter()
        for done in engine.step():
            engine.release(done.blocks)
        steps.append(time.perf_counter() - t)
    seconds = time.perf_counter() - start
    engine.close()
    return {"seconds": seconds, "steps": steps}


def on_a_thread(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    out: list[dict[str, Any]] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        finally:
            mx.clear_streams()  # else the thread's MLX state outlives it (mlx#4373)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    steps = best.get("steps", [])
    out = {
        "seconds_median": round(best["seconds"], 4),
        "all_seconds": [round(r["seconds"], 3) for r in runs],
    }
    if isinstance(steps, list) and steps:
        out |= {
            "steps": len(steps),
            "step_ms_median": round(statistics.median(steps) * 1e3, 3),
            "first_8_steps_ms": [round(s * 1e3, 1) for s in steps[:8]],
            "steps_total_ms": round(sum(steps) * 1e3, 1),
        }
    return out


async def actors_runs(path: Path, jobs: list[Any], new: int, repeats: int) -> list[dict[str, Any]]:
    async with Runtime(  # the repeats ask the same prompts: none may reuse another's blocks
        path,
        max_batch_size=max(32, len(jobs)),
        pool_blocks=1 << 16,
        log_level="warning",
        share_prefixes=False,
    ) as rt:
        return [await through_actors(rt, jobs, new, r) for r in range(repeats)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default="f32", choices=["bf16", "f16", "f32"])
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    path = random_model(args.shape, args.dtype)
    model, tokenizer = mlx_lm.load(str(path))
    jobs = prompts_for(tokenizer, args.agents, args.prompt_tokens)
    prompts = [t for _, _, t in jobs]
    through_batch_generator(model, tokenizer, prompts, 8)  # warm up
    modes: dict[str, Callable[[], dict[str, Any]]] = {
        "raw_main_thread": lambda: raw_steps(model, tokenizer, prompts, args.new_tokens),
        "raw_worker_thread": lambda: on_a_thread(
            raw_steps, model, tokenizer, prompts, args.new_tokens
        ),
        "engine_main_thread": lambda: engine_steps(model, tokenizer, prompts, args.new_tokens),
        "engine_worker_thread": lambda: on_a_thread(
            engine_steps, model, tokenizer, prompts, args.new_tokens
        ),
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    for _ in range(args.repeats):  # interleaved, so drift hits every mode alike
        for name, fn in modes.items():
            results[name].append(fn())
    actors = anyio.run(actors_runs, path, jobs, args.new_tokens, args.repeats)
    report = {name: summary(runs) for name, runs in results.items()}
    report["actors"] = summary(actors)
    print(
        json.dumps(
            {
                "benchmark": "layers",
                "shape": args.shape,
                "dtype": args.dtype,
                "device": device_name(),
                "agents": args.agents,
                "modes": report,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
