"""Quantized KV blocks (``kv_bits``): how many agents with long histories stay resident
in one fixed pool, and the aggregate decode throughput at batch 8 and 32, for the
model's own dtype, 8 bits and 4 bits. Prints JSON.

    python benchmarks/capacity.py --shape llama-3.2-1b --dtype bf16 --pool-gb 4

Residents: agents with a ``--history``-token conversation are spawned and asked one at a
time into a pool of ``--pool-gb`` until the first eviction; the count before it is the
measure (and the pool's arithmetic, blocks and bytes per agent, is printed beside it).
Throughput: ``--batch`` agents, each with a ``--decode-history``-token conversation, asked at once
for ``--new-tokens`` tokens; tokens per second of the whole batch, as the median of
``--repeats`` runs that alternate the settings. Replies are compared with the
unquantized ones (the agreement is a figure, not an assertion: quantizing changes
them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import mlx_lm
from _models import model_arguments, random_model, run_facts

from mlx_actors import Runtime, gather
from mlx_actors.scheduler import KVQuantization, ModelCacheSpec

SETTINGS: list[int | None] = [None, 8, 4]


def filler(tokens: int, seed: int) -> str:
    """Text of about ``tokens`` tokens of the byte tokenizer (and more of a real one)."""
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    out, n = [], 0
    while n < tokens:
        word = words[(seed + n) % len(words)]
        out.append(word)
        n += len(word) + 1
    return " ".join(out)


async def residents(path: Path, bits: int | None, args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = dict(
        pool_bytes=int(args.pool_gb * 2**30),
        log_level="off",
        kv_bits=bits,
        kv_group_size=args.group_size,
    )
    async with Runtime(path, **options) as rt:
        count = 0
        while count < args.max_agents:
            agent = await rt.spawn(f"r{count}", max_tokens=4)
            await agent.ask(f"Agent {count}: {filler(args.history, count)}")  # shares nothing
            if (await rt.stats()).evictions:
                break
            count += 1
        stats = await rt.stats()
        return {
            "resident_agents": count,
            "pool_bytes": stats.pool.total_blocks * stats.pool.block_bytes,
        }


async def throughput(
    path: Path, bits: int | None, batch: int, args: argparse.Namespace
) -> tuple[float, list[tuple[int, ...]]]:
    options: dict[str, Any] = dict(log_level="off", kv_bits=bits, kv_group_size=args.group_size)
    async with Runtime(path, **options) as rt:
        agents = [
            await rt.spawn(
                f"t{i}", system=f"Agent {i}: {filler(args.decode_history, i)}", max_tokens=4
            )
            for i in range(batch)
        ]
        await gather(*(a.ask("Warm up.") for a in agents))
        started = time.perf_counter()
        replies = await gather(
            *(a.ask("Go on.", max_tokens=args.new_tokens, min_p=0.0) for a in agents)
        )
        seconds = time.perf_counter() - started
        generated = sum(len(r.tokens) for r in replies)
        return generated / seconds, [r.tokens for r in replies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--pool-gb", type=float, default=0.25)
    parser.add_argument("--history", type=int, default=8192)
    parser.add_argument("--max-agents", type=int, default=200)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--decode-history", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=64, help="kv_group_size")
    args = parser.parse_args()
    path = args.model or random_model(args.shape, args.dtype)
    model, _ = mlx_lm.load(str(path))
    results: dict[str, Any] = {**run_facts("capacity", args), "settings": {}}
    for bits in SETTINGS:
        spec = ModelCacheSpec.from_model(
            model, quantization=KVQuantization(bits, args.group_size) if bits else None
        )
        name = f"{bits}-bit" if bits else "unquantized"
        results["settings"][name] = {
            "blocks_per_agent": spec.blocks_held(args.history),
            "bytes_per_agent": spec.units_held(args.history) * spec.unit_bytes,
            "block_bytes": spec.block_bytes,
            "kv_attention": spec.quantization and spec.quantization.attention,
            **anyio.run(residents, path, bits, args),
        }
    for batch in args.batch:
        runs: dict[str, list[float]] = {str(b): [] for b in SETTINGS}
        replies: dict[str, list[tuple[int, ...]]] = {}
        for _ in range(args.repeats):
            for bits in SETTINGS:
                rate, out = anyio.run(throughput, path, bits, batch, args)
                runs[str(bits)].append(rate)
                replies[str(bits)] = out
        base = statistics.median(runs["None"])
        for bits in SETTINGS:
            name = f"{bits}-bit" if bits else "unquantized"
            rate = statistics.median(runs[str(bits)])
            same = sum(a == b for a, b in zip(replies[str(bits)], replies["None"]))
            results["settings"][name][f"batch_{batch}"] = {
                "tok_per_s": round(rate, 1),
                "vs_unquantized": round(rate / base, 3),
                "replies_equal_to_unquantized": f"{same}/{batch}",
            }
    base_residents = results["settings"]["unquantized"]["resident_agents"]
    base_bytes = results["settings"]["unquantized"]["bytes_per_agent"]
    for setting in results["settings"].values():
        setting["residents_vs_unquantized"] = round(
            setting["resident_agents"] / max(1, base_residents), 2
        )
        setting["arithmetic_vs_unquantized"] = round(base_bytes / setting["bytes_per_agent"], 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
