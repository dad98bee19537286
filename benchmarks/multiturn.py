"""A 10-turn two-agent dialogue: time to first token per turn when each agent's history
comes from its cache blocks (what mlx-actors does), against re-prefilling the whole
conversation every turn. Prints JSON.

    python benchmarks/multiturn.py --shape smollm2-135m --dtype bf16

Both modes run the same conversation through the same engine, as the agents do:
render the chat, then submit either only the tokens the cache lacks (with the blocks)
or the whole rendering (no cache). Replies are identical; only the prefill differs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from typing import Any

import mlx_lm
from _models import model_arguments, random_model, run_facts

from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine, ModelCacheSpec


def dialogue(
    engine: BlockPoolBatchEngine, tokenizer: Any, turns: int, new: int, opening: str, cached: bool
) -> list[dict[str, Any]]:
    systems = ["You are Alice, an optimist.", "You are Bob, a sceptic."]
    conversations: list[list[dict[str, str]]] = [
        [{"role": "system", "content": s}] for s in systems
    ]
    blocks: list[Any] = [None, None]
    line, out = opening, []
    for turn in range(turns):
        who = turn % 2
        conversations[who].append({"role": "user", "content": line})
        tokens = tokenizer.apply_chat_template(conversations[who], add_generation_prompt=True)
        cache = blocks[who] if cached else None
        common = min(cache.common_prefix(tokens), len(tokens) - 1) if cache is not None else 0
        trim = cache.num_tokens - common if cache is not None else 0
        # Re-prefilling: a namespace of its own each turn, so no live block is reused.
        namespace = f"agent{who}" if cached else ("reprefill", turn)
        uid = engine.submit(
            f"agent{who}", tokens[common:], cache, trim=trim, max_tokens=new, namespace=namespace
        )
        result = None
        while result is None:
            for done in engine.step():
                if done.uid == uid:
                    result = done
        engine.release(blocks[who])
        blocks[who] = result.blocks
        line = result.text or "..."
        conversations[who].append({"role": "assistant", "content": line})
        out.append(
            {
                "turn": turn + 1,
                "history_tokens": len(tokens),
                "prefill_tokens": result.usage.prompt_tokens,
                "ttft_ms": round(result.ttft_s * 1e3, 3),
                "tokens": list(result.tokens),
            }
        )
    for b in blocks:
        engine.release(b)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode; medians reported")
    args = parser.parse_args()

    path = args.model or random_model(args.shape, args.dtype)
    model, tokenizer = mlx_lm.load(str(path))
    spec = ModelCacheSpec.from_model(model)
    engine = BlockPoolBatchEngine(model, tokenizer, BlockPool(spec, total_blocks=1 << 16))
    rng = random.Random(0)
    opening = "".join(rng.choice("abcdefgh ijklmnop") for _ in range(200))
    dialogue(engine, tokenizer, 2, 8, opening, cached=True)  # warm up the kernels

    runs = {
        mode: [
            dialogue(engine, tokenizer, args.turns, args.new_tokens, opening, mode == "cached")
            for _ in range(args.repeats)
        ]
        for mode in ("cached", "reprefill")
    }
    assert all(a["tokens"] == b["tokens"] for a, b in zip(runs["cached"][0], runs["reprefill"][0]))
    table = []
    for i in range(args.turns):
        c = statistics.median(r[i]["ttft_ms"] for r in runs["cached"])
        p = statistics.median(r[i]["ttft_ms"] for r in runs["reprefill"])
        table.append(
            {
                "turn": i + 1,
                "history_tokens": runs["cached"][0][i]["history_tokens"],
                "prefill_cached": runs["cached"][0][i]["prefill_tokens"],
                "prefill_reprefill": runs["reprefill"][0][i]["prefill_tokens"],
                "ttft_ms_cached": round(c, 2),
                "ttft_ms_reprefill": round(p, 2),
                "speedup": round(p / c, 2),
            }
        )
    print(
        json.dumps(
            {
                **run_facts("multiturn", args),
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "identical_replies": True,
                "turns": table,
                "last_turn_speedup": table[-1]["speedup"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
