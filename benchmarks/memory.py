"""Peak memory while N agents decode a turn together, as a multiple of the KV bytes of
their histories: mlx-actors (its batch holding a copy of each history, and with
``paged_batch``, reading them from the pool's blocks) against raw mlx-lm (a prompt cache
per sequence plus ``BatchGenerator``) in the same run, with the decode throughput of
each. Prints JSON.

    python benchmarks/memory.py --shape llama-3.2-1b --dtype bf16 --workloads 8x2048 32x2048 8x8192
    python benchmarks/memory.py --kv-bits 8

Each workload ``NxH``: N agents each hold a history of about H tokens (a first turn's
prompt and its reply), then all N ask a second turn at once (``--prompt-tokens`` new
tokens, ``--new-tokens`` generated). The figure is MLX's peak memory during the second
turn above what was in use before the histories were made (the weights), divided by the
KV bytes the histories need (every layer's keys and values of every history token, as
mlx-lm's own caches hold them). 1.0 would be the histories and nothing else.

Raw mlx-lm does the same work as a hand-written program would: each history prefilled
into its own ``make_prompt_cache`` (then quantized with ``--kv-bits``, as
``generate_step`` does), and the second turns decoded by one ``BatchGenerator`` on those
caches. With ``--kv-bits`` raw mlx-lm cannot batch (its ``BatchGenerator`` takes no
quantized cache): its sequences decode one after another with ``generate_step``, as
``mlx_lm.server`` does with ``--kv-bits``; on MLX's CUDA backend (0.32) its quantized
attention does not run at all, and the row gives the error instead of a figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import mlx_lm
from _models import model_arguments, random_model, run_facts
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_actors import Runtime

GROUP_SIZE = 64


def filler(tokens: int, seed: int) -> str:
    """Text of about ``tokens`` tokens of the byte tokenizer (more of a real one)."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(tokens))


def settle() -> int:
    """Free what is unreferenced; the bytes MLX has in use."""
    gc.collect()
    mx.clear_cache()
    return int(mx.get_active_memory())


def kv_bytes(caches: list[list[Any]]) -> int:
    """The bytes of what the caches hold (their filled part, not their room)."""
    arrays = [a for cache in caches for c in cache for _, a in tree_flatten(c.state)]
    return sum(int(a.nbytes) for a in arrays if isinstance(a, mx.array))


async def through_actors(
    path: Path, n: int, history: int, args: argparse.Namespace, paged: bool
) -> dict[str, Any]:
    base = settle()
    options: dict[str, Any] = dict(
        log_level="off", kv_bits=args.kv_bits, kv_group_size=GROUP_SIZE, paged_batch=paged
    )
    if args.pool_gb:
        options["pool_bytes"] = int(args.pool_gb * 2**30)
    async with Runtime(path, **options) as rt:
        weights = settle() - base
        agents = [await rt.spawn(f"a{i}", max_tokens=1) for i in range(n)]
        held: list[int] = [0] * n

        async def first(i: int) -> None:
            reply = await agents[i].ask(filler(history, i))
            held[i] = reply.usage.prompt_tokens + reply.usage.generated_tokens

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(first, i)
        stats = await rt.stats()
        assert stats.evictions == 0, "the pool is too small for the histories: raise --pool-gb"
        before = settle()
        mx.reset_peak_memory()
        generated = [0] * n

        async def second(i: int) -> None:
            reply = await agents[i].ask(
                filler(args.prompt_tokens, 1000 + i), max_tokens=args.new_tokens
            )
            generated[i] = reply.usage.generated_tokens

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(second, i)
        seconds = time.perf_counter() - start
        peak = int(mx.get_peak_memory())
        pool_used = (await rt.stats()).pool.used_bytes
    return {
        "weights": weights,
        "history_tokens": held,
        "in_use_before": before - base - weights,
        "peak": peak - base - weights,
        "pool_used": pool_used,
        "generated": sum(generated),
        "seconds": seconds,
    }


