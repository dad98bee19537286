"""Turns on their way to the engine: how many, for the admission window.

An idle engine that receives a turn waits a moment for the turns still on their way, so
that turns asked together start in one batch (:class:`~._loop.EngineLoop`). A turn is on
its way from when its agent is asked until it reaches the engine's queue (the agent's
mailbox and rendering in between). A front end can count one earlier still: a request
it has begun to receive and has not yet turned into an ask (:meth:`Coming.expect`); the
ask made in the same task then takes that place over, so the count does not drop
between the two. The count is changed on the event loop only; the engine thread reads it.
"""

from __future__ import annotations

import contextvars

#: The expectation a front end opened in this task (or the task that started it).
_EXPECTED: contextvars.ContextVar[Expected | None] = contextvars.ContextVar(
    "mlx_actors_expected", default=None
)


class Coming:
    """How many turns are on their way."""

    def __init__(self) -> None:
        self.count = 0

    def announce(self, turns: int) -> None:
        """``turns`` more are on their way (negative: they came, or will not)."""
        self.count += turns

    def asked(self) -> None:
        """A turn was asked: on its way, in the place of this task's open expectation
        if there is one (:meth:`expect`)."""
        expected = _EXPECTED.get()
        if expected is not None and expected.coming is self and expected.pending:
            expected.pending = False  # the turn counts in its place
        else:
            self.count += 1

    def expect(self) -> Expected:
        """Count a turn that is not asked yet (a request being received): until the
        next turn asked in this task, or :meth:`Expected.close`."""
        expected = Expected(self)
        self.count += 1
        _EXPECTED.set(expected)
        return expected


class Expected:
    """One turn expected by :meth:`Coming.expect`."""

    def __init__(self, coming: Coming) -> None:
        self.coming = coming
        #: Still counted by itself (no turn asked in its place yet).
        self.pending = True

    def close(self) -> None:
        """No turn will come in its place (or one did): stop counting it. Idempotent."""
        if self.pending:
            self.pending = False
            self.coming.count -= 1
