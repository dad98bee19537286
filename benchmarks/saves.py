"""The cost of keeping every answered turn on disk: one runtime, many agents, each turn
saved (``persist="turn"``) against saved only at the end (``persist="exit"``) and no
state directory at all. Prints JSON.

    python benchmarks/saves.py --shape tiny --agents 64 --rounds 3

Each mode starts a runtime, spawns ``--agents`` agents, lets each answer a warm-up turn,
then times ``--rounds`` rounds in which every agent asks once (all at once), each reply
``--new-tokens`` long: generated tokens per second, and each ask's time from its call to
its reply. The modes alternate ``--repeats`` times (a shared machine drifts); the replies
of the three are compared (saving must not change them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from _models import model_arguments, random_model, run_facts

from mlx_actors import Agent, Runtime, gather

MODES = ("none", "exit", "turn")


async def run(path: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mlx-actors-saves-") as state:
        options: dict[str, Any] = {} if mode == "none" else {"state_dir": state, "persist": mode}
        async with Runtime(path, log_level="off", max_batch_size=args.batch, **options) as rt:
            agents = [
                await rt.spawn(f"a{i}", system=f"You are agent {i}.", max_tokens=args.new_tokens)
                for i in range(args.agents)
            ]
            await gather(*(a.ask("Warm up.") for a in agents))
            asks: list[float] = []
            tokens = 0
            replies = []

            async def ask(agent: Agent, text: str) -> Any:
                started = time.perf_counter()
                reply = await agent.ask(text)
                asks.append(time.perf_counter() - started)
                return reply

            started = time.perf_counter()
            for r in range(args.rounds):
                out = await gather(*(ask(a, f"Round {r}, {a.name}: go on.") for a in agents))
                tokens += sum(len(x.tokens) for x in out)
                replies.append([x.tokens for x in out])
            seconds = time.perf_counter() - started
    return {"tok_per_s": tokens / seconds, "ask_ms": asks, "replies": replies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="max_batch_size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    path = args.model or random_model(args.shape, args.dtype)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in args.modes:
            runs[mode].append(anyio.run(run, path, mode, args))
    modes = [m for m in MODES if runs[m]]
    rates = {m: [r["tok_per_s"] for r in runs[m]] for m in modes}

    def ask_ms(mode: str, q: float) -> float:
        times = sorted(t for r in runs[mode] for t in r["ask_ms"])
        return round(1000 * times[min(len(times) - 1, int(q * len(times)))], 1)

    def paired(a: str, b: str) -> list[float]:
        return [round(x / y, 3) for x, y in zip(rates[a], rates[b], strict=True)]

    first = runs[modes[0]][0]["replies"]
    print(
        json.dumps(
            {
                **run_facts("saves", args),
                "agents": args.agents,
                "rounds": args.rounds,
                "new_tokens": args.new_tokens,
                "tok_per_s": {m: round(statistics.median(rates[m]), 1) for m in modes},
                **{
                    f"{a}_over_{b}": paired(a, b)
                    for a, b in (("turn", "exit"), ("turn", "none"), ("exit", "none"))
                    if a in rates and b in rates
                },
                "ask_ms_p50": {m: ask_ms(m, 0.5) for m in modes},
                "ask_ms_p95": {m: ask_ms(m, 0.95) for m in modes},
                "replies_equal": all(r["replies"] == first for m in modes for r in runs[m]),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
