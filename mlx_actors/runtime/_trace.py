"""Where a runtime's events go: Python's ``logging`` (the ``mlx_actors`` logger, which an
application configures like any other) and the trace files (JSON lines, and a Chrome
trace for Perfetto), each written as events happen.

Events are structlog events named ``noun.verb`` with their facts as fields. Turn-level
events are at info, per-step events at debug. An application that configured logging
gets them as ordinary records (the message reads ``turn.finished agent=ann ...``; the
fields are in ``record.mlx_actors``); one that configured nothing sees warnings and
progress on stderr, rendered by structlog, unless the runtime asks for a level.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import IO, Any

import structlog

from ..errors import InvalidRequestError
from ._chrome import ChromeTrace

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50, "off": 100}
#: The library's logger; ``mlx_actors.progress`` carries progress of long first-run steps.
LOGGER = "mlx_actors"
PROGRESS = "mlx_actors.progress"


class Trace:
    """One runtime's structlog logger and where its events go.

    The files are opened when the trace is made (a path that cannot be written fails
    at once); logging is joined only by :meth:`start` (a runtime's entry), and left by
    :meth:`close`.

    Args:
        paths: trace files, one or several: ``*.jsonl`` gets every event (debug
            included) as JSON lines; ``*.json`` a Chrome trace-event file.
        level: ``None`` (the default) leaves the ``mlx_actors`` logger to the
            application's logging setup, and if the application set up nothing, shows
            warnings and progress on stderr. A level (``"debug"``, ``"info"``...) shows
            events from that level on stderr (through the application's handlers if it
            has some). ``"off"``: nothing goes to logging, and no progress is shown.
        stream: show events on this stream (at ``level``, default info) whatever the
            logging setup.
        process: the name of the process in the Chrome trace.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
        *,
        level: str | None = None,
        stream: IO[str] | None = None,
        process: str = "mlx-actors",
    ) -> None:
        if level is not None and level not in LEVELS:
            raise InvalidRequestError(f"log level must be one of {sorted(LEVELS)}, got {level!r}")
        self.paths = _paths(paths)
        self.level, self._stream = level, stream
        self._lock = threading.Lock()
        self._logger = logging.getLogger(LOGGER)
        self._forward = level != "off"
        self._jsonl: list[IO[str]] = []
        self._chrome: list[ChromeTrace] = []
        self._own_console: _Console | None = None
        self._shown: int | None = None  # the level asked of the shared console
        self._levels: list[tuple[str, int]] = []  # the levels asked of loggers
        self._started = False
        for path in self.paths:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                if path.suffix == ".jsonl":
                    self._jsonl.append(path.open("w", encoding="utf-8"))
                else:
                    self._chrome.append(ChromeTrace(path, process=process))
            except OSError as exc:
                self.close()
                raise InvalidRequestError(
                    f"the trace file {path} cannot be written: {exc.strerror or exc}"
                ) from exc
        # A trace never started nor closed (a runtime never entered) still closes its
        # files when it is collected.
        self._finalizer = weakref.finalize(self, _close_files, self._jsonl, self._chrome)
        # Whether an event goes anywhere is asked per event (``_gate``): the application
        # may change its logging levels while the runtime runs.
        self.log: Any = structlog.wrap_logger(
            structlog.ReturnLogger(),
            processors=[
                structlog.processors.add_log_level,
                self._gate,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                self._emit,
            ],
            context_class=dict,
        )

    def start(self) -> Trace:
        """Join logging: show events as ``level`` and ``stream`` ask (idempotent)."""
        if self._started:
            return self
        self._started = True
        level = self.level
        if self._stream is not None:
            self._own_console = _Console(self._stream, LEVELS[level or "info"])
            self._logger.addHandler(self._own_console)
            self._levels.append(_levels.want(LOGGER, LEVELS[level or "info"]))
        elif level is not None and level != "off":
            self._levels.append(_levels.want(LOGGER, LEVELS[level]))
            if not _configured(self._logger):
                self._shown = _console.want(LEVELS[level])
        elif level is None and not _configured(self._logger):
            self._shown = _console.want(logging.WARNING)
        return self

    def _console(self) -> _Console | None:
        """The stderr handler this trace shows events on, while the application has not
        set up logging of its own (then its handlers show them)."""
        if self._own_console is not None:
            return self._own_console
        if self._shown is not None and not _configured(self._logger):
            return _console.handler
        return None

    def wants_progress(self) -> bool:
        """Whether progress should be shown (a bar on a terminal, lines elsewhere):
        this trace shows it on stderr, or the application's logging takes it."""
        if not self._forward:
            return False
        return self._console() is not None or logging.getLogger(PROGRESS).isEnabledFor(logging.INFO)

    def _target(self, event: Mapping[str, Any]) -> logging.Logger | _Console | None:
        """Where an event goes: the logger, if it takes events of its level; progress
        straight to this trace's console, whatever the levels (the application's are
        left alone), when it has one."""
        if not self._forward:
            return None
        if event.get("progress"):
            console = self._console()
            if console is not None:
                return console
            target = logging.getLogger(PROGRESS)
        else:
            target = self._logger
        return target if target.isEnabledFor(LEVELS.get(event["level"], 20)) else None

    def _gate(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> Any:
        """Drop an event nothing would take, before any work is spent on it."""
        if not (self._jsonl or self._chrome) and self._target(event) is None:
            raise structlog.DropEvent
        return event

    def _emit(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        levelno = LEVELS.get(event.get("level", method), logging.INFO)
        with self._lock:
            if self._jsonl or self._chrome:
                line = json.dumps(event, default=str)
                for file in self._jsonl:
                    file.write(line + "\n")
                    file.flush()
                for chrome in self._chrome:
                    chrome.write(event)
        target = self._target(event)
        if isinstance(target, _Console):
            record = logging.getLogger(PROGRESS).makeRecord(
                PROGRESS,
                levelno,
                "",
                0,
                _message(event),
                (),
                None,
                extra={"mlx_actors": dict(event)},
            )
            target.handle(record)
        elif target is not None:
            target.log(levelno, _message(event), extra={"mlx_actors": dict(event)})
        raise structlog.DropEvent

    def close(self) -> None:
        """Finish the files and take back the logging changes (idempotent)."""
        with self._lock:
            for chrome in self._chrome:
                chrome.close()
            for file in self._jsonl:
                file.close()
            self._chrome, self._jsonl = [], []
        if self._own_console is not None:
            self._logger.removeHandler(self._own_console)
            self._own_console = None
        if self._shown is not None:
            _console.drop(self._shown)
            self._shown = None
        for request in self._levels:
            _levels.drop(request)
        self._levels = []


class _Console(logging.StreamHandler):  # type: ignore[type-arg]
    """Events rendered by structlog (colours on a terminal); progress always."""

    def __init__(self, stream: IO[str] | None, level: int) -> None:
        super().__init__(stream)
        self.shown = level
        self._follow = stream is None  # sys.stderr as it is at each record
        self._renderers = {
            colors: structlog.dev.ConsoleRenderer(colors=colors) for colors in (False, True)
        }

    def filter(self, record: logging.LogRecord) -> bool:
        if self._follow and _configured(logging.getLogger(LOGGER)):
            return False  # the application set up logging since: its handlers show it
        return record.levelno >= self.shown or record.name == PROGRESS

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow:
            self.stream = sys.stderr
        super().emit(record)

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "mlx_actors", None)
        if event is None:
            return record.getMessage()
        colors = bool(getattr(self.stream, "isatty", lambda: False)())
        shown = {k: v for k, v in event.items() if k != "progress"}
        return str(self._renderers[colors](None, record.levelname.lower(), shown))


class _SharedConsole:
    """The stderr handler runtimes share when the application set up no logging: one
    handler however many runtimes, showing the lowest level any of them asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handler: _Console | None = None
        self._levels: list[int] = []

    @property
    def handler(self) -> _Console | None:
        return self._handler

    def want(self, level: int) -> int:
        with self._lock:
            self._levels.append(level)
            if self._handler is None:
                self._handler = _Console(None, level)  # stderr as it is when writing
                logging.getLogger(LOGGER).addHandler(self._handler)
            self._handler.shown = min(self._levels)
        return level

    def drop(self, level: int) -> None:
        with self._lock:
            self._levels.remove(level)
            if self._handler is None:
                return
            if self._levels:
                self._handler.shown = min(self._levels)
            else:
                logging.getLogger(LOGGER).removeHandler(self._handler)
                self._handler = None


_console = _SharedConsole()


class _LevelRequests:
    """Levels runtimes asked of the library's loggers: each logger is set to the lowest
    level asked while any request stands, and put back when the last one goes (unless
    the application set another level meanwhile)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: dict[str, list[int]] = {}
        self._before: dict[str, tuple[int, int]] = {}  # the level found, the one set

    def want(self, name: str, level: int) -> tuple[str, int]:
        with self._lock:
            logger = logging.getLogger(name)
            asked = self._asked.setdefault(name, [])
            if not asked:
                self._before[name] = (logger.level, logger.level)
            asked.append(level)
            self._apply(name, logger)
        return name, level

    def drop(self, request: tuple[str, int]) -> None:
        name, level = request
        with self._lock:
            logger, asked = logging.getLogger(name), self._asked.get(name, [])
            if level in asked:
                asked.remove(level)
            found, set_ = self._before.get(name, (logger.level, logger.level))
            if asked:
                self._apply(name, logger)
            elif logger.level == set_:  # not changed by the application meanwhile
                logger.setLevel(found)

    def _apply(self, name: str, logger: logging.Logger) -> None:
        found, set_ = self._before[name]
        if logger.level != set_:  # the application set a level meanwhile: start from it
            found = logger.level
        lowest = min(self._asked[name])
        level = min(lowest, found) if found else lowest  # NOTSET (0): no level of its own
        logger.setLevel(level)
        self._before[name] = (found, level)


_levels = _LevelRequests()


def _close_files(jsonl: list[IO[str]], chrome: list[ChromeTrace]) -> None:
    for file in jsonl:
        file.close()
    for trace in chrome:
        trace.close()


def _configured(logger: logging.Logger) -> bool:
    """Whether records of ``logger`` would reach a handler the application set up."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, _Console) for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def _message(event: Mapping[str, Any]) -> str:
    """An event as one line for plain formatters: its name, then ``key=value`` fields."""
    fields = " ".join(
        f"{k}={v!r}" if isinstance(v, str) and " " in v else f"{k}={v}"
        for k, v in event.items()
        if k not in ("event", "level", "timestamp", "progress")
    )
    return f"{event.get('event')} {fields}".rstrip()


def _paths(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None,
) -> list[Path]:
    if paths is None:
        return []
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise InvalidRequestError(f"a trace file is a path, got {item!r}")
        path = Path(item)
        if path.suffix not in (".jsonl", ".json"):
            raise InvalidRequestError(
                f"trace files end in .jsonl (JSON lines) or .json (Chrome trace for "
                f"Perfetto); got {path}"
            )
        out.append(path)
    return out


# Work done for a runtime (loading its model, say) logs to that runtime's trace; work
# done outside any runtime logs to a trace of its own, which goes to ``logging`` too.
# Never to structlog's global setup, which belongs to the application.
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("mlx_actors_log")
_fallback: list[Trace] = []


def current_trace() -> Trace:
    """The trace of the runtime this work is for, or one of its own."""
    try:
        trace: Trace = _current.get()
        return trace
    except LookupError:
        if not _fallback:
            # Work outside any runtime (loading a model, say): a console while the
            # application has set up no logging, and no level of its changed.
            _fallback.append(Trace(level=os.environ.get("MLX_ACTORS_LOG_LEVEL")).start())
        return _fallback[0]


def current_log() -> Any:
    """The logger of the runtime this work is for, or one of its own."""
    return current_trace().log


@contextlib.contextmanager
def logging_to(trace: Trace) -> Iterator[None]:
    """Send :func:`current_log` events to ``trace`` within the block (this thread only)."""
    token = _current.set(trace)
    try:
        yield
    finally:
        _current.reset(token)


class ModuleLog:
    """A module's ``log``: forwards each call to :func:`current_log`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(current_log(), name)
