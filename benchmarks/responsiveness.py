"""How long one engine step can take while prompts are prefilled: the longest step is how
long a cancel, a timeout, a new turn or Ctrl-C waits. Paced steps (the default, about a
quarter of a second each) against unpaced ones (every prompt chunk at once), on the same
work, with the total time of both. Prints JSON.

    python benchmarks/responsiveness.py --shape smollm2-135m --agents 4 --prompt-tokens 600
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import mlx_lm
from _models import model_arguments, random_model, run_facts

from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine, ModelCacheSpec


def workload(engine: BlockPoolBatchEngine, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """Submit every prompt at once (a fan-out), step until all finish; step times."""
    uids = [engine.submit(f"a{i}", p, max_tokens=new) for i, p in enumerate(prompts)]
    steps: list[float] = []
    outputs: dict[int, list[int]] = {}
    started = time.perf_counter()
    while engine.active:
        for r in engine.step():
            outputs[r.uid] = list(r.tokens)
            engine.release(r.blocks)
        assert engine.last_step is not None
        if engine.last_step.prefill_tokens:
            steps.append(engine.last_step.seconds)
    return {
        "total_s": round(time.perf_counter() - started, 3),
        "prefill_steps": len(steps),
        "longest_step_s": round(max(steps), 3),
        "median_step_s": round(statistics.median(steps), 3),
        "outputs": [outputs[u] for u in uids],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--step-seconds", type=float, default=0.25)
    args = parser.parse_args()

    path = args.model or random_model(args.shape, args.dtype)
    model, tokenizer = mlx_lm.load(str(path))
    spec = ModelCacheSpec.from_model(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(args.prompt_tokens)] for _ in range(args.agents)]
    runs = {}
    for mode, seconds in (("paced", args.step_seconds), ("unpaced", 1e9)):
        engine = BlockPoolBatchEngine(
            model,
            tokenizer,
            BlockPool(spec, total_blocks=1 << 14),
            share_prefixes=False,
            step_seconds=seconds,
        )
        workload(engine, [p[:64] for p in prompts], 2)  # warm-up, and a first rate
        runs[mode] = workload(engine, prompts, args.new_tokens)
        engine.close()
    identical = runs["paced"].pop("outputs") == runs["unpaced"].pop("outputs")
    print(
        json.dumps(
            {
                **run_facts("responsiveness", args),
                "agents": args.agents,
                "prompt_tokens": args.prompt_tokens,
                "step_seconds": args.step_seconds,
                **runs,
                "longest_step_ratio": round(
                    runs["unpaced"]["longest_step_s"] / runs["paced"]["longest_step_s"], 2
                ),
                "total_ratio": round(runs["paced"]["total_s"] / runs["unpaced"]["total_s"], 3),
                "identical_outputs": identical,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
