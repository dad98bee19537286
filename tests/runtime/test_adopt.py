"""Moving an agent between runtimes through their state directories (what a cluster's
replicas do): ``detach`` saves and stops it, ``adopt`` brings it into another runtime
exactly, from a directory whose runtime was left or died, and ``forget_detached`` deletes
what was left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_actors import Runtime
from mlx_actors.errors import InvalidRequestError, ModelMismatchError, UnknownAgentError
from mlx_actors.testing import tiny_config, write_random_model

from ..conftest import Loaded, reference, render

pytestmark = pytest.mark.anyio


async def test_an_adopted_agent_goes_on_exactly(tiny: Loaded, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    async with Runtime(tiny.path, pool_blocks=100, log_level="off", state_dir=a) as one:
        async with Runtime(tiny.path, pool_blocks=100, log_level="off", state_dir=b) as two:
            ann = await one.spawn("ann", system="Be brief.", max_tokens=12)
            await ann.ask("Hello")
            await one.detach("ann")
            assert "ann" not in one.agents and (await one.stats()).pool.used_blocks == 0
            moved = await two.adopt(a, "ann")
            assert moved.history == ann.history and moved.cached_tokens == ann.cached_tokens
            reply = await moved.ask("And then?")
            prompt = render(tiny.tokenizer, moved.history[:-1])
            assert list(reply.tokens) == reference(tiny.model, prompt, 12, stop=[258])
            assert reply.usage.cached_tokens > 0  # the cache came with it
            with pytest.raises(InvalidRequestError, match="already exists"):
                await two.adopt(a, "ann")  # the name is live here
            await one.forget_detached("ann")
            assert not list((a / "agents").iterdir())
            with pytest.raises(UnknownAgentError):
                await two.adopt(a, "ann")


async def test_adopting_from_another_models_directory_is_refused(
    tiny: Loaded, tmp_path: Path
) -> None:
    other = write_random_model(tmp_path / "other", tiny_config(), seed=99)
    async with Runtime(other, pool_blocks=100, log_level="off", state_dir=tmp_path / "a") as rt:
        await (await rt.spawn("ann", max_tokens=4)).ask("Hi")
    async with Runtime(tiny.path, pool_blocks=100, log_level="off", state_dir=tmp_path / "b") as rt:
        with pytest.raises(ModelMismatchError):
            await rt.adopt(tmp_path / "a", "ann")
    async with Runtime(tiny.path, pool_blocks=100, log_level="off") as rt:
        with pytest.raises(InvalidRequestError, match="state_dir"):
            await rt.adopt(tmp_path / "a", "ann")
