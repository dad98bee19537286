"""Token sequences (and texts): the longest common prefix of two, at C speed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Tokens compared at once before bisecting.
_STRIDE = 256


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences of the same type (token
    tuples, or strings), compared a block at a time, then by bisection: C speed, not a
    Python loop."""
    n = min(len(a), len(b))
    done = 0
    while done < n:
        step = min(_STRIDE, n - done)
        if a[done : done + step] != b[done : done + step]:
            lo, hi = done, done + step - 1  # the mismatch is in [done, done + step)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if a[done:mid] == b[done:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            return lo
        done += step
    return n
