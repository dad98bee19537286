"""The runtime's trace: Python's logging (the application's configuration obeyed), JSON
lines and a Chrome trace written as events happen (readable while the runtime runs, and
after it is killed), several at once."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from mlx_actors import Runtime, gather
from mlx_actors.errors import InvalidRequestError
from mlx_actors.runtime._chrome import read_trace
from mlx_actors.runtime._trace import Trace

pytestmark = pytest.mark.anyio


async def converse(rt: Runtime) -> None:
    a = await rt.spawn("ann", max_tokens=8)
    b = await rt.spawn("bo", max_tokens=8)
    await gather(a.ask("Hello"), b.ask("Hi there"))


# -- a strict reading of the Trace Event Format -------------------------------------------

_NEEDS = {
    "X": {"name", "ph", "ts", "dur", "pid", "tid"},
    "i": {"name", "ph", "ts", "pid", "tid", "s"},
    "s": {"name", "ph", "ts", "pid", "tid", "id", "cat"},
    "f": {"name", "ph", "ts", "pid", "tid", "id", "cat", "bp"},
    "M": {"name", "ph", "pid", "args"},
}
_METADATA = {"process_name", "thread_name", "thread_sort_index", "process_sort_index"}


def check_chrome(events: list[dict[str, Any]]) -> None:
    """Raise AssertionError unless every event is well formed per the Trace Event
    Format: known phases with their required fields and types, named lanes, flows that
    end where they started, spans whose children nest in them."""
    starts: dict[Any, dict[str, Any]] = {}
    named = set()
    for e in events:
        ph = e.get("ph")
        assert ph in _NEEDS, e
        missing = _NEEDS[ph] - set(e)
        assert not missing, (missing, e)
        assert isinstance(e["name"], str) and e["name"], e
        assert isinstance(e["pid"], int), e
        if ph == "M":
            assert e["name"] in _METADATA and isinstance(e["args"], dict), e
            if e["name"] == "thread_name":
                named.add(e["tid"])
            continue
        assert isinstance(e["tid"], int) and e["tid"] in named, e  # lanes are named first
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e.get("args", {}), dict), e
        if ph == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        elif ph == "i":
            assert e["s"] in ("g", "p", "t"), e
        elif ph == "s":
            assert e["id"] not in starts, e
            starts[e["id"]] = e
        elif ph == "f":
            start = starts.get(e["id"])
            assert start is not None and start["cat"] == e["cat"], e
            assert e["ts"] >= start["ts"] and e["bp"] == "e", e


def phases(events: list[dict[str, Any]], tid: int) -> Iterator[tuple[dict[str, Any], list[str]]]:
    """Each turn span on lane ``tid`` with the names of the phase spans inside it."""
    spans = [e for e in events if e.get("ph") == "X" and e["tid"] == tid]
    for turn in (e for e in spans if e["name"].startswith("turn ")):
        end = turn["ts"] + turn["dur"]
        inside = [
            e["name"]
            for e in spans
            if e is not turn and turn["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end + 1e-3
        ]
        yield turn, inside


# -- the files ----------------------------------------------------------------------------


async def test_json_lines_hold_every_event_and_are_readable_as_it_runs(
    tiny_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "run.jsonl"
    async with Runtime(tiny_dir, pool_blocks=100, trace=path, log_level="off") as rt:
        await converse(rt)
        now = [json.loads(line) for line in path.read_text().splitlines()]
        assert sum(e["event"] == "turn.finished" for e in now) == 2  # flushed per event
    events = [json.loads(line) for line in path.read_text().splitlines()]
    names = [e["event"] for e in events]
    for name in [
        "scheduler.started",
        "agent.spawned",
        "turn.queued",
        "turn.admitted",
        "batch.step",
        "turn.finished",
        "agent.closed",
        "scheduler.stopped",
    ]:
        assert name in names, name
    step = next(e for e in events if e["event"] == "batch.step")
    assert step["level"] == "debug"
    assert {"batch", "prefill_tokens", "finished", "ms", "pool_used", "prefilled"} <= set(step)
    assert all(e["timestamp"].endswith("Z") for e in events)  # with its zone: UTC


async def test_the_chrome_trace_is_well_formed_and_says_what_happened(
    tiny_dir: Path, tmp_path: Path
) -> None:
    jsonl, path = tmp_path / "run.jsonl", tmp_path / "run.json"
    async with Runtime(tiny_dir, pool_blocks=100, trace=[jsonl, path], log_level="off") as rt:
        await converse(rt)
    events = json.loads(path.read_text())  # closed: strict JSON
    assert events == read_trace(path)
    check_chrome(events)
    assert jsonl.exists()  # both sinks at once
    meta = {(e["name"], e["args"].get("name")) for e in events if e.get("ph") == "M"}
    assert ("process_name", f"mlx-actors: {tiny_dir}") in meta
    lanes = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
    assert {"engine", "ann", "bo"} <= set(lanes)
    steps = [e["name"] for e in events if e.get("ph") == "X" and e["tid"] == lanes["engine"]]
    assert any(s.startswith("prefill ") and "ann" in s and "bo" in s for s in steps), steps
    assert any("decode batch of 2" in s for s in steps), steps
    for agent in ("ann", "bo"):
        (turn, inside), *_ = phases(events, lanes[agent])
        assert {"prefill", "decode"} <= set(inside), (turn, inside)
    flows = [e for e in events if e.get("ph") in ("s", "f")]
    assert {e["ph"] for e in flows} == {"s", "f"}


def test_a_killed_process_leaves_a_chrome_trace_up_to_its_last_event(
    tiny_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "run.json"
    script = textwrap.dedent(
        f"""
        import sys, anyio
        from mlx_actors import Runtime

        async def main():
            async with Runtime({str(tiny_dir)!r}, pool_blocks=100, trace={str(path)!r},
                               log_level="off") as rt:
                agent = await rt.spawn("ann", max_tokens=8)
                await agent.ask("Hello")
                print("asked", flush=True)
                await anyio.sleep_forever()

        anyio.run(main)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "asked"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    events = read_trace(path)
    check_chrome(events)
    assert any(e["name"].startswith("turn ") for e in events if e.get("ph") == "X")


