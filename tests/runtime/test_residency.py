"""Which idle agent's cache leaves the pool: the one expected to be asked furthest from
now, against the least recently used, on the same conversations."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest

from mlx_actors import Runtime
from mlx_actors.errors import AgentClosedError, InvalidRequestError, TurnTimeoutError
from mlx_actors.runtime._store import DiskCacheStore
from mlx_actors.scheduler.residency._entry import ROUND_PIN_SECONDS, CacheEntry
from mlx_actors.scheduler.residency._image import CacheImage

from .test_persistence import converse, question

pytestmark = pytest.mark.anyio


async def test_a_round_robin_restores_fewer_caches_than_lru_with_the_same_replies(
    tiny_dir: Path, tmp_path: Path
) -> None:
    names = [f"agent{i}" for i in range(5)]
    runs = {}
    for policy in ("lru", "next-use"):
        trace = tmp_path / f"{policy}.jsonl"
        async with Runtime(
            tiny_dir, pool_blocks=14, log_level="off", eviction=policy, trace=trace
        ) as rt:
            replies = await converse(rt, names, range(4))
            stats = await rt.stats()
        events = [json.loads(line) for line in trace.read_text().splitlines()]
        evicted = [e for e in events if e["event"] == "blocks.evicted"]
        runs[policy] = replies, stats, evicted
    (lru, lru_stats, lru_evicted), (ours, stats, evicted) = runs["lru"], runs["next-use"]
    assert {k: r.tokens for k, r in ours.items()} == {k: r.tokens for k, r in lru.items()}
    # LRU evicts the agent asked next, every time: each later turn waits on a restore
    assert lru_stats.restores >= 3 * len(names) - 2
    assert 0 < 3 * stats.restores <= 2 * lru_stats.restores
    assert {e["why"] for e in lru_evicted} == {"least recently used"}
    assert all(e["why"].startswith("next turn expected in ") for e in evicted)


@pytest.mark.parametrize("host_bytes", [1 << 30, 0], ids=["host-memory", "disk"])
async def test_the_agent_expected_next_comes_back_before_its_turn(
    tiny_dir: Path, tmp_path: Path, host_bytes: int
) -> None:
    names = [f"agent{i}" for i in range(5)]
    trace = tmp_path / "trace.jsonl"
    async with Runtime(tiny_dir, pool_blocks=64, log_level="off") as rt:
        alone = {k: r.tokens for k, r in (await converse(rt, names, range(5))).items()}
    async with Runtime(  # room for two agents' caches and a turn's new blocks
        tiny_dir, pool_blocks=18, log_level="off", trace=trace, host_bytes=host_bytes
    ) as rt:
        replies = {k: r.tokens for k, r in (await converse(rt, names, range(5))).items()}
        stats = await rt.stats()
    assert replies == alone  # brought back ahead or not, the same caches
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    # From its third turn on, each agent is asked in a regular order (every fifth turn):
    # from the fourth round on, the next speaker's cache comes back ahead of its turn.
    admitted = [i for i, e in enumerate(events) if e["event"] == "turn.admitted"]
    late = events[admitted[3 * len(names)] :]
    restored = [e for e in late if e["event"] == "blocks.restored"]
    # (read from its files, or taken from its eviction's image while that is written)
    reads = [e for e in late if e["event"] == "blocks.read" and e["source"] in ("disk", "write")]
    assert len(restored) >= 4 and stats.prefetches >= 4
    if host_bytes == 0:
        # Each read once, in the background, from the start of the turn before its own
        # (whether the read or the turn reaches the engine first is the machine's doing).
        assert len(reads) == len(restored) and all(e.get("prefetch") for e in reads)
    else:
        # From host memory it came back while the turn before its own ran, every time.
        assert all(e["prefetch"] == "next turn expected in 1 turns" for e in restored)
        assert not reads
    for e in late:  # only agents expected later made room for one expected next
        if e["event"] == "blocks.evicted":
            assert int(e["why"].split()[-2]) > 1


async def test_a_turn_given_up_while_its_cache_is_read_ahead_leaves_nothing_behind(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [f"agent{i}" for i in range(5)]
    trace = tmp_path / "trace.jsonl"

    def runtime(**more: Path) -> Runtime:  # every evicted cache to disk
        return Runtime(tiny_dir, pool_blocks=18, log_level="off", host_bytes=0, **more)

    async with runtime() as rt:
        alone = {k: r.tokens for k, r in (await converse(rt, names, range(5))).items()}
    gate, loads = anyio.Event(), []
    load = DiskCacheStore.load

    async def slow_load(self: DiskCacheStore, agent: str) -> CacheImage:
        loads.append(agent)
        if agent == "agent2":
            await gate.wait()  # the disk is slow for agent2
        return await load(self, agent)

    monkeypatch.setattr(DiskCacheStore, "load", slow_load)
    async with runtime(trace=trace) as rt:
        replies = {k: r.tokens for k, r in (await converse(rt, names, range(4))).items()}
        for name in ("agent0", "agent1"):  # agent2's cache is read ahead meanwhile
            replies[name, 4] = (await rt.agent(name).ask(question(name, 4))).tokens
        assert loads[-1] == "agent2"
        with pytest.raises(TurnTimeoutError):  # its turn waits for that read, then gives up
            await rt.agent("agent2").ask(question("agent2", 4), timeout=0.5)
        reads = loads.count("agent2")
        gate.set()
        for name in names[2:]:
            replies[name, 4] = (await rt.agent(name).ask(question(name, 4))).tokens
        assert loads.count("agent2") == reads  # its next turn took the read ahead
        stats = await rt.stats()
        resident = [a.statistics() for a in rt.agents.values()]
        held = sum(a.cached_blocks for a in resident if not a.on_disk)
        assert stats.pool.used_blocks == held and stats.turns_in_flight == 0
    assert replies == alone  # nothing of the turn given up is left
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(e["event"] == "blocks.prefetching" and e["agent"] == "agent2" for e in events)


async def test_an_unknown_eviction_policy_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="eviction must be one of"):
        Runtime(tiny_dir, eviction="fifo")


async def test_a_pinned_agent_stays_while_others_can_leave(tiny_dir: Path, tmp_path: Path) -> None:
    names = [f"agent{i}" for i in range(5)]
    evicted: dict[tuple[float | None, str], list[str]] = {}
    replies: dict[tuple[float | None, str], dict[object, object]] = {}
    # No pin, a pin, a pin that has run out (LRU: in a round robin agent0 would leave
    # every round); and a pin with next-use.
    runs = [(None, "lru"), (3600.0, "lru"), (1e-9, "lru"), (3600.0, "next-use")]
    for seconds, eviction in runs:
        trace = tmp_path / f"{seconds}{eviction}.jsonl"
        async with Runtime(
            tiny_dir, pool_blocks=14, log_level="off", trace=trace, eviction=eviction
        ) as rt:
            await rt.spawn("agent0", system="You are agent0.", max_tokens=12)
            if seconds is not None:
                rt.agent("agent0").pin(seconds)
            answered = await converse(rt, names, range(3))
            replies[seconds, eviction] = {k: r.tokens for k, r in answered.items()}
        events = [json.loads(line) for line in trace.read_text().splitlines()]
        evicted[seconds, eviction] = [e["agent"] for e in events if e["event"] == "blocks.evicted"]
    none, pinned, expired, ahead = runs
    assert all(r == replies[none] for r in replies.values())
    assert "agent0" in evicted[none] and len(evicted[pinned]) > 3
    assert "agent0" not in evicted[pinned]
    assert evicted[expired] == evicted[none]  # an expired pin changes nothing
    assert "agent0" not in evicted[ahead]


def test_an_agent_between_tool_rounds_counts_as_pinned_for_a_minute() -> None:
    now = time.perf_counter()
    entry = CacheEntry(holding=True, held_since=now - 1.0)
    assert entry.pinned(now)  # its tools are running: it leaves only as a pinned one does
    assert not entry.pinned(now + ROUND_PIN_SECONDS)  # a stuck tool holds no one back
    entry.holding = False
    assert not entry.pinned(now)
    entry.pinned_until = now + 5.0
    assert entry.pinned(now) and not entry.pinned(now + 5.0)


async def test_pins_take_seconds_and_an_open_agent(tiny_dir: Path) -> None:
    async with Runtime(tiny_dir, pool_blocks=14, log_level="off") as rt:
        agent = await rt.spawn("a")
        for bad in (0, -1.0, float("inf"), True, "5"):
            with pytest.raises(InvalidRequestError, match="seconds must be"):
                agent.pin(bad)  # type: ignore[arg-type]
        agent.pin(5)
        agent.unpin()
        await agent.close()
        with pytest.raises(AgentClosedError):
            agent.pin()
