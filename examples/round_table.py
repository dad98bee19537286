"""Four agents in a group chat: each hears what the others said since it last spoke.

python examples/round_table.py [MODEL]
"""

import sys

import anyio

from mlx_actors import Runtime

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
        transcript = [("host", "What would make our town a better place to live?")]
        heard = {agent.name: 0 for agent in agents}  # how much of the transcript each has heard
        print(f"host: {transcript[0][1]}")
        for _ in range(2):
            for agent in agents:
                news = "\n".join(f"{who}: {said}" for who, said in transcript[heard[agent.name] :])
                reply = await agent.ask(news)
                transcript.append((agent.name, reply.text))
                heard[agent.name] = len(transcript)
                print(f"{agent.name}: {reply.text}")


if __name__ == "__main__":
    anyio.run(main)
