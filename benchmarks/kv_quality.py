"""What quantizing the KV cache costs in quality, on a real model (the default,
SmolLM2-135M-Instruct, unless ``--model``): the agreement of greedy replies with the
unquantized cache over a fixed set of questions, through the runtime, and the mean
log-likelihood per token of a fixed text, read through mlx-lm's model with and without a
quantized cache (as ``generate_step`` would fill it, chunk by chunk). Prints JSON.

    python benchmarks/kv_quality.py [--model DIR] [--bits 8 4]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from typing import Any

import anyio
import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from mlx_actors import Runtime, gather
from mlx_actors.runtime import load_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "What is water made of?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Give me a word that rhymes with cat.",
    "What is 12 times 12?",
    "Why is the sky blue? One sentence.",
    "Name a planet bigger than Earth.",
    "What do bees make?",
    "Translate 'thank you' into French.",
    "What is the opposite of cold?",
    "How many days are in a leap year?",
    "What is the largest ocean?",
    "Suggest a name for a cat.",
]

TEXT = (
    "The city council met on Tuesday to discuss the new library. Most members agreed that "
    "the old building, which had served the town for nearly a century, could no longer hold "
    "the growing collection. Some argued for repairing it; others wanted a modern building "
    "near the station, where commuters could borrow books on their way home. After a long "
    "debate, the council voted to ask the public before deciding, and a survey will be sent "
    "to every household next month. The librarian said she was pleased that the town cared "
    "so much about reading, and that whatever was decided, the children's section would be "
    "twice as large as before."
)


async def replies(model: str | None, bits: int | None, group: int) -> list[tuple[int, ...]]:
    options: dict[str, Any] = dict(log_level="off", kv_bits=bits, kv_group_size=group)
    async with Runtime(model, **options) as rt:
        agents = [await rt.spawn(f"q{i}", max_tokens=48) for i in range(len(QUESTIONS))]
        out = await gather(*(a.ask(q) for a, q in zip(agents, QUESTIONS)))
        return [r.tokens for r in out]


def log_likelihood(loaded: Any, tokens: list[int], bits: int | None, group: int) -> float:
    """Mean log-probability of each token of ``tokens`` given those before it, reading
    the text in chunks of 64 through a cache (quantized with ``bits``)."""
    model = loaded.model
    cache = make_prompt_cache(model)
    if bits is not None:
        cache = [QuantizedKVCache(group_size=group, bits=bits) for _ in cache]
    total, count = 0.0, 0
    for at in range(0, len(tokens) - 1, 64):
        chunk = tokens[at : at + 64]
        logits = model(mx.array(chunk)[None], cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = tokens[at + 1 : at + 1 + len(chunk)]
        picked = logprobs[mx.arange(len(targets)), mx.array(targets)]
        total += picked.sum().item()
        count += len(targets)
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: the default model)")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args()
    loaded = load_model(args.model)
    tokens = loaded.tokenizer.encode(TEXT)
    base = anyio.run(replies, args.model, None, args.group_size)
    base_ll = log_likelihood(loaded, tokens, None, args.group_size)
    results: dict[str, Any] = {
        "benchmark": "kv_quality",
        "model": str(loaded.path),
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "questions": len(QUESTIONS),
        "text_tokens": len(tokens),
        "unquantized_mean_log_likelihood": round(base_ll, 4),
        "settings": {},
    }
    for bits in args.bits:
        got = anyio.run(replies, args.model, bits, args.group_size)
        same = sum(a == b for a, b in zip(got, base))
        matching = sum(
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            for a, b in zip(got, base)
        )
        ll = log_likelihood(loaded, tokens, bits, args.group_size)
        results["settings"][f"{bits}-bit"] = {
            "identical_replies": f"{same}/{len(QUESTIONS)}",
            "tokens_before_the_first_difference": round(matching / len(QUESTIONS), 1),
            "mean_log_likelihood": round(ll, 4),
            "log_likelihood_change": round(ll - base_ll, 4),
            "perplexity_change_percent": round(100 * (math.exp(base_ll - ll) - 1), 2),
        }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
