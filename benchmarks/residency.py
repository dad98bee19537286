"""Which cache leaves a full pool: eviction by expected next use against least recently
used, on agent workloads whose caches do not all fit. Prints JSON.

    python benchmarks/residency.py [--shape llama-3.2-1b --dtype bf16] [--history 8192]

Two workloads, each run with ``eviction="lru"`` and ``"next-use"`` (alternating which
goes first), the pool at half the workload's cache (``--pool-share``):

- ``round-robin``: ``--agents`` agents, each with a history of about ``--history``
  tokens, asked one after another for ``--rounds`` rounds;
- ``main-helpers``: a main agent with twice that history and four helpers, each helper
  asked in turn and the main agent after each, for ``--rounds`` rounds.

Histories (a text of their own for each agent, so that no blocks are shared) are built
first (untimed); then the timed turns are short questions with
``--reply``-token replies. Figures: wall time of the timed turns, turns that waited on a
restore, time spent bringing caches back (the trace's ``blocks.read`` from disk and
``blocks.restored``), bytes brought back; replies compared between the two policies.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from _models import model_arguments, random_model, run_facts
from mlx_lm.utils import load_tokenizer
from restore import filler

from mlx_actors import Runtime

POLICIES = ("lru", "next-use")


def plan(workload: str, args: argparse.Namespace) -> tuple[dict[str, int], list[str]]:
    """Each agent's history in tokens, and the order of the timed turns."""
    if workload == "round-robin":
        agents = {f"agent{i}": args.history for i in range(args.agents)}
        return agents, list(agents) * args.rounds
    helpers = [f"helper{i}" for i in range(4)]
    agents = {"main": 2 * args.history, **dict.fromkeys(helpers, args.history)}
    return agents, [a for _ in range(args.rounds) for h in helpers for a in (h, "main")]


async def run(
    model: Path, workload: str, policy: str, args: argparse.Namespace, tokenizer: Any
) -> dict[str, Any]:
    agents, order = plan(workload, args)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    turns = {name: order.count(name) + 1 for name in agents}
    blocks = sum(-(-(h + turns[a] * (args.reply + 32)) // 256) for a, h in agents.items())
    pool_blocks = max(1, int(blocks * args.pool_share)) * layers  # a block is one layer's
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        async with Runtime(
            model, pool_blocks=pool_blocks, eviction=policy, log_level="off", trace=trace
        ) as rt:
            for i, (name, history) in enumerate(agents.items()):
                agent = await rt.spawn(name, system="You are a careful reader.")
                await agent.ask(filler(tokenizer, history - i), max_tokens=args.reply)
            before = await rt.stats()
            mark = len(trace.read_text().splitlines())
            began = time.perf_counter()
            replies = [
                (await rt.agent(name).ask(f"Turn {i}: what next?", max_tokens=args.reply)).tokens
                for i, name in enumerate(order)
            ]
            wall = time.perf_counter() - began
            after = await rt.stats()
        events = [json.loads(line) for line in trace.read_text().splitlines()[mark:]]
    back = [e for e in events if e["event"] in ("blocks.restored", "blocks.read")]
    return {
        "wall_s": round(wall, 3),
        "turns": len(order),
        "pool_blocks": pool_blocks,
        "restores": after.restores - before.restores,
        "restore_ms": round(sum(e.get("ms", 0.0) for e in back), 1),
        "bytes_back": sum(e["bytes"] for e in events if e["event"] == "blocks.restored"),
        "evictions": after.evictions - before.evictions,
        "replies": replies,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--history", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--pool-share", type=float, default=0.5)
    parser.add_argument("--workloads", nargs="*", default=["round-robin", "main-helpers"])
    args = parser.parse_args()
    model = Path(args.model or random_model(args.shape, args.dtype))
    tokenizer = load_tokenizer(model)
    out: dict[str, Any] = {"facts": run_facts("residency", args), "workloads": {}}
    for k, workload in enumerate(args.workloads):
        order = POLICIES if k % 2 == 0 else POLICIES[::-1]
        runs = {p: anyio.run(run, model, workload, p, args, tokenizer) for p in order}
        lru, ours = runs["lru"], runs["next-use"]
        out["workloads"][workload] = {
            **{p: {k: v for k, v in r.items() if k != "replies"} for p, r in runs.items()},
            "replies_identical": lru["replies"] == ours["replies"],
            "restore_ms_lru_over_next_use": round(
                lru["restore_ms"] / max(ours["restore_ms"], 1e-3), 2
            ),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
