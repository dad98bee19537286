"""Agent memory beyond RAM and the process: LRU eviction to disk with exact restore, and a
state directory that brings agents back warm in a new runtime."""

from __future__ import annotations

import json
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import pytest
from anyio import wait_all_tasks_blocked

from mlx_actors import Reply, Runtime
from mlx_actors.errors import (
    ContextLengthError,
    CorruptStateError,
    ModelMismatchError,
    StateInUseError,
)
from mlx_actors.runtime import _disk, _store
from mlx_actors.runtime._state import StateDir
from mlx_actors.scheduler import BlockEntry, CacheImage, Scheduler
from mlx_actors.scheduler.residency import CacheManager
from mlx_actors.scheduler.service._deliveries import Deliveries
from mlx_actors.testing import tiny_config, write_random_model

from ..actors.test_agents import FaultyRuntime, long_question
from ..conftest import Loaded, ReferenceChat, reference, render

pytestmark = pytest.mark.anyio


def question(name: str, turn: int) -> str:
    return f"Question {turn} for {name}: what next?"


async def converse(rt: Runtime, names: list[str], turns: range, **options: Any) -> dict[Any, Any]:
    """Each agent (spawned if new) asks its questions, in order, one agent after another."""
    replies = {}
    for name in names:
        if name not in rt.agents:
            await rt.spawn(name, system=f"You are {name}.", max_tokens=12, **options)
    for turn in turns:
        for name in names:
            replies[name, turn] = await rt.agent(name).ask(question(name, turn))
    return replies