def through_mlx_lm(path: Path, held: list[int], args: argparse.Namespace) -> dict[str, Any]:
    base = settle()
    model, _ = mlx_lm.load(str(path))
    weights = settle() - base
    rng = random.Random(0)
    caches = []
    for length in held:
        cache = make_prompt_cache(model)
        tokens = [rng.randrange(256) for _ in range(length)]
        for i in range(0, length, 2048):
            model(mx.array(tokens[i : i + 2048])[None], cache=cache)
            mx.eval([c.state for c in cache])
        if args.kv_bits:
            cache = [c.to_quantized(group_size=GROUP_SIZE, bits=args.kv_bits) for c in cache]
        caches.append(cache)
        mx.clear_cache()
    kv = kv_bytes(caches)
    before = settle()
    mx.reset_peak_memory()
    prompts = [[rng.randrange(256) for _ in range(args.prompt_tokens)] for _ in held]
    start = time.perf_counter()
    generated, error = 0, None
    try:  # (mlx-lm's quantized attention does not run on MLX's CUDA backend 0.32)
        if args.kv_bits:
            for prompt, cache in zip(prompts, caches, strict=True):
                for _ in generate_step(
                    mx.array(prompt), model, max_tokens=args.new_tokens, prompt_cache=cache
                ):
                    generated += 1
        else:
            gen = BatchGenerator(
                model,
                max_tokens=args.new_tokens,
                stop_tokens=[],
                completion_batch_size=max(32, len(held)),
            )
            gen.insert(prompts, max_tokens=[args.new_tokens] * len(held), caches=caches)
            live = len(held)
            while live:
                _, responses = gen.next()
                for r in responses:
                    generated += 1
                    live -= r.finish_reason is not None
            gen.close()
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    seconds = time.perf_counter() - start
    peak = int(mx.get_peak_memory())
    del caches, model
    return {
        "weights": weights,
        "kv_bytes": kv,
        "in_use_before": before - base - weights,
        "peak": None if error else peak - base - weights,
        "generated": generated,
        "seconds": seconds,
        "error": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model_arguments(parser)
    parser.add_argument("--workloads", nargs="+", default=["8x2048", "32x2048", "8x8192"])
    parser.add_argument("--kv-bits", type=int, choices=[4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pool-gb", type=float, help="the pool (default: the runtime's)")
    args = parser.parse_args()
    path = args.model or random_model(args.shape, args.dtype)
    results = []
    for workload in args.workloads:
        n, history = (int(x) for x in workload.split("x"))
        ours = {}
        for name, paged in (("mlx_actors", False), ("mlx_actors_paged", True)):
            began = time.perf_counter()
            ours[name] = anyio.run(through_actors, path, n, history, args, paged)
            print(f"{name}: {time.perf_counter() - began:.1f} s", file=sys.stderr)
        raw = through_mlx_lm(path, ours["mlx_actors"]["history_tokens"], args)
        kv = raw["kv_bytes"]
        row = {
            "workload": workload,
            "kv_bytes": kv,
            "ratio": {
                **{name: run["peak"] / kv for name, run in ours.items()},
                "mlx_lm": None if raw["error"] else raw["peak"] / kv,
            },
            "tokens_per_s": {
                **{name: run["generated"] / run["seconds"] for name, run in ours.items()},
                "mlx_lm": None if raw["error"] else raw["generated"] / raw["seconds"],
            },
            **{
                name: {k: v for k, v in run.items() if k != "history_tokens"}
                for name, run in ours.items()
            },
            "mlx_lm": raw,
        }
        results.append(row)
        print(
            json.dumps(
                {"workload": workload, "ratio": row["ratio"], "tokens_per_s": row["tokens_per_s"]}
            ),
            flush=True,
        )
    print(
        json.dumps(
            {**run_facts("memory", args), "kv_bits": args.kv_bits, "results": results}, indent=2
        )
    )


if __name__ == "__main__":
    main()
