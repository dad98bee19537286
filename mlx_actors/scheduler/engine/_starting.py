"""How planned sequences start, and how prefill jobs run within a step: a planned
sequence goes into the batch or becomes a prefill job (jobs started together ganged);
each step runs chunks of the jobs, oldest first, within the step's prompt-token budget,
publishes the checkpoints they reach and hands each finished job's sequence to the
batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module

from ...errors import MlxActorsError
from ..kv._pool import BlockPool
from ..kv._spec import ModelCacheSpec
from ._batch import Batch
from ._pacing import Pacing
from ._pacing import chunk as fit
from ._planner import Planner
from ._prefill import PrefillJob
from ._sequence import EngineSequence


class Starter:
    """Starts the sequences the planner made ready and runs the prefill jobs' chunks of
    each step; keeps the agents whose prompts ran as jobs in the step under way.

    Args:
        model: the mlx-lm model the jobs run.
        spec: its cache spec.
        pool: the pool a finished job without a sequence gives its blocks back to.
        planner: whose pending sequences start, and whose jobs run.
        batch: where started sequences (and finished jobs' sequences) decode.
        pacing: the step's prompt-token budget, told of each chunk's rate.
        prefill_batch_size: prefill chunks run in one step, at most.
        prefill_step_size: most prompt tokens per job run in one step while the batch
            decodes.
        long_prefill: new prompt tokens (or, without ``paged_batch``, cached history
            tokens) from which a prefill runs as a job.
        paged_batch: whether the batch reads histories from the blocks.
        refuse: called with a sequence that could no longer get the blocks it needs when
            a checkpoint it waited for was published, and the error.
    """

    def __init__(
        self,
        model: Module,
        spec: ModelCacheSpec,
        pool: BlockPool,
        planner: Planner,
        batch: Batch,
        pacing: Pacing,
        *,
        prefill_batch_size: int,
        prefill_step_size: int,
        long_prefill: int,
        paged_batch: bool,
        refuse: Callable[[EngineSequence, MlxActorsError], None],
    ) -> None:
        self.model = model
        self.spec = spec
        self.pool = pool
        self.planner = planner
        self.batch = batch
        self.pacing = pacing
        self.prefill_batch_size = prefill_batch_size
        self.prefill_step_size = prefill_step_size
        self.long_prefill = long_prefill
        self.paged_batch = paged_batch
        self._refuse = refuse
        #: Agents whose prompts ran as prefill jobs in the step under way.
        self.prefilled: list[str] = []

    def start_pending(self) -> None:
        """Start the sequences planned since the last step. A long prefill runs as a job
        (one sequence, unpadded, as mlx-lm's own prefill: a batch of prompts is padded
        to its longest), as does one on a long cached history unless the batch reads
        histories from the blocks (``paged_batch``: else ``BatchGenerator`` copies and
        pads every cache in a batch of prompts); short prompts are prefilled together
        in the batch. Jobs of a chunk or less started together form a gang: they run in
        one step, so their turns start decoding together."""
        pending, self.planner.pending = self.planner.pending, []
        short: list[PrefillJob] = []
        # One short prompt alone decodes outside the batch at once, from its agent's
        # last cache if that is kept (no blocks to gather), whatever its history.
        lone = len(pending) == 1 and not self.planner.jobs and not self.batch.busy
        # Short prompts started together run as one batch of prompts, whatever their
        # histories: one model call for all of them, not one each.
        shorts = [self._short(seq) for seq in pending]
        together = sum(shorts) > 1
        gathered: dict[Hashable, list[Any]] = {}  # histories gathered, by their pieces
        for seq, is_short in zip(pending, shorts, strict=True):
            cached = seq.source.length
            uncached = len(seq.tokens) - 1 - cached
            if self.planner.lost(seq):
                self.planner.make_job(seq)  # it keeps the sliding layers' state at seq.kept
            elif (lone and uncached < self.long_prefill) or (together and is_short):
                self.batch.insert(seq, None, gathered=gathered)
            elif uncached >= self.long_prefill or (
                uncached > 0 and not self.paged_batch and cached >= self.long_prefill
            ):
                job = self.planner.make_job(seq)
                if job.cache is None and cached:  # its agent's kept cache: no gather
                    job.cache = self.batch.kept(seq, cached)
                if job.next_stop() - job.pos <= self.prefill_step_size:
                    short.append(job)
            else:
                self.batch.insert(seq, None, gathered=gathered)
        if len(short) > 1:
            gang = object()
            for job in short:
                job.gang = gang

    def _short(self, seq: EngineSequence) -> bool:
        """Whether ``seq``'s prompt is short: under ``long_prefill`` new tokens, and no
        more than one step's chunk (``prefill_step_size``)."""
        uncached = len(seq.tokens) - 1 - seq.source.length
        return (
            not self.planner.lost(seq)
            and uncached < self.long_prefill
            and uncached <= self.prefill_step_size
        )

    def run_jobs(self) -> tuple[int, int]:
        """A chunk of each prefill job, oldest first, while the step's budget lasts (as
        many tokens as ``prefill_batch_size`` chunks): publish the checkpoints they reach
        (the sequences that waited there start at once, as jobs or in the batch), hand
        each finished job's sequence to the batch. Once a job of a gang ran, the rest of
        its gang runs in the same step, whatever the budget. Returns the jobs run and the
        tokens prefilled."""
        self.prefilled = []
        # Chunks of ``prefill_step_size`` keep the decoding sequences' steps short; when
        # nothing decodes, chunks as large as mlx-lm's own; all within the step's pace.
        decoding = self.batch.busy
        whole = self.prefill_step_size if decoding else max(self.prefill_step_size, 2048)
        budget = min(whole * self.prefill_batch_size, self.pacing.budget())
        chunk = min(whole, budget)
        done = ran = at = 0
        gangs: set[object] = set()  # gangs with a job run in this step: the rest run too
        while at < len(self.planner.jobs):
            job = self.planner.jobs[at]
            if done >= budget and job.gang not in gangs:
                at += 1  # over the budget, only the rest of a gang that ran goes on
                continue
            if job.owner is not None:
                self.prefilled.append(job.owner.agent_id)
            began = time.perf_counter()
            with mx.stream(self.batch.stream):
                if job.gang is not None:  # a chunk or less: all of it, beside its gang
                    gangs.add(job.gang)
                    limit = fit(whole, job.next_stop() - job.pos)
                else:
                    limit = fit(min(chunk, budget - done), job.next_stop() - job.pos)
                n = job.run_chunk(self.model, self.spec, limit)
            self.pacing.record(n, time.perf_counter() - began)
            done += n
            ran += 1
            if job.stops_at(job.pos):
                for seq, error in self.planner.publish(job, job.pos):
                    self._refuse(seq, error)
                self.start_pending()  # the waiters' own jobs can run in this step too
            if job.orphaned:
                self.planner.drop_job(job)
            elif job.pos == job.end:
                self._end_job(job)
            else:
                at += 1
        return ran, done

    def _end_job(self, job: PrefillJob) -> None:
        self.planner.jobs.remove(job)
        seq = job.owner
        if seq is None:
            job.release(self.pool)
            return
        seq.reservation, seq.held, seq.job = job.reservation, job.held, None
        seq.anchors = (*seq.anchors, *job.published)
        self.batch.insert(seq, job.cache, job.pos)
