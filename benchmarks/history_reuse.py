"""How much of each turn's history comes from the cache, per model family: total prefill
over a multi-agent dialogue against the minimum (the tokens that differ from what the
agent's cache holds). Prints JSON.

    python benchmarks/history_reuse.py                       # every family and case
    python benchmarks/history_reuse.py --window 32 --case stop

Tiny random-weight models of each family (Llama, Qwen 2.5, Gemma 3 with its 5:1 pattern
of sliding-window and global layers, Qwen MoE) and the byte tokenizer, so that replies
often re-encode differently from the tokens generated (invalid UTF-8 decodes to U+FFFD):
the re-rendered conversation then differs from the cache inside the last reply. Cases:

- ``plain``: 4 agents take turns, each answering the one before (48 turns);
- ``stop``: the same with stop strings, cut from the replies' text;
- ``trim``: a Gemma-like template that trims every message;
- ``concurrent``: the 4 agents ask at once, 12 rounds, with stop strings.

The minimum is, per turn, the prompt less the tokens it shares with the agent's own
cache (``reply.usage.reusable_tokens``); "lost" turns are those that prefilled more.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import anyio
from _models import device_name

from mlx_actors import Runtime
from mlx_actors.testing import family_configs, write_random_model

#: A template that trims every message, as Gemma 3's does.
TRIM_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CASES = ("plain", "stop", "trim", "concurrent")
STOPS = ("e", "t")
OPENING = "Let us plan a trip to the mountains together; what should we take?"


def write_model(root: Path, family: str, config: dict[str, Any], case: str) -> Path:
    # Gemma's scaled embeddings saturate at larger scales: every reply would be "\n"s.
    scale = 1.0 if family == "gemma3_text" else 4.0
    path = write_random_model(root / f"{family}-{case}", config, seed=11, init_scale=scale)
    if case == "trim":
        settings = path / "tokenizer_config.json"
        data = json.loads(settings.read_text())
        data["chat_template"] = TRIM_TEMPLATE
        settings.write_text(json.dumps(data))
    return path


async def dialogue(path: Path, case: str, agents: int, rounds: int, words: int) -> dict[str, Any]:
    stop = STOPS if case in ("stop", "concurrent") else None
    turns: list[Any] = []
    async with Runtime(path, pool_blocks=2000, log_level="off") as rt:
        team = [
            await rt.spawn(f"a{i}", system=f"You are agent {i}.", max_tokens=words, stop=stop)
            for i in range(agents)
        ]
        if case == "concurrent":
            for r in range(rounds):
                replies: list[Any] = [None] * agents

                async def ask(i: int, r: int = r, replies: list[Any] = replies) -> None:
                    replies[i] = await team[i].ask(f"Round {r}: {OPENING}")

                async with anyio.create_task_group() as tg:
                    for i in range(agents):
                        tg.start_soon(ask, i)
                turns.extend(replies)
        else:
            line = OPENING
            for r in range(rounds):
                for agent in team:
                    reply = await agent.ask(f"Round {r}. {line}")
                    turns.append(reply)
                    line = reply.text[:80] or "Go on."
    prefill = minimum = lost = full = 0
    for reply in turns:
        usage = reply.usage
        prompt = usage.prompt_tokens + usage.cached_tokens
        prefill += usage.prompt_tokens
        minimum += prompt - max(usage.reusable_tokens, usage.cached_tokens)
        lost += usage.cached_tokens < usage.reusable_tokens
        full += usage.cached_tokens == 0 < usage.reusable_tokens
    return {
        "turns": len(turns),
        "prefill_tokens": prefill,
        "minimum_tokens": minimum,
        "ratio": round(prefill / minimum, 3),
        "turns_lost": lost,
        "turns_fully_reprefilled": full,
        "generated_tokens": sum(r.usage.generated_tokens for r in turns),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(family_configs(0)), action="append")
    parser.add_argument("--case", choices=CASES, action="append")
    parser.add_argument("--window", type=int, default=512, help="Gemma 3's sliding window")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--words", type=int, default=48, help="max_tokens per reply")
    args = parser.parse_args()
    configs = family_configs(args.window)
    root = Path(tempfile.mkdtemp(prefix="mlx-actors-reuse-"))
    results: dict[str, Any] = {
        "benchmark": "history_reuse",
        "device": device_name(),
        "window": args.window,
        "families": {},
    }
    for family in args.family or sorted(configs):
        for case in args.case or CASES:
            path = write_model(root, family, configs[family], case)
            result = anyio.run(dialogue, path, case, args.agents, args.rounds, args.words)
            results["families"].setdefault(family, {})[case] = result
            print(f"{family:12s} {case:10s} {json.dumps(result)}", flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
