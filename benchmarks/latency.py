"""One agent's turn against the limit: raw mlx-lm's ``generate_step`` with a prompt cache
that already holds the history (what ``mlx_lm.chat`` does), per history length. Prints
JSON.

    python benchmarks/latency.py --shape llama-3.2-1b --dtype bf16 \\
        --history 1024 4096 8192 16384

For each history length an agent is spawned whose system prompt makes its first prompt
that long; then

- the first turn (nothing cached): time to first token through the agent, against
  ``generate_step`` on the same prompt with a fresh cache;
- ``--turns`` cached turns of ``--new`` new tokens each: time to first token, total,
  and decode ms/token at batch 1 through the agent, against ``generate_step`` fed only
  the new tokens through one persistent cache (the ideal), and against re-prefilling
  the whole conversation (what a framework without caches pays).

Each pair runs back to back, so the ratios compare like with like on a shared machine.
The replies are compared token by token with mlx-lm's (greedy decoding).
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


def timed(model: Any, tokens: list[int], n: int, cache: list[Any]) -> dict[str, Any]:
    """``generate_step`` on ``tokens`` through ``cache`` for ``n`` tokens: its first-token
    and total times and the tokens."""
    start = time.perf_counter()
    first, out = 0.0, []
    for token, _ in generate_step(mx.array(tokens), model, max_tokens=n, prompt_cache=cache):
        if not out:
            first = time.perf_counter() - start
        out.append(int(token))
    return {"ttft_ms": first * 1e3, "total_ms": (time.perf_counter() - start) * 1e3, "tokens": out}


def per_token(ttft_ms: float, total_ms: float, n: int) -> float | None:
    return (total_ms - ttft_ms) / (n - 1) if n > 1 else None


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(n))


async def one_history(
    rt: Runtime,
    model: Any,
    tokenizer: Any,
    history: int,
    args: argparse.Namespace,
    name: str = "",
) -> dict[str, Any]:
    rng = random.Random(f"{name}{history}")
    template = len(tokenizer.apply_chat_template([{"role": "user", "content": "x"}]))
    system = text(rng, max(1, history - template - 8))
    agent = await rt.spawn(f"{name}h{history}", system=system, max_tokens=args.reply)
    # The first turn: nothing cached.
    first_text = text(rng, 8)
    reply = await agent.ask(first_text)
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": first_text}]
    prompt = list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True))
    # The raw chat: one persistent cache from the first turn on (as ``mlx_lm.chat``
    # keeps it), each later turn fed only what it lacks. Every position is then
    # computed in the same chunks as the agent's (re-prefilled where the rendering
    # changed), so the replies can be compared bit for bit in bfloat16 too.
    cache = make_prompt_cache(model)
    raw_first = timed(model, prompt, len(reply.tokens), cache)
    held = [*prompt, *raw_first["tokens"]]
    identical = raw_first["tokens"] == list(reply.tokens)
    # Turns whose reply differs from mlx-lm's (0: the first), and at which token.
    differing = [] if identical else [(0, _first_difference(raw_first["tokens"], reply.tokens))]
    first = {
        "prompt_tokens": len(prompt),
        "actors_ttft_ms": round(reply.ttft_s * 1e3, 2),
        "raw_ttft_ms": round(raw_first["ttft_ms"], 2),
    }
    conversation.append({"role": "assistant", "content": reply.text})
    turns = []
    for _ in range(args.turns):
        message = text(rng, args.new)
        started = time.perf_counter()
        reply = await agent.ask(message)
        wall = (time.perf_counter() - started) * 1e3
        conversation.append({"role": "user", "content": message})
        prompt = list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True))
        n = len(reply.tokens)
        common = 0
        while common < min(len(held), len(prompt) - 1) and held[common] == prompt[common]:
            common += 1
        for c in cache:
            c.trim(len(held) - common)
        ideal = timed(model, prompt[common:], n, cache)
        held = [*prompt, *ideal["tokens"]]
        again = timed(model, prompt, 1, make_prompt_cache(model)) if args.reprefill else None
        if ideal["tokens"] != list(reply.tokens):
            identical = False
            differing.append((len(turns) + 1, _first_difference(ideal["tokens"], reply.tokens)))
        conversation.append({"role": "assistant", "content": reply.text})
        turns.append(
            {
                "history_tokens": reply.usage.cached_tokens,
                "new_tokens": reply.usage.prompt_tokens,
                "generated": n,
                "actors_ttft_ms": reply.ttft_s * 1e3,
                "actors_total_ms": reply.total_s * 1e3,
                "actors_wall_ms": wall,
                "raw_ttft_ms": ideal["ttft_ms"],
                "raw_total_ms": ideal["total_ms"],
                "reprefill_ttft_ms": again["ttft_ms"] if again else None,
                "actors_ms_per_token": per_token(reply.ttft_s * 1e3, reply.total_s * 1e3, n),
                "raw_ms_per_token": per_token(ideal["ttft_ms"], ideal["total_ms"], n),
            }
        )
    await agent.close()

    def med(key: str) -> float | None:
        values = [t[key] for t in turns if t[key] is not None]
        return round(statistics.median(values), 3) if values else None

    summary = {k: med(k) for k in turns[0] if k != "generated"}
    ratio = {
        "ttft": _ratio(summary["actors_ttft_ms"], summary["raw_ttft_ms"]),
        "total": _ratio(summary["actors_total_ms"], summary["raw_total_ms"]),
        "ms_per_token": _ratio(summary["actors_ms_per_token"], summary["raw_ms_per_token"]),
        "first_turn_ttft": _ratio(first["actors_ttft_ms"], first["raw_ttft_ms"]),
        "reprefill_over_actors_ttft": _ratio(
            summary["reprefill_ttft_ms"], summary["actors_ttft_ms"]
        ),
    }
    return {
        "history": history,
        "first_turn": first,
        "cached_turns": summary,
        "overhead_ttft_ms": round(summary["actors_ttft_ms"] - summary["raw_ttft_ms"], 2)
        if summary["actors_ttft_ms"] is not None and summary["raw_ttft_ms"] is not None
        else None,
        "actors_over_raw": ratio,
        "identical_replies": identical,
        "differing_turns": differing,
    }


def _first_difference(a: list[int], b: Any) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    path: Path = args.model or random_model(args.shape, args.dtype)
    model, tokenizer = mlx_lm.load(str(path))
    results = []
    async with Runtime(path, pool_blocks=1 << 16, log_level="warning", share_prefixes=False) as rt:
        for history in args.history:
            # Two first passes compile the kernels of this length's shapes, in both (the
            # first may also move the engine's prefill pace, and with it the chunks).
            warm = argparse.Namespace(**{**vars(args), "turns": 1, "reprefill": False})
            for n in range(2):
                await one_history(rt, model, tokenizer, history, warm, f"warm{n}-")
            results.append(await one_history(rt, model, tokenizer, history, args))
    return {
        **run_facts("latency", args),
        "new_tokens": args.new,
        "reply_tokens": args.reply,
        "turns": args.turns,
        "histories": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--history", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--new", type=int, default=66, help="new tokens per cached turn")
    parser.add_argument("--reply", type=int, default=32, help="tokens per reply, at most")
    parser.add_argument("--turns", type=int, default=5, help="cached turns per history")
    parser.add_argument("--no-reprefill", dest="reprefill", action="store_false")
    print(json.dumps(anyio.run(run, parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
