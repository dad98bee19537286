"""Which cache leaves a full pool: eviction by expected next use against least recently
used, on agent workloads whose caches do not all fit. Prints JSON.

    python benchmarks/residency.py [--shape llama-3.2-1b --dtype bf16] [--history 8192]

Three workloads, each run with ``eviction="lru"`` and ``"next-use"`` (alternating which
goes first), the pool at half the workload's cache (``--pool-share``):

- ``round-robin``: ``--agents`` agents, each with a history of about ``--history``
  tokens, asked one after another for ``--rounds`` rounds;
- ``main-helpers``: a main agent with ``--main-share`` times that history and four
  helpers, each helper asked in turn and the main agent after each, for ``--rounds``
  rounds;
- ``tool-team``: three workers whose every task is two turns with a tool between them
  (0.5-2 s, as a client of the server runs it: the first turn's reply stands for the
  call, the second turn brings the result), all working at once, while seven other agents
  are asked in a round robin. With ``"next-use"`` each worker is pinned while its tool
  runs, as ``mlx-actors serve`` pins a session after a reply that calls tools
  (``--tool-pin-seconds``); with ``"lru"`` it is not (eviction as it was before either).
  Figures add the tool results whose turn found its worker's cache out of the pool (a
  restore before a worker's second turn of a task), and the pinned agents evicted.

Histories (a text of their own for each agent, so that no blocks are shared) are built
first (untimed); then the timed turns are short questions with ``--reply``-token
replies. Figures: wall time of the timed turns; caches brought back, of them ahead of
their turn (``"next-use"`` brings back the agent expected next while other turns run)
and from host memory, and the time spent bringing them back (the trace's ``blocks.read``
from disk and ``blocks.restored``); the turns whose cache came back only after they were
asked (``turns_waited``), and the time from being asked to admission of the turns whose
cache came back at all (``waited_ms``: the time waiting on restores, the figure the
policy should cut); every turn's time from being asked to its admission; bytes brought
back; replies compared between the two policies.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from _models import model_arguments, random_model, run_facts
from mlx_lm.utils import load_tokenizer
from restore import filler

from mlx_actors import Runtime

POLICIES = ("lru", "next-use")


#: The tool-team workload's workers, and how many tasks each does.
WORKERS, TASKS = 3, 3


def plan(workload: str, args: argparse.Namespace) -> tuple[dict[str, int], list[str]]:
    """Each agent's history in tokens, and the order of the timed turns (for the tool
    team: the round robin's, beside the workers' own)."""
    if workload == "tool-team":
        workers = {f"worker{i}": args.history for i in range(WORKERS)}
        others = {f"agent{i}": args.history for i in range(7)}
        return {**workers, **others}, list(others) * args.rounds
    if workload == "round-robin":
        agents = {f"agent{i}": args.history for i in range(args.agents)}
        return agents, list(agents) * args.rounds
    helpers = [f"helper{i}" for i in range(4)]
    agents = {"main": int(args.main_share * args.history), **dict.fromkeys(helpers, args.history)}
    return agents, [a for _ in range(args.rounds) for h in helpers for a in (h, "main")]


async def run(
    model: Path, workload: str, policy: str, args: argparse.Namespace, tokenizer: Any
) -> dict[str, Any]:
    agents, order = plan(workload, args)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    tasks = {name: 2 * TASKS if name.startswith("worker") else 0 for name in agents}
    turns = {name: order.count(name) + tasks[name] + 1 for name in agents}
    blocks = sum(-(-(h + turns[a] * (args.reply + 32)) // 256) for a, h in agents.items())
    pool_blocks = max(1, int(blocks * args.pool_share)) * layers  # a block is one layer's
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        async with Runtime(
            model, pool_blocks=pool_blocks, eviction=policy, log_level="off", trace=trace
        ) as rt:
            for i, (name, history) in enumerate(agents.items()):
                agent = await rt.spawn(name, system="You are a careful reader.")
                await agent.ask(filler(tokenizer, history - i), max_tokens=args.reply)
            before = await rt.stats()
            mark = len(trace.read_text().splitlines())
            began = time.perf_counter()
            replies: dict[str, list[tuple[int, ...]]] = {name: [] for name in agents}
            async with anyio.create_task_group() as team:
                if workload == "tool-team":
                    for name in agents:
                        if name.startswith("worker"):
                            team.start_soon(work, rt, name, policy == "next-use", args, replies)
                for i, name in enumerate(order):
                    reply = await rt.agent(name).ask(f"Turn {i}: what next?", max_tokens=args.reply)
                    replies[name].append(reply.tokens)
            wall = time.perf_counter() - began
            after = await rt.stats()
        events = [json.loads(line) for line in trace.read_text().splitlines()[mark:]]
    back = [e for e in events if e["event"] in ("blocks.restored", "blocks.read")]
    return {
        "wall_s": round(wall, 3),
        "turns": sum(len(r) for r in replies.values()),
        "pool_blocks": pool_blocks,
        "restores": after.restores - before.restores,
        "restores_ahead": after.prefetches - before.prefetches,
        "restores_from_memory": after.memory_restores - before.memory_restores,
        "restore_ms": round(sum(e.get("ms", 0.0) for e in back), 1),
        **waits(events),
        "bytes_back": sum(e["bytes"] for e in events if e["event"] == "blocks.restored"),
        "evictions": after.evictions - before.evictions,
        **(tool_figures(events) if workload == "tool-team" else {}),
        "replies": replies,
    }


def waits(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the turns waited for their caches: the turns whose agent's cache was brought
    back after the turn was asked (not ahead of it), and the time from being asked to
    admission of every turn whose cache was brought back since its agent's last turn,
    ahead or not (a restore ahead that was not done when the turn came still holds it
    up); and that time for all turns."""
    back: set[str] = set()  # agents whose cache came back since their last turn
    late: set[str] = set()  # of those, brought back after the turn was asked
    waited, waited_ms = 0, 0.0
    for e in events:
        agent = e.get("agent", "")
        if e["event"] == "blocks.restored":
            back.add(agent)
            if not e.get("prefetch"):
                late.add(agent)
        elif e["event"] == "turn.admitted":
            if agent in back:
                waited_ms += e["queued_ms"]
            waited += agent in late
            back.discard(agent)
            late.discard(agent)
    admitted = [e for e in events if e["event"] == "turn.admitted"]
    return {
        "turns_waited": waited,
        "waited_ms": round(waited_ms, 1),
        "queued_ms": round(sum(e["queued_ms"] for e in admitted), 1),
    }


