"""Bringing an agent back from disk and answering, against re-prefilling its whole
conversation. Prints JSON.

    python benchmarks/restore.py --shape smollm2-135m --dtype bf16

For each history length, one runtime builds an agent whose conversation is that long
and keeps it in a state directory. Then, in alternating order, a fresh runtime opens a
copy of that directory and asks the agent one more question, either with its cache
(``restore``: the blocks are read from disk and put back in the pool before the turn
runs) or with the cache files deleted (``reprefill``: the turn runs the whole
conversation through the model). Both give the same reply; the figures are the wall
time of that ``ask`` and its time to first token, and from the trace the milliseconds
spent reading the files (checksums included) and putting the blocks back. In each
runtime a twin of the agent (the same conversation) asks first, the same way, so that
compiling kernels for a new engine thread is not counted (with ``share_prefixes=False``,
so that the twin's blocks do not serve the reader). The files were just written,
so they are read from the page cache, not from a cold disk.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from _models import model_arguments, random_model, run_facts
from mlx_lm.utils import load_tokenizer

from mlx_actors import Runtime

SYSTEM = "You are a careful reader."
QUESTION = "And what comes next?"


def filler(tokenizer: Any, target: int) -> str:
    """A user message that makes the rendered conversation about ``target`` tokens."""
    rng = random.Random(target)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(5)) for _ in range(target)]

    def size(n: int) -> int:
        chat = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": " ".join(words[:n])},
        ]
        return len(tokenizer.apply_chat_template(chat, add_generation_prompt=True))

    lo, hi = 1, target
    while lo < hi:  # the most words that stay within the target
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= target else (lo, mid - 1)
    return " ".join(words[:lo])


def median(runs: dict[str, list[dict[str, Any]]], mode: str, key: str) -> float:
    return round(statistics.median(r[key] for r in runs[mode]), 2)


async def build(model: Path, state: Path, text: str) -> int:
    # share_prefixes=False throughout: the twin's blocks must not serve the reader.
    async with Runtime(
        model, state_dir=state, persist="exit", log_level="off", share_prefixes=False
    ) as rt:
        for name in ("twin", "reader"):  # the same conversation twice
            agent = await rt.spawn(name, system=SYSTEM)
            reply = await agent.ask(text, max_tokens=8)
        return reply.usage.prompt_tokens + reply.usage.cached_tokens + len(reply.tokens)


async def answer(model: Path, state: Path, new_tokens: int) -> dict[str, Any]:
    trace = state.parent / f"{state.name}.jsonl"
    async with Runtime(
        model,
        state_dir=state,
        persist="exit",
        log_level="off",
        trace=trace,
        share_prefixes=False,
    ) as rt:
        # The first turns on a new engine thread compile kernels for their shapes: the
        # twin's turn, the same as the reader's, keeps that out of the figures.
        await rt.agent("twin").ask(QUESTION, max_tokens=new_tokens)
        agent = rt.agent("reader")
        started = time.perf_counter()
        reply = await agent.ask(QUESTION, max_tokens=new_tokens)
        wall = time.perf_counter() - started
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    ms = {e["event"]: e.get("ms", 0.0) for e in events if e["event"].startswith("blocks.")}
    return {
        "wall_ms": wall * 1e3,
        "ttft_ms": reply.ttft_s * 1e3,
        "read_ms": ms.get("blocks.read", 0.0),
        "inject_ms": ms.get("blocks.restored", 0.0),
        "prefill_tokens": reply.usage.prompt_tokens,
        "cached_tokens": reply.usage.cached_tokens,
        "tokens": list(reply.tokens),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or random_model(args.shape, args.dtype)
    tokenizer = load_tokenizer(model)
    root = Path(tempfile.mkdtemp(prefix="mlx-actors-restore-"))
    rows = []
    try:
        # Warm up: load once and run both kinds of turn, so kernels are compiled.
        await build(model, root / "warm", filler(tokenizer, 300))
        await answer(model, root / "warm", 2)
        for target in args.histories:
            base = root / f"h{target}"
            history = await build(model, base, filler(tokenizer, target))
            size = sum(f.stat().st_size for f in (base / "caches" / "reader").iterdir())
            runs: dict[str, list[dict[str, Any]]] = {"restore": [], "reprefill": []}
            for repeat in range(args.repeats):
                order = ["restore", "reprefill"] if repeat % 2 == 0 else ["reprefill", "restore"]
                for mode in order:
                    work = root / f"h{target}-{mode}-{repeat}"
                    shutil.copytree(base, work)
                    if mode == "reprefill":
                        shutil.rmtree(work / "caches")
                    runs[mode].append(await answer(model, work, args.new_tokens))
                    shutil.rmtree(work)
            first = {mode: r[0] for mode, r in runs.items()}
            assert first["restore"]["tokens"] == first["reprefill"]["tokens"], "replies differ"
            assert first["restore"]["cached_tokens"] > 0, "the cache was not used"
            assert first["reprefill"]["cached_tokens"] == 0, "the cache was not deleted"
            med = functools.partial(median, runs)

            ratios = [
                b["wall_ms"] / a["wall_ms"] for a, b in zip(runs["restore"], runs["reprefill"])
            ]
            rows.append(
                {
                    "history_tokens": history,
                    "cache_file_bytes": size,
                    "restore": {
                        "prefill_tokens": first["restore"]["prefill_tokens"],
                        "wall_ms": med("restore", "wall_ms"),
                        "ttft_ms": med("restore", "ttft_ms"),
                        "read_ms": med("restore", "read_ms"),
                        "inject_ms": med("restore", "inject_ms"),
                    },
                    "reprefill": {
                        "prefill_tokens": first["reprefill"]["prefill_tokens"],
                        "wall_ms": med("reprefill", "wall_ms"),
                        "ttft_ms": med("reprefill", "ttft_ms"),
                    },
                    "speedup": round(statistics.median(ratios), 2),
                    "ttft_speedup": round(
                        med("reprefill", "ttft_ms") / med("restore", "ttft_ms"), 2
                    ),
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        **run_facts("restore", args),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "identical_replies": True,
        "histories": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--histories", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode; medians reported")
    args = parser.parse_args()
    print(json.dumps(anyio.run(run, args), indent=2))


if __name__ == "__main__":
    main()
