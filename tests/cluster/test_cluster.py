"""The cluster on a local Ray instance started by the tests: two replicas of a tiny model
answer exactly as one runtime does, placement is sticky and keeps a shared brief on one
replica, moves go through saved state exactly, and a replica killed mid-turn gives a
typed error while its agents come back elsewhere as they were."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray

from mlx_actors import Runtime
from mlx_actors.cluster import Cluster
from mlx_actors.errors import InvalidRequestError, ReplicaLostError, RuntimeClosedError

from ..conftest import asyncio_only

# One local Ray instance at a time: these tests run in one worker process.
pytestmark = [pytest.mark.anyio, pytest.mark.xdist_group("ray")]

# The driver runs on both event loops in two tests (marked); the rest check what does
# not depend on the loop.
anyio_backend = asyncio_only()


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    """One local Ray instance for the module (a cluster joins a running one)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


OPTIONS: dict[str, Any] = dict(replicas=2, pool_blocks=100, log_level="off")


async def single_runtime(model: Path, script: list[tuple[str, str, str]]) -> list[tuple[int, ...]]:
    """The same asks, in order, through one local runtime: (agent, system, text) each."""
    async with Runtime(model, pool_blocks=200, log_level="off") as rt:
        out = []
        for name, system, text in script:
            agent = rt.agents.get(name) or await rt.spawn(name, system=system, max_tokens=12)
            out.append((await agent.ask(text)).tokens)
        return out


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a driver on trio: the stream test
async def test_replies_match_one_runtime_and_placement_is_sticky(tiny_dir: Path) -> None:
    script = [
        (f"a{i}", f"You are agent {i}.", f"Turn {t} for a{i}") for t in range(2) for i in range(4)
    ]
    async with Cluster(tiny_dir, **OPTIONS) as cl:
        for i in range(4):
            await cl.spawn(f"a{i}", system=f"You are agent {i}.", max_tokens=12)
        placed = {name: cl.replica_of(name) for name in cl.agents}
        assert sorted(placed.values()) == [0, 0, 1, 1]  # the least busy replica each time
        got = [(await cl.agent(name).ask(text)).tokens for name, _, text in script]
        assert {name: cl.replica_of(name) for name in cl.agents} == placed  # sticky
        stats = await cl.stats()
        assert sum(s.turns for s in stats.replicas.values()) == len(script)
    assert got == await single_runtime(tiny_dir, script)


async def test_agents_that_share_a_long_brief_share_a_replica(tiny_dir: Path) -> None:
    brief = "The brief every reviewer reads. " * 20
    async with Cluster(tiny_dir, **OPTIONS) as cl:
        other = await cl.spawn("other", system="Someone else.")
        team = [await cl.spawn(f"r{i}", system=f"{brief}You are reviewer {i}.") for i in range(3)]
        # Alone, the second and third reviewers would go to the less busy replica.
        assert {agent.replica for agent in team} == {1 - other.replica}


async def test_a_moved_agent_goes_on_exactly(tiny_dir: Path) -> None:
    script = [("ann", "You are Ann.", "Hello"), ("ann", "You are Ann.", "And then?")]
    async with Cluster(tiny_dir, **OPTIONS) as cl:
        ann = await cl.spawn("ann", system="You are Ann.", max_tokens=12)
        first = await ann.ask("Hello")
        source = ann.replica
        await cl.move("ann", 1 - source)
        assert ann.replica == 1 - source
        second = await ann.ask("And then?")
        assert second.usage.cached_tokens > 0  # its cache came along
    assert [first.tokens, second.tokens] == await single_runtime(tiny_dir, script)


