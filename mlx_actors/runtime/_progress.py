"""Progress of a long first-run step (fetching the default model): a tqdm bar when stderr
is a terminal, a few ``mlx_actors.progress`` log lines when it is not, and nothing when
progress is not wanted (``log_level="off"``, or an application that quieted it)."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from tqdm import tqdm

from ._trace import ModuleLog, current_trace

log = ModuleLog()


class Progress:
    """Counts ``total`` units of ``what`` done; use as a context manager.

    Args:
        what: what is being done (``"fetching SmolLM2-135M"``).
        total: units in all.
        event: the log event of the lines written off a terminal.
        unit: ``"B"`` for bytes (shown as KB, MB...).
    """

    def __init__(self, what: str, total: int, *, event: str, unit: str = "B") -> None:
        self.what, self.total, self.event = what, max(1, total), event
        self.done = 0
        self._said = -1  # the last quarter said off a terminal
        wanted = current_trace().wants_progress()
        terminal = wanted and _is_terminal(sys.stderr)
        self._bar: Any = None
        if terminal:
            self._bar = tqdm(
                total=total,
                desc=what,
                unit=unit,
                unit_scale=True,
                unit_divisor=1024,
                leave=False,
                file=sys.stderr,
                dynamic_ncols=True,
            )
        self._lines = wanted and not terminal

    def update_to(self, done: int) -> None:
        """``done`` units are done so far."""
        done = min(max(done, 0), self.total)
        if self._bar is not None:
            self._bar.update(done - self.done)
        elif self._lines and done * 4 // self.total > self._said:
            self._said = done * 4 // self.total
            log.info(
                self.event,
                what=self.what,
                done=done,
                total=self.total,
                percent=round(100 * done / self.total),
                progress=True,
            )
        self.done = done

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False
