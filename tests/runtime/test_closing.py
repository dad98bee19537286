"""Closing agents and runtimes: a name whose close is finishing, or whose last turn is
being saved, can be spawned again; a close that failed can be retried; a fork in flight
when the runtime leaves fails; an engine thread stopped by an error answers every turn."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from mlx_actors import Runtime
from mlx_actors.errors import EngineError, MlxActorsError, RuntimeClosedError, StateWriteError
from mlx_actors.runtime import _state
from mlx_actors.scheduler.residency import _image

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

pytestmark = pytest.mark.anyio


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


@pytest.mark.timeout(120)  # before the engine answered what waited on it, this hung
async def test_an_unexpected_error_on_the_engine_thread_stops_it_and_answers_every_turn(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug of ours raising on the engine thread (here: copying a turn's cache to host
    memory for its save, while the engine applies the commit) stops the engine: every
    turn waiting on it, or asked later, fails with EngineError, and the runtime raises
    it (caused by the bug) as it exits."""

    def broken(arrays: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(_image, "to_host", broken)
    failed: list[EngineError] = []
    with pytest.raises(BaseExceptionGroup) as caught:
        async with Runtime(
            tiny_dir, pool_blocks=100, log_level="off", state_dir=tmp_path / "state"
        ) as rt:
            agent = await rt.spawn("ann", max_tokens=4)
            try:
                for _ in range(3):  # the first commit stops the engine
                    await agent.ask("Hello")
            except EngineError as exc:  # (or the runtime's failure cancels this first)
                failed.append(exc)
    stopped = caught.value.subgroup(EngineError)
    assert stopped is not None
    error = stopped.exceptions[0]
    assert "stopped on an unexpected error" in str(error)
    assert isinstance(error.__cause__, RuntimeError) and str(error.__cause__) == "injected"
    assert all("stopped on an unexpected error" in str(e) for e in failed)
