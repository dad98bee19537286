"""Where a batch's time goes: N agents asking at once through mlx-actors, against raw
mlx-lm ``BatchGenerator`` on the main thread and on a worker thread (as the engine runs
it), interleaved, with a sampling profiler on the thread that runs the generator.
Prints JSON.

    python benchmarks/batch_profile.py --shape llama-3.2-1b --dtype bf16 --agents 8

Per mode: tokens per second of each run and their median, and the source lines where
the sampled thread was found most often (every 0.5 ms). The prompts and the decoding
are those of ``batching.py`` (128 + 128 tokens, greedy).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import anyio
import mlx_lm
from _models import model_arguments, random_model, run_facts
from batching import prompts_for, through_actors, through_batch_generator

from mlx_actors import Runtime


class Sampler:
    """Counts the source line a thread is on, every half millisecond."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.counts: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler")

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            frame = sys._current_frames().get(self.target)
            if frame is not None:
                code = frame.f_code
                name = f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}"
                self.counts[name] += 1
            time.sleep(0.0005)


def in_thread(work: Any) -> Any:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", work()), name="worker")
    thread.start()
    thread.join()
    return box["result"]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    path = args.model or random_model(args.shape, args.dtype)
    model, tokenizer = mlx_lm.load(str(path))
    jobs = prompts_for(tokenizer, args.agents, args.prompt_tokens)
    prompts = [tokens for _, _, tokens in jobs]
    new = args.new_tokens

    def raw() -> dict[str, Any]:
        return through_batch_generator(model, tokenizer, prompts, new)

    speeds: dict[str, list[float]] = collections.defaultdict(list)
    samples: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    async with Runtime(
        path, max_batch_size=32, pool_blocks=1 << 16, log_level="warning", share_prefixes=False
    ) as rt:
        for r in range(2):  # compile kernels for every mode's shapes
            await through_actors(rt, jobs, new, 1000 + r)
            raw()
            in_thread(raw)
        engine = next(t for t in threading.enumerate() if t.name == "mlx-actors-engine")
        for r in range(args.repeats):
            for mode in ("main thread", "worker thread", "mlx-actors"):
                if mode == "main thread":
                    with Sampler(threading.get_ident()) as sampler:
                        result = raw()
                elif mode == "worker thread":

                    def work() -> dict[str, Any]:
                        sampler.target = threading.get_ident()
                        return raw()

                    with Sampler(0) as sampler:
                        result = in_thread(work)
                else:
                    assert engine.ident is not None
                    with Sampler(engine.ident) as sampler:
                        result = await through_actors(rt, jobs, new, r)
                speeds[mode].append(round(result["tok_per_s"], 1))
                samples[mode].update(sampler.counts)
    modes = {}
    for mode, runs in speeds.items():
        total = sum(samples[mode].values())
        modes[mode] = {
            "tok_per_s": runs,
            "median_tok_per_s": statistics.median(runs),
            "samples": total,
            "where": [
                [round(100 * n / total, 1), line] for line, n in samples[mode].most_common(12)
            ],
        }
    return {**run_facts("batch_profile", args), "agents": args.agents, "modes": modes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(anyio.run(run, args), indent=2))


if __name__ == "__main__":
    main()
