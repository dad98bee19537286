"""Aggregate throughput of many agents on clusters of 1, 2 (and more) replicas (Ray
actors, each a runtime with its own model copy). Prints JSON.

    python benchmarks/cluster.py --shape tiny --agents 64 [--gpus] [--replicas 1 2 4]

Each run starts a cluster, spawns ``--agents`` agents (distinct system prompts, so
placement spreads them), lets each answer one warm-up turn, then times one more turn of
``--new-tokens`` tokens for all of them at once: generated tokens per second. The
replies of the two clusters are compared (they run the same model on the same prompts).
``--gpus`` gives each replica a GPU (``num_gpus=1``). ``--persist exit`` saves the
agents only when a cluster closes instead of after every turn (the cost of keeping every
answered turn on disk, compared in two runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import anyio
import ray
from _models import model_arguments, random_model, run_facts

from mlx_actors import gather
from mlx_actors.cluster import Cluster


async def run(path: Any, replicas: int, args: argparse.Namespace) -> tuple[float, list[Any]]:
    options: dict[str, Any] = {"num_gpus": 1} if args.gpus else {}
    async with Cluster(
        path,
        replicas=replicas,
        persist=args.persist,
        replica_options=options,
        log_level="off",
        max_batch_size=64,
    ) as cl:
        agents = [
            await cl.spawn(f"a{i}", system=f"You are agent {i}.", max_tokens=4)
            for i in range(args.agents)
        ]
        await gather(*(a.ask("Warm up.") for a in agents))
        started = time.perf_counter()
        replies = await gather(
            *(a.ask(f"Go on, {a.name}.", max_tokens=args.new_tokens) for a in agents)
        )
        seconds = time.perf_counter() - started
        return sum(len(r.tokens) for r in replies) / seconds, [r.tokens for r in replies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpus", action="store_true", help="one GPU per replica")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--persist", choices=["turn", "exit"], default="turn")
    args = parser.parse_args()
    path = args.model or random_model(args.shape, args.dtype)
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    counts = sorted(set(args.replicas) | {1})
    rates: dict[int, list[float]] = {n: [] for n in counts}
    replies: dict[int, list[Any]] = {}
    try:
        for _ in range(args.repeats):  # alternating: a shared machine drifts
            for replicas in counts:
                rate, out = anyio.run(run, path, replicas, args)
                rates[replicas].append(rate)
                replies[replicas] = out
    finally:
        ray.shutdown()
    one = statistics.median(rates[1])
    print(
        json.dumps(
            {
                **run_facts("cluster", args),
                "agents": args.agents,
                "new_tokens": args.new_tokens,
                "persist": args.persist,
                "tok_per_s": {str(n): round(statistics.median(rates[n]), 1) for n in counts},
                "over_one": {
                    n: round(statistics.median(rates[n]) / one, 3) for n in counts if n > 1
                },
                "pairs": {
                    n: [round(b / a, 3) for a, b in zip(rates[1], rates[n], strict=True)]
                    for n in counts
                    if n > 1
                },
                "replies_equal": {
                    n: f"{sum(a == b for a, b in zip(replies[1], replies[n], strict=True))}"
                    f"/{args.agents}"
                    for n in counts
                    if n > 1
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
