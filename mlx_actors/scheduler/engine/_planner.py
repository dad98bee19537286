"""Where each submitted sequence starts, and what it reserves: the longest prefix live
blocks hold (the agent's own first under memory pressure), or a checkpoint of a prefill
job that computes a longer shared prefix, and the pool's blocks it may need from there.
vLLM v1's ``get_computed_blocks`` and ``allocate_slots`` do this job there."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ...errors import MlxActorsError, PoolExhaustedError
from ..kv._blocks import (
    blocks_needed,
    checkpoint_blocks,
    checkpoint_copies,
    evaluate,
    pieces,
    plan_cut,
)
from ..kv._pool import BlockPool
from ..kv._prefix import PrefixIndex
from ..kv._spec import ModelCacheSpec
from ..kv._tokens import common_prefix
from ._prefill import PrefillJob, snapshot
from ._records import Admission
from ._sequence import EngineSequence, SequenceState


class Planner:
    """Plans sequences, and keeps those not yet running: ``pending`` (to start at the
    next step) and the prefill ``jobs`` (running, or queued to start); when a job
    reaches a checkpoint, publishes it as blocks and plans the sequences that waited
    there.

    ``make_room(agent)`` is called when a reservation fails; it returns whether it freed
    blocks (by moving an idle agent's cache out of the pool), so that the planner tries
    again.
    """

    def __init__(
        self,
        spec: ModelCacheSpec,
        pool: BlockPool,
        index: PrefixIndex,
        *,
        share_prefixes: bool,
        min_shared: int,
        make_room: Callable[[str], bool] | None,
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.index = index
        self.share_prefixes = share_prefixes
        self.min_shared = min_shared
        self._make_room = make_room
        self.pending: list[EngineSequence] = []
        self.jobs: list[PrefillJob] = []
        #: Prefill jobs made so far, and checkpoints they published.
        self.prefill_jobs = self.checkpoints = 0

    def plan(self, seq: EngineSequence) -> None:
        """Decide where ``seq`` starts: take references to the longest prefix live blocks
        hold, then wait for a prefill that computes a longer shared prefix, or start at
        the next step. Reserves the blocks it may need; raises (holding nothing new) if
        the pool cannot give them.

        Under memory pressure the agent's own history comes first: if the pool has no
        room while the sequence holds other agents' blocks (which keeps them from being
        moved to disk), it starts from its own blocks instead."""
        n = len(seq.tokens)
        own = False
        while True:
            if own:
                source = self.index.own(seq.own, seq.kept)
            else:
                source = self.index.find(seq.namespace, seq.tokens, n - 1, seq.own, seq.kept)
            held = self.pool.share_all(source.blocks())
            try:
                target = (
                    self._shared_prefill(seq, source.length)
                    if self.share_prefixes and not own
                    else None
                )
                final = n + seq.budget
                # The sliding layers' state where the turn's new tokens begin, if the
                # prefill must compute it again (see Starter.start_pending).
                lost = source.length < seq.kept and self.spec.sliding_layers
                extra = checkpoint_blocks(self.spec, seq.kept) if lost else 0
                extra += checkpoint_copies(self.spec, source.layers)
                if target is None:
                    self._reserve(seq, blocks_needed(self.spec, final, source.length) + extra)
                else:
                    job, at, new = target
                    extra = checkpoint_blocks(self.spec, at) if new else 0
                    if lost and job.pos < seq.kept < at:  # the job keeps its checkpoint
                        extra += checkpoint_blocks(self.spec, seq.kept)
                    self._reserve(seq, blocks_needed(self.spec, final, at) + extra)
                    assert seq.reservation is not None
                    seq.reservation.give(extra, job.reservation)
                break
            except PoolExhaustedError:
                self.pool.free(held)
                mine = {b.id for b in seq.own.blocks()} if seq.own is not None else set()
                if own or all(b.id in mine for b in source.blocks()):
                    raise
                own = True
            except BaseException:
                self.pool.free(held)
                raise
        self.pool.free(seq.held)
        seq.source, seq.held = source, held
        shared = max(0, source.length - seq.kept)
        seq.admission = Admission(
            cached_tokens=source.length,
            shared_tokens=shared,
            prefill_tokens=n - source.length,
            reusable_tokens=seq.kept,
            not_reused=self._not_reused(seq.kept, source.length),
        )
        if target is None:
            seq.state = SequenceState.PENDING
            self.pending.append(seq)
            return
        job, at, _ = target
        job.checkpoints.setdefault(at, []).append(seq)
        if self.lost(seq) and job.pos < seq.kept < at:
            job.keep(seq.kept, seq)
        seq.state, seq.waiting = SequenceState.PARKED, (job, at)
        owner = job.owner.agent_id if job.owner is not None else None
        seq.admission = attrs.evolve(seq.admission, waits_for=owner, waits_tokens=at)

    def lost(self, seq: EngineSequence) -> bool:
        """Whether the sliding layers' state where ``seq``'s new tokens begin must be
        computed again (its source stops short of it)."""
        return seq.source.length < seq.kept and bool(self.spec.sliding_layers)

    def _not_reused(self, reusable: int, cached: int) -> str | None:
        """Why a sequence starts from ``cached`` tokens when its agent's cache agrees with
        ``reusable`` of them (``None`` if it loses none)."""
        if cached >= reusable:
            return None
        windows = sorted({layer.window for layer in self.spec.layers if layer.window is not None})
        if windows:
            return (
                f"the history changed at token {reusable}, before what the sliding-window "
                f"layers still hold (their last {'/'.join(map(str, windows))} tokens, and "
                f"their state where the last turn started); prefilling from token {cached}"
            )
        return f"the blocks of tokens [{cached}, {reusable}) are no longer live"

    def _shared_prefill(
        self, seq: EngineSequence, start: int
    ) -> tuple[PrefillJob, int, bool] | None:
        """A prefill (running, or queued to start) that will compute a prefix of ``seq``'s
        tokens at least ``min_shared`` tokens longer than ``start``: the job, where to
        wait, and whether that checkpoint is new."""
        tokens, n, slack = seq.tokens, len(seq.tokens), self.min_shared
        head = tokens[start : start + slack]
        best: tuple[PrefillJob | EngineSequence, int] | None = None
        candidates: list[PrefillJob | EngineSequence] = [*self.jobs, *self.pending]
        for other in candidates:
            if other.namespace != seq.namespace or other is seq:
                continue
            if isinstance(other, PrefillJob):
                pos, end = other.pos, other.end
            else:
                pos, end = other.source.length, len(other.tokens) - 1
            if other.tokens[start : start + slack] != head:
                continue
            at = min(common_prefix(tokens, other.tokens), n - 1, end)
            if at - start >= slack and at > pos and (best is None or at > best[1]):
                best = (other, at)
        if best is None:
            return None
        other, at = best
        if isinstance(other, PrefillJob):
            job = other
        else:
            self.pending.remove(other)
            job = self.make_job(other)
        at, new = job.checkpoint(at, slack)
        return job, at, new

    def make_job(self, seq: EngineSequence) -> PrefillJob:
        """Turn a sequence's prefill into a job (its first chunk runs at the next step)."""
        assert seq.reservation is not None
        job = PrefillJob(
            namespace=seq.namespace,
            tokens=seq.tokens,
            pos=seq.source.length,
            end=len(seq.tokens) - 1,
            source=seq.source,
            reservation=seq.reservation,
            held=seq.held,
            owner=seq,
        )
        if seq.seed is not None and seq.seed[0].offset == seq.source.length:
            job.cache = snapshot(seq.seed)  # its own cache objects, over the same views
        if self.lost(seq):
            # The sliding layers lost the history's end: the job stops there to keep
            # their state (the turn's checkpoint, see :meth:`publish`).
            job.keep(seq.kept, seq)
        seq.reservation, seq.held, seq.seed = None, [], None
        seq.state, seq.job = SequenceState.JOB, job
        self.jobs.append(job)
        self.prefill_jobs += 1
        return job

    def _reserve(self, seq: EngineSequence, need: int) -> None:
        """Make sure ``seq`` has ``need`` blocks reserved."""
        have = seq.reservation.remaining if seq.reservation is not None else 0
        if have >= need:
            return
        while True:
            try:
                if seq.reservation is None:
                    seq.reservation = self.pool.reserve(need)
                else:
                    seq.reservation.grow(need - have)
                return
            except PoolExhaustedError:
                if self._make_room is None or not self._make_room(seq.agent_id):
                    raise

    def grow(self, job: PrefillJob, need: int) -> None:
        """Top the job's reservation up to ``need`` blocks, moving idle agents' caches to
        disk if the pool is short (raises :class:`PoolExhaustedError` if that fails)."""
        agent = job.owner.agent_id if job.owner is not None else ""
        while job.reservation.remaining < need:
            try:
                job.reservation.grow(need - job.reservation.remaining)
            except PoolExhaustedError:
                if self._make_room is None or not self._make_room(agent):
                    raise

    def publish(self, job: PrefillJob, at: int) -> list[tuple[EngineSequence, MlxActorsError]]:
        """Cut the job's cache at ``at`` into blocks (indexed, so the waiting sequences
        find them) and plan the sequences that waited for it; returns those that can no
        longer be planned, each with its error."""
        waiting, keepers = job.checkpoints.pop(at, []), job.keeps.pop(at, [])
        assert job.cache is not None
        cut = plan_cut(
            self.pool,
            job.cache,
            job.tokens[:at],
            index=self.index,
            namespace=job.namespace,
            path=job.source.path,
        )
        try:
            self.grow(job, cut.new_blocks)
        except PoolExhaustedError:
            cut.abandon()  # the waiting sequences start from what they can find
        else:
            blocks = cut.apply(job.reservation)
            evaluate([blocks])
            job.held.extend(blocks.blocks())
            self.checkpoints += 1
            for seq in keepers:  # (the blocks stay held: by the job, which its owner
                seq.checkpoint = pieces(self.spec, blocks, at)  # inherits, or by seq)
                if seq is not job.owner:
                    seq.kept_blocks = self.pool.share_all(blocks.blocks())
            if waiting:
                job.published.append(at)
        seed = snapshot(job.cache)
        refused = []
        for seq in waiting:
            seq.waiting, seq.seed = None, seed
            try:
                self.plan(seq)
            except MlxActorsError as exc:
                refused.append((seq, exc))
        return refused

    def drop_job(self, job: PrefillJob) -> None:
        """Stop a prefill job no sequence needs any more; give back what it holds."""
        self.jobs.remove(job)
        job.release(self.pool)