def snapshot(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


#: Blocks for one of the two agents of the room test (4 layers), not both.
POOL_FOR_ONE = 10


def no_pickle(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("pickle was used")


@pytest.mark.parametrize("host_bytes", [0, None])
async def test_evicted_caches_come_back_exactly(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_bytes: int | None
) -> None:
    # host_bytes=0: every restore reads the files; by default, recent evictions are
    # also kept in memory and most restores read nothing.
    for name in ("dump", "dumps", "load", "loads", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, no_pickle)
    names = [f"agent{i}" for i in range(5)]
    async with Runtime(tiny_dir, pool_blocks=400, log_level="off") as rt:
        roomy = await converse(rt, names, range(3))
        assert (await rt.stats()).evictions == 0
    trace = tmp_path / "run.jsonl"
    async with Runtime(  # LRU: in a round robin every later turn restores its cache
        tiny_dir,
        pool_blocks=14,
        host_bytes=host_bytes,
        log_level="off",
        trace=trace,
        eviction="lru",
    ) as rt:
        tight = await converse(rt, names, range(3))
        await rt.flush()  # the last evictions' files are written in the background
        stats = await rt.stats()
        on_disk = sorted(a.name for a in rt.agents.values() if a.statistics().on_disk)
        assert rt.cache_dir is not None
        files = sorted(p.parent.name for p in rt.cache_dir.glob("*/index.json"))
    assert {k: r.tokens for k, r in tight.items()} == {k: r.tokens for k, r in roomy.items()}
    assert stats.evictions > 5 and stats.restores > 5
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    reads = [e["source"] for e in events if e["event"] == "blocks.read"]
    assert len(reads) == stats.restores
    assert reads.count("memory") == stats.memory_restores
    if host_bytes == 0:
        assert stats.memory_restores == 0
    else:
        assert stats.memory_restores > stats.restores // 2
    assert stats.pool.used_blocks == stats.resident_blocks  # nothing else holds blocks
    assert stats.resident_agents + stats.agents_on_disk == len(names)
    assert files == on_disk and len(on_disk) == stats.agents_on_disk > 0
    for name in ("blocks.evicted", "blocks.restored"):
        event = next(e for e in events if e["event"] == name)
        assert {"agent", "blocks", "bytes", "ms"} <= set(event) and event["bytes"] > 0
    # a restored cache is reused: the history is not prefilled again
    last = [r for (name, turn), r in tight.items() if turn == 2]
    assert all(r.usage.cached_tokens > r.usage.prompt_tokens for r in last)


async def test_agents_with_a_turn_in_flight_are_never_evicted(tiny: Loaded, tiny_dir: Path) -> None:
    # Nine blocks: a short cache takes three (one block per layer); a turn that may run
    # to 300 tokens reserves six.
    async with FaultyRuntime(tiny_dir, pool_blocks=9, log_level="off") as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        bob = await rt.spawn("bob", max_tokens=8)
        await bob.ask("Hello")  # not ann's words: identical caches would be one
        await ann.ask("Hi")
        rt.faulty.delay = 0.005
        waited: list[Reply] = []

        async def bob_asks() -> None:
            waited.append(await bob.ask("May I?"))

        async with anyio.create_task_group() as tg:
            async with ann.stream(long_question(tiny, ann.history), max_tokens=300) as running:
                await anext(running)  # ann's turn is running: bob's cache made room for it
                assert bob.statistics().on_disk
                tg.start_soon(bob_asks)  # only ann's cache is left, and she is busy
                while (await rt.stats()).turns_in_flight < 2:
                    pass
                assert not ann.statistics().on_disk and not waited
            # leaving the stream cancelled ann's turn: she is idle again, and evictable,
            # so bob's turn, which waited for room, runs
        assert waited  # (ann's cancelled turn freed what it had reserved)
        rt.faulty.delay = 0
        await bob.ask(long_question(tiny, bob.history, tokens=300), max_tokens=300)
        assert ann.statistics().on_disk and not bob.statistics().on_disk
        reply = await ann.ask("Back again?")  # her cache comes back for her turn
        assert not ann.statistics().on_disk and bob.statistics().on_disk
        chat = ReferenceChat(tiny.model, tiny.tokenizer.eos_token_ids)
        for i in range(2):
            expected = chat.turn(render(tiny.tokenizer, ann.history[: 2 * i + 1]), 8)
        assert list(reply.tokens) == expected
        assert reply.usage.cached_tokens > 0
        stats = await rt.stats()
        assert stats.restores >= 2 and stats.pool.used_blocks == stats.resident_blocks


@pytest.mark.parametrize("persist", ["turn", "exit"])
async def test_a_new_runtime_brings_agents_back_warm(
    tiny_dir: Path, tmp_path: Path, persist: str
) -> None:
    names = ["alice", "bob"]
    async with Runtime(tiny_dir, pool_blocks=400, log_level="off") as rt:
        straight = await converse(rt, names, range(3), temperature=0.7, seed=5)
    state = tmp_path / "state"
    async with Runtime(
        tiny_dir, pool_blocks=400, log_level="off", state_dir=state, persist=persist
    ) as rt:
        first = await converse(rt, names, range(2), temperature=0.7, seed=5)
        histories = {name: rt.agent(name).history for name in names}
    assert {k: r.tokens for k, r in first.items()} == {
        k: r.tokens for k, r in straight.items() if k[1] < 2
    }
    async with Runtime(tiny_dir, pool_blocks=400, log_level="off", state_dir=state) as rt:
        assert sorted(rt.agents) == names
        assert {name: rt.agent(name).history for name in names} == histories
        assert rt.agent("alice").options.temperature == 0.7
        resumed = await converse(rt, names, range(2, 3))
    for name in names:
        reply = resumed[name, 2]
        assert reply.tokens == straight[name, 2].tokens  # as if never interrupted
        assert reply.usage == straight[name, 2].usage  # as warm: the same tokens prefilled
        assert reply.usage.cached_tokens > reply.usage.prompt_tokens


async def test_another_model_is_refused_and_the_directory_left_untouched(
    tiny_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    before = snapshot(state)
    other = write_random_model(tmp_path / "other", tiny_config(num_hidden_layers=3), seed=99)
    with pytest.raises(ModelMismatchError, match="another state_dir"):
        async with Runtime(other, pool_blocks=100, log_level="off", state_dir=state):
            pass
    assert snapshot(state) == before


async def test_without_its_runtime_record_a_directory_with_caches_is_refused(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Before, a missing ``runtime.json`` let a model of the same shape read another's
    caches (wrong greedy output) and then record itself as their maker."""
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    (state / "runtime.json").unlink()
    before = snapshot(state)
    other = write_random_model(tmp_path / "other", tiny_config(), seed=99)  # same shape
    for model in (other, tiny_dir):
        with pytest.raises(CorruptStateError, match=r"runtime\.json is missing, yet"):
            async with Runtime(model, pool_blocks=100, log_level="off", state_dir=state):
                pass
    assert snapshot(state) == before


@pytest.fixture(params=["whole", "in pieces"])
def reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Chunk files read whole, or (as large ones are) in pieces on several threads."""
    if request.param == "in pieces":
        monkeypatch.setattr(_disk, "PARALLEL_READ", 1)
        monkeypatch.setattr(_disk, "READ_PIECE", 4096)
    return str(request.param)


async def test_caches_saved_with_sha256_checksums_still_come_back_warm(
    tiny_dir: Path, tmp_path: Path, reading: str
) -> None:
    """Chunk files are written with an XXH3 checksum; those of older versions carry the
    sha256 of their pieces, and still load."""
    async with Runtime(tiny_dir, pool_blocks=400, log_level="off") as rt:
        straight = await converse(rt, ["ann"], range(3))
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=400, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(2))
    where = state / "caches" / "ann" / "index.json"
    index = json.loads(where.read_text())
    assert all(sum.startswith("xxh3-128:") for sum in index["chunks"].values())
    blocks = state / "caches" / "_blocks"
    index["chunks"] = {
        name: _disk.piecewise_sha256((blocks / name).read_bytes()) for name in index["chunks"]
    }
    del index["sha256"]
    where.write_text(json.dumps(_disk.with_digest(index)))
    async with Runtime(tiny_dir, pool_blocks=400, log_level="off", state_dir=state) as rt:
        resumed = await converse(rt, ["ann"], range(2, 3))
    assert resumed["ann", 2].tokens == straight["ann", 2].tokens
    assert resumed["ann", 2].usage == straight["ann", 2].usage  # as warm


@pytest.mark.parametrize("damage", ["truncated", "one byte changed"])
async def test_a_corrupt_cache_is_a_clear_error_then_the_agent_starts_over(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path, damage: str, reading: str
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(2))
    (chunk,) = (state / "caches" / "_blocks").glob("chunk-*.safetensors")
    data = bytearray(chunk.read_bytes())
    if damage == "truncated":
        del data[-100:]
    else:  # a value of a block: only the checksum can tell
        data[-100] ^= 1
    chunk.write_bytes(bytes(data))
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = rt.agent("ann")
        with pytest.raises(CorruptStateError, match=chunk.name):
            await ann.ask(question("ann", 2))
        reply = await ann.ask(question("ann", 2))  # the broken cache was dropped
        prompt = render(tiny.tokenizer, ann.history[:-1])
        assert list(reply.tokens) == reference(
            tiny.model, prompt, 12, stop=tiny.tokenizer.eos_token_ids
        )
        assert reply.usage.cached_tokens == 0


async def test_a_corrupt_chunk_that_agents_share_costs_each_one_turn_and_is_gone(
    tiny_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    brief = "A brief that every agent reads first. " * 12  # over a block: shared on disk
    caches = state / "caches"

    def chunks(name: str) -> set[str]:
        return set(json.loads((caches / name / "index.json").read_text())["chunks"])

    def runtime() -> Runtime:
        return Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state)

    async with runtime() as rt:
        for name in ("ann", "bob"):
            await (await rt.spawn(name, system=brief, max_tokens=12)).ask(f"Hi from {name}?")
    (shared,) = chunks("ann") & chunks("bob")
    chunk = caches / "_blocks" / shared
    chunk.write_bytes(chunk.read_bytes()[:-100])  # truncated
    failed = []

    async def ask(rt: Runtime, name: str, text: str) -> None:
        try:
            await rt.agent(name).ask(text)
        except CorruptStateError:
            failed.append(name)
            await rt.agent(name).ask(text)  # the cache was dropped: it starts over

    async with runtime() as rt:  # bob reads the chunk; ann, who lists it too, is not asked
        for turn in range(3):
            await ask(rt, "bob", f"Turn {turn}?")
    assert failed == ["bob"] and not chunk.exists() and shared in chunks("ann")
    async with runtime() as rt:  # a new agent with the same brief, then ann
        await (await rt.spawn("cat", system=brief, max_tokens=12)).ask("Hi from cat?")
        await rt.flush()  # the cache is written after the reply
        assert shared not in chunks("cat")  # its blocks were written, not found there
        for turn in range(2):
            await ask(rt, "ann", f"Turn {turn}?")
    assert failed == ["bob", "ann"]  # once each
    # what was saved since is written anew, not pointed back at the chunk (and no new
    # chunk took its name)
    assert not chunk.exists()
    assert all(shared not in chunks(name) for name in ("ann", "bob", "cat"))
    async with runtime() as rt:
        for name in ("ann", "bob", "cat"):
            reply = await rt.agent(name).ask("After a restart?")
            assert reply.usage.cached_tokens > 0


def test_a_save_under_way_never_lists_a_chunk_just_found_corrupt(tmp_path: Path) -> None:
    store = _store.DiskCacheStore(tmp_path / "caches", persistent=True)

    def block(value: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full((1, 2, 256, 4), value, np.uint16), np.full((1, 2, 256, 4), value, np.uint16)

    entries = (BlockEntry(layer=0, start=0, end=256, key=1),)
    first = CacheImage(tokens=tuple(range(256)), layers=(entries,), dtype="float16")
    store._save("ann", attrs.evolve(first, arrays={1: block(1)}))
    (chunk,) = (tmp_path / "caches" / "_blocks").iterdir()
    longer = CacheImage(
        tokens=tuple(range(512)),
        layers=((*entries, BlockEntry(layer=0, start=256, end=512, key=2)),),
        dtype="float16",
        arrays={1: block(1), 2: block(2)},
    )
    # bob's save refers to ann's block by what it holds, then pauses writing its own
    writing, go_on = threading.Event(), threading.Event()
    write = store._write_chunk

    def paused(*args: Any) -> None:
        writing.set()
        go_on.wait()
        write(*args)

    store._write_chunk = paused  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def save() -> None:
        try:
            store._save("bob", longer)
        except OSError as exc:
            errors.append(exc)

    saving = threading.Thread(target=save)
    saving.start()
    writing.wait()
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(CorruptStateError, match="checksum"):
        store._load("ann")  # finds the chunk corrupt, and deletes it
    go_on.set()
    saving.join()
    assert not chunk.exists()
    index = store._index("bob")
    assert index is None and errors  # the save failed rather than list the chunk


def _signed(change: Any) -> Any:
    """An edit of a record that signs it again, as a hand (not a bit flip) would."""

    def edit(text: str) -> str:
        data = json.loads(change(text))
        return json.dumps(_disk.with_digest(data))

    return edit


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda text: "{not json", "not valid JSON"),
        (lambda text: text.replace('"ann"', '"bob"'), "checksum"),
        (_signed(lambda text: text.replace('"ann"', '"../evil"')), "agent names must be"),
        (_signed(lambda text: text.replace('"ann"', '"bob"')), "names the agent 'bob'"),
        (_signed(lambda text: text.replace('"turns":1', '"turns":"one"')), "turns is"),
        (_signed(lambda text: text.replace('"top_p"', '"top_q"')), "its options are"),
        (_signed(lambda text: text.replace('"max_tokens":12', '"max_tokens":-1')), "max_tokens"),
        (_signed(lambda text: text.replace('"user"', '"system"')), "role"),
    ],
)
async def test_a_corrupt_agent_record_stops_the_start(
    tiny_dir: Path, tmp_path: Path, change: Any, match: str
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    record = state / "agents" / "ann.json"
    record.write_text(change(record.read_text()))
    before = snapshot(state)
    with pytest.raises(CorruptStateError, match=r"ann\.json") as info:
        async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
            pass
    assert match in str(info.value)
    assert snapshot(state) == before and not (tmp_path / "evil").exists()


async def test_a_cache_that_does_not_fit_is_an_error_then_the_agent_starts_over(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(2))
    # A well-formed index, checksum and all, that describes the blocks wrongly.
    where = state / "caches" / "ann" / "index.json"
    index = json.loads(where.read_text())
    index["dtype"] = "float16" if index["dtype"] != "float16" else "float32"
    del index["sha256"]
    index = _disk.with_digest(index)
    where.write_text(json.dumps(index))
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = rt.agent("ann")
        with pytest.raises(CorruptStateError, match="does not fit") as info:
            await ann.ask(question("ann", 2))
        assert str(where) in str(info.value)
        reply = await ann.ask(question("ann", 2))
        assert reply.usage.cached_tokens == 0
        prompt = render(tiny.tokenizer, ann.history[:-1])
        assert list(reply.tokens) == reference(
            tiny.model, prompt, 12, stop=tiny.tokenizer.eos_token_ids
        )
        stats = await rt.stats()
        assert stats.pool.used_blocks == stats.resident_blocks
    assert json.loads(where.read_text())["dtype"] != index["dtype"]  # saved afresh


def writes_fail_once_open(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every cache write waits for the gate returned (30 s at most), then fails."""
    gate = threading.Event()

    def failing_save(self: Any, agent: str, image: Any) -> None:
        gate.wait(30)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_store.DiskCacheStore, "_save", failing_save)
    return gate


async def test_a_turn_s_reply_waits_for_its_record_and_its_cache_is_written_behind(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    happened: list[str] = []
    save = _store.DiskCacheStore._save

    def gated_save(self: Any, agent: str, image: Any) -> Any:
        assert gate.wait(30)
        happened.append("cache written")
        return save(self, agent, image)

    monkeypatch.setattr(_store.DiskCacheStore, "_save", gated_save)
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=4)
        with anyio.fail_after(30):
            first = await ann.ask("Hi")  # back while its cache's write waits
        happened.append("first reply")
        saved = StateDir(state, persist="turn").record("ann")
        assert saved.turns == 1 and saved.messages[-1]["content"] == first.text
        assert not (state / "caches" / "ann" / "index.json").exists()

        async def second() -> None:
            await ann.ask("Again?")
            happened.append("second reply")

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await wait_all_tasks_blocked()
            while (await rt.stats()).turns_in_flight:  # the engine is done with it
                await wait_all_tasks_blocked()
            gate.set()
        # the next turn's save waits for the agent's previous cache write
        assert happened.index("cache written") < happened.index("second reply")
        assert happened[0] == "first reply"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = rt.agent("ann")
        third = await ann.ask("And now?")
        assert third.usage.cached_tokens == third.usage.reusable_tokens > 0
        prompt = render(tiny.tokenizer, ann.history[:-1])
        stop = tiny.tokenizer.eos_token_ids
        assert list(third.tokens) == reference(tiny.model, prompt, 4, stop=stop)


async def test_an_agent_closed_while_its_cache_is_written_behind_leaves_nothing(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    save = _store.DiskCacheStore._save

    def gated_save(self: Any, agent: str, image: Any) -> Any:
        assert gate.wait(30)
        return save(self, agent, image)

    monkeypatch.setattr(_store.DiskCacheStore, "_save", gated_save)
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=4)
        await ann.ask("Hi")  # its cache's write waits
        async with anyio.create_task_group() as tg:
            tg.start_soon(ann.close)  # waits for the write, then deletes what it wrote
            await wait_all_tasks_blocked()
            gate.set()
        await rt.flush()  # (the disk work asked for so far is done)
        assert not (state / "agents" / "ann.json").exists()
        assert not (state / "caches" / "ann").exists()
        again = await rt.spawn("ann", max_tokens=4)  # a new agent of that name
        reply = await again.ask("Hello?")
        assert reply.usage.reusable_tokens == 0 and len(again.history) == 2
        await rt.flush()
        saved = StateDir(state, persist="turn").record("ann")
        assert saved.turns == 1 and saved.messages[-1]["content"] == reply.text
    assert sorted(p.name for p in (state / "caches").iterdir()) == ["_blocks", "ann"]
    chunks = list((state / "caches" / "_blocks").iterdir())
    index = json.loads((state / "caches" / "ann" / "index.json").read_text())
    assert {c.name for c in chunks} == set(index["chunks"])  # the old cache's chunk is gone


async def test_a_failed_eviction_write_lets_the_agent_start_over(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = writes_fail_once_open(monkeypatch)
    trace = tmp_path / "run.jsonl"
    # Five blocks: one agent's cache (three) and not quite room for another turn.
    async with Runtime(tiny_dir, pool_blocks=5, log_level="off", trace=trace) as rt:
        ann = await rt.spawn("ann", max_tokens=4)
        bob = await rt.spawn("bob", max_tokens=4)
        await ann.ask("Hi")
        await bob.ask("Hello")  # ann's cache goes to disk: the write hangs
        assert ann.statistics().on_disk
        result: list[Any] = []

        async def ask_again() -> None:
            result.append(await ann.ask("Again?"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask_again)
            # ann's turn waits for that write (or, if the engine thread is slow to
            # answer, finds it failed): either way the cache is gone, not corrupt.
            await wait_all_tasks_blocked()
            gate.set()
        (reply,) = result
        assert reply.usage.cached_tokens == 0 and not ann.statistics().on_disk
        prompt = render(tiny.tokenizer, ann.history[:-1])
        assert list(reply.tokens) == reference(
            tiny.model, prompt, 4, stop=tiny.tokenizer.eos_token_ids
        )
        stats = await rt.stats()
        assert stats.pool.used_blocks == stats.resident_blocks
    events = [json.loads(line)["event"] for line in trace.read_text().splitlines()]
    assert "blocks.write_failed" in events


@pytest.mark.parametrize("state", [False, True])
async def test_an_ask_crosses_the_thread_boundary_four_or_five_times(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: bool
) -> None:
    # Commands to the engine thread and events back, for one ask of an agent that has
    # a cache: the turn, its result, the commit that holds the cache it started from
    # (and, with a state directory, takes the snapshot the save writes, which comes
    # back: the reply does not wait for it, as the cache is written behind), and the
    # commit once the caller has the reply.
    crossings: list[str] = []
    put, deliver = Scheduler._put, Deliveries._one
    arrived = [anyio.Event()]

    def counted_put(self: Scheduler, command: object) -> None:
        crossings.append(type(command).__name__)
        put(self, command)

    def counted_deliver(self: Deliveries, event: Any) -> None:
        crossings.append(type(event).__name__)
        deliver(self, event)
        if type(event).__name__ == "Snapshot":
            arrived[0].set()

    async def its_snapshot() -> None:
        """Wait for the turn's snapshot to come back (with a state directory)."""
        if state:
            with anyio.fail_after(30):
                await arrived[0].wait()
            arrived[0] = anyio.Event()

    monkeypatch.setattr(Scheduler, "_put", counted_put)
    monkeypatch.setattr(Deliveries, "_one", counted_deliver)
    where = {"state_dir": tmp_path / "state"} if state else {}
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", **where) as rt:
        ann = await rt.spawn("ann", max_tokens=4)
        await ann.ask("Hi")
        await its_snapshot()
        crossings.clear()
        reply = await ann.ask("Again?")
        await its_snapshot()
        seen = list(crossings)
        assert reply.usage.cached_tokens > 0
    # (the snapshot and the last commit cross in no fixed order)
    assert seen[:3] == ["Submit", "Finished", "Commit"]
    assert sorted(seen[3:]) == sorted(["Commit", *(["Snapshot"] if state else [])])
    if state:  # the snapshot taken with the commit is the cache the next process reads
        async with Runtime(tiny_dir, pool_blocks=100, log_level="off", **where) as rt:
            ann = rt.agent("ann")
            assert len(ann.history) == 4
            again = await ann.ask("And now?")
            assert again.usage.cached_tokens == again.usage.reusable_tokens > 0


@pytest.mark.timeout(60)  # (it hangs where the save misses the snapshot)
async def test_a_save_that_asks_before_its_snapshot_comes_back_still_gets_it(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The snapshot a turn's commit takes may come back after the save asks for it (the
    # engine thread was busy): the engine thread here takes it only once the save asks.
    asked = threading.Event()
    commit, save, take = Scheduler.commit, Scheduler.save, CacheManager.commit

    def commit_asking_anew(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("snapshot"):
            asked.clear()
        commit(self, *args, **kwargs)

    async def save_asking(self: Scheduler, agent: str, **kwargs: Any) -> None:
        asked.set()
        await save(self, agent, **kwargs)

    def take_once_asked(self: CacheManager, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("snapshot"):
            assert asked.wait(30)
        return take(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "commit", commit_asking_anew)
    monkeypatch.setattr(Scheduler, "save", save_asking)
    monkeypatch.setattr(CacheManager, "commit", take_once_asked)
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=4)
        with anyio.fail_after(30):
            first = await ann.ask("Hi")
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = rt.agent("ann")
        assert ann.history[-1].content == first.text
        again = await ann.ask("Again?")
        assert again.usage.cached_tokens == again.usage.reusable_tokens > 0


async def test_a_cache_in_host_memory_comes_back_while_its_write_hangs_and_outlives_its_failure(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An evicted cache kept in host memory is the engine thread's to restore: its turn
    # neither waits for the write nor loses the cache when that write fails later.
    gate = writes_fail_once_open(monkeypatch)
    trace = tmp_path / "run.jsonl"
    # Seven blocks: two agents' caches (three each), or one and a turn (three more).
    async with Runtime(
        tiny_dir, pool_blocks=7, host_bytes=1 << 24, log_level="off", trace=trace
    ) as rt:
        ann, bob, cy = [await rt.spawn(name, max_tokens=4) for name in ("ann", "bob", "cy")]
        await ann.ask("Hi")
        await bob.ask("Hello")
        await cy.ask("Hey")  # ann's cache goes to host memory; its write hangs
        assert ann.statistics().on_disk
        again = await ann.ask("Again?")  # bob's and cy's go out in turn
        assert not gate.is_set()  # the write still hangs: the cache came from memory
        assert again.usage.cached_tokens == again.usage.reusable_tokens > 0
        prompt = render(tiny.tokenizer, ann.history[:-1])
        stop = tiny.tokenizer.eos_token_ids
        assert list(again.tokens) == reference(tiny.model, prompt, 4, stop=stop)
        gate.set()
        await rt.flush()  # the three writes failed
        last = await ann.ask("And now?")  # ann's cache outlived the failure
        assert last.usage.cached_tokens == last.usage.reusable_tokens > 0
        hello = await bob.ask("Still there?")  # bob's was out when its write failed
        assert hello.usage.reusable_tokens == 0 and not bob.statistics().on_disk
        stats = await rt.stats()
        assert stats.memory_restores == 1 and stats.pool.used_blocks == stats.resident_blocks
    events = [json.loads(line)["event"] for line in trace.read_text().splitlines()]
    assert events.count("blocks.write_failed") == 3


async def test_a_cache_evicted_to_disk_comes_back_from_its_write_while_it_is_written(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No host memory tier: the image an eviction is writing serves the agent's turn
    # (no wait for the write, no read of the files), and the write goes on.
    gate = threading.Event()
    save = _store.DiskCacheStore._save
    written: list[str] = []

    def gated_save(self: Any, agent: str, image: Any) -> Any:
        assert gate.wait(30)
        written.append(agent)
        return save(self, agent, image)

    monkeypatch.setattr(_store.DiskCacheStore, "_save", gated_save)
    trace = tmp_path / "run.jsonl"
    # Seven blocks: two agents' caches (three each), or one and a turn (three more).
    async with Runtime(tiny_dir, pool_blocks=7, host_bytes=0, log_level="off", trace=trace) as rt:
        ann, bob, cy = [await rt.spawn(name, max_tokens=4) for name in ("ann", "bob", "cy")]
        await ann.ask("Hi")
        await bob.ask("Hello")
        await cy.ask("Hey")  # ann's cache goes to disk; its write hangs
        assert ann.statistics().on_disk
        with anyio.fail_after(20):
            again = await ann.ask("Again?")  # bob's and cy's go out in turn
        assert not written  # every write still hangs: the cache came from the image
        assert again.usage.cached_tokens == again.usage.reusable_tokens > 0
        prompt = render(tiny.tokenizer, ann.history[:-1])
        stop = tiny.tokenizer.eos_token_ids
        assert list(again.tokens) == reference(tiny.model, prompt, 4, stop=stop)
        gate.set()
        await rt.flush()
        hello = await bob.ask("Still there?")  # from its files, written meanwhile
        assert hello.usage.cached_tokens == hello.usage.reusable_tokens > 0
        prompt = render(tiny.tokenizer, bob.history[:-1])
        assert list(hello.tokens) == reference(tiny.model, prompt, 4, stop=stop)
        stats = await rt.stats()
        assert stats.memory_restores == 0 and stats.pool.used_blocks == stats.resident_blocks
    reads = [
        e for e in map(json.loads, trace.read_text().splitlines()) if e["event"] == "blocks.read"
    ]
    assert [(e["agent"], e["source"]) for e in reads][:1] == [("ann", "write")]
    assert ("bob", "disk") in [(e["agent"], e["source"]) for e in reads]


CHILD = textwrap.dedent(
    """
    import os, sys, time, anyio
    from mlx_actors import Runtime
    from mlx_actors.runtime import _disk

    model, state, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real_replace, count = os.replace, [0]

    def replace(src, dst):  # stop, for good, in the middle of the kill_at-th save
        count[0] += 1
        if count[0] == kill_at:
            print("SAVING", dst, flush=True)
            time.sleep(600)
        real_replace(src, dst)

    _disk.os.replace = replace

    async def main():
        async with Runtime(model, pool_blocks=100, log_level="off", state_dir=state) as rt:
            ann = rt.agent("ann") if "ann" in rt.agents else await rt.spawn("ann", max_tokens=12)
            for turn in range(20):
                await ann.ask(f"Question {turn}?")
                await rt._scheduler.idle_disk()  # its cache, written behind the reply
                print("TURN", turn, flush=True)

    anyio.run(main)
    """
)


# The child runs on asyncio; the parent reads what it left on each loop in turn.
@pytest.mark.parametrize(
    ("kill_at", "anyio_backend"), [(3, "asyncio"), (5, "trio"), (7, "asyncio"), (8, "trio")]
)
async def test_a_save_killed_halfway_leaves_the_previous_state_loadable(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path, kill_at: int
) -> None:
    state = tmp_path / "state"
    child = subprocess.Popen(  # noqa: ASYNC220 (its output is read on a worker thread)
        [sys.executable, "-c", CHILD, str(tiny_dir), str(state), str(kill_at)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    with anyio.fail_after(120):
        line = await anyio.to_thread.run_sync(child.stdout.readline)
        while line and not line.startswith("SAVING"):
            line = await anyio.to_thread.run_sync(child.stdout.readline)
    assert line.startswith("SAVING"), "the child never reached the save"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert list(state.rglob("*.tmp")), "the kill should leave a half-written file"
    # Writes go runtime.json, ann.json (spawn), then per turn ann.json, chunk, index.
    had_cache = (state / "caches" / "ann" / "index.json").exists()
    assert had_cache == (kill_at > 5)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = rt.agent("ann")
        reply = await ann.ask("Still there?")
        prompt = render(tiny.tokenizer, ann.history[:-1])
        assert list(reply.tokens) == reference(
            tiny.model, prompt, 12, stop=tiny.tokenizer.eos_token_ids
        )
        # A cache whose index was written before the kill is complete, and it is used.
        assert (reply.usage.cached_tokens > 0) == had_cache
    assert not list(state.rglob("*.tmp"))
    caches = state / "caches"
    listed = json.loads((caches / "ann" / "index.json").read_text())["chunks"]
    assert sorted(p.name for p in (caches / "_blocks").iterdir()) == sorted(listed)
    assert sorted(p.name for p in caches.iterdir()) == ["_blocks", "ann"]


async def test_saves_racing_turns_leave_a_loadable_state(tiny_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=6)
        for turn in range(4):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ann.ask, question("ann", turn))
                for _ in range(3):
                    tg.start_soon(rt.flush)
        await rt.flush()
        history = ann.history
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = rt.agent("ann")
        assert ann.history == history
        reply = await ann.ask(question("ann", 4))
        assert reply.usage.cached_tokens > reply.usage.prompt_tokens


async def test_one_state_directory_one_runtime(tiny_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
        with pytest.raises(StateInUseError, match="another runtime"):
            async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
                pass
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
        pass  # free again once the first one has left


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_hundred_agents_through_a_pool_for_sixteen(tiny_dir: Path) -> None:
    names = [f"agent{i:03d}" for i in range(100)]
    rng = random.Random(3)
    order = [(name, turn) for turn in range(3) for name in rng.sample(names, len(names))]

    async def run(pool_blocks: int) -> tuple[dict[Any, Any], Any, list[str], list[str]]:
        replies: dict[Any, Any] = {}
        limiter = anyio.CapacityLimiter(8)
        async with Runtime(tiny_dir, pool_blocks=pool_blocks, log_level="off") as rt:
            for name in names:  # a system prompt each: identical agents would share blocks
                await rt.spawn(name, system=f"You are {name}.", max_tokens=6)
            for turn in range(3):

                async def ask(name: str, turn: int = turn) -> None:
                    async with limiter:
                        replies[name, turn] = (await rt.agent(name).ask(f"Turn {turn}?")).tokens

                async with anyio.create_task_group() as tg:
                    for name, t in order:
                        if t == turn:
                            tg.start_soon(ask, name)
            await rt.flush()
            stats = await rt.stats()
            on_disk = sorted(a.name for a in rt.agents.values() if a.statistics().on_disk)
            assert rt.cache_dir is not None
            files = (
                sorted(p.parent.name for p in rt.cache_dir.glob("*/index.json"))
                if rt.cache_dir.exists()
                else []
            )
        return replies, stats, on_disk, files

    roomy, _, _, _ = await run(2000)
    tight, stats, on_disk, files = await run(50)  # each agent holds 3 blocks: about 16 fit
    assert tight == roomy
    assert 8 <= stats.resident_agents <= 17 and stats.evictions > 100
    assert stats.pool.used_blocks == stats.resident_blocks
    assert files == on_disk and len(on_disk) == stats.agents_on_disk == 100 - stats.resident_agents


async def test_a_runtime_cancelled_from_outside_still_saves_and_exits(
    tiny_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    with anyio.fail_after(60):
        with anyio.CancelScope() as scope:
            async with Runtime(
                tiny_dir, pool_blocks=100, log_level="off", state_dir=state, persist="exit"
            ) as rt:
                ann = await rt.spawn("ann", max_tokens=6)
                await ann.ask("Hi")
                scope.cancel()
                await anyio.sleep_forever()
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = rt.agent("ann")
        assert ann.statistics().turns == 1
        reply = await ann.ask("Still there?")
        assert reply.usage.cached_tokens > 0  # its cache was kept too


async def test_a_closed_agent_leaves_no_files(tiny_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=6)
        await ann.ask("Hi")
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(rt.flush)
            tg.start_soon(ann.close)
        await rt.flush()
    assert list((state / "agents").iterdir()) == []
    assert [p for p in (state / "caches").rglob("*") if p.is_file()] == []


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(
        tmp_path_factory.mktemp("models") / "three", tiny_config(num_hidden_layers=3), seed=7
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_restored_cache_too_large_beside_its_turn_gives_way_to_a_fresh_start(
    three_layers: Path, tmp_path: Path
) -> None:
    """Four agents whose caches (two blocks a layer, the last one partly filled) each
    fill most of a pool of nine blocks: a turn cannot keep its own cache beside the
    block copy and the blocks of its reply, but fits from the conversation. It starts
    without the cache, as a fresh start would (it was refused), with replies a roomy
    pool gives; a pool that cannot hold the turn even from the start refuses it as a
    conversation too long for the pool, not as a pool short for now."""
    system = "You are a careful reviewer of plans. " * 9

    async def sessions(pool_blocks: int, state: Path) -> list[list[Any]]:
        replies: list[list[Any]] = []
        for n in range(3):  # a new runtime each time: every cache comes back from disk
            async with Runtime(
                three_layers,
                pool_blocks=pool_blocks,
                host_bytes=0,
                state_dir=state,
                log_level="off",
            ) as rt:
                for name in ("a0", "a1", "a2", "a3"):
                    if name not in rt.agents:
                        await rt.spawn(name, system=system + name, max_tokens=40)
                replies.append([await rt.agents[a].ask(f"Turn {n}?") for a in sorted(rt.agents)])
        return replies

    tight = await sessions(9, tmp_path / "tight")
    roomy = await sessions(400, tmp_path / "roomy")
    assert [[r.tokens for r in s] for s in tight] == [[r.tokens for r in s] for s in roomy]
    assert any(r.usage.cached_tokens == 0 for r in tight[1])  # started without its cache
    assert all(r.usage.cached_tokens > 0 for r in roomy[1])
    async with Runtime(
        three_layers, pool_blocks=6, host_bytes=0, state_dir=tmp_path / "tight", log_level="off"
    ) as rt:
        with pytest.raises(ContextLengthError, match="more than the whole pool of 6"):
            await rt.agents["a0"].ask("Turn 3?")
        assert (await rt.stats()).pool.used_blocks == 0  # its cache made way, and the turn


async def test_an_agent_brought_back_leaves_again_copying_only_its_newer_blocks(
    tiny_dir: Path, tmp_path: Path
) -> None:
    # A pool that holds one of the two agents: each turn moves the other out. An agent
    # whose cache came back from host memory keeps that copy of its blocks, so that
    # leaving again copies out only the blocks its turn made.
    async def run(pool: int, trace: Path | None) -> list[list[int]]:
        async with Runtime(
            tiny_dir, pool_blocks=pool, host_bytes=1 << 26, log_level="off", trace=trace
        ) as rt:
            for name in ("ann", "bob"):
                await rt.spawn(name, system=f"You are {name}. " + "Go on. " * 40, max_tokens=8)
            replies = [
                list((await rt.agent(name).ask(question(name, turn))).tokens)
                for turn in range(3)
                for name in ("ann", "bob")
            ]
            assert (await rt.stats()).memory_restores >= (3 if trace else 0)
        return replies

    trace = tmp_path / "run.jsonl"
    assert await run(POOL_FOR_ONE, trace) == await run(400, None)
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    restored: set[str] = set()
    partial = 0
    for e in events:
        if e["event"] == "blocks.restored":
            restored.add(e["agent"])
        elif e["event"] == "blocks.dropped":  # its turn started over: every block new
            restored.discard(e["agent"])
        elif e["event"] == "blocks.evicted":
            if e["agent"] in restored:  # one turn since: the blocks it made
                assert 0 < e["copied"] < e["blocks"], e
                partial += 1
            else:
                assert e["copied"] == e["blocks"]
    assert partial >= 3


async def test_a_restore_into_a_full_pool_says_how_long_making_room_took(
    tiny_dir: Path, tmp_path: Path
) -> None:
    # A pool that holds one of the two agents: each restore from host memory first
    # moves the other agent out, inside the restore.
    trace = tmp_path / "run.jsonl"
    async with Runtime(
        tiny_dir, pool_blocks=POOL_FOR_ONE, host_bytes=1 << 26, log_level="off", trace=trace
    ) as rt:
        for name in ("ann", "bob"):
            await rt.spawn(name, system=f"You are {name}. " + "Go on. " * 40, max_tokens=8)
        for turn in range(3):
            for name in ("ann", "bob"):
                await rt.agent(name).ask(question(name, turn))
        stats = await rt.stats()
    assert stats.memory_restores >= 2
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    inside: list[float] | None = None
    made_room = 0
    for e in events:
        if e["event"] == "blocks.read" and e["source"] == "memory":
            inside = []  # logged as the restore starts
        elif e["event"] == "blocks.evicted" and inside is not None:
            inside.append(e["ms"])
        elif e["event"] == "blocks.restored":
            assert 0 <= e["room_ms"] <= e["ms"]
            if inside:  # at least the evictions inside it (each rounded to 0.01 ms)
                assert e["room_ms"] >= sum(inside) - 0.01 * len(inside)
                made_room += 1
            inside = None
    assert made_room >= 2
