"""A team reading one brief: 16 agents, a 4K-token brief plus a short persona each, one
turn each, asked at once; with prefix sharing and without. Prints JSON.

    python benchmarks/shared.py --shape llama-3.2-1b --dtype bf16

Each repeat runs, in alternating order, a runtime with ``share_prefixes=True`` and one
with ``False``; in each, a first round on another brief of the same length compiles the
kernels for these shapes and is not counted, and its agents are closed. The figures of
the measured round: tokens prefilled, distinct cache blocks resident once every reply is
in, and the wall time from the asks to the last reply. Two raw mlx-lm runs of the same
work bound it: ``raw_batch`` (one ``BatchGenerator``, every prompt prefilled in full: what
sharing removes) and ``raw_shared`` (the brief prefilled once by hand, its cache given
to the 16 sequences of one ``BatchGenerator``: the limit sharing aims at).
"""

from __future__ import annotations

import argparse
import functools
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
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_actors import Runtime
from mlx_actors.scheduler import BLOCK_SIZE

QUESTION = "What is your verdict on the plan?"
TOPICS = (
    "cost safety schools traffic water noise trees housing jobs power rail fish art law health time"
)


def brief(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of text (the test models' tokenizer has a token per byte)."""
    rng = random.Random(seed)
    words = ["the", "plan", "harbour", "district", "council", "budget", "ground", "residents"]
    text = ""
    while len(text) < tokens:
        text += rng.choice(words) + " "
    return text[:tokens]


def personas(n: int) -> list[str]:
    return [f"You are critic {i}, who cares about {t}." for i, t in enumerate(TOPICS[:n])]


async def round_(rt: Runtime, text: str, n: int, max_tokens: int, tag: str) -> dict[str, Any]:
    agents = [
        await rt.spawn(f"{tag}{i}", system=f"{text}\n\n{p}", max_tokens=max_tokens)
        for i, p in enumerate(personas(n))
    ]
    before = await rt.stats()
    replies: dict[str, Any] = {}

    async def ask(agent: Any) -> None:
        replies[agent.name] = await agent.ask(QUESTION)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for agent in agents:
            tg.start_soon(ask, agent)
    seconds = time.perf_counter() - started
    after = await rt.stats()
    out = {
        "seconds": seconds,
        "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        "resident_blocks": after.resident_blocks,
        "shared_bytes": after.shared_bytes,
        "ttft_ms_median": statistics.median(r.ttft_s for r in replies.values()) * 1e3,
        "replies": [replies[a.name].tokens for a in agents],
    }
    for agent in agents:
        await agent.close()
    return out


async def actors(model: Path, args: argparse.Namespace, share: bool, seed: int) -> dict[str, Any]:
    trace = None
    if args.trace is not None:
        trace = args.trace / f"shared-{'on' if share else 'off'}-{seed}.jsonl"
    async with Runtime(
        model,
        share_prefixes=share,
        max_batch_size=args.agents,
        log_level="off",
        trace=trace,
    ) as rt:
        await round_(rt, brief(args.brief, seed + 1000), args.agents, args.max_tokens, "warm")
        return await round_(rt, brief(args.brief, seed), args.agents, args.max_tokens, "agent")


def raw(model: Any, tokenizer: Any, args: argparse.Namespace, seed: int, *, shared: bool) -> float:
    """mlx-lm alone: the 16 prompts through one BatchGenerator (``shared``: the brief's
    cache computed once and given to every sequence). Returns the wall time."""
    text = brief(args.brief, seed)
    prompts = [
        tokenizer.apply_chat_template(
            [
                {"role": "system", "content": f"{text}\n\n{p}"},
                {"role": "user", "content": QUESTION},
            ],
            add_generation_prompt=True,
        )
        for p in personas(args.agents)
    ]
    gen = BatchGenerator(
        model,
        completion_batch_size=args.agents,
        prefill_batch_size=8,
        prefill_step_size=512,
        stop_tokens=[],
    )
    started = time.perf_counter()
    if shared:
        common = min(
            next(i for i, t in enumerate(zip(*prompts)) if len(set(t)) > 1),
            min(len(p) for p in prompts) - 1,
        )
        cache = make_prompt_cache(model)
        head = mx.array(prompts[0][:common])
        for i in range(0, common, 2048):
            model(head[None, i : i + 2048], cache=cache)
            mx.eval([c.state for c in cache])
        caches = []
        for _ in prompts:  # the same arrays: the generator copies them into its batch
            per = []
            for c in cache:
                k = KVCache()
                k.keys, k.values, k.offset = (
                    c.keys[..., :common, :],
                    c.values[..., :common, :],
                    common,
                )
                per.append(k)
            caches.append(per)
        gen.insert([p[common:] for p in prompts], [args.max_tokens] * len(prompts), caches=caches)
    else:
        gen.insert(prompts, [args.max_tokens] * len(prompts))
    done = 0
    while done < len(prompts):
        _, responses = gen.next()
        done += sum(1 for r in responses if r.finish_reason is not None)
    seconds = time.perf_counter() - started
    gen.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--brief", type=int, default=4096, help="tokens in the brief")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--trace", type=Path, help="write each runtime's trace in this directory")
    args = parser.parse_args()
    model = args.model or random_model(args.shape, args.dtype)
    loaded, tokenizer = mlx_lm.load(str(model))
    raw(loaded, tokenizer, args, 999, shared=False)  # compiles the raw shapes once
    raw(loaded, tokenizer, args, 999, shared=True)
    repeats = []
    for r in range(args.repeats):
        order = [True, False] if r % 2 == 0 else [False, True]
        run = {
            share: anyio.run(functools.partial(actors, model, args, share, r)) for share in order
        }
        on, off = run[True], run[False]
        raw_batch = raw(loaded, tokenizer, args, r, shared=False)
        raw_shared = raw(loaded, tokenizer, args, r, shared=True)
        repeats.append(
            {
                "identical": on.pop("replies") == off.pop("replies"),
                "sharing": on,
                "no_sharing": off,
                "raw_batch_seconds": raw_batch,
                "raw_shared_seconds": raw_shared,
                "prefill_ratio": off["prefill_tokens"] / on["prefill_tokens"],
                "resident_ratio": off["resident_blocks"] / on["resident_blocks"],
                "speedup": off["seconds"] / on["seconds"],
                "vs_raw_batch": raw_batch / on["seconds"],
                "vs_raw_shared": raw_shared / on["seconds"],
            }
        )

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in repeats), 3)

    result = {
        **run_facts("shared", args),
        "agents": args.agents,
        "brief_tokens": args.brief,
        "max_tokens": args.max_tokens,
        "block_size": BLOCK_SIZE,
        "all_identical": all(r["identical"] for r in repeats),
        "median": {
            key: med(key)
            for key in (
                "prefill_ratio",
                "resident_ratio",
                "speedup",
                "vs_raw_batch",
                "vs_raw_shared",
            )
        },
        "repeats": repeats,
    }
    text = json.dumps(result, indent=1, default=float)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
