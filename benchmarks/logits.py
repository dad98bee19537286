"""Where batched replies leave mlx-lm's, step by step: every generated token's logits for
N prompts asked together, through mlx-lm's single stream (``generate_step``, prompt by
prompt), raw ``BatchGenerator`` and mlx-actors' engine with and without the decode
kernel (``decode_kernel``), compared bit for bit. Prints JSON.

    python benchmarks/logits.py --shape llama-3.2-1b --dtype bf16 --agents 8

For each pair of paths and each prompt: the first step whose logits differ in any bit,
the largest difference there, the first token that differs, and the top-two margin of
the logits that chose it (0: a tie in the model's dtype). The engine runs the prompts
twice and is compared on the second run (the first sets its prefill pace, which cuts a
process's first prompts into chunks). Every path is recorded at the model's call, so
the figures are the logits the samplers saw.
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
from _models import SHAPES, device_name, random_model
from batching import prompts_for, sequentially, through_batch_generator

from mlx_actors.scheduler.engine._engine import BlockPoolBatchEngine
from mlx_actors.scheduler.kv._pool import BlockPool
from mlx_actors.scheduler.kv._spec import ModelCacheSpec
from mlx_actors.scheduler.service._build import _compile_kernels

#: Per model call while recording: (input tokens, (last position's logits as bits, as f32)).
Calls = list[tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]]


class Recorder:
    """Records every call of the model's class while ``calls`` is a list."""

    def __init__(self, model: Any) -> None:
        self.calls: list[Any] | None = None
        cls = type(model)
        original = cls.__call__
        recorder = self

        def call(self: Any, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
            out = original(self, inputs, *args, **kwargs)
            if recorder.calls is not None:
                recorder.calls.append((np.array(inputs), out[:, -1, :]))
            return out

        cls.__call__ = call

    def start(self) -> None:
        self.calls = []

    def stop(self) -> Calls:
        """The calls recorded, read into host arrays (on the thread that ran them)."""
        calls, self.calls = self.calls or [], None
        out = []
        for inputs, logits in calls:
            as_bits = logits.view(mx.uint32 if logits.dtype == mx.float32 else mx.uint16)
            out.append((inputs, (np.array(as_bits), np.array(logits.astype(mx.float32)))))
        return out


def batched_rows(calls: Calls, prompts: list[list[int]]) -> dict[int, list[Any]]:
    """Each prompt's logits per generated token, from a batched path's calls: a call of
    B rows of the prompts' tokens before their last maps rows to prompts; decoding calls
    (one token per row) keep that map while the batch keeps its rows."""
    rows: dict[int, list[Any]] = {i: [] for i in range(len(prompts))}
    where: list[int | None] = []
    for inputs, (bits, floats) in calls:
        batch, length = inputs.shape
        if length > 1:
            where = []
            for r in range(batch):
                row = list(inputs[r])  # left-padded to the longest
                match = [
                    i
                    for i, p in enumerate(prompts)
                    if row[length - min(length, len(p) - 1) :] == list(p[:-1])[-length:]
                ]
                where.append(match[0] if len(match) == 1 else None)
            continue
        if len(where) != batch:  # rows left or joined: stop following them
            where = [None] * batch
        for r, i in enumerate(where):
            if i is not None:
                rows[i].append((bits[r], floats[r]))
    return rows


def single_stream(
    model: Any, tokenizer: Any, recorder: Recorder, prompts: list[list[int]], new: int
) -> tuple[dict[int, list[Any]], list[list[int]]]:
    rows, outputs = {}, []
    for i, prompt in enumerate(prompts):
        recorder.start()
        out = sequentially(model, tokenizer, [prompt], new)["outputs"][0]
        calls = recorder.stop()
        first = max(j for j, (inputs, _) in enumerate(calls) if inputs.shape[1] > 1)
        rows[i] = [(b[0], f[0]) for _, (b, f) in calls[first:]][: len(out)]
        outputs.append(out)
    return rows, outputs


def through_engine(
    model: Any, tokenizer: Any, recorder: Recorder, prompts: list[list[int]], new: int, kernel: bool
) -> tuple[Calls, list[list[int]]]:
    """The prompts through the engine on a thread of its own, twice; the second recorded."""
    box: list[tuple[Calls, list[list[int]]]] = []

    spec = ModelCacheSpec.from_model(model)
    _compile_kernels(spec, model)

    def run() -> None:
        engine = BlockPoolBatchEngine(
            model, tokenizer, BlockPool(spec, total_blocks=20_000), decode_kernel=kernel
        )
        outputs: dict[str, list[int]] = {}
        for run in range(2):
            if run == 1:
                recorder.start()
            for i, prompt in enumerate(prompts):
                engine.submit(f"{run}-{i}", prompt, max_tokens=new)
            while engine.active:
                for done in engine.step():
                    outputs[done.agent_id] = list(done.tokens)
                    engine.release(done.blocks)
        calls = recorder.stop()
        engine.close()
        box.append((calls, [outputs[f"1-{i}"] for i in range(len(prompts))]))
        mx.clear_streams()  # as the runtime's engine thread ends (ml-explore/mlx#4327)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return box[0]


def compare(
    a: dict[int, list[Any]], b: dict[int, list[Any]], out_a: list[list[int]], out_b: list[list[int]]
) -> list[dict[str, Any]]:
    """Per prompt: where two paths' logits and tokens first differ."""
    result = []
    for i in a:
        token = next((t for t, (x, y) in enumerate(zip(out_a[i], out_b[i])) if x != y), None)
        last = token if token is not None else min(len(out_a[i]), len(out_b[i])) - 1
        first_bits, difference, compared = None, None, 0
        for t in range(min(last + 1, len(a[i]), len(b[i]))):
            compared += 1
            if first_bits is None and not np.array_equal(a[i][t][0], b[i][t][0]):
                first_bits = t
                difference = float(np.abs(a[i][t][1] - b[i][t][1]).max())
        margin = None
        if token is not None and token < len(a[i]):
            top = np.sort(a[i][token][1])
            margin = float(top[-1] - top[-2])
        result.append(
            {
                "steps_compared": compared,
                "first_step_bits_differ": first_bits,
                "max_difference_there": difference,
                "first_token_differs": token,
                "top_two_margin_there": margin,
            }
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default="f32", choices=["bf16", "f16", "f32"])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()

    model, tokenizer = mlx_lm.load(str(random_model(args.shape, args.dtype)))
    recorder = Recorder(model)
    prompts = [t for _, _, t in prompts_for(tokenizer, args.agents, args.prompt_tokens)]
    new = args.new_tokens
    single, single_out = single_stream(model, tokenizer, recorder, prompts, new)
    recorder.start()
    raw_out = through_batch_generator(model, tokenizer, prompts, new)["outputs"]
    raw = batched_rows(recorder.stop(), prompts)
    paths = {"single_stream": (single, single_out), "batch_generator": (raw, raw_out)}
    for kernel in (True, False):
        calls, out = through_engine(model, tokenizer, recorder, prompts, new, kernel)
        paths[f"engine_decode_kernel_{str(kernel).lower()}"] = (batched_rows(calls, prompts), out)
    pairs = {}
    for first, second in (
        ("batch_generator", "single_stream"),
        ("engine_decode_kernel_true", "batch_generator"),
        ("engine_decode_kernel_false", "batch_generator"),
        ("engine_decode_kernel_true", "single_stream"),
        ("engine_decode_kernel_false", "single_stream"),
    ):
        (a, out_a), (b, out_b) = paths[first], paths[second]
        rows = compare(a, b, out_a, out_b)
        pairs[f"{first}_vs_{second}"] = {
            "rows_bits_equal": sum(r["first_step_bits_differ"] is None for r in rows),
            "replies_equal": sum(r["first_token_differs"] is None for r in rows),
            "rows": rows,
        }
    print(
        json.dumps(
            {
                "benchmark": "logits",
                "shape": args.shape,
                "dtype": args.dtype,
                "device": device_name(),
                "machine": platform.machine(),
                "mlx": mx.__version__,
                "agents": args.agents,
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": new,
                "pairs": pairs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
