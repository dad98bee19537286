"""What the sliding-window margin costs while decoding: mlx-lm's own decoding (one stream
through ``generate_step``, and batches through ``BatchGenerator``) on a Gemma-3-shaped
model, with mlx-lm's rotating caches and with mlx-actors' margin caches (which copy
aside the tokens the ring overwrites), paired in one run. Prints JSON.

    python benchmarks/margin.py --shape gemma-3-1b --dtype bf16 --batch 1 8 32
    python benchmarks/margin.py --shape tiny-gemma3     # a quick check on a CPU

Replies run past the window, so the rings rotate and the copies happen; the tokens
must be the same with both caches.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import mlx.core as mx
import mlx_lm
from _models import model_arguments, random_model, run_facts
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_actors.scheduler import ModelCacheSpec
from mlx_actors.scheduler.kv._blocks import make_cache


def single(
    model: Any, prompt: list[int], new: int, margin: bool, spec: Any
) -> tuple[list[int], float]:
    cache = make_cache(spec) if margin else make_prompt_cache(model)
    tokens, began = [], 0.0
    for n, (token, _) in enumerate(
        generate_step(mx.array(prompt), model, max_tokens=new, prompt_cache=cache)
    ):
        if n == 0:
            began = time.perf_counter()
        tokens.append(int(token))
    return tokens, (time.perf_counter() - began) / max(1, len(tokens) - 1)


def batched(
    model: Any, prompts: list[list[int]], new: int, margin: bool, spec: Any
) -> tuple[list[list[int]], float]:
    gen = BatchGenerator(model, stop_tokens=set(), prefill_batch_size=len(prompts))
    caches = [make_cache(spec) for _ in prompts] if margin else None
    uids = gen.insert(prompts, max_tokens=[new] * len(prompts), caches=caches)
    out: dict[int, list[int]] = {u: [] for u in uids}
    began, steps = None, 0
    while True:
        _, responses = gen.next()
        if not responses and began is not None:
            break
        if responses and began is None:
            began = time.perf_counter()
        steps += bool(responses)
        for r in responses:
            out[r.uid].append(r.token)
        if all(len(v) >= new for v in out.values()):
            break
    seconds = time.perf_counter() - (began or time.perf_counter())
    gen.close()
    return [out[u] for u in uids], seconds / max(1, steps - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(parser)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=0, help="default: 1.5 windows")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    path = args.model or random_model(args.shape, args.dtype)
    model, _ = mlx_lm.load(str(path))
    spec = ModelCacheSpec.from_model(model)
    windows = [layer.window for layer in spec.layers if layer.window is not None]
    if not windows:
        raise SystemExit("the model has no sliding-window layers")
    new = args.new_tokens or 3 * max(windows) // 2
    rng = random.Random(0)
    results: dict[str, Any] = {}
    for batch in args.batch:
        prompts = [[rng.randrange(256) for _ in range(args.prompt_tokens)] for _ in range(batch)]
        times: dict[bool, list[float]] = {False: [], True: []}
        outputs: dict[bool, Any] = {}
        for _ in range(args.repeats):
            for margin in (False, True):  # paired, alternating
                if batch == 1:
                    outputs[margin], ms = single(model, prompts[0], new, margin, spec)
                else:
                    outputs[margin], ms = batched(model, prompts, new, margin, spec)
                times[margin].append(ms * 1000)
        plain, kept = min(times[False]), min(times[True])
        results[str(batch)] = {
            "ms_per_step_mlx_lm_caches": round(plain, 3),
            "ms_per_step_margin_caches": round(kept, 3),
            "ratio": round(kept / plain, 3),
            "same_tokens": outputs[False] == outputs[True],
        }
        print(f"batch {batch:3d}  {json.dumps(results[str(batch)])}", flush=True)
    print(
        json.dumps(
            {
                **run_facts("margin", args),
                "window": max(windows),
                "new_tokens": new,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
