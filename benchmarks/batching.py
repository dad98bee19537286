"""N agents each asking one turn at once: aggregate tokens/s through mlx-actors, through
mlx-lm's raw ``BatchGenerator`` on the same prompts, and through sequential single-stream
generation, all in one run. Prints JSON.

    python benchmarks/batching.py --shape smollm2-135m --dtype bf16 --agents 1 4 8 16 32

Each agent's prompt is its chat-templated system + user message, padded to
``--prompt-tokens``; every mode decodes greedily up to ``--new-tokens`` tokens and
stops at the end-of-turn token, so all three generate the same tokens. The batched modes
run once each before the counted runs (kernels compiled for their shapes), then in
pairs; the figure is the median pair. One more raw run prefills every prompt in one
group (mlx-lm's default is 8 at a time): on a GPU in bf16 that alone can change outputs.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import mlx_lm
from _models import SHAPES, device_name, random_model
from mlx_lm.generate import BatchGenerator, generate_step

from mlx_actors import Runtime


def prompts_for(tokenizer: Any, n: int, length: int) -> list[tuple[str, str, list[int]]]:
    """(system, user text, rendered tokens) per agent, ``length`` tokens each."""
    rng = random.Random(n)
    out = []
    for i in range(n):
        system = f"You are agent {i}."
        base = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": ""}],
            add_generation_prompt=True,
        )
        user = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(length))
        while True:  # trim the user text until the rendering fits the length
            tokens = tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": user}],
                add_generation_prompt=True,
            )
            if len(tokens) <= length or len(user) <= 1:
                break
            user = user[: max(1, len(user) - (len(tokens) - length))]
        assert len(base) < length
        out.append((system, user, list(tokens)))
    return out


async def through_actors(
    rt: Runtime, jobs: list[tuple[str, str, list[int]]], new: int, run: int
) -> dict[str, Any]:
    agents = [
        await rt.spawn(f"run{run}-agent{i}", system=system, max_tokens=new)
        for i, (system, _, _) in enumerate(jobs)
    ]
    replies: dict[int, Any] = {}

    async def ask(i: int) -> None:
        replies[i] = await agents[i].ask(jobs[i][1])

    steps = (await rt.stats()).batches
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(ask, i)
    seconds = time.perf_counter() - start
    steps = (await rt.stats()).batches - steps
    for i, (_, _, tokens) in enumerate(jobs):  # the agents saw exactly these prompts
        assert replies[i].usage.prompt_tokens == len(tokens)
    for agent in agents:
        await agent.close()
    generated = sum(r.usage.generated_tokens for r in replies.values())
    return {
        "seconds": seconds,
        "steps": steps,
        "tokens": generated,
        "tok_per_s": generated / seconds,
        "outputs": [list(replies[i].tokens) for i in range(len(jobs))],
    }


async def measure_batched(
    path: Path,
    model: Any,
    tokenizer: Any,
    jobs: list[tuple[str, str, list[int]]],
    new: int,
    repeats: int,
    trace: Path | None,
    decode_kernel: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Both batched modes, interleaved, ``repeats`` times each, after a run of each that
    is not counted (it compiles the kernels for the shapes each mode makes, and sets the
    runtime's prefill pace)."""
    actor_runs, raw_runs = [], []
    prompts = [tokens for _, _, tokens in jobs]
    # Every repeat asks the same prompts: without share_prefixes=False the later ones
    # would start from the blocks of the first, and measure no prefill at all.
    async with Runtime(
        path,
        max_batch_size=max(32, len(jobs)),
        pool_blocks=1 << 16,
        log_level="warning",
        trace=trace,
        share_prefixes=False,
        decode_kernel=decode_kernel,
    ) as rt:
        await through_actors(rt, jobs, new, -1)
        through_batch_generator(model, tokenizer, prompts, new)
        for r in range(repeats):
            actor_runs.append(await through_actors(rt, jobs, new, r))
            raw_runs.append(through_batch_generator(model, tokenizer, prompts, new))
    return actor_runs, raw_runs


def unlike(a: dict[str, Any], b: dict[str, Any]) -> int:
    """How many prompts' replies differ between two runs."""
    return sum(x != y for x, y in zip(a["outputs"], b["outputs"], strict=True))


