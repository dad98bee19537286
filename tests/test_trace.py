"""The runtime's trace: readable on the terminal, JSON lines, Chrome trace for Perfetto."""

from __future__ import annotations

import io
import json
from pathlib import Path

import anyio
import pytest

from mlx_actors import Runtime
from mlx_actors.errors import InvalidRequestError
from mlx_actors.runtime._trace import Trace

pytestmark = pytest.mark.anyio


async def converse(rt: Runtime) -> None:
    a = await rt.spawn("ann", max_tokens=8)
    b = await rt.spawn("bo", max_tokens=8)
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.ask, "Hello")
        tg.start_soon(b.ask, "Hi there")


async def test_json_lines_hold_every_event_with_its_facts(tiny_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    async with Runtime(tiny_dir, pool_blocks=100, trace=path, log_level="off") as rt:
        await converse(rt)
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
    assert {"batch", "prefill_tokens", "finished", "ms", "pool_used"} <= set(step)
    assert all("timestamp" in e for e in events)


async def test_chrome_trace_has_batches_and_turns_as_spans(tiny_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    async with Runtime(tiny_dir, pool_blocks=100, trace=path, log_level="off") as rt:
        await converse(rt)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    assert {"engine", "ann", "bo"} <= set(lanes)
    spans = [e for e in events if e["ph"] == "X"]
    turns = [e for e in spans if e["name"].startswith("turn ")]
    assert {e["tid"] for e in turns} == {lanes["ann"], lanes["bo"]}
    assert any(e["name"].startswith("batch of ") and e["tid"] == lanes["engine"] for e in spans)
    assert all(e["dur"] >= 0 and e["ts"] >= -1e3 for e in spans)


def test_the_terminal_shows_turns_but_not_steps_by_default() -> None:
    out = io.StringIO()
    trace = Trace(stream=out)
    trace.log.info("turn.finished", agent="ann", turn=1)
    trace.log.debug("batch.step", batch=2)
    trace.close()
    text = out.getvalue()
    assert "turn.finished" in text and "agent" in text and "ann" in text
    assert "batch.step" not in text


def test_bad_trace_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="jsonl"):
        Trace(tmp_path / "run.txt")
    with pytest.raises(InvalidRequestError, match="level"):
        Trace(level="loud")
