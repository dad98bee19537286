"""Four agents in a group chat: each is told what the others say (``tell``: no reply, its
tokens prefilled with the agent's next turn) and speaks in turn.

python examples/round_table.py [MODEL]
"""

import sys

from mlx_actors import Runtime, run

MODEL = sys.argv[1] if len(sys.argv) > 1 else None

PEOPLE = {
    "ada": "You are Ada, an engineer. Speak in one short sentence.",
    "ben": "You are Ben, a farmer. Speak in one short sentence.",
    "cleo": "You are Cleo, a poet. Speak in one short sentence.",
    "dev": "You are Dev, a doctor. Speak in one short sentence.",
}


async def main() -> None:
    async with Runtime(MODEL, log_level="warning") as rt:
        agents = [
            await rt.spawn(name, system=system, max_tokens=48) for name, system in PEOPLE.items()
        ]
        question = "host: What would make our town a better place to live?"
        print(question)
        for agent in agents:
            await agent.tell(question)  # everyone hears the host
        for _ in range(2):
            for agent in agents:
                reply = await agent.ask(f"Your turn, {agent.name}.")
                print(f"{agent.name}: {reply.text}")
                for other in agents:  # the others hear it: no reply, no turn
                    if other is not agent:
                        await other.tell(f"{agent.name}: {reply.text}")


if __name__ == "__main__":
    run(main)