def median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median speed, with every run's tokens/s beside it."""
    ordered = sorted(results, key=lambda r: r["tok_per_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["all_tok_per_s"] = [round(r["tok_per_s"], 1) for r in results]
    return chosen


def raw_generator(model: Any, tokenizer: Any, batch: int, prefill: int = 8) -> BatchGenerator:
    """mlx-lm's BatchGenerator as the engine builds it: stops at end of turn, room for
    ``batch`` sequences at once, prompts prefilled ``prefill`` at a time (mlx-lm's
    default: 8)."""
    return BatchGenerator(
        model,
        stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
        completion_batch_size=max(32, batch),
        prefill_batch_size=prefill,
    )


def through_batch_generator(
    model: Any, tokenizer: Any, prompts: list[list[int]], new: int, prefill: int = 8
) -> dict[str, Any]:
    gen = raw_generator(model, tokenizer, len(prompts), prefill)
    start = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[new] * len(prompts))
    outputs: dict[int, list[int]] = {u: [] for u in uids}
    live = set(uids)
    steps = 0
    while live:
        steps += 1
        _, responses = gen.next()
        for r in responses:
            outputs[r.uid].append(r.token)
            if r.finish_reason is not None:
                live.discard(r.uid)
    seconds = time.perf_counter() - start
    gen.close()
    generated = sum(len(v) for v in outputs.values())
    return {
        "seconds": seconds,
        "steps": steps,
        "tokens": generated,
        "tok_per_s": generated / seconds,
        "outputs": [outputs[u] for u in uids],
    }


def sequentially(model: Any, tokenizer: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    eos = tokenizer.eos_token_ids
    start = time.perf_counter()
    outputs = []
    for prompt in prompts:
        out = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=new):
            out.append(int(token))
            if token in eos:
                break
        outputs.append(out)
    seconds = time.perf_counter() - start
    generated = sum(len(o) for o in outputs)
    return {
        "seconds": seconds,
        "tokens": generated,
        "tok_per_s": generated / seconds,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default="f32", choices=["bf16", "f16", "f32"])
    parser.add_argument("--model", type=Path, help="a model directory instead of --shape")
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-sequential", action="store_true", help="skip the slow baseline")
    parser.add_argument("--trace", type=Path, help="also write the actors' trace: NAME-N.jsonl")
    parser.add_argument(
        "--no-decode-kernel",
        action="store_true",
        help="Runtime(decode_kernel=False): on CUDA, mlx-lm's masked attention in the batch",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each batched mode, interleaved; the median is reported",
    )
    args = parser.parse_args()

    path = args.model or random_model(args.shape, args.dtype)
    model, tokenizer = mlx_lm.load(str(path))
    warm = prompts_for(tokenizer, 2, args.prompt_tokens)
    through_batch_generator(model, tokenizer, [t for _, _, t in warm], 8)  # compile kernels

    runs = []
    for n in args.agents:
        jobs = prompts_for(tokenizer, n, args.prompt_tokens)
        prompts = [t for _, _, t in jobs]
        trace = args.trace and args.trace.with_name(f"{args.trace.stem}-{n}{args.trace.suffix}")
        actor_runs, raw_runs = anyio.run(
            measure_batched,
            path,
            model,
            tokenizer,
            jobs,
            args.new_tokens,
            args.repeats,
            trace,
            not args.no_decode_kernel,
        )
        actors, raw = median_run(actor_runs), median_run(raw_runs)
        seq = (
            None if args.no_sequential else sequentially(model, tokenizer, prompts, args.new_tokens)
        )
        # mlx-lm's own batching, its prompts prefilled all at once instead of 8 at a time.
        together = through_batch_generator(model, tokenizer, prompts, args.new_tokens, n)
        run: dict[str, Any] = {
            "agents": n,
            # On a GPU in bf16, how a batch is formed changes the arithmetic (how many
            # prompt tokens a model call runs), so outputs of differently formed
            # batches may differ, mlx-lm's own among them; on a CPU in float32 they match.
            "actors_outputs_equal_batch_generator": actors["outputs"] == raw["outputs"],
            "actors_replies_unlike_batch_generator": unlike(actors, raw),
            # mlx-lm's single stream, the oracle (None: not run, --no-sequential).
            "sequential_outputs_equal_batch_generator": None
            if seq is None
            else seq["outputs"] == raw["outputs"],
            "actors_outputs_equal_sequential": None
            if seq is None
            else actors["outputs"] == seq["outputs"],
            "actors_replies_unlike_sequential": None if seq is None else unlike(actors, seq),
            "batch_generator_replies_unlike_sequential": None if seq is None else unlike(raw, seq),
            "batch_generator_outputs_equal_with_one_prefill_group": together["outputs"]
            == raw["outputs"],
            "actors_outputs_equal_one_prefill_group": actors["outputs"] == together["outputs"],
            "actors_replies_unlike_one_prefill_group": unlike(actors, together),
        }
        for name, result in (("mlx_actors", actors), ("batch_generator", raw), ("sequential", seq)):
            if result is not None:
                run[name] = {
                    k: round(v, 4) if isinstance(v, float) else v
                    for k, v in result.items()
                    if k != "outputs"
                }
        # Runs are interleaved in pairs, so the device's drift cancels within a pair.
        pairs = [a["tok_per_s"] / r["tok_per_s"] for a, r in zip(actor_runs, raw_runs)]
        run["actors_vs_batch_generator"] = round(statistics.median(pairs), 3)
        run["actors_vs_batch_generator_pairs"] = [round(p, 3) for p in pairs]
        if seq is not None:
            run["actors_vs_sequential"] = round(actors["tok_per_s"] / seq["tok_per_s"], 2)
        runs.append(run)
        print(json.dumps(run), flush=True)
    print(
        json.dumps(
            {
                "benchmark": "batching",
                "shape": args.shape if args.model is None else str(args.model),
                "dtype": args.dtype,
                "device": device_name(),
                "machine": platform.machine(),
                "mlx": mx.__version__,
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens,
                "decode_kernel": not args.no_decode_kernel,
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
