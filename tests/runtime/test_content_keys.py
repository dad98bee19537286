"""Content keys of saved blocks: a save that reuses the keys of its agent's last save
gets exactly the keys it would have hashed."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_actors.runtime._store import content_keys
from mlx_actors.scheduler import BLOCK_SIZE


def spans(length: int, layers: int, window: int | None) -> list[tuple[int, int, int]]:
    """Blocks of a cache of ``length`` tokens: every block of global layers, the last
    few of a sliding one (``window``)."""
    out = []
    for layer in range(layers):
        start = 0 if window is None or layer % 2 == 0 else max(0, length - window)
        first = start // BLOCK_SIZE * BLOCK_SIZE
        for at in range(first, length, BLOCK_SIZE):
            out.append((layer, at, min(at + BLOCK_SIZE, length)))
    return out


@settings(max_examples=60, deadline=None)
@given(
    first=st.integers(1, 3 * BLOCK_SIZE),
    kept=st.integers(0, 3 * BLOCK_SIZE),
    added=st.integers(1, 2 * BLOCK_SIZE),
    window=st.sampled_from([None, 100, 300]),
    seed=st.integers(0, 2**16),
)
def test_keys_reused_from_a_last_save_are_the_keys_hashed_anew(
    first: int, kept: int, added: int, window: int | None, seed: int
) -> None:
    before = [(seed * 7 + i * 13) % 1000 for i in range(first)]
    # the next save's tokens: the first ``kept`` (at most all) then others
    kept = min(kept, first)
    after = [*before[:kept], *((seed + 3 * i + 1) % 997 for i in range(added))]
    _, known = content_keys(before, spans(first, 4, window))
    reused, again = content_keys(after, spans(len(after), 4, window), known)
    fresh, _ = content_keys(after, spans(len(after), 4, window))
    assert reused == fresh
    assert again[1] == dict(zip(spans(len(after), 4, window), fresh, strict=True))


def test_a_turn_s_save_hashes_only_the_blocks_it_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    history = [(i * 31) % 1000 for i in range(40 * BLOCK_SIZE + 100)]
    _, known = content_keys(history, spans(len(history), 16, None))
    longer = [*history, *range(50)]  # a turn: its last block grows
    calls = []
    sha256 = hashlib.sha256

    def counted(data: bytes = b"") -> Any:
        calls.append(len(data))
        return sha256(data)

    monkeypatch.setattr(hashlib, "sha256", counted)
    keys, _ = content_keys(longer, spans(len(longer), 16, None), known)
    reused = len(calls)
    calls.clear()
    assert keys == content_keys(longer, spans(len(longer), 16, None))[0]
    # the 16 last blocks, and the chain of chunks leading to them, are hashed again
    assert reused == 16 + 1 + 40 and len(calls) == 16 * 41 + 1 + 40