def test_bad_trace_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="jsonl"):
        Trace(tmp_path / "run.txt")
    with pytest.raises(InvalidRequestError, match="jsonl"):
        Trace([tmp_path / "a.jsonl", tmp_path / "b.log"])
    with pytest.raises(InvalidRequestError, match="level"):
        Trace(level="loud")


# -- Python's logging -----------------------------------------------------------------------


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[Records]:
    """A handler on the ``mlx_actors`` logger, as an application would set one."""
    logger = logging.getLogger("mlx_actors")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def test_events_follow_the_applications_logging_setup(
    tiny_dir: Path, records: Records
) -> None:
    logging.getLogger("mlx_actors").setLevel(logging.INFO)
    async with Runtime(tiny_dir, pool_blocks=100) as rt:
        await converse(rt)
    finished = [r for r in records.records if r.getMessage().startswith("turn.finished")]
    assert len(finished) == 2 and finished[0].levelno == logging.INFO
    assert "agent=" in finished[0].getMessage()
    assert finished[0].mlx_actors["agent"] in ("ann", "bo")  # type: ignore[attr-defined]
    assert not any(r.levelno < logging.INFO for r in records.records)

    records.records.clear()
    logging.getLogger("mlx_actors").setLevel(logging.WARNING)  # quieted by the application
    async with Runtime(tiny_dir, pool_blocks=100) as rt:
        await converse(rt)
    assert records.records == []

    logging.getLogger("mlx_actors").setLevel(logging.INFO)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        await converse(rt)
    assert records.records == []  # "off": nothing goes to logging


async def test_a_runtime_level_shows_events_through_the_applications_handlers(
    tiny_dir: Path, records: Records
) -> None:
    async with Runtime(tiny_dir, pool_blocks=100, log_level="debug") as rt:
        await converse(rt)
    assert any(r.getMessage().startswith("batch.step") for r in records.records)
    assert logging.getLogger("mlx_actors").level == logging.NOTSET  # put back


