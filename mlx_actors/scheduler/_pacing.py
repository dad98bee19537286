"""Prefill pacing: how many prompt tokens one engine step may run, so that a step stays
short on any machine.

Between two steps the engine thread takes its commands: a cancel, a timeout, a newly
queued turn, a shutdown (Ctrl-C) wait for the step in progress. A fixed number of tokens
per step is a few milliseconds on a GPU and a minute on a small CPU with a real model,
so the budget follows the prefill rate measured on this machine: as many tokens as fit
in ``target`` seconds, between ``floor`` and ``ceiling``.
"""

from __future__ import annotations


class Pacing:
    """The prompt-token budget of one step, from the measured prefill rate.

    Args:
        target: seconds one step's prefill should take, at most (roughly: the rate is
            an average, and one chunk of ``floor`` tokens always runs).
        floor: fewest tokens a step may prefill.
        ceiling: most tokens a step may prefill, however fast the machine.
        start: the budget before anything was measured (small: the first step on a
            slow machine must be short too).
    """

    def __init__(
        self, target: float = 0.25, *, floor: int = 64, ceiling: int = 16384, start: int = 64
    ) -> None:
        self.target, self.floor, self.ceiling = target, floor, ceiling
        #: Seconds per prompt token: an average over recent steps (``None``: unknown).
        self.seconds_per_token: float | None = None
        self._start = start

    def budget(self) -> int:
        """Prompt tokens the next step may run."""
        if self.seconds_per_token is None:
            tokens = self._start
        elif self.seconds_per_token <= 0:
            tokens = self.ceiling
        else:
            tokens = int(self.target / self.seconds_per_token)
        return max(self.floor, min(self.ceiling, tokens))

    def record(self, tokens: int, seconds: float) -> None:
        """Note that ``tokens`` prompt tokens took ``seconds`` (counted in full
        against them: an upper bound of the rate's cost when decoding ran too)."""
        if tokens <= 0 or seconds < 0:
            return
        rate = seconds / tokens
        known = self.seconds_per_token
        # Slower news counts at once (a step must not run long twice); faster news
        # moves the average a quarter of the way.
        self.seconds_per_token = (
            rate if known is None or rate > known else known + (rate - known) / 4
        )
