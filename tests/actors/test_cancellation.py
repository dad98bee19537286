"""A turn, a told message or a fork whose caller gave up (a cancel, a timeout) is not
kept, in memory or in the state directory, whenever the agent is when the caller leaves;
one that cannot be undone is kept and returned."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from mlx_actors import Runtime
from mlx_actors.actors._envelope import Envelope
from mlx_actors.errors import StateWriteError, TurnTimeoutError
from mlx_actors.runtime import _state, _store

from ..runtime.test_persistence import converse, question

pytestmark = pytest.mark.anyio


def records_on_disk(state: Path, name: str) -> list[dict[str, str]]:
    return list(json.loads((state / "agents" / f"{name}.json").read_text())["messages"])


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
        assert len(_store._tokens(index)) == ann.statistics().cached_tokens  # not the undone turn's
        bob = await rt.spawn("bob", max_tokens=8)
        await bob.ask("Make room " * 60)  # ann's cache goes to disk
        assert ann.statistics().on_disk
        again = await ann.ask("And then?")  # its cache comes back from disk
        assert again.usage.cached_tokens > 0 and (await rt.stats()).restores > 0
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        await ann.ask("Hello there " * 20)
        assert (await ann.ask("And then?")).tokens == again.tokens
