"""Where a runtime's trace goes: readable lines on the terminal, every event as JSON lines,
or a Chrome trace-event file that opens in Perfetto (ui.perfetto.dev)."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import IO, Any

import structlog

from ..errors import InvalidRequestError

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50, "off": 100}


class Trace:
    """One runtime's structlog logger and the sinks its events go to.

    The runtime builds its own logger instead of configuring structlog globally, so
    an application's own structlog setup is left alone. Events are ``noun.verb``
    with facts as fields. Turn-level events are at info, per-step events at debug.

    Args:
        path: ``None`` for the terminal only; ``*.jsonl`` to also write every event
            (debug included) as JSON lines; ``*.json`` to also write a Chrome
            trace-event file (batches and each agent's turns on a timeline).
        level: the lowest level shown on the terminal (``"off"`` shows nothing).
        stream: the terminal stream.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        level: str = "info",
        stream: IO[str] | None = None,
    ) -> None:
        if level not in LEVELS:
            raise InvalidRequestError(f"log level must be one of {sorted(LEVELS)}, got {level!r}")
        self.path = Path(path) if path is not None else None
        if self.path is not None and self.path.suffix not in (".jsonl", ".json"):
            raise InvalidRequestError(
                f"trace files end in .jsonl (JSON lines) or .json (Chrome trace for Perfetto); "
                f"got {self.path}"
            )
        self._console_level = LEVELS[level]
        self._console = stream if stream is not None else sys.stderr
        colors = getattr(self._console, "isatty", lambda: False)()
        self._render = structlog.dev.ConsoleRenderer(colors=colors)
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._chrome_file: IO[str] | None = None
        self._chrome: list[dict[str, Any]] | None = None
        self._lanes: dict[str, int] = {}
        self._t0 = time.perf_counter()
        if self.path is not None:
            # Opened now, so that a path that cannot be written fails here, not at exit.
            # The Chrome trace goes to a temporary file renamed into place at the end.
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if self.path.suffix == ".jsonl":
                    self._file = self.path.open("w", encoding="utf-8")
                else:
                    self._chrome_file = self._chrome_tmp.open("w", encoding="utf-8")
                    self._chrome = []
            except OSError as exc:
                raise InvalidRequestError(
                    f"the trace file {self.path} cannot be written: {exc.strerror or exc}"
                ) from exc
        # structlog filters only standard levels; "off" is handled in _emit.
        floor = min(self._console_level, 10 if self.path is not None else 50)
        self.log: Any = structlog.wrap_logger(
            structlog.ReturnLogger(),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=False),
                self._emit,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(floor),
            context_class=dict,
        )

    def _emit(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        level = LEVELS.get(event.get("level", method), 20)
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(event, default=str) + "\n")
            if self._chrome is not None:
                lane, item = _chrome_event(dict(event), time.perf_counter() - self._t0)
                item["tid"] = self._lane(lane)
                self._chrome.append(item)
            if level >= self._console_level:
                self._console.write(self._render(logger, method, dict(event)) + "\n")
        raise structlog.DropEvent

    def _lane(self, name: str) -> int:
        """A Chrome trace thread id per lane (the engine, each agent), named once."""
        tid = self._lanes.get(name)
        if tid is None:
            tid = self._lanes[name] = len(self._lanes) + 1
            assert self._chrome is not None
            self._chrome.append(
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
            )
        return tid

    def close(self) -> None:
        with self._lock:
            if self._chrome is not None and self._chrome_file is not None:
                doc = {"traceEvents": self._chrome, "displayTimeUnit": "ms"}
                self._chrome_file.write(json.dumps(doc))
                self._chrome_file.close()
                assert self.path is not None
                os.replace(self._chrome_tmp, self.path)
                self._chrome, self._chrome_file = None, None
            if self._file is not None:
                self._file.close()
                self._file = None

    @property
    def _chrome_tmp(self) -> Path:
        assert self.path is not None
        return self.path.with_suffix(".json.tmp")


def _chrome_event(event: dict[str, Any], now_s: float) -> tuple[str, dict[str, Any]]:
    """One Chrome trace event (and its lane) for a log event: batch steps and turns as
    spans, the rest as instants. Times in microseconds since the trace began."""
    name = str(event.get("event"))
    now = now_s * 1e6
    args = {k: v for k, v in event.items() if k not in ("event", "timestamp", "level")}
    args = json.loads(json.dumps(args, default=str))
    if name == "batch.step":
        dur = float(event.get("ms", 0.0)) * 1e3
        label = f"batch of {event.get('batch', 0)}"
        return "engine", {
            "name": label,
            "ph": "X",
            "ts": now - dur,
            "dur": dur,
            "pid": 1,
            "args": args,
        }
    agent = event.get("agent")
    lane = str(agent) if agent is not None else "runtime"
    if name == "turn.finished":
        dur = float(event.get("total_ms", 0.0)) * 1e3
        label = f"turn {event.get('turn')}"
        return lane, {"name": label, "ph": "X", "ts": now - dur, "dur": dur, "pid": 1, "args": args}
    return lane, {"name": name, "ph": "i", "s": "t", "ts": now, "pid": 1, "args": args}


# Work done for a runtime (loading its model, say) logs to that runtime's trace; work
# done outside any runtime logs to a terminal trace. Never to structlog's global setup,
# which belongs to the application.
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("mlx_actors_log")
_fallback: list[Trace] = []


def current_log() -> Any:
    """The logger of the runtime this work is for, or one that writes to stderr."""
    try:
        return _current.get()
    except LookupError:
        if not _fallback:
            _fallback.append(Trace(level=os.environ.get("MLX_ACTORS_LOG_LEVEL", "info")))
        return _fallback[0].log


@contextlib.contextmanager
def logging_to(log: Any) -> Iterator[None]:
    """Send :func:`current_log` events to ``log`` within the block (this thread only)."""
    token = _current.set(log)
    try:
        yield
    finally:
        _current.reset(token)


class ModuleLog:
    """A module's ``log``: forwards each call to :func:`current_log`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(current_log(), name)
