"""The cost of constrained decoding (``schema=``, a required tool call) inside a batch:
time per decode step with none, one, or all of the batch's sequences under a JSON-schema
grammar (llguidance), on the block-pool engine. Prints JSON.

    python benchmarks/constrained.py --shape smollm2-135m --dtype bf16 --batch 8 32

Every sequence decodes ``--tokens`` tokens (the end-of-sequence token is biased away,
and the schema, an array of at least 1,000 strings, cannot end sooner), so every step
of the measured stretch runs the whole batch. ``--tokenizer DIR`` puts a real
tokenizer (``tokenizer.json`` and ``tokenizer_config.json`` of DIR) on the random
weights: the grammar engine's work per token grows with the vocabulary, and the byte
tokenizer of the random models has only 259 tokens. The unconstrained sequences'
tokens are compared between the modes: a constrained neighbour must not change them.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import mlx_lm
from _models import model_arguments, random_model, run_facts

from mlx_actors.scheduler import (
    BlockPool,
    BlockPoolBatchEngine,
    Constraint,
    ModelCacheSpec,
    Sampling,
    grammar_tokenizer,
    schema_grammar,
)

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1000}


def run(
    engine: BlockPoolBatchEngine, llg: Any, grammar: str, n: int, constrained: int, tokens: int
) -> tuple[float, dict[int, tuple[int, ...]]]:
    """Median seconds per full-batch decode step, and the unconstrained replies."""
    rng = random.Random(n)
    eos = sorted(engine.tokenizer.eos_token_ids)
    sampling = Sampling(logit_bias=tuple((t, -1e9) for t in eos))
    uids = {}
    for i in range(n):
        prompt = [rng.randrange(1, 250) for _ in range(32)]
        processors = (
            [Constraint(llg, grammar, len(prompt), engine.vocab_size)] if i < constrained else []
        )
        uid = engine.submit(
            f"s{i}", prompt, max_tokens=tokens, sampling=sampling, processors=processors
        )
        uids[uid] = i
    steps: list[float] = []
    replies: dict[int, tuple[int, ...]] = {}
    while engine.active:
        started = time.perf_counter()
        for result in engine.step():
            if uids[result.uid] >= constrained:
                replies[uids[result.uid]] = result.tokens
            engine.release(result.blocks)
        info = engine.last_step
        if info is not None and info.decode_batch == n and info.prefill_tokens == 0:
            steps.append(time.perf_counter() - started)
    return statistics.median(steps[2:] or steps), replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, default=64, help="tokens each sequence decodes")
    parser.add_argument("--tokenizer", type=Path, help="a model directory's tokenizer to use")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = args.model or random_model(args.shape, args.dtype)
    if args.tokenizer is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(args.tokenizer / name, Path(path) / name)
    model, tokenizer = mlx_lm.load(str(path))
    spec = ModelCacheSpec.from_model(model)
    pool = BlockPool(spec, total_blocks=spec.num_layers * (max(args.batch) + 4) * 2)
    engine = BlockPoolBatchEngine(model, tokenizer, pool, max_batch_size=max(args.batch))
    began = time.perf_counter()
    llg = grammar_tokenizer(tokenizer, engine.vocab_size)
    tokenizer_s = time.perf_counter() - began
    grammar = schema_grammar(SCHEMA)
    results: dict[str, Any] = {
        **run_facts("constrained", args),
        "vocab_size": engine.vocab_size,
        "grammar_tokenizer_s": round(tokenizer_s, 3),
        "tokens": args.tokens,
        "runs": [],
    }
    try:
        for n in args.batch:
            run(engine, llg, grammar, n, n, 8)  # warm up: shapes, the grammar's caches
            modes: dict[str, list[float]] = {"none": [], "one": [], "all": []}
            outputs: dict[str, dict[int, tuple[int, ...]]] = {}
            for _ in range(args.repeats):  # the modes alternate: a shared machine drifts
                for mode, constrained in (("none", 0), ("one", 1), ("all", n)):
                    seconds, replies = run(engine, llg, grammar, n, constrained, args.tokens)
                    modes[mode].append(seconds)
                    outputs[mode] = replies
            ms = {mode: statistics.median(v) * 1e3 for mode, v in modes.items()}
            same = all(outputs["one"][i] == outputs["none"][i] for i in outputs["one"])
            results["runs"].append(
                {
                    "batch": n,
                    "ms_per_step": {k: round(v, 3) for k, v in ms.items()},
                    "one_vs_none": round(ms["one"] / ms["none"], 3),
                    "all_vs_none": round(ms["all"] / ms["none"], 3),
                    "unconstrained_unchanged_beside_one": same,
                }
            )
    finally:
        engine.close()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