def tool_figures(events: list[dict[str, Any]]) -> dict[str, int]:
    """Tool results that waited on a restore (a worker's restore before its second turn
    of a task), and evictions of pinned agents."""
    admitted: dict[str, int] = {}
    restored: set[str] = set()
    waited = 0
    for e in events:
        agent = e.get("agent", "")
        if not agent.startswith("worker"):
            continue
        if e["event"] == "blocks.restored":
            restored.add(agent)
        elif e["event"] == "turn.admitted":
            turn = admitted.get(agent, 0)
            admitted[agent] = turn + 1
            waited += turn % 2 == 1 and agent in restored
            restored.discard(agent)
    pinned = sum(
        1 for e in events if e["event"] == "blocks.evicted" and e["why"].startswith("pinned")
    )
    return {"tool_results_restored": waited, "pinned_evicted": pinned}


async def work(
    rt: Runtime,
    name: str,
    pin: bool,
    args: argparse.Namespace,
    replies: dict[str, list[tuple[int, ...]]],
) -> None:
    """A worker's tasks: a turn that calls a tool, the tool (0.5-2 s), a turn with its
    result; pinned while the tool runs if ``pin``."""
    agent = rt.agent(name)
    wait = random.Random(name)
    for task in range(TASKS):
        call = await agent.ask(f"Task {task}: which tool?", max_tokens=args.reply)
        if pin:
            agent.pin(60)  # as the server pins a session after a reply with calls
        await anyio.sleep(wait.uniform(0.5, 2.0))  # the tool runs
        result = await agent.ask(f"Task {task}: the tool says 42.", max_tokens=args.reply)
        if pin:
            agent.unpin()
        replies[name].extend([call.tokens, result.tokens])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--history", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--pool-share", type=float, default=0.5)
    parser.add_argument(
        "--main-share",
        type=float,
        default=1.25,
        help="the main agent's history, in helpers' histories (from about 1.5 on, a pool "
        "at half the caches cannot hold it beside a helper once it has grown, and every "
        "turn restores whatever the policy)",
    )
    parser.add_argument(
        "--workloads", nargs="*", default=["round-robin", "main-helpers", "tool-team"]
    )
    args = parser.parse_args()
    model = Path(args.model or random_model(args.shape, args.dtype))
    tokenizer = load_tokenizer(model)
    out: dict[str, Any] = {"facts": run_facts("residency", args), "workloads": {}}
    for k, workload in enumerate(args.workloads):
        order = POLICIES if k % 2 == 0 else POLICIES[::-1]
        runs = {p: anyio.run(run, model, workload, p, args, tokenizer) for p in order}
        lru, ours = runs["lru"], runs["next-use"]
        out["workloads"][workload] = {
            **{p: {k: v for k, v in r.items() if k != "replies"} for p, r in runs.items()},
            "replies_identical": lru["replies"] == ours["replies"],
            "restore_ms_lru_over_next_use": round(
                lru["restore_ms"] / max(ours["restore_ms"], 1e-3), 2
            ),
            "waited_ms_lru_over_next_use": round(
                lru["waited_ms"] / max(ours["waited_ms"], 1e-3), 2
            ),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
