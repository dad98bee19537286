"""What a hostile probe of the public API found (issue 11): nothing a caller was told is
lost, nothing outside the state directory is touched, and every error is typed."""

from __future__ import annotations

import errno
import functools
import json
import math
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from mlx_actors import Runtime
from mlx_actors.actors._envelope import Envelope
from mlx_actors.errors import (
    CorruptStateError,
    InvalidRequestError,
    MlxActorsError,
    ModelIntegrityError,
    RuntimeClosedError,
    StateWriteError,
    TurnTimeoutError,
    UnsupportedModelError,
)
from mlx_actors.runtime import _disk, _state, _store
from mlx_actors.runtime._models import load_model
from mlx_actors.scheduler.engine._text import TextStream
from mlx_actors.testing import tiny_config, write_random_model

from ..conftest import Loaded, ReferenceChat, render
from ..runtime.test_persistence import converse, question, snapshot

pytestmark = pytest.mark.anyio


def records_on_disk(state: Path, name: str) -> list[dict[str, str]]:
    return list(json.loads((state / "agents" / f"{name}.json").read_text())["messages"])


# -- 1. a turn its caller gave up on is not kept -------------------------------------------


def giving_up(monkeypatch: pytest.MonkeyPatch) -> anyio.Event:
    """An event set as soon as a caller gives up on a request (a timeout, a cancel)."""
    gave_up = anyio.Event()
    cancel = Envelope.cancel

    def cancel_and_tell(self: Envelope) -> None:
        cancel(self)
        gave_up.set()

    monkeypatch.setattr(Envelope, "cancel", cancel_and_tell)
    return gave_up


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_turn_given_up_while_it_is_saved_is_rolled_back(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The caller gives up exactly while the finished turn is being saved: the turn is
    undone, in memory and on disk, and a retry does not duplicate the message."""
    state = tmp_path / "state"
    gave_up = giving_up(monkeypatch)
    saving = anyio.Event()
    save = _state.StateDir.save

    async def slow_save(self: _state.StateDir, record: _state.AgentRecord) -> None:
        if len(record.messages) == 2 and not saving.is_set():  # the first turn's save
            saving.set()
            await gave_up.wait()  # the disk is slow: the caller gives up meanwhile
        await save(self, record)

    monkeypatch.setattr(_state.StateDir, "save", slow_save)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        if how == "timeout":
            with pytest.raises(TurnTimeoutError):
                # more than the turn takes; the save then waits until it has passed
                await ann.ask("Hello there", timeout=2)
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ann.ask, "Hello there")
                await saving.wait()
                tg.cancel_scope.cancel()
        assert ann.history == () and ann.statistics().turns == 0
        assert records_on_disk(state, "ann") == []
        # and the cache is the one before the turn: the turn's blocks went back
        assert ann.statistics().cached_tokens == 0
        assert (await rt.stats()).pool.used_blocks == 0
        reply = await ann.ask("Hello there")  # the retry: one user message, not two
        assert [m.content for m in ann.history] == ["Hello there", reply.text]
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        assert [m.content for m in rt.agent("ann").history] == ["Hello there", reply.text]


async def test_a_turn_given_up_while_saved_whose_undo_fails_oddly_still_gives_back(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, and saving the undone agent raises an error nobody expected: the turn's
    blocks still go back, and the agent is not left counted as busy."""
    gave_up = giving_up(monkeypatch)
    save = _state.StateDir.save
    fires: list[str] = []

    async def failing_save(self: _state.StateDir, record: _state.AgentRecord) -> None:
        if len(record.messages) == 2:  # the turn's save: slow, the caller gives up
            await gave_up.wait()
        elif gave_up.is_set() and not fires:  # the undo's save
            fires.append(record.name)
            raise RuntimeError("the disk caught fire")
        await save(self, record)

    monkeypatch.setattr(_state.StateDir, "save", failing_save)
    options = dict(pool_blocks=100, log_level="off", state_dir=tmp_path / "state")
    async with Runtime(tiny_dir, **options) as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        with pytest.raises(TurnTimeoutError):
            await ann.ask("Hello there", timeout=2)
        assert fires == ["ann"]
        assert ann.history == () and ann.statistics().cached_tokens == 0
        stats = await rt.stats()
        assert stats.pool.used_blocks == 0 and stats.turns_in_flight == 0


@pytest.mark.parametrize("kind", ["ask", "tell"])
async def test_a_flush_while_an_outcome_waits_for_its_caller_keeps_nothing_it_gives_up(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """With ``persist="exit"``, a flush runs after a turn (or a told message) is made and
    before its caller, cancelled meanwhile, takes it: the flush writes it, the agent then
    takes it back. Before, only the memory was undone: a process killed at that point
    reopened with a turn whose caller had seen a cancel."""
    from mlx_actors.actors._transaction import AgentState

    state = tmp_path / "state"
    scopes: dict[str, anyio.CancelScope] = {}
    delivered, abandon = AgentState.delivered, Envelope.abandon
    written: list[list[str]] = []

    def delivered_then_cancelled(self: AgentState, envelope: Envelope, *args: Any) -> None:
        delivered(self, envelope, *args)
        if (scope := scopes.pop(self.name, None)) is not None:
            scope.cancel()  # the caller gives up before it could take the outcome

    async def flush_then_abandon(self: Envelope) -> None:
        if self.delivering and self.receipt is None:  # made, not yet taken
            with anyio.CancelScope(shield=True):
                await rt.flush()  # the flush lands inside the hold
            written.append([m["content"] for m in records_on_disk(state, self.agent.name)])
        await abandon(self)

    monkeypatch.setattr(AgentState, "delivered", delivered_then_cancelled)
    monkeypatch.setattr(Envelope, "abandon", flush_then_abandon)
    with anyio.fail_after(60):
        async with Runtime(
            tiny_dir, pool_blocks=100, log_level="off", state_dir=state, persist="exit"
        ) as rt:
            ann = await rt.spawn("ann", max_tokens=8)
            first = await ann.ask("Hello there")
            told = "And then?"
            scopes["ann"] = scope = anyio.CancelScope()
            with scope:
                await (ann.ask(told) if kind == "ask" else ann.tell(told))
            assert scope.cancelled_caught  # the caller saw a cancel
            kept = ["Hello there", first.text]
            assert [m.content for m in ann.history] == kept
            assert written[0][:3] == [*kept, told]  # the flush wrote the outcome
            assert records_on_disk(state, "ann") == [  # taking it back wrote it again
                {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": first.text},
            ]
            shutil.copytree(state, tmp_path / "killed")  # as a kill -9 would leave it
    async with Runtime(
        tiny_dir, pool_blocks=100, log_level="off", state_dir=tmp_path / "killed"
    ) as rt:
        ann = rt.agent("ann")
        assert [m.content for m in ann.history] == kept
        again = await ann.ask(told)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        fresh = await rt.spawn("ann", max_tokens=8)
        await fresh.ask("Hello there")
        assert (await fresh.ask(told)).tokens == again.tokens


# -- 2. a full disk: the turn fails, typed, and nothing returned is lost -----------------


class Disk:
    """``write_atomic`` that fails with ENOSPC while ``full`` (for some paths)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self.only: str | None = None  # only paths containing this fail
        write = _disk.write_atomic

        def write_atomic(path: Path, data: bytes) -> None:
            if self.full and (self.only is None or self.only in str(path)):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            write(path, data)

        monkeypatch.setattr(_disk, "write_atomic", write_atomic)


async def test_a_full_disk_fails_the_turn_and_loses_no_returned_reply(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    disk = Disk(monkeypatch)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        first = await ann.ask("One")
        disk.full = True
        with pytest.raises(StateWriteError, match="No space left") as info:
            await ann.ask("Two")
        assert isinstance(info.value, OSError)
        assert [m.content for m in ann.history] == ["One", first.text]  # as before the turn
        with pytest.raises(StateWriteError):
            await rt.spawn("bob")
        assert "bob" not in rt.agents  # never made: the name is free again
        disk.full = False
        bob = await rt.spawn("bob", max_tokens=8)
        second = await ann.ask("Two")
        disk.full, disk.only = True, "caches"  # the cache cannot be written, the record can
        third = await ann.ask("Three")  # the turn is kept: the cache is only an aid
        await bob.ask("Hi")
        disk.full = False
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = rt.agent("ann")
        assert [m.content for m in ann.history] == [
            "One", first.text, "Two", second.text, "Three", third.text,
        ]  # fmt: skip
        assert "bob" in rt.agents
        reply = await ann.ask("Four")  # the older cache on disk still serves its prefix
        assert reply.usage.cached_tokens > 0


async def test_opening_a_state_directory_that_cannot_be_written_is_a_typed_error(
    tiny_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StateWriteError):
        async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=blocker / "s"):
            pass


# -- 4. closing an agent and spawning its name again ---------------------------------------


async def test_spawning_a_name_whose_close_is_finishing_keeps_the_new_agent(
    tiny_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        old = await rt.spawn("ann", max_tokens=8)
        await old.ask("Old words")
        async with anyio.create_task_group() as tg:
            tg.start_soon(old.close)
            await wait_all_tasks_blocked()  # the close is under way (its files)
            new = await rt.spawn("ann", max_tokens=8)  # waits for the old one's files
            reply = await new.ask("New words")
        await old.close()  # closing the old one again touches nothing of the new one
        assert rt.agent("ann") is new
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        assert [m.content for m in rt.agent("ann").history] == ["New words", reply.text]


# -- 6. symbolic links: nothing outside the state directory is read, written or deleted --


async def test_links_in_the_state_directory_are_never_followed(
    tiny_dir: Path, tmp_path: Path
) -> None:
    state, outside = tmp_path / "state", tmp_path / "outside"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann", "bob"], range(1))
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (outside / "secret.json").write_text(json.dumps({"format": 2}))
    before = snapshot(outside)
    # ann's cache directory is now a link to a directory outside
    for path in (state / "caches" / "ann").iterdir():
        path.unlink()
    (state / "caches" / "ann").rmdir()
    (state / "caches" / "ann").symlink_to(outside)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        for _ in range(2):  # saves, and their clean-ups
            await rt.agent("ann").ask("Again?")
        await rt.agent("ann").reset()
        await rt.agent("ann").close()
    assert snapshot(outside) == before
    # links in place of the state directory's own folders, or of a record: refused
    for link, target in [
        (state / "caches" / "_blocks", outside),
        (state / "agents" / "eve.json", outside / "secret.json"),
    ]:
        saved = state / "saved"
        if link.exists():
            link.rename(saved)
        link.symlink_to(target)
        with pytest.raises(CorruptStateError, match="symbolic link"):
            async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
                pass
        link.unlink()
        if saved.exists():
            saved.rename(link)
        assert snapshot(outside) == before


async def test_folders_replaced_by_links_while_running_are_not_followed(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """``agents/`` and ``caches/_blocks/`` swapped for links to folders outside while the
    runtime runs: before, records and chunks were written there, and an outside file
    named like a chunk was deleted. Now each write or delete checks its folder first:
    the save fails (typed), and nothing outside changes."""
    state, outside = tmp_path / "state", tmp_path / "outside"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=4)
        await ann.ask("Hello")
        for folder in ("agents", "blocks"):
            (outside / folder).mkdir(parents=True)
        for chunk in (state / "caches" / "_blocks").iterdir():  # a victim of the same name
            (outside / "blocks" / chunk.name).write_text("keep me")
        before = snapshot(outside)
        for link, target in [
            (state / "agents", outside / "agents"),
            (state / "caches" / "_blocks", outside / "blocks"),
        ]:
            link.rename(link.with_name(link.name + ".real"))
            link.symlink_to(target)
        with pytest.raises(CorruptStateError, match="replaced"):
            await ann.ask("Again?")
        assert [m.content for m in ann.history][:1] == ["Hello"] and len(ann.history) == 2
        await ann.close()
        assert snapshot(outside) == before


async def test_an_index_that_names_a_file_outside_is_corrupt(
    tiny_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    where = state / "caches" / "ann" / "index.json"
    index = json.loads(where.read_text())
    (chunk,) = index["chunks"]
    text = json.dumps(index).replace(chunk, "../../../outside.safetensors")
    index = json.loads(text)
    index = _disk.with_digest(index)
    where.write_text(json.dumps(index))
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        reply = await rt.agent("ann").ask(question("ann", 1))
        assert reply.usage.cached_tokens == 0  # that cache was not used (nor read)


# -- 7. a corrupt cache index costs only its agent's cache --------------------------------


@pytest.mark.parametrize("damage", ["truncate", "flip"])
async def test_a_corrupt_cache_index_costs_only_that_agents_cache(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path, damage: str
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann", "bob"], range(2))
    where = state / "caches" / "ann" / "index.json"
    data = bytearray(where.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x04
    where.write_bytes(bytes(data))
    trace = tmp_path / "trace.jsonl"
    async with Runtime(
        tiny_dir, pool_blocks=100, log_level="off", state_dir=state, trace=trace
    ) as rt:
        ann, bob = rt.agent("ann"), rt.agent("bob")
        assert ann.cached_tokens == 0 and bob.cached_tokens > 0
        reply = await ann.ask(question("ann", 2))
        chat = ReferenceChat(tiny.model, tiny.tokenizer.eos_token_ids)
        assert list(reply.tokens) == chat.turn(render(tiny.tokenizer, ann.history[:-1]), 12)
        assert (await bob.ask(question("bob", 2))).usage.cached_tokens > 0
    lost = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(e["event"] == "blocks.lost" and e["agent"] == "ann" for e in lost)


# -- 8. a stalled disk read does not hold a caller past its timeout -----------------------


async def test_a_stalled_disk_read_is_cancelled_by_the_timeout(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    stalled, load = threading.Event(), _store.DiskCacheStore._load

    def stalled_load(self: _store.DiskCacheStore, agent: str) -> Any:
        stalled.wait()
        return load(self, agent)

    monkeypatch.setattr(_store.DiskCacheStore, "_load", stalled_load)
    unstall = threading.Timer(20, stalled.set)  # so that a failure cannot hang the run
    unstall.start()
    try:
        async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
            ann = rt.agent("ann")
            with pytest.raises(TurnTimeoutError):
                await ann.ask(question("ann", 1), timeout=0.5)
            assert not stalled.is_set()  # the caller got its error while the disk stalls
            assert len(ann.history) == 3  # the system prompt and the first turn
            stalled.set()
            await ann.ask(question("ann", 1))
    finally:
        unstall.cancel()
        stalled.set()


# -- 9. records carry checksums --------------------------------------------------------------


async def test_bit_flips_in_records_are_corrupt_state(tiny_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(2))
    rng = random.Random(11)
    for path in [state / "agents" / "ann.json", state / "runtime.json"]:
        good = path.read_bytes()
        for _ in range(12):
            data = bytearray(good)
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
            with pytest.raises(CorruptStateError, match=path.name):
                async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
                    pass
        path.write_bytes(good)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        assert len(rt.agent("ann").history) == 5


async def test_a_record_with_text_no_model_can_read_is_corrupt_state(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A lone surrogate (JSON can spell one) in a record with a good checksum: before,
    it loaded, and every turn then failed with the tokenizer's ``TypeError``."""
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    path = state / "agents" / "ann.json"
    good = json.loads(path.read_text())
    for field in ("message", "system"):
        record = {k: v for k, v in good.items() if k != "sha256"}
        if field == "message":
            record["messages"][0] = {**record["messages"][0], "content": "hel\ud800lo"}
        else:
            record["system"] = "You are \udfff."
        path.write_text(json.dumps(_disk.with_digest(record)))
        with pytest.raises(CorruptStateError, match=r"ann\.json.*not valid Unicode"):
            async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
                pass


# -- 10. every error is typed ----------------------------------------------------------------


def _broken_models(base: Path) -> dict[str, Path]:
    """Model directories broken in the ways users' downloads break."""
    made = {}

    def model(name: str, **changes: Any) -> Path:
        path = write_random_model(base / name, tiny_config(), seed=1)
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps(config))
        made[name] = path
        return path

    model("bad_json").joinpath("config.json").write_text("{not json")
    model("unknown_type", model_type="no_such_model")
    config = model("missing_field") / "config.json"
    data = json.loads(config.read_text())
    del data["hidden_size"]
    config.write_text(json.dumps(data))
    weights = model("truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    model("wrong_shape", intermediate_size=96)
    (model("bad_tokenizer") / "tokenizer.json").write_text("{")
    return made


def test_broken_model_directories_raise_typed_errors(tmp_path: Path) -> None:
    for name, path in _broken_models(tmp_path).items():
        with pytest.raises(MlxActorsError) as info:
            load_model(path)
        expected = UnsupportedModelError if name == "unknown_type" else ModelIntegrityError
        assert isinstance(info.value, expected), (name, info.value)
        assert str(path) in str(info.value)


async def test_bad_arguments_raise_typed_errors(tiny_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InvalidRequestError, match="trace file"):
        Runtime(tiny_dir, trace=blocker / "trace.jsonl")
    rt = Runtime(tiny_dir, pool_blocks=100, log_level="off")
    async with rt:
        ann = await rt.spawn("ann", max_tokens=4, temperature=1.0)
        bad: list[dict[str, Any]] = [
            {"stop": 123},
            {"stop": [1, 2]},
            {"stop": ["x"] * 20_000},
            {"stop": "y" * 5_000},
            {"timeout": math.nan},
            {"timeout": -1},
            {"seed": -1},
            {"seed": 2**70},
        ]
        for options in bad:
            with pytest.raises(InvalidRequestError):
                await ann.ask("Hello", **options)
        for text in ["bad \ud800 surrogate", "x" * 1_000_000, b"bytes", ""]:
            with pytest.raises(InvalidRequestError):
                await ann.ask(text)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError):
            await rt.spawn("bob", system="lone \udfff")
        await ann.ask("Hello", seed=2**64 - 1)  # the largest seed is fine
        assert len(ann.history) == 2
    with pytest.raises(InvalidRequestError, match="only once"):
        async with rt:
            pass


# -- 11. an agent called from another event loop -------------------------------------------


async def test_an_ask_from_another_event_loop_is_refused_or_forwarded(tiny_dir: Path) -> None:
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        ann = await rt.spawn("ann", max_tokens=4)
        outcome: list[Any] = []

        def other_thread() -> None:
            async def ask() -> Any:
                return await ann.ask("Hello")

            try:
                outcome.append(anyio.run(ask))
            except Exception as exc:
                outcome.append(exc)
            # the way that works: run the call on the runtime's own loop
            outcome.append(anyio.from_thread.run(functools.partial(ann.ask, "Hi"), token=rt.token))
            anyio.from_thread.run_sync(done.set, token=rt.token)

        done = anyio.Event()
        threading.Thread(target=other_thread, daemon=True).start()
        with anyio.fail_after(60):  # an ask stuck in the other loop would never return
            await done.wait()
        refused, forwarded = outcome
        assert isinstance(refused, InvalidRequestError) and "event loop" in str(refused)
        assert forwarded.text == ann.history[-1].content


# -- 12. huge inputs are refused before any work; many stops stay cheap --------------------


def test_the_stop_matcher_agrees_with_the_obvious_one() -> None:
    rng = random.Random(5)

    def obvious(text: str, emitted: int, stops: list[str]) -> int:
        longest = 0
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text) - emitted), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    for _ in range(3000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 12)))
        stream = TextStream(None, tuple(stops))
        stream._emitted = rng.randint(0, len(text))
        assert stream._held_back(text) == obvious(text, stream._emitted, stops)


