"""A review panel that reads one long brief: what the agents share is computed once.

Three reviewers get the same brief in their system prompt, each with a role of its
own, and are asked at once: one of them prefills the brief, the others wait for its
blocks and prefill only their role and the question. Then the first reviewer is
forked into two follow-ups that continue its conversation from the same cache (no
copy, no prefill). The numbers at the end say what sharing saved.

    python examples/review_panel.py [MODEL]
"""

import sys

import anyio

from mlx_actors import Runtime, run

MODEL = sys.argv[1] if len(sys.argv) > 1 else None
BRIEF = """Project brief: the old harbour.

The city wants to turn its old harbour into a park with housing. The site covers
forty hectares between the river and the ring road. It holds six brick warehouses
from the 1890s (two of them listed), a disused rail yard with three sidings, a fish
market that still trades every morning from four to nine, a boat repair yard, and a
car park used by commuters. Two primary schools stand at the northern edge, and a
retirement home faces the market across the quay.

Ground. A century of shipbuilding left oil, heavy metals and asbestos in parts of
the soil, worst under the rail yard and the repair yard. A survey from 2019 found
the water table two metres below the surface, so digging deep is costly, and the
quay walls need repair within ten years whatever is built.

Money. The first plan asked for 420 million; the council has about half of that,
from a national grant that must be spent within six years and from the sale of
building plots. Every phase must pay for itself or bring in the next grant.

People. At four public meetings, residents asked above all for homes they can
afford, green space that is open at night, and safe ways to walk to the schools.
The market traders want to stay where they are, with their early deliveries. The
port authority wants one quay kept for the ferry that may return in 2030. Cyclists
want a path along the water; the retirement home asks for quiet.

What the council asks of the panel: a plan that can be built in phases, that keeps
the schools safe during the works, that keeps the market open throughout, and that
says what to build first and why. Reviewers should be concrete and brief."""
ROLES = ["an engineer", "an economist", "a parent from one of the schools"]


async def main() -> None:
    async with Runtime(MODEL, log_level="warning") as rt:
        panel = [
            await rt.spawn(f"reviewer{i}", system=f"{BRIEF}\nYou are {role}.", max_tokens=48)
            for i, role in enumerate(ROLES)
        ]
        replies = {}

        async def review(agent) -> None:  # type: ignore[no-untyped-def]
            replies[agent.name] = await agent.ask("What is the biggest risk? One sentence.")

        async with anyio.create_task_group() as tg:
            for agent in panel:
                tg.start_soon(review, agent)
        for agent in panel:
            usage = replies[agent.name].usage
            print(f"{agent.name}: {replies[agent.name].text}")
            print(f"  ({usage.prompt_tokens} tokens prefilled, {usage.shared_tokens} shared)\n")

        what_ifs = [await panel[0].fork(f"what_if{i}") for i in range(2)]
        for agent, question in zip(what_ifs, ["What if the budget doubled?", "And if not?"]):
            reply = await agent.ask(question)
            print(f"{agent.name}: {reply.text}")
            print(
                f"  ({reply.usage.prompt_tokens} prefilled, {reply.usage.cached_tokens} cached)\n"
            )

        stats = await rt.stats()
        print(
            f"[{stats.prefill_tokens} tokens prefilled, {stats.shared_tokens} taken from "
            f"blocks another agent computed; {stats.shared_blocks} cache blocks held by "
            f"several agents, saving {stats.shared_bytes / 1e6:.1f} MB]"
        )


if __name__ == "__main__":
    run(main)
