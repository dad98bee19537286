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
spent reading the files (checksums included) and putting the blocks back, and
``slabs_made_mb``: host memory the process made meanwhile for blocks' bits (slabs
page-locked on CUDA, at about 2 GB/s; made once and reused after). In each
runtime a twin of the agent (the same conversation) asks first, the same way, so that
compiling kernels for a new engine thread is not counted (with ``share_prefixes=False``,
so that the twin's blocks do not serve the reader). The files were just written,
so they are read from the page cache, not from a cold disk.

Two more modes bring the agent back after an eviction inside one runtime, whose pool
holds only one of the two agents: the twin's turn pushes the reader out, then the
reader asks again. ``evicted-memory`` keeps evicted caches in host memory
(``host_bytes``), ``evicted-disk`` does not (``host_bytes=0``: the files are read).
Their reader has one turn more in its history than the other modes' reader.

On MLX's CUDA backend, blocks go to and from host memory through the CUDA driver's copy
engine (``mlx_actors/scheduler/residency/_transfer.py``); ``--plain-copies`` adds the modes
``restore-plain`` and ``evicted-memory-plain``, the same with ``MLX_ACTORS_CUDA_COPIES=0``
(numpy into MLX arrays, as before), run in the same alternation.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
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
from mlx_actors.scheduler.residency._transfer import host_memory

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
    async with reading_runtime(model, state, trace) as rt:
        # The first turns on a new engine thread compile kernels for their shapes: the
        # twin's turn, the same as the reader's, keeps that out of the figures.
        await rt.agent("twin").ask(QUESTION, max_tokens=new_tokens)
        agent = rt.agent("reader")
        slabs = _slab_bytes()
        started = time.perf_counter()
        reply = await agent.ask(QUESTION, max_tokens=new_tokens)
        wall = time.perf_counter() - started
        slabs = _slab_bytes() - slabs
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    ms = {e["event"]: e.get("ms", 0.0) for e in events if e["event"].startswith("blocks.")}
    return {
        "wall_ms": wall * 1e3,
        "ttft_ms": reply.ttft_s * 1e3,
        "read_ms": ms.get("blocks.read", 0.0),
        "inject_ms": ms.get("blocks.restored", 0.0),
        "slabs_made_mb": round(slabs / 1e6, 1),
        "prefill_tokens": reply.usage.prompt_tokens,
        "cached_tokens": reply.usage.cached_tokens,
        "tokens": list(reply.tokens),
    }


async def answer_evicted(
    model: Path, state: Path, new_tokens: int, history: int, host_bytes: int
) -> dict[str, Any]:
    """The reader's turn after the twin's pushed its cache out of the pool."""
    trace = state.parent / f"{state.name}.jsonl"
    tokens = history + 4 * new_tokens + 64
    async with _sized_runtime(model, state, trace, tokens, host_bytes) as rt:
        twin, reader = rt.agent("twin"), rt.agent("reader")
        # Each turn pushes the other agent out; the first two also compile kernels.
        await twin.ask(QUESTION, max_tokens=new_tokens)
        await reader.ask(QUESTION, max_tokens=new_tokens)
        await twin.ask(QUESTION, max_tokens=new_tokens)
        assert reader.statistics().on_disk, "the pool kept both agents"
        if not host_bytes:  # the eviction is written: the turn reads the files (a turn
            await rt.flush()  # that comes while it is written takes the image)
        slabs = _slab_bytes()
        started = time.perf_counter()
        reply = await reader.ask(QUESTION, max_tokens=new_tokens)
        wall = time.perf_counter() - started
        slabs = _slab_bytes() - slabs
        stats = await rt.stats()
    assert stats.memory_restores == (2 if host_bytes else 0), stats
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    last = {e["event"]: e for e in events if e["event"].startswith("blocks.")}
    return {
        "wall_ms": wall * 1e3,
        "ttft_ms": reply.ttft_s * 1e3,
        "read_ms": last["blocks.read"].get("ms", 0.0),
        "inject_ms": last["blocks.restored"].get("ms", 0.0),
        "room_ms": last["blocks.restored"].get("room_ms", 0.0),  # of inject_ms
        "evict_ms": last["blocks.evicted"].get("ms", 0.0),
        "slabs_made_mb": round(slabs / 1e6, 1),
        "prefill_tokens": reply.usage.prompt_tokens,
        "cached_tokens": reply.usage.cached_tokens,
        "tokens": list(reply.tokens),
    }


def _slab_bytes() -> int:
    """Bytes of host memory slabs the process has made (page-locked on CUDA)."""
    memory = host_memory(start=False)
    return 0 if memory is None else memory.nbytes


def reading_runtime(model: Path, state: Path, trace: Path, **options: Any) -> Runtime:
    """A runtime on ``state`` that traces to ``trace`` and shares no blocks between
    agents (the twin's must not serve the reader)."""
    return Runtime(
        model,
        state_dir=state,
        persist="exit",
        log_level="off",
        trace=trace,
        share_prefixes=False,
        **options,
    )


def _sized_runtime(model: Path, state: Path, trace: Path, tokens: int, host_bytes: int) -> Runtime:
    """A runtime whose pool holds one agent of ``tokens`` tokens, not two."""
    layers = int(json.loads((model / "config.json").read_text())["num_hidden_layers"])
    per_agent = layers * -(-tokens // 256)
    return reading_runtime(
        model, state, trace, pool_blocks=per_agent * 3 // 2, host_bytes=host_bytes
    )


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
            modes = ["restore", "reprefill", "evicted-memory", "evicted-disk"]
            if args.plain_copies:
                modes += ["restore-plain", "evicted-memory-plain"]
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for repeat in range(args.repeats):
                for mode in modes if repeat % 2 == 0 else modes[::-1]:
                    work = root / f"h{target}-{mode}-{repeat}"
                    shutil.copytree(base, work)
                    if mode == "reprefill":
                        shutil.rmtree(work / "caches")
                    os.environ["MLX_ACTORS_CUDA_COPIES"] = "0" if mode.endswith("plain") else "1"
                    if mode.startswith("evicted"):
                        host = 0 if mode == "evicted-disk" else 1 << 36
                        result = await answer_evicted(model, work, args.new_tokens, history, host)
                    else:
                        result = await answer(model, work, args.new_tokens)
                    runs[mode].append(result)
                    shutil.rmtree(work)
            first = {mode: r[0] for mode, r in runs.items()}
            assert first["restore"]["tokens"] == first["reprefill"]["tokens"], "replies differ"
            assert first["evicted-memory"]["tokens"] == first["evicted-disk"]["tokens"]
            for mode in modes[4:]:
                twin = "restore" if mode.startswith("restore") else "evicted-memory"
                assert first[mode]["tokens"] == first[twin]["tokens"], "replies differ"
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
                        "slabs_made_mb": med("restore", "slabs_made_mb"),
                    },
                    "reprefill": {
                        "prefill_tokens": first["reprefill"]["prefill_tokens"],
                        "wall_ms": med("reprefill", "wall_ms"),
                        "ttft_ms": med("reprefill", "ttft_ms"),
                    },
                    **{
                        mode: {
                            "prefill_tokens": first[mode]["prefill_tokens"],
                            "wall_ms": med(mode, "wall_ms"),
                            "ttft_ms": med(mode, "ttft_ms"),
                            "read_ms": med(mode, "read_ms"),
                            "inject_ms": med(mode, "inject_ms"),
                            "slabs_made_mb": med(mode, "slabs_made_mb"),
                            **(
                                {"evict_ms": med(mode, "evict_ms"), "room_ms": med(mode, "room_ms")}
                                if "evict_ms" in first[mode]
                                else {}
                            ),
                            "reprefill_over_this_ttft": round(
                                med("reprefill", "ttft_ms") / med(mode, "ttft_ms"), 2
                            ),
                        }
                        for mode in modes
                        if mode not in ("restore", "reprefill")
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
    parser.add_argument(
        "--plain-copies",
        action="store_true",
        help="also run restore and evicted-memory with MLX_ACTORS_CUDA_COPIES=0",
    )
    args = parser.parse_args()
    print(json.dumps(anyio.run(run, args), indent=2))


if __name__ == "__main__":
    main()
