"""What turning a long conversation into tokens costs each turn: mlx-lm's way (render the
whole chat, encode the whole text) against the agent's (render the whole chat, encode
only from the last cut it shares with the previous turn's text). And a new agent's first
turn on a brief another agent read just before (``--brief`` tokens): encoded in full, or
from the other's rendering (``share_prefixes``). Prints JSON.

    python benchmarks/render.py --turns 1000

Uses the embedded default model's tokenizer (SmolLM2, fetched once) unless ``--model``
names another model directory. Both give the same tokens (checked each time).
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

from mlx_lm.utils import load_tokenizer

from mlx_actors.actors._render import Renderer, Rendering
from mlx_actors.runtime import default_model_dir


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(5)) for _ in range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: SmolLM2)")
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--at", type=int, nargs="+", default=[10, 100, 500, 1000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--brief", type=int, default=8192, help="tokens of the shared brief")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model or default_model_dir())
    agents = new_agents(tokenizer, args.brief, args.repeats)
    renderer = Renderer(tokenizer)
    rng = random.Random(0)
    conversation: list[dict[str, Any]] = [{"role": "system", "content": "You listen."}]
    previous: Rendering | None = None
    rows = []
    for turn in range(1, args.turns + 1):
        conversation.append({"role": "user", "content": words(rng, 6)})
        if turn in args.at:
            full, incremental = [], []
            for _ in range(args.repeats):
                started = time.perf_counter()
                expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
                full.append(time.perf_counter() - started)
                started = time.perf_counter()
                rendering = renderer.render(conversation, previous)
                incremental.append(time.perf_counter() - started)
                assert rendering.tokens == tuple(expected)
            rows.append(
                {
                    "turn": turn,
                    "tokens": len(rendering.tokens),
                    "mlx_lm_ms": round(statistics.median(full) * 1e3, 2),
                    "agent_ms": round(statistics.median(incremental) * 1e3, 2),
                    "reused_tokens": rendering.reused,
                }
            )
        else:
            rendering = renderer.render(conversation, previous)
        previous = rendering
        conversation.append({"role": "assistant", "content": words(rng, 8)})
    out = {"benchmark": "render", "machine": platform.machine(), "turns": rows, **agents}
    print(json.dumps(out, indent=2))


def new_agents(tokenizer: Any, brief_tokens: int, repeats: int) -> dict[str, Any]:
    """New agents' first turns on a brief one agent read before: each agent's rendering
    alone, and starting from the recent ones (milliseconds, median)."""
    rng = random.Random(1)
    brief = words(rng, brief_tokens)
    ids = tokenizer.encode(brief, add_special_tokens=False)[:brief_tokens]
    brief = tokenizer.decode(ids)

    def conversation(i: int) -> list[dict[str, Any]]:
        return [{"role": "system", "content": brief}, {"role": "user", "content": f"Q{i}?"}]

    times: dict[bool, list[float]] = {False: [], True: []}
    for share in (False, True):
        renderer = Renderer(tokenizer)
        renderer.render(conversation(0), share=share)  # the agent that read it first
        for i in range(1, repeats + 1):
            started = time.perf_counter()
            rendering = renderer.render(conversation(i), share=share)
            times[share].append(time.perf_counter() - started)
            expected = tokenizer.apply_chat_template(conversation(i), add_generation_prompt=True)
            assert rendering.tokens == tuple(expected)
    return {
        "new_agent_on_brief": {
            "brief_tokens": len(ids),
            "alone_ms": round(statistics.median(times[False]) * 1e3, 2),
            "from_recent_ms": round(statistics.median(times[True]) * 1e3, 2),
        }
    }


if __name__ == "__main__":
    main()