def test_with_no_logging_set_up_a_script_shows_warnings_not_turns(tiny_dir: Path) -> None:
    script = textwrap.dedent(
        f"""
        import anyio
        from mlx_actors import Runtime

        async def main():
            async with Runtime({str(tiny_dir)!r}, pool_blocks=100) as rt:
                agent = await rt.spawn("ann", max_tokens=4)
                await agent.ask("Hello")
                rt.log.warning("test.warned", agent="ann")
            async with Runtime({str(tiny_dir)!r}, pool_blocks=100, log_level="info") as rt:
                await (await rt.spawn("bo", max_tokens=4)).ask("Hi")

        anyio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any("test.warned" in line and "ann" in line for line in lines), lines
    turns = [line for line in lines if "turn.finished" in line]
    assert len(turns) == 1 and "bo" in turns[0], lines  # only the runtime that asked


def test_a_stream_shows_turns_but_not_steps() -> None:
    out = io.StringIO()
    trace = Trace(stream=out).start()
    trace.log.info("turn.finished", agent="ann", turn=1)
    trace.log.debug("batch.step", batch=2)
    trace.close()
    text = out.getvalue()
    assert "turn.finished" in text and "agent" in text and "ann" in text
    assert "batch.step" not in text
    handlers = logging.getLogger("mlx_actors").handlers
    assert all(getattr(h, "stream", None) is not out for h in handlers)  # taken back


# -- progress -------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_a_few_lines_elsewhere(
    records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_actors.runtime._progress import Progress

    progress = logging.getLogger("mlx_actors.progress")
    level = progress.level
    try:
        progress.setLevel(logging.INFO)
        with Progress("fetching", 1000, event="model.fetching") as bar:
            for done in range(0, 1001, 10):
                bar.update_to(done)
        lines = [r.mlx_actors for r in records.records]  # type: ignore[attr-defined]
        assert [line["percent"] for line in lines] == [0, 25, 50, 75, 100]
        assert all(r.name == "mlx_actors.progress" for r in records.records)

        records.records.clear()
        screen = Terminal()
        monkeypatch.setattr(sys, "stderr", screen)
        with Progress("fetching", 1000, event="model.fetching") as bar:
            bar.update_to(1000)
        assert "fetching" in screen.getvalue() and records.records == []  # tqdm's bar

        shown = len(screen.getvalue())
        progress.setLevel(logging.WARNING)  # quieted: nothing at all
        with Progress("fetching", 1000, event="model.fetching") as bar:
            bar.update_to(1000)
        assert records.records == [] and len(screen.getvalue()) == shown
    finally:
        progress.setLevel(level)


# -- found in review ------------------------------------------------------------------------


async def test_levels_asked_by_overlapping_runtimes_are_put_back(
    tiny_dir: Path, records: Records
) -> None:
    logger = logging.getLogger("mlx_actors")
    assert logger.level == logging.NOTSET
    first_in, second_in, first_out = anyio.Event(), anyio.Event(), anyio.Event()
    seen: dict[str, int] = {}

    async def first() -> None:  # "debug", entered first, left first
        async with Runtime(tiny_dir, pool_blocks=100, log_level="debug"):
            first_in.set()
            await second_in.wait()
            seen["both"] = logger.level
        first_out.set()

    async def second() -> None:  # "info", entered second, left last
        await first_in.wait()
        async with Runtime(tiny_dir, pool_blocks=100, log_level="info") as rt:
            second_in.set()
            await first_out.wait()
            seen["second"] = logger.level
            records.records.clear()
            await (await rt.spawn("ann", max_tokens=4)).ask("Hi")
            seen["turns"] = sum(r.getMessage().startswith("turn.finished") for r in records.records)

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        tg.start_soon(second)
    assert seen == {"both": logging.DEBUG, "second": logging.INFO, "turns": 1}
    assert logger.level == logging.NOTSET  # put back when the last one left


def test_a_runtime_never_entered_changes_no_logging(tiny_dir: Path, tmp_path: Path) -> None:
    handlers = list(logging.getLogger("mlx_actors").handlers)
    rt = Runtime(tiny_dir, log_level="debug", trace=tmp_path / "run.json")
    with pytest.raises(InvalidRequestError):
        with rt:  # type: ignore[attr-defined]
            pass
    assert logging.getLogger("mlx_actors").handlers == handlers
    assert logging.getLogger("mlx_actors").level == logging.NOTSET
    assert (tmp_path / "run.json").read_text().startswith("[")  # written as it goes
    del rt


async def test_a_cancelled_turn_ends_its_span_and_leaves_no_arrow_behind(
    tiny_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "run.json"
    async with Runtime(tiny_dir, pool_blocks=100, trace=path, log_level="off") as rt:
        agent = await rt.spawn("ann", max_tokens=4000)
        with anyio.move_on_after(0.5):  # cancelled mid-turn (decoding a long reply)
            await agent.ask("Talk for long.", logit_bias={258: -1e9})  # no end of turn
        await agent.ask("Short one.", max_tokens=2)
    events = read_trace(path)
    check_chrome(events)
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert any(n.endswith("(cancelled)") for n in names), names
    ends = [e for e in events if e.get("ph") == "f"]
    assert len(ends) == len({e["id"] for e in ends}) == 2  # one per turn, none doubled


def test_off_shows_no_progress_and_later_logging_setup_is_respected(
    tiny_dir: Path, tmp_path: Path
) -> None:
    script = textwrap.dedent(
        f"""
        import logging, sys
        import anyio
        from mlx_actors import Runtime
        from mlx_actors.runtime._progress import Progress
        from mlx_actors.runtime._trace import logging_to

        async def main():
            rt = Runtime({str(tiny_dir)!r}, pool_blocks=100, log_level="off")
            async with rt:
                with logging_to(rt._trace), Progress("quiet", 10, event="p") as bar:
                    bar.update_to(10)
            rt = Runtime({str(tiny_dir)!r}, pool_blocks=100)
            async with rt:
                logging.basicConfig(level=logging.WARNING, format="APP %(message)s")
                rt.log.warning("test.warned")

        anyio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "test.warned" in line or "quiet" in line]
    assert lines == ["APP test.warned"], done.stderr  # once, by the application's handler