# -- 13. a burst larger than the pool waits for room instead of failing ------------------


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


# -- what a review of the fixes found ------------------------------------------------------


async def test_odd_files_in_the_state_directory_neither_hang_nor_delete(
    tiny_dir: Path, tmp_path: Path
) -> None:
    import os

    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann", "bob"], range(1))
    (state / "caches" / "_blocks" / "index.json").write_text("{}")  # not an agent's
    os.mkfifo(state / "caches" / "bob" / "index.json.fifo")
    (state / "caches" / "bob" / "index.json").unlink()
    os.rename(state / "caches" / "bob" / "index.json.fifo", state / "caches" / "bob" / "index.json")
    with anyio.fail_after(60):  # a FIFO opened for reading would block for ever
        async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
            assert (await rt.agent("ann").ask(question("ann", 1))).usage.cached_tokens > 0
            assert rt.agent("bob").cached_tokens == 0
        os.mkfifo(state / "agents" / "eve.json")
        with pytest.raises(CorruptStateError, match="not a regular file"):
            async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
                pass


async def test_records_of_the_older_format_still_open(tiny_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    path = state / "agents" / "ann.json"
    record = json.loads(path.read_text())
    del record["sha256"]
    record["format"] = 1  # what the older version wrote, with what it accepted
    record["options"].update(seed=-1, stop=[f"stop{i}" for i in range(100)])
    path.write_text(json.dumps(record))
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        options = rt.agent("ann").options
        assert options.seed == 2**64 - 1 and len(options.stop) == 64
        await rt.agent("ann").ask(question("ann", 1))


async def test_a_close_that_failed_can_be_retried(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    fail = {"delete": True}
    delete = _state.StateDir.delete

    async def failing_delete(self: _state.StateDir, name: str) -> None:
        if fail.pop("delete", False):
            raise StateWriteError("could not write: Read-only file system")
        await delete(self, name)

    monkeypatch.setattr(_state.StateDir, "delete", failing_delete)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        await ann.ask("Hello")
        with pytest.raises(StateWriteError):
            await ann.close()
        await ann.close()  # tried again, and this time deleted
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        assert "ann" not in rt.agents


async def test_a_turn_that_cannot_be_undone_is_kept_and_returned(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller timed out while the turn was saved, and the undo cannot be written:
    the turn stays on disk, so it is kept in memory too, and the caller gets it."""
    state = tmp_path / "state"
    gave_up = giving_up(monkeypatch)
    save = _state.StateDir.save
    saves = []

    async def save_then_fail(self: _state.StateDir, record: _state.AgentRecord) -> None:
        saves.append(len(record.messages))
        if saves[-1] == 2:
            await save(self, record)
            await gave_up.wait()
        elif len(saves) > 2:  # the undo
            raise StateWriteError("could not write: No space left on device")
        else:
            await save(self, record)

    monkeypatch.setattr(_state.StateDir, "save", save_then_fail)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        reply = await ann.ask("Hello there", timeout=2)
        assert [m.content for m in ann.history] == ["Hello there", reply.text]
        assert records_on_disk(state, "ann") == [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": reply.text},
        ]


async def test_spawning_while_the_old_agents_turn_is_saved_waits(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    saving, proceed = anyio.Event(), anyio.Event()
    save = _state.StateDir.save

    async def held_save(self: _state.StateDir, record: _state.AgentRecord) -> None:
        if record.messages and not saving.is_set():
            saving.set()
            await proceed.wait()
        await save(self, record)

    monkeypatch.setattr(_state.StateDir, "save", held_save)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        old = await rt.spawn("ann", max_tokens=8)
        async with anyio.create_task_group() as tg:
            tg.start_soon(old.ask, "Hello")
            await saving.wait()  # the old agent's turn is being saved (shielded)
            tg.start_soon(old.close)
            await wait_all_tasks_blocked()

            async def release() -> None:
                await wait_all_tasks_blocked()  # the spawn below waits for the close
                proceed.set()

            tg.start_soon(release)
            new = await rt.spawn("ann", max_tokens=8)  # waits for the close, not an error
        assert rt.agent("ann") is new and new.history == ()


async def test_a_caller_cancelled_as_its_turn_finishes_gets_the_reply_or_finds_it_undone(
    tiny_dir: Path,
) -> None:
    """A's caller is cancelled from B's stream in the engine step where both finish (no
    state directory): before, A's agent took the reply while its caller, already
    cancelled, had not run yet, so the caller saw a cancel and the agent kept the turn."""
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        for trial in range(3):
            a = await rt.spawn(f"a{trial}", max_tokens=1)
            b = await rt.spawn(f"b{trial}", max_tokens=1)
            got: list[Any] = []
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()

                async def ask_a(
                    scope: anyio.CancelScope = scope, a: Any = a, got: list[Any] = got
                ) -> None:
                    with scope:
                        got.append(await a.ask("Hello"))

                tg.start_soon(ask_a)
                async with b.stream("Hellp") as pieces:  # as long as A's: the same steps
                    async for _ in pieces:
                        scope.cancel()
                        break
            if got:  # the reply was returned: kept
                assert [m.content for m in a.history] == ["Hello", got[0].text]
            else:  # the caller went away: as if never asked
                assert a.history == () and a.statistics().cached_blocks == 0
            await a.close()
            await b.close()
        assert (await rt.stats()).pool.used_blocks == 0  # every block came back


async def test_a_stream_that_finished_in_time_is_not_timed_out_by_a_slow_reader(
    tiny_dir: Path,
) -> None:
    """The timeout covers the turn, not the reading of the pieces it already made: a
    reader still reading after the deadline gets every piece, and the turn is kept."""
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        ann = await rt.spawn("ann", max_tokens=12)
        got = []
        async with ann.stream("Tell me a story", timeout=1.0) as pieces:
            async for piece in pieces:
                got.append(piece)
                if len(got) == 1:
                    await ann.tell("(noted)")  # handled after the turn: it has finished
                    assert len(ann.history) == 3, "the turn did not finish within 1 s"
                    await anyio.sleep(1.1)  # the reader is slow: past the turn's deadline
        assert "".join(got) == pieces.reply.text
        assert [m.content for m in ann.history] == [
            "Tell me a story",
            pieces.reply.text,
            "(noted)",
        ]


async def test_leaving_the_runtime_while_a_fork_is_in_flight_fails_the_fork(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the fork started its agent after the closing runtime had listed the
    agents to stop, and leaving ``async with Runtime`` waited for it forever."""
    from mlx_actors.scheduler import Scheduler

    forking, proceed = anyio.Event(), anyio.Event()
    fork = Scheduler.fork

    async def held_fork(self: Scheduler, parent: str, child: str) -> None:
        forking.set()
        await proceed.wait()
        await fork(self, parent, child)

    monkeypatch.setattr(Scheduler, "fork", held_fork)
    state = tmp_path / "state"
    outcome: list[Any] = []

    async def try_fork(ann: Any) -> None:
        try:
            outcome.append(await ann.fork("bob"))
        except MlxActorsError as exc:
            outcome.append(exc)

    async def release_once_closing() -> None:
        await wait_all_tasks_blocked()  # the runtime waits for ann, ann for its fork
        proceed.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            async with Runtime(tiny_dir, pool_blocks=60, log_level="off", state_dir=state) as rt:
                ann = await rt.spawn("ann", max_tokens=4)
                await ann.ask("Hello")
                tg.start_soon(try_fork, ann)
                await forking.wait()
                tg.start_soon(release_once_closing)
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeClosedError)
    assert sorted(p.name for p in (state / "agents").iterdir()) == ["ann.json"]
    assert sorted(p.name for p in (state / "caches").iterdir()) == ["_blocks", "ann"]


async def test_a_tell_or_fork_whose_caller_saw_a_cancel_is_not_kept(tiny_dir: Path) -> None:
    """Callers cancelled after 0 to 11 checkpoints (no state directory): before, a cancel
    that reached the caller as the agent handled its request left the message told, or
    the fork alive, though the caller saw a cancel."""
    async with Runtime(tiny_dir, pool_blocks=40, log_level="off") as rt:
        for kind in ("tell", "fork"):
            for n in range(12):
                ann = await rt.spawn(f"{kind}{n}", max_tokens=4)
                scope = anyio.CancelScope()

                async def cancel_after(n: int = n, scope: anyio.CancelScope = scope) -> None:
                    for _ in range(n):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_after)
                    with scope:
                        if kind == "tell":
                            await ann.tell("Remember this.")
                        else:
                            await ann.fork(f"child{n}")
                kept = len(ann.history) == 1 if kind == "tell" else f"child{n}" in rt.agents
                assert kept != scope.cancelled_caught, (kind, n, kept)
                await ann.close()
        assert (await rt.stats()).pool.used_blocks == sum(
            a.statistics().cached_blocks for a in rt.agents.values()
        )


async def test_misuse_gets_typed_errors_that_say_what_happened(tiny_dir: Path) -> None:
    """Reading a stream's reply too early or after leaving it, spawning after the
    runtime ended, ``run`` inside a running event loop (a notebook): before, a bare
    ``RuntimeError``, or advice to use ``async with`` to one who did."""
    from mlx_actors import run

    async def main() -> None:
        pass

    with pytest.raises(InvalidRequestError, match="notebook"):
        run(main)
    async with Runtime(tiny_dir, pool_blocks=40, log_level="off") as rt:
        ann = await rt.spawn("ann", max_tokens=30)
        async with ann.stream("Tell me a story") as pieces:
            with pytest.raises(InvalidRequestError, match="has not finished"):
                pieces.reply  # noqa: B018
        # left at once: the turn is cancelled, and the agent as it was
        with pytest.raises(MlxActorsError, match="cancelled"):
            pieces.reply  # noqa: B018
        assert ann.history == ()
    with pytest.raises(RuntimeClosedError, match="has shut down"):
        await rt.spawn("bob")


async def test_a_later_turn_undone_in_the_state_directory_leaves_the_cache_before_it(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second turn given up while it is saved: the undo saves the agent with the cache
    before the turn. Before, it saved the undone turn's cache beside the conversation
    without it, and after a restart the agent's cache did not fit its conversation."""
    gave_up = giving_up(monkeypatch)
    save = _state.StateDir.save

    async def slow_save(self: _state.StateDir, record: _state.AgentRecord) -> None:
        if len(record.messages) == 4 and not gave_up.is_set():  # the second turn's save
            await gave_up.wait()  # the disk is slow: the caller gives up meanwhile
        await save(self, record)

    monkeypatch.setattr(_state.StateDir, "save", slow_save)
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=12, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        await ann.ask("Hello there " * 20)
        with pytest.raises(TurnTimeoutError):
            await ann.ask("And then? " * 30, timeout=2)
        assert len(ann.history) == 2
        index = json.loads((state / "caches" / "ann" / "index.json").read_text())
        assert len(index["tokens"]) == ann.statistics().cached_tokens  # not the undone turn's
        bob = await rt.spawn("bob", max_tokens=8)
        await bob.ask("Make room " * 60)  # ann's cache goes to disk
        assert ann.statistics().on_disk
        again = await ann.ask("And then?")  # its cache comes back from disk
        assert again.usage.cached_tokens > 0 and (await rt.stats()).restores > 0
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        await ann.ask("Hello there " * 20)
        assert (await ann.ask("And then?")).tokens == again.tokens
