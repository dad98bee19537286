"""Prefill jobs: a long or shared prompt prefilled by the engine itself, one chunk per step,
so that it can stop where other sequences wait for its prefix and publish its cache there
as blocks."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import attrs
import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import RotatingKVCache

from ..caches._dequantized import DequantizedKVCache
from ..caches._global import GlobalKVCache
from ..caches._margin import MarginRotatingKVCache
from ..caches._quantized import BlockQuantizedKVCache, sliced
from ..kv._blocks import make_cache, to_cache
from ..kv._pool import BlockPool, KVBlock, Reservation
from ..kv._prefix import Source
from ..kv._spec import BLOCK_SIZE, ModelCacheSpec


@attrs.define(eq=False)
class PrefillJob:
    """The prefill of ``tokens[pos:end]`` onto the cache ``source`` holds.

    Runs exactly as mlx-lm's ``generate_step`` prefills (the model on chunks of the
    prompt, one sequence), outside the ``BatchGenerator``; the sequence joins the batch
    with its last prompt token once the job is done. Other sequences whose prompts
    share a prefix with it wait at a *checkpoint*: the job stops there, its cache is
    cut into blocks (:meth:`~._planner.Planner.publish`), and they start from them.
    """

    namespace: Hashable
    #: The whole prompt of the sequence the job prefills.
    tokens: list[int]
    #: Tokens the cache holds now.
    pos: int
    #: Where the job stops: the last prompt token is left for the batch.
    end: int
    #: The blocks the cache starts from.
    source: Source
    #: Blocks the job may make: its owner's, and what its checkpoints' waiters added.
    reservation: Reservation
    #: References it holds: the source's blocks, and the blocks it published.
    held: list[KVBlock]
    #: The sequence it prefills (``None`` once that sequence was cancelled).
    owner: Any
    cache: list[Any] | None = None
    #: Positions where sequences wait for the prefix, and who waits there.
    checkpoints: dict[int, list[Any]] = attrs.Factory(dict)
    #: Positions where sequences on a sliding-window model want the state kept as their
    #: checkpoint (where their turns' new tokens begin), and who: the job stops there.
    keeps: dict[int, list[Any]] = attrs.Factory(dict)
    #: Positions it published blocks at.
    published: list[int] = attrs.Factory(list)
    #: The short prefills started with it (turns admitted together), shared by them:
    #: once one runs in a step, all do, so that they start decoding together.
    gang: object | None = None

    def checkpoint(self, at: int, slack: int) -> tuple[int, bool]:
        """Where a sequence that shares the first ``at`` tokens should wait: an existing
        checkpoint a little before ``at`` in the same block, or a new one at ``at``.
        Returns the position and whether it is new."""
        for known in self.checkpoints:
            if known <= at < known + slack and known // BLOCK_SIZE == at // BLOCK_SIZE:
                return known, False
        return at, True

    def keep(self, at: int, seq: Any) -> None:
        """Stop at ``at`` and give ``seq`` the state there as its checkpoint."""
        self.keeps.setdefault(at, []).append(seq)

    def leave(self, seq: Any) -> None:
        """``seq`` (its owner or a sequence waiting on it) was cancelled: forget it. The
        job goes on while anyone else waits on it."""
        if self.owner is seq:
            self.owner = None
        for table in (self.checkpoints, self.keeps):
            for at in [at for at, seqs in table.items() if seq in seqs]:
                table[at].remove(seq)
                if not table[at]:
                    del table[at]

    def stops_at(self, at: int) -> bool:
        return at in self.checkpoints or at in self.keeps

    def release(self, pool: BlockPool) -> None:
        """Give back its reservation and the references it holds."""
        self.reservation.release()
        pool.free(self.held)
        self.held = []

    @property
    def orphaned(self) -> bool:
        """Nobody needs it any more: no owner, and no sequence waits at a checkpoint."""
        return self.owner is None and not any(self.checkpoints.values())

    def next_stop(self) -> int:
        stops = (at for at in (*self.checkpoints, *self.keeps) if at > self.pos)
        return min(stops, default=self.end)

    def run_chunk(self, model: Module, spec: ModelCacheSpec, limit: int) -> int:
        """Prefill up to ``limit`` tokens, stopping at the next checkpoint; returns how
        many were prefilled."""
        if self.cache is None:
            length = self.source.length
            self.cache = to_cache(spec, self.source.layers, length) if length else make_cache(spec)
        n = min(limit, self.next_stop() - self.pos)
        model(mx.array(self.tokens[self.pos : self.pos + n])[None], cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.pos += n
        return n


def snapshot(cache: list[Any]) -> list[Any]:
    """A new cache holding what ``cache`` holds now, as views of its arrays: a sequence
    that waited at a checkpoint starts from it without gathering blocks (the views stay
    valid: MLX arrays are values, and the job's later writes make new ones)."""
    out: list[Any] = []
    for c in cache:
        if isinstance(c, RotatingKVCache):
            keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
            held = min(int(keys.shape[2]), c.offset, c.max_size)
            copy: Any = (
                c.empty_like()
                if isinstance(c, MarginRotatingKVCache)
                else MarginRotatingKVCache(c.max_size)
            )
            copy.keys, copy.values = keys[..., -held:, :], values[..., -held:, :]
            copy._idx = held
        elif isinstance(c, BlockQuantizedKVCache):
            copy = BlockQuantizedKVCache(group_size=c.group_size, bits=c.bits)
            copy.keys, copy.values = sliced(c.keys, 0, c.offset), sliced(c.values, 0, c.offset)
        else:
            copy = c.empty_like() if isinstance(c, DequantizedKVCache) else GlobalKVCache()
            copy.keys, copy.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        copy.offset = c.offset
        out.append(copy)
    return out