async def test_a_replica_killed_mid_turn_loses_nothing_that_was_answered(
    tiny_dir: Path, tmp_path: Path
) -> None:
    script = [("ann", "You are Ann.", "Hello"), ("ann", "You are Ann.", "Still there?")]
    async with Cluster(tiny_dir, state_dir=tmp_path, **OPTIONS) as cl:
        ann = await cl.spawn("ann", system="You are Ann.", max_tokens=12)
        bob = await cl.spawn("bob", system="You are Bob.", max_tokens=12)
        first = await ann.ask("Hello")
        before = await ann.history()
        victim = ann.replica
        outcome: list[BaseException] = []

        async def long_turn() -> None:
            try:
                await ann.ask("Talk for long.", max_tokens=100_000, logit_bias={258: -1e9})
            except ReplicaLostError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_turn)
            deadline = time.monotonic() + 60
            while not (await cl.stats()).replicas[victim].turns_in_flight:  # it runs
                assert time.monotonic() < deadline
                await anyio.sleep(0.05)
            ray.kill(cl._replicas.handles[victim])
        assert len(outcome) == 1 and isinstance(outcome[0], ReplicaLostError)
        assert ann.replica != victim and bob.replica != victim
        assert await ann.history() == before  # the killed turn is not kept
        second = await ann.ask("Still there?")
        assert second.usage.cached_tokens > 0  # its saved cache came along
        assert (await cl.stats()).placement == {"ann": ann.replica, "bob": bob.replica}
    assert [first.tokens, second.tokens] == await single_runtime(tiny_dir, script)
    async with Cluster(tiny_dir, state_dir=tmp_path, **OPTIONS) as cl:  # one home each
        assert sorted(cl.agents) == ["ann", "bob"]
        assert len(await cl.agent("ann").history()) == 5


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # the driver on both
async def test_a_remote_stream_gives_the_pieces_then_the_reply(tiny_dir: Path) -> None:
    async with Cluster(tiny_dir, **OPTIONS) as cl:
        ann = await cl.spawn("ann", system="You are Ann.", max_tokens=12)
        async with ann.stream("Hello") as pieces:
            text = "".join([piece async for piece in pieces])
        first = pieces.reply
        assert text == first.text and first.tokens
        history = await ann.history()
        async with ann.stream("Talk for long.", max_tokens=100_000) as cut:
            async for _ in cut:
                break  # leaving early cancels the turn there
        assert await ann.history() == history
        again = await ann.ask("Hello again")
    script = [("ann", "You are Ann.", "Hello"), ("ann", "You are Ann.", "Hello again")]
    assert [first.tokens, again.tokens] == await single_runtime(tiny_dir, script)


async def test_two_replicas_dying_at_once_lose_no_agent(tiny_dir: Path, tmp_path: Path) -> None:
    brief = "The brief every reviewer reads. " * 20  # long: its agents share a replica
    async with Cluster(tiny_dir, state_dir=tmp_path, **{**OPTIONS, "replicas": 3}) as cl:
        agents = [await cl.spawn(f"r{i}", system=f"{brief}You are {i}.") for i in range(2)]
        agents += [await cl.spawn(f"a{i}", system=f"You are {i}.") for i in range(4)]
        for agent in agents:
            await agent.ask("Hello", max_tokens=4)
        histories = {agent.name: await agent.history() for agent in agents}
        survivor = agents[0].replica
        for index in {0, 1, 2} - {survivor}:
            ray.kill(cl._replicas.handles[index])
        with pytest.raises(ReplicaLostError):
            await cl.agent(next(a.name for a in agents if a.replica != survivor)).ask("Hi")
        assert set((await cl.stats()).placement.values()) == {survivor}
        for agent in agents:
            assert await agent.history() == histories[agent.name]
            assert (await agent.ask("Again", max_tokens=4)).usage.cached_tokens > 0
        # The brief's agents are still placed together with new ones reading it.
        newcomer = await cl.spawn("r9", system=f"{brief}You are 9.")
        assert newcomer.replica == survivor


async def test_names_are_unique_and_concurrent_spawns_spread(tiny_dir: Path) -> None:
    async with Cluster(tiny_dir, **OPTIONS) as cl:
        placed: dict[str, int] = {}

        async def spawn(name: str) -> None:
            placed[name] = (await cl.spawn(name, system="Hi.")).replica

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(spawn, f"p{i}")
        assert sorted(placed.values()) == [0, 0, 1, 1]
        with pytest.raises(InvalidRequestError, match="already has an agent"):
            await cl.spawn("P0")  # names ignore case, across replicas
        with pytest.raises(InvalidRequestError, match="already has an agent"):
            await cl.agent("p0").fork("p1")
        assert len(cl.agents) == 4
        p0 = cl.agent("p0")
    with pytest.raises(RuntimeClosedError):
        await p0.ask("Hello")
    with pytest.raises(RuntimeClosedError):
        cl.agent("p0")


