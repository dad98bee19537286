"""Two agents argue in turns; each reply is streamed as it is generated.

python examples/debate.py [MODEL]      # MODEL: a model directory, .gguf or id
"""

import sys

from mlx_actors import Runtime, run

MODEL = sys.argv[1] if len(sys.argv) > 1 else None  # None: the embedded default model


async def main() -> None:
    async with Runtime(MODEL, log_level="warning") as rt:
        alice = await rt.spawn(
            "alice", system="You are Alice. You are optimistic about the future.", max_tokens=64
        )
        bob = await rt.spawn("bob", system="You are Bob, a sceptic.", max_tokens=64)
        line = "Should we build a city on Mars?"
        print(f"moderator: {line}\n")
        for _ in range(2):
            for agent in (alice, bob):
                print(f"{agent.name}: ", end="", flush=True)
                async with agent.stream(line) as pieces:
                    async for piece in pieces:
                        print(piece, end="", flush=True)
                print("\n")
                line = pieces.reply.text
        stats = await rt.stats()
        print(
            f"[{stats.turns} turns: {stats.prefill_tokens} tokens prefilled, "
            f"{stats.cached_tokens} reused from the agents' caches, "
            f"{stats.generated_tokens} generated]"
        )


if __name__ == "__main__":
    run(main)  # or: run(main, backend="trio"); Ctrl-C ends it with one line
