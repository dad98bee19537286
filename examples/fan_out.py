"""One question to eight agents at once, then a judge sums up.

The eight turns run in the same batches: the trace printed on stderr shows each
turn admitted next to the others (`batch=`), and the statistics at the end show the
largest batch. Pass a file name ending in .json as a second argument to also write a
Chrome trace (open it in ui.perfetto.dev).

    python examples/fan_out.py [MODEL] [TRACE.json]

(``-`` as MODEL: the default model, for a trace file without a model.)
"""

import sys

from mlx_actors import Runtime, gather, run

MODEL = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else None
TRACE = sys.argv[2] if len(sys.argv) > 2 else None
QUESTION = "Name one thing every city needs, and say why in one sentence."


async def main() -> None:
    async with Runtime(MODEL, trace=TRACE, log_level="info") as rt:  # info: every turn
        panel = [
            await rt.spawn(
                f"panelist{i}",
                system=f"You are panelist {i}. Be brief.",
                seed=i,
                temperature=0.7,
                max_tokens=48,
            )
            for i in range(8)
        ]
        replies = await gather(*(agent.ask(QUESTION) for agent in panel))  # one batch
        answers = {agent.name: reply.text for agent, reply in zip(panel, replies)}
        for name, text in answers.items():
            print(f"{name}: {text}")

        judge = await rt.spawn("judge", system="You are a fair judge. Be brief.", max_tokens=96)
        summary = await judge.ask(
            "Sum up these answers in two sentences:\n"
            + "\n".join(f"- {text}" for text in answers.values())
        )
        print(f"\njudge: {summary.text}")
        stats = await rt.stats()
        print(f"\n[{stats.batches} batches, up to {stats.max_batch_size} turns in one batch]")


if __name__ == "__main__":
    run(main)