async def test_a_smaller_cluster_brings_back_every_agent(tiny_dir: Path, tmp_path: Path) -> None:
    async with Cluster(tiny_dir, state_dir=tmp_path, **OPTIONS) as cl:
        for i in range(4):
            await (await cl.spawn(f"a{i}", system=f"You are {i}.")).ask("Hello", max_tokens=4)
        assert set((await cl.stats()).placement.values()) == {0, 1}
    async with Cluster(tiny_dir, state_dir=tmp_path, **{**OPTIONS, "replicas": 1}) as cl:
        assert sorted(cl.agents) == ["a0", "a1", "a2", "a3"]
        for name in cl.agents:
            reply = await cl.agent(name).ask("Again", max_tokens=4)
            assert reply.usage.cached_tokens > 0  # its cache came along
    # What the larger cluster's second replica held is gone from its directory.
    assert not list((tmp_path / "replica-1" / "agents").glob("*.json"))
    assert not list((tmp_path / "replica-1" / "caches").rglob("*.safetensors"))
    async with Cluster(tiny_dir, state_dir=tmp_path, **OPTIONS) as cl:  # one home each
        assert sorted(cl.agents) == ["a0", "a1", "a2", "a3"]
        assert set(cl.replica_of(name) for name in cl.agents) == {0}


def saved_caches(root: Path) -> list[Path]:
    return list(root.rglob("*.safetensors"))


async def test_persist_exit_saves_nothing_on_a_turn_and_everything_at_close(
    tiny_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequestError, match="persist"):
        Cluster(tiny_dir, persist="never")
    async with Cluster(tiny_dir, state_dir=tmp_path, persist="exit", **OPTIONS) as cl:
        for i in range(2):
            await (await cl.spawn(f"a{i}", system=f"You are {i}.")).ask("Hello", max_tokens=4)
        assert not saved_caches(tmp_path)  # no cache saved on a turn
        before = {name: await cl.agent(name).history() for name in cl.agents}
    async with Cluster(tiny_dir, state_dir=tmp_path, **OPTIONS) as cl:
        assert {name: await cl.agent(name).history() for name in cl.agents} == before
        reply = await cl.agent("a0").ask("Again", max_tokens=4)
        assert reply.usage.cached_tokens > 0  # its cache was saved at close


async def test_a_move_the_target_refuses_leaves_the_agent_where_it_was(tiny_dir: Path) -> None:
    async with Cluster(tiny_dir, **OPTIONS) as cl:
        ann = await cl.spawn("ann", system="You are Ann.", max_tokens=8)
        first = await ann.ask("Hello")
        source = ann.replica
        # An agent the cluster does not know of takes the name on the target.
        await cl._replicas.raw(1 - source, "spawn", "ann", {})
        with pytest.raises(InvalidRequestError):
            await cl.move("ann", 1 - source)
        assert ann.replica == source
        assert [m.content for m in await ann.history()][-1] == first.text
        again = await ann.ask("And then?")
        assert again.usage.cached_tokens > 0  # its cache is still there


async def test_replicas_the_ray_cluster_cannot_place_are_refused_at_once(tiny_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="GPU"):
        async with Cluster(tiny_dir, **OPTIONS, replica_options={"num_gpus": 1}):
            pass
    with pytest.raises(InvalidRequestError, match="CPU"):
        async with Cluster(tiny_dir, **OPTIONS, replica_options={"num_cpus": 2}):
            pass


async def test_a_call_during_a_move_waits_for_it(tiny_dir: Path) -> None:
    async with Cluster(tiny_dir, **OPTIONS) as cl:
        ann = await cl.spawn("ann", system="You are Ann.", max_tokens=8)
        await ann.ask("Hello")
        target = 1 - ann.replica
        replies = []

        async def ask() -> None:
            replies.append(await ann.ask("And then?"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(cl.move, "ann", target)
            await anyio.wait_all_tasks_blocked()  # the move has begun
            tg.start_soon(ask)
        assert ann.replica == target
        assert replies[0].usage.cached_tokens > 0
        assert len(await ann.history()) == 5


@pytest.mark.parametrize("call", ["ask", "stream"])
async def test_a_replica_whose_runtime_stopped_is_replaced(
    tiny_dir: Path, tmp_path: Path, call: str
) -> None:
    async with Cluster(tiny_dir, state_dir=tmp_path, **OPTIONS) as cl:
        ann = await cl.spawn("ann", system="You are Ann.", max_tokens=8)
        await ann.ask("Hello")
        before = await ann.history()
        victim = ann.replica
        await cl._replicas.raw(victim, "stop")  # its runtime ends; the process lives on
        with pytest.raises(ReplicaLostError, match="brought back"):
            if call == "ask":
                await ann.ask("Hi")
            else:
                async with ann.stream("Hi") as pieces:
                    async for _ in pieces:
                        pass
        assert ann.replica != victim
        assert await ann.history() == before
        assert (await ann.ask("Again")).usage.cached_tokens > 0
