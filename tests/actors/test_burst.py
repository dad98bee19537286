"""A burst of turns larger than the pool waits for room instead of failing: every turn
is answered, as it would be alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from mlx_actors import Runtime

from ..conftest import Loaded, ReferenceChat, render
from ..runtime.test_persistence import question

pytestmark = pytest.mark.anyio


async def test_a_burst_larger_than_the_pool_queues_and_every_turn_is_answered(
    tiny: Loaded, tiny_dir: Path
) -> None:
    # one short turn takes 3 blocks (one per layer) and reserves up to 6: 24 blocks
    # hold about 4 turns at once, and 12 agents ask together
    names = [f"agent{i}" for i in range(12)]
    async with Runtime(tiny_dir, pool_blocks=24, log_level="off") as rt:
        agents = [await rt.spawn(n, system=f"You are {n}.", max_tokens=12) for n in names]
        replies: dict[str, Any] = {}

        async def ask(agent: Any) -> None:
            replies[agent.name] = await agent.ask(question(agent.name, 0))

        async with anyio.create_task_group() as tg:
            for agent in agents:
                tg.start_soon(ask, agent)
        stats = await rt.stats()
        assert stats.pool.used_blocks == stats.resident_blocks
        for agent in agents:
            chat = ReferenceChat(tiny.model, tiny.tokenizer.eos_token_ids)
            prompt = render(tiny.tokenizer, agent.history[:-1])
            assert list(replies[agent.name].tokens) == chat.turn(prompt, 12)
