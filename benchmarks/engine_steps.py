"""Where a served workload's engine steps go: agent sessions' turns replayed straight
through the engine (no HTTP, no runtime), as the BFCL replay of ``serve.py`` sends them:
each agent holds a history of 2K-12K tokens, and turn after turn it adds 200 tokens and
gets a short reply, a few steps after its last one ended. Prints JSON:

- ``steps``: the engine's steps by kind (``plain`` decoding, a sequence ``join``-ing the
  batch, one ``fin``-ishing, ``+jobs`` when prefill jobs ran in the step): how many, their
  total and median milliseconds, the median of their prefill jobs' and of the batch's
  part, and the median number of sequences decoding;
- ``parts``: time inside the parts of a step (mlx-lm's ``GenerationBatch`` step, filter
  and extend, the prompt batch's merge and first step, the engine's prefill jobs, its
  cutting of finished caches into blocks...), in all and per call. Timers wrap those
  functions; with ``--sync`` each waits for the device before and after, so that a
  part's time is its own (and the run slower), else a part includes waiting for work
  queued before it;
- ``wall_s``, MLX's peak memory (``peak_gb``) and what its buffer cache holds at the end.

Every session first runs two turns untimed (MLX compiles its kernels), then ``--turns``.

    python benchmarks/engine_steps.py --shape llama-3.2-1b --dtype bf16 [--sync]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx_lm
from _models import model_arguments, random_model, run_facts

from mlx_actors.scheduler.caches import _global
from mlx_actors.scheduler.engine import _batch, _engine, _output, _prefill
from mlx_actors.scheduler.engine._engine import BlockPoolBatchEngine
from mlx_actors.scheduler.kv._pool import AgentBlocks, BlockPool
from mlx_actors.scheduler.kv._spec import ModelCacheSpec
from mlx_actors.scheduler.service._build import _compile_kernels

generate = importlib.import_module("mlx_lm.generate")  # the module, not the function


class Timers:
    """Time spent in the functions wrapped, and their calls."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.sync:
                mx.synchronize()
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.sync:
                    mx.synchronize()
                self.seconds[label] += time.perf_counter() - began
                self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def report(self) -> dict[str, Any]:
        return {
            k: {
                "ms": round(s * 1e3, 1),
                "calls": self.calls[k],
                "ms_each": round(s * 1e3 / self.calls[k], 2),
            }
            for k, s in self.seconds.most_common()
        }


PARTS = [
    (generate.GenerationBatch, "_step", "GenerationBatch._step"),
    (generate.GenerationBatch, "filter", "GenerationBatch.filter"),
    (generate.GenerationBatch, "extend", "GenerationBatch.extend"),
    (generate.PromptProcessingBatch, "__init__", "PromptProcessingBatch.__init__ (merge)"),
    (generate.PromptProcessingBatch, "split", "PromptProcessingBatch.split"),
    (generate.PromptProcessingBatch, "generate", "PromptProcessingBatch.generate"),
    (_global.GlobalBatchKVCache, "filter", "GlobalBatchKVCache.filter (a layer)"),
    (_global.GlobalBatchKVCache, "extend", "GlobalBatchKVCache.extend (a layer)"),
    (_prefill.PrefillJob, "run_chunk", "PrefillJob.run_chunk"),
    (_prefill, "to_cache", "a job's cache from blocks"),
    (_output.Output, "finish", "Output.finish"),
    (_engine, "evaluate", "finished blocks evaluated"),
    (_batch.Batch, "advance", "Batch.advance"),
    (_batch.Batch, "collect", "Batch.collect"),
]


def replay(args: argparse.Namespace) -> dict[str, Any]:
    timers = Timers(args.sync)
    for owner, name, label in PARTS:
        timers.wrap(owner, name, label)
    model, tokenizer = mlx_lm.load(str(args.model or random_model(args.shape, args.dtype)))
    spec = ModelCacheSpec.from_model(model)
    _compile_kernels(spec, model)
    rng = random.Random(0)
    histories = [rng.randint(*args.history) for _ in range(args.agents)]
    pool = BlockPool(spec, total_blocks=200_000)
    engine = BlockPoolBatchEngine(model, tokenizer, pool)
    vocab = min(len(tokenizer.vocab), 30_000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    blocks: dict[int, AgentBlocks] = {}
    owner: dict[int, int] = {}
    for a, n in enumerate(histories):  # each agent's history (untimed)
        owner[engine.submit(f"a{a}", tokens(n), max_tokens=1)] = a
    while engine.active:
        for done in engine.step():
            blocks[owner[done.uid]] = done.blocks

    def sessions(turns: int) -> tuple[dict[str, list[tuple[float, ...]]], float]:
        timers.clear()
        mx.reset_peak_memory()
        steps: dict[str, list[tuple[float, ...]]] = collections.defaultdict(list)
        left = dict.fromkeys(range(args.agents), turns)
        wait = {a: rng.randint(0, 20) for a in range(args.agents)}  # arrivals spread
        running: dict[int, int] = {}
        began = time.perf_counter()
        while any(left.values()) or running:
            for a in list(wait):
                if wait[a] <= 0 and left[a] > 0:
                    reply = rng.randint(*args.reply)
                    uid = engine.submit(f"a{a}", tokens(args.new), blocks[a], max_tokens=reply)
                    running[uid] = a
                    left[a] -= 1
                    del wait[a]
                else:
                    wait[a] -= 1
            finished = engine.step()
            step = engine.last_step
            if step is not None:
                kind = "join" * bool(step.joined) + "fin" * bool(step.finished)
                kind = (kind or "plain") + "+jobs" * bool(step.jobs)
                steps[kind].append(
                    (
                        step.seconds * 1e3,
                        step.batch_seconds * 1e3,
                        step.jobs_seconds * 1e3,
                        step.decode_batch,
                    )
                )
            for done in finished:
                a = running.pop(done.uid)
                engine.release(blocks[a])
                blocks[a] = done.blocks
                if left[a] > 0:
                    wait[a] = args.think
        return steps, time.perf_counter() - began

    sessions(2)  # MLX compiles its kernels
    steps, wall = sessions(args.turns)
    engine.close()

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 2)

    return {
        **run_facts("engine_steps", args),
        "agents": args.agents,
        "turns": args.turns,
        "history": args.history,
        "new_tokens": args.new,
        "reply_tokens": args.reply,
        "sync": args.sync,
        "wall_s": round(wall, 3),
        "peak_gb": round(mx.get_peak_memory() / 1e9, 2),
        "buffer_cache_gb": round(mx.get_cache_memory() / 1e9, 2),
        "steps": {
            kind: {
                "n": len(rows),
                "ms": round(sum(r[0] for r in rows)),
                "ms_p50": median([r[0] for r in rows]),
                "batch_ms_p50": median([r[1] for r in rows]),
                "jobs_ms_p50": median([r[2] for r in rows]),
                "decoding_p50": median([r[3] for r in rows]),
            }
            for kind, rows in sorted(steps.items())
        },
        "parts": timers.report(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6, help="timed turns per agent")
    parser.add_argument("--history", type=int, nargs=2, default=[2000, 12000])
    parser.add_argument("--new", type=int, default=200, help="new tokens per turn")
    parser.add_argument("--reply", type=int, nargs=2, default=[15, 60])
    parser.add_argument("--think", type=int, default=5, help="steps between an agent's turns")
    parser.add_argument("--sync", action="store_true", help="each part waits for the device")
    print(json.dumps(replay(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
