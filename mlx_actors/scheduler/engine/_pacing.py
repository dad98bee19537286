"""Prefill pacing: how many prompt tokens one engine step may run, so that a step stays
short on any machine.

Between two steps the engine thread takes its commands: a cancel, a timeout, a newly
queued turn, a shutdown (Ctrl-C) wait for the step in progress. A fixed number of tokens
per step is a few milliseconds on a GPU and a minute on a small CPU with a real model,
so the budget follows the prefill rate measured on this machine: as many tokens as fit
in ``target`` seconds, between ``floor`` and ``ceiling``.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Pacing:
    """The prompt-token budget of one step, from the measured prefill rate.

    Args:
        target: seconds one step's prefill should take, at most (roughly: the rate is
            measured, and one chunk of ``floor`` tokens always runs).
        floor: fewest tokens a step may prefill.
        ceiling: most tokens a step may prefill, however fast the machine.
        start: the budget before anything was measured: small, since on a slow
            machine the first steps must be short too; on a fast one the budget
            grows from it at once.
    """

    def __init__(
        self, target: float = 0.25, *, floor: int = 16, ceiling: int = 16384, start: int = 128
    ) -> None:
        self.target, self.floor, self.ceiling, self.start = target, floor, ceiling, start
        #: Tokens a step may prefill, before rounding (see :meth:`budget`).
        self.tokens = start
        self._over = False

    def calibrate(self, prefill: Callable[[int], object], runs: int = 2) -> None:
        """Measure the rate before the first turn: time ``prefill`` (the model run on
        that many prompt tokens, evaluated) on :attr:`start` tokens ``runs`` times and
        record the last (the first of a shape may compile kernels). On a fast machine
        the first turns then run whole rather than in chunks of the cautious start
        budget; on a slow one nothing changes."""
        seconds = 0.0
        for _ in range(runs):
            began = time.perf_counter()
            prefill(self.start)
            seconds = time.perf_counter() - began
        self.record(self.start, seconds)

    def budget(self) -> int:
        """Prompt tokens the next step may run: a power of two. Every new chunk length
        is a new shape for the model's kernels (compiled once each on a GPU, which
        can take longer than the chunk), so the lengths a budget makes are kept few."""
        tokens = max(self.floor, min(self.ceiling, self.tokens))
        return max(self.floor, 1 << (tokens.bit_length() - 1))

    def record(self, tokens: int, seconds: float) -> None:
        """Note that a prefill of ``tokens`` prompt tokens, and nothing else, took
        ``seconds``.

        Two chunks in a row that ran over the target lower the budget to what fits
        in it (one alone may be a kernel compiled for a new shape, or a busy moment).
        A chunk of at least half the budget that ran within the target raises it, to
        what fits or four times as much, whichever is more. A smaller chunk says
        nothing about larger ones: a model call has a fixed cost."""
        if tokens <= 0 or seconds < 0:
            return
        fits = int(tokens * self.target / seconds) if seconds > 0 else self.ceiling
        if seconds > self.target:
            if self._over:
                self.tokens = fits
            self._over = True
        else:
            self._over = False
            if 2 * tokens >= self.budget():
                self.tokens = max(self.tokens, fits, 4 * self.budget())
        self.tokens = max(self.floor, min(self.ceiling, self.tokens))


def chunk(limit: int, left: int) -> int:
    """How much of ``left`` tokens to prefill under a ``limit``: the limit, or all of
    them when what would be left over is under a quarter of it (a short last chunk is
    one more model call, and on a GPU one more shape to compile)."""
    return left if left - limit < limit // 4 else min(limit, left)
