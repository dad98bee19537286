"""A burst of turns on one warm prefix where one turn arrives a step ahead of the others
(``serve.py``'s prefix workload when one request comes first), straight through the
engine (no HTTP, no runtime). Prints JSON.

An agent's turn leaves a prefix of ``--prefix`` tokens in the pool; then, ``--reps``
times over, ``--streams`` new sequences ask a question of ``--question`` tokens on it,
``--new-tokens`` tokens each: ``skewed``, the first is submitted and runs one step alone
before the others are submitted; ``together``, all at once. Figures per repetition: the
spread of the sequences' first tokens (milliseconds from the first to the last), the
first steps' milliseconds, and time inside the parts of those steps (``engine_steps.py``'s
timers, without ``--sync``). The first repetition of each kind is reported apart: it
runs shapes the process has not run yet (MLX compiles at first use).

    python benchmarks/skewed_burst.py --shape llama-3.2-1b --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import mlx_lm
from _models import model_arguments, random_model, run_facts
from engine_steps import PARTS, Timers

from mlx_actors.scheduler.engine._engine import BlockPoolBatchEngine
from mlx_actors.scheduler.kv._pool import BlockPool
from mlx_actors.scheduler.kv._spec import ModelCacheSpec
from mlx_actors.scheduler.service._build import _compile_kernels


def burst(
    engine: BlockPoolBatchEngine,
    timers: Timers,
    tokens: Any,
    prefix: list[int],
    args: argparse.Namespace,
    skewed: bool,
) -> dict[str, Any]:
    """One burst: the first tokens' spread, the first steps, the parts' time."""
    firsts: dict[int, float] = {}
    steps: list[float] = []

    def submit(i: int) -> None:
        def first(event: Any) -> None:
            firsts.setdefault(i, time.perf_counter())

        question = tokens(args.question)
        engine.submit(f"s{i}", prefix + question, max_tokens=args.new_tokens, on_token=first)

    def step() -> list[Any]:
        began = time.perf_counter()
        done = engine.step()
        if len(steps) < 6:
            steps.append(round((time.perf_counter() - began) * 1e3, 1))
        return done

    timers.clear()
    submit(0)
    done = step() if skewed else []
    for i in range(1, args.streams):
        submit(i)
    while engine.active:
        done += step()
    for result in done:
        engine.release(result.blocks)
    at = sorted(firsts.values())
    return {
        "spread_ms": round((at[-1] - at[0]) * 1e3, 1),
        "steps_ms": steps,
        "parts_ms": {k: v["ms"] for k, v in timers.report().items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--prefix", type=int, default=8200)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--question", type=int, default=17)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    timers = Timers(False)
    for owner, name, label in PARTS:
        timers.wrap(owner, name, label)
    model, tokenizer = mlx_lm.load(str(args.model or random_model(args.shape, args.dtype)))
    spec = ModelCacheSpec.from_model(model)
    _compile_kernels(spec, model)
    engine = BlockPoolBatchEngine(model, tokenizer, BlockPool(spec, total_blocks=200_000))
    rng = random.Random(0)
    vocab = min(len(tokenizer.vocab), 30_000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    prefix = tokens(args.prefix)
    engine.submit("warm", prefix + tokens(args.question), max_tokens=1)
    while engine.active:  # the prefix's blocks stay in the pool (never released)
        engine.step()
    out: dict[str, Any] = {**run_facts("skewed_burst", args), "prefix": args.prefix}
    out["streams"] = args.streams
    for kind in ("skewed", "together"):
        skewed = kind == "skewed"
        runs = [burst(engine, timers, tokens, prefix, args, skewed) for _ in range(args.reps + 1)]
        out[kind] = {"first": runs[0], "spread_ms": [r["spread_ms"] for r in runs[1:]]}
        out[kind]["steps_ms"] = [r["steps_ms"] for r in runs[1:]]
        out[kind]["parts_ms_last"] = runs[-1]["parts_ms"]
    engine.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
