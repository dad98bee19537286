"""One agent over a long dialogue (1000 turns by default): what a turn costs as the
history grows, against raw mlx-lm with a prompt cache at the same history. Prints JSON.

    python benchmarks/long_dialogue.py --turns 1000

Each turn the agent is asked a short message and replies ``--reply`` tokens (greedy,
so the replies are compared with mlx-lm's token by token). Raw mlx-lm runs the same
conversation through one persistent prompt cache, fed only the tokens it lacks, as
``mlx_lm.chat`` does; its time is ``generate_step``'s alone (its prompt is rendered
outside the timing). So the ratio is what the agent pays beyond the model's own work at
that history length: rendering, tokenising, the scheduler, the cache's blocks.

The figures are medians over windows of ``--window`` turns ending at each checkpoint
(turn 10, 100, 250, 500, 1000 by default).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import mlx_lm
from _models import model_arguments, random_model, run_facts
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_actors import Runtime


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(5)) for _ in range(n))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    path: Path = args.model or random_model(args.shape, args.dtype)
    model, tokenizer = mlx_lm.load(str(path))
    rng = random.Random(0)
    system = "You are a patient listener."
    conversation: list[dict[str, str]] = [{"role": "system", "content": system}]
    cache = make_prompt_cache(model)
    held: list[int] = []
    rows: list[dict[str, float]] = []
    identical = True
    async with Runtime(path, pool_blocks=1 << 16, log_level="warning", trace=args.trace) as rt:
        agent = await rt.spawn("listener", system=system, max_tokens=args.reply)
        for _ in range(args.turns):
            message = words(rng, args.new)
            started = time.perf_counter()
            reply = await agent.ask(message)
            wall = time.perf_counter() - started
            conversation.append({"role": "user", "content": message})
            prompt = list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True))
            common = 0
            while common < min(len(held), len(prompt) - 1) and held[common] == prompt[common]:
                common += 1
            for c in cache:
                c.trim(len(held) - common)
            out: list[int] = []
            raw_started = time.perf_counter()
            raw_ttft = 0.0
            for token, _ in generate_step(
                mx.array(prompt[common:]), model, max_tokens=len(reply.tokens), prompt_cache=cache
            ):
                if not out:
                    raw_ttft = time.perf_counter() - raw_started
                out.append(int(token))
            raw = time.perf_counter() - raw_started
            held = [*prompt, *out]
            identical &= out == list(reply.tokens)
            conversation.append({"role": "assistant", "content": reply.text})
            rows.append(
                {
                    "history": reply.usage.cached_tokens,
                    "prefilled": reply.usage.prompt_tokens,
                    "raw_prefilled": len(prompt) - common,
                    "agent_ms": wall * 1e3,
                    "raw_ms": raw * 1e3,
                    "agent_ttft_ms": reply.ttft_s * 1e3,
                    "raw_ttft_ms": raw_ttft * 1e3,
                }
            )
        stats = await rt.stats()
    checkpoints = [t for t in args.at if t <= args.turns] or [args.turns]
    windows = []
    for end in checkpoints:
        window = rows[max(0, end - args.window) : end]
        agent_ms = statistics.median(r["agent_ms"] for r in window)
        raw_ms = statistics.median(r["raw_ms"] for r in window)
        ttft = {
            k: round(statistics.median(r[k] for r in window), 2)
            for k in ("agent_ttft_ms", "raw_ttft_ms")
        }
        windows.append(
            {
                "turn": end,
                "history_tokens": int(window[-1]["history"]),
                "agent_ms": round(agent_ms, 2),
                "raw_ms": round(raw_ms, 2),
                "overhead_ms": round(agent_ms - raw_ms, 2),
                "agent_over_raw": round(agent_ms / raw_ms, 3),
                **ttft,
            }
        )
    return {
        **run_facts("long_dialogue", args),
        "turns": args.turns,
        "new_words": args.new,
        "reply_tokens": args.reply,
        "prefilled": int(sum(r["prefilled"] for r in rows)),
        "raw_prefilled": int(sum(r["raw_prefilled"] for r in rows)),
        "identical_replies": identical,
        "engine": {"prefill_tokens": stats.prefill_tokens},
        "windows": windows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--new", type=int, default=6, help="words in each message")
    parser.add_argument("--reply", type=int, default=16, help="tokens in each reply")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--at", type=int, nargs="+", default=[10, 100, 250, 500, 1000])
    parser.add_argument("--trace", type=Path, help="also write the runtime's trace there")
    args = parser.parse_args()
    print(json.dumps(anyio.run(run, args), indent=2))


if __name__ == "__main__":
    main()
